"""kvtier replay against a hostile or broken server (a real aiohttp server on 127.0.0.1): malformed
events are that request's recorded error, endless events and /metrics pages are bounded, Ctrl+C cuts
the streams in flight, and the run always writes what it has."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from aiohttp import web

from tests.conftest import kvtier_cmd, replay_summary

DATA = b"data: "


def delta(text: str) -> bytes:
    return DATA + json.dumps({"choices": [{"delta": {"content": text}}]}).encode() + b"\n\n"


class Hostile:
    """A server whose n-th chat request gets the n-th behaviour; /metrics never ends."""

    def __init__(self, behaviours: list[str]) -> None:
        self.behaviours = behaviours
        self.calls = 0
        self.started = threading.Event()
        self.port = 0
        ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "m"}]})

        async def metrics(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()
            await resp.prepare(request)
            line = b"# an endless metrics page\n" * 4096
            try:
                for _ in range(2000):  # ~200 MB if read to the end
                    await resp.write(line)
            except ConnectionError:
                pass  # the scraper gave up, as it should
            return resp

        async def chat(request: web.Request) -> web.StreamResponse:
            await request.read()
            kind = self.behaviours[min(self.calls, len(self.behaviours) - 1)]
            self.calls += 1
            self.started.set()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if kind == "bad-utf8":
                await resp.write(DATA + b'{"choices": [{"delta": {"content": "\xff\xfe"}}]}\n\n')
            elif kind == "not-an-object":
                await resp.write(delta("a") + b"data: 1\n\n")
            elif kind == "string-usage":
                await resp.write(delta("a") + DATA + b'{"choices": [], "usage": {"completion_tokens": "5"}}\n\n')
            elif kind == "endless-event":
                await resp.write(DATA + b'{"choices": [')
                for _ in range(100):  # 10 MB, never a separator
                    await resp.write(b"1," * 50_000)
            elif kind.startswith("decomposition-"):  # a token, then kvtier's extension as a hostile server sends it
                d = {"tokens": {"gpu": 0, "recomputed": 1}, "seconds": {"queue": 0.0001}, "server_ttft_s": 0.0001}
                if kind == "decomposition-nan":
                    d["seconds"] = {"queue": float("nan")}
                elif kind == "decomposition-names":
                    d["seconds"] = {f"part-{i}-" + "x" * 60_000: 0.0 for i in range(50)}  # 3 MB of names
                elif kind == "decomposition-digits":
                    d["tokens"] = {"gpu": 10**400}
                elif kind == "decomposition-long":
                    d["server_ttft_s"] = 3600.0
                ext = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}, "kvtier": {
                    "ttft_decomposition": d}}  # fmt: skip
                await resp.write(delta("a") + DATA + json.dumps(ext).encode() + b"\n\n" + b"data: [DONE]\n\n")
                return resp
            elif kind == "slow":
                while True:  # one token a second, forever
                    await resp.write(delta("t"))
                    await asyncio.sleep(1)
            await resp.write(delta("ok") + b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.add_routes(
            [web.get("/v1/models", models), web.get("/metrics", metrics), web.post("/v1/chat/completions", chat)]
        )
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def sessions(path: Path, n: int) -> Path:
    turn = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    path.write_text("".join(json.dumps({"session_id": f"s{i}", "turns": [turn]}) + "\n" for i in range(n)))
    return path


def replay_cmd(server: Hostile, data: Path, out: Path) -> list[str]:
    return kvtier_cmd() + [
        "replay",
        "--base-url",
        f"http://127.0.0.1:{server.port}/v1",
        "--model",
        "m",
        "--dataset",
        str(data),
        "--num-rounds",
        "1",
        "--min-chunk-rounds",
        "0",
        "--concurrency",
        "1",
        "--warmup",
        "0",
        "--output",
        str(out),
        "--scrape-interval",
        "0.5",
    ]


def test_malformed_output_is_recorded_per_request_and_bounded(tmp_path: Path):
    server = Hostile(["bad-utf8", "not-an-object", "string-usage", "endless-event", "fine"])
    try:
        p = subprocess.run(
            replay_cmd(server, sessions(tmp_path / "d.jsonl", 5), tmp_path / "out"),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.close()
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 1, p.stderr  # 4 of 5 failed: far above --max-failure-rate, the run is failed
    assert "4 of 5 requests failed: stream-malformed 4" in p.stdout
    recs = [json.loads(x) for x in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    assert [r["status"] for r in recs] == ["error", "error", "error", "error", "ok"]
    assert [r["cause"] for r in recs] == ["stream-malformed"] * 4 + [None]
    errors = " | ".join(r["error"] for r in recs[:4])
    assert "UnicodeDecodeError" in errors and "not a JSON object" in errors
    assert "usage.completion_tokens" in errors and "without a separator" in errors
    s = replay_summary(tmp_path / "out" / "summary.json")
    assert s["status"] == "failed" and s["stop_reason"]["code"] == "too-many-failures"
    assert s["summary"]["requests_failed"] == 4 and s["summary"]["failures"]["stream-malformed"]["count"] == 4
    assert "UnicodeDecodeError" in s["summary"]["failures"]["stream-malformed"]["first_message"]
    m = s["server_metrics"][0]  # the endless /metrics page: scrape errors, no samples, no memory blow-up
    assert m["samples"] == 0 and m["scrape_errors"] >= 2
    assert "scrape-failed" in {w["code"] for w in s["warnings"]}


def test_a_hostile_decomposition_is_dropped_and_counted_and_the_requests_stand(tmp_path: Path):
    """#41 item 4: NaN, 3 MB of part names, a 401-digit count and a server TTFT longer than the request are each
    dropped from their record with a counted warning; the requests stay ok, the honest one keeps its parts, and
    requests.jsonl stays small (the audit's 100 requests made 368 MB)."""
    kinds = ["decomposition-nan", "decomposition-names", "decomposition-digits", "decomposition-long",
             "decomposition-fine"]  # fmt: skip
    server = Hostile(kinds)
    try:
        p = subprocess.run(replay_cmd(server, sessions(tmp_path / "d.jsonl", 5), tmp_path / "out"),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        server.close()
    assert "Traceback" not in p.stderr, p.stderr
    recs = [json.loads(x) for x in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    assert [r["status"] for r in recs] == ["ok"] * 5
    assert [bool(r.get("decomposition_dropped")) for r in recs] == [True] * 4 + [False]
    assert recs[4]["server_ttft_parts"] == {"queue": 0.0001} and recs[0]["server_ttft_parts"] is None
    assert (tmp_path / "out" / "requests.jsonl").stat().st_size < 20_000
    s = replay_summary(tmp_path / "out" / "summary.json")
    assert s["summary"]["ttft_decomposition"]["dropped"] == 4 and s["summary"]["ttft_decomposition"]["requests"] == 1
    w = [w for w in s["warnings"] if w["code"] == "decomposition-dropped"]
    assert w and w[0]["requests"] == 4


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_cuts_streams_in_flight_and_writes_the_partial_result(tmp_path: Path, sig: int, code: int):
    server = Hostile(["slow"])
    try:
        proc = subprocess.Popen(
            replay_cmd(server, sessions(tmp_path / "d.jsonl", 3), tmp_path / "out"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert server.started.wait(60), "the replay never sent a request"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)  # a stream that never ends must not hold the run
    finally:
        server.close()
    assert proc.returncode == code, err
    s = replay_summary(tmp_path / "out" / "summary.json")
    assert s["status"] == "partial" and s["stop_reason"]["code"] in ("interrupted", "terminated")
    recs = [json.loads(x) for x in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    assert [r["status"] for r in recs] == ["cut"] and "stopped" in recs[0]["error"]
    assert recs[0]["cause"] == "cut-at-stop" and s["summary"]["requests_failed"] == 0
    assert s["summary"]["requests_cut_at_stop"] == 1


def test_a_script_whose_replay_is_interrupted_stops_with_the_partial_result_written(tmp_path: Path):
    """#44 item 7: Ctrl+C inside kvtier.replay.run once returned a partial result and the script carried on (exit
    0). The library now writes the partial result, then raises Interrupted (a KeyboardInterrupt carrying it)."""
    import sys

    server = Hostile(["slow"])
    data, out = sessions(tmp_path / "d.jsonl", 3), tmp_path / "out"
    script = tmp_path / "s.py"
    script.write_text(
        "from kvtier import replay\n"
        "from kvtier.config import ReplayConfig\n"
        f"r = replay.run(ReplayConfig(base_url='http://127.0.0.1:{server.port}/v1', model='m', dataset={str(data)!r},"
        f" num_rounds=1, min_chunk_rounds=0, concurrency=1, warmup=0, scrape_interval=0.5, output={str(out)!r},"
        " progress='none'))\n"
        "print('CARRIED ON', r.status)\n"
    )
    try:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
        assert server.started.wait(60), "the replay never sent a request"
        proc.send_signal(signal.SIGINT)
        stdout, err = proc.communicate(timeout=30)
    finally:
        server.close()
    assert "CARRIED ON" not in stdout and proc.returncode != 0
    assert "kvtier.errors.Interrupted: replay interrupted; its partial result is in" in err, err[-2000:]
    s = replay_summary(out / "summary.json")
    assert s["status"] == "partial" and s["stop_reason"]["code"] == "interrupted"
