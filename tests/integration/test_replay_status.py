"""The status rule and the up-front checks of kvtier replay, against a real kvtier sim on 127.0.0.1: prompts
the server cannot hold are counted before the run and decide the status, a wrong model or a root URL stops
the run before any request, and --max-requests / --duration stop it with their own stop codes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import kvtier_cmd, replay_summary
from tests.integration.test_sim import start_sim, stop_sim

pytestmark = pytest.mark.slow

# --gpu-kv-gb 0.05 of tiny-1b (24,576 B/token): 136 blocks of 16 tokens, max_model_len 2,176 tokens
GPU = ("--offload", "none", "--gpu-kv-gb", "0.05")


def dataset(path: Path, sessions: int = 4, turns: int = 5, huge: int = 1) -> Path:
    """``sessions`` of ``turns`` short turns; the last turn of the first ``huge`` sessions is ~6,000 words
    (far over the GPU above whatever the tokenizer)."""
    rows = []
    for s in range(sessions):
        ts = []
        for t in range(turns):
            words = 6000 if s < huge and t == turns - 1 else 20
            text = " ".join(f"w{s}x{t}x{i}" for i in range(words))
            ts.append({"messages": [{"role": "user", "content": text}], "max_tokens": 8})
        rows.append({"session_id": f"s{s}", "turns": ts})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def replay(base: str, data: Path, out: Path, *extra: str, model: str = "tiny-1b") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        kvtier_cmd()
        + [
            "replay",
            "--base-url",
            base,
            "--model",
            model,
            "--dataset",
            str(data),
            "--num-rounds",
            "5",
            "--concurrency",
            "2",
            "--warmup",
            "0",
            "--gap-scale",
            "0",
            "--output",
            str(out),
            "--scrape-interval",
            "0.5",
            "--progress",
            "plain",
            *extra,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=180,
    )


def load(out: Path) -> tuple[dict, list[dict]]:
    s = replay_summary(out / "summary.json")
    return s, [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]


def codes(s: dict) -> dict[str, dict]:
    return {w["code"]: w for w in s["warnings"]}


def test_prompts_over_the_servers_length_are_counted_up_front_and_fail_the_run(tmp_path: Path):
    sim = start_sim(tmp_path, *GPU)
    try:
        data = dataset(tmp_path / "d.jsonl")
        p = replay(f"{sim.base}/v1", data, tmp_path / "sent")
        skipped = replay(f"{sim.base}/v1", data, tmp_path / "skipped", "--skip-too-long")
        tolerant = replay(f"{sim.base}/v1", data, tmp_path / "tolerant", "--max-failure-rate", "0.1")
    finally:
        stop_sim(sim)
    # sent (the default): the server's answer is recorded, 1 of 20 failed is over 1 %: failed, exit 1
    assert p.returncode == 1, p.stderr
    assert "1 of 20 prompts cannot fit the server's max_model_len 2176" in p.stderr  # said before the run
    s, recs = load(tmp_path / "sent")
    assert s["status"] == "failed" and s["stop_reason"]["code"] == "too-many-failures"
    assert s["server"]["max_model_len"] == 2176
    hw = s["hardware"]  # the methodology's hardware telemetry: the host CPU sampled, no GPU here (a code, nulls)
    assert hw["host_cpu"]["code"] is None and 0 < hw["host_cpu"]["utilization"] <= 1 and hw["host_cpu"]["timeline"]
    assert not hw["gpu"]["available"] and hw["gpu"]["code"] and hw["gpu"]["gpus"] == []
    w = codes(s)["prompts-exceed-context"]
    assert (w["prompts"], w["of"], w["max_model_len"], w["skipped_turns"]) == (1, 20, 2176, 0)
    assert w["largest_tokens"] > 2176
    failed = [r for r in recs if r["status"] != "ok"]
    assert [(r["cause"], r["http_status"]) for r in failed] == [("context-length", 400)]
    f = s["summary"]["failures"]["context-length"]
    assert f["count"] == 1 and f["http_status"] == 400 and "maximum context length" in f["first_message"]
    assert codes(s)["requests-failed"]["failed"] == 1
    assert "1 of 20 requests failed: context-length (HTTP 400) 1" in p.stdout
    assert "run failed (too-many-failures)" in p.stdout
    # --skip-too-long: not sent, counted, and the run is complete with nothing failed
    assert skipped.returncode == 0, skipped.stderr
    s, recs = load(tmp_path / "skipped")
    assert s["status"] == "complete" and len(recs) == 19 and all(r["status"] == "ok" for r in recs)
    assert codes(s)["prompts-exceed-context"]["skipped_turns"] == 1 and "requests-failed" not in codes(s)
    # a looser --max-failure-rate: complete, the failure still counted and warned of
    assert tolerant.returncode == 0, tolerant.stderr
    s, _ = load(tmp_path / "tolerant")
    assert s["status"] == "complete" and s["summary"]["requests_failed"] == 1 and "requests-failed" in codes(s)


def test_a_wrong_model_or_a_root_url_stops_before_any_request(tmp_path: Path):
    sim = start_sim(tmp_path, *GPU)
    try:
        data = dataset(tmp_path / "d.jsonl", huge=0)
        wrong = replay(f"{sim.base}/v1", data, tmp_path / "a", model="llama-typo")
        root = replay(sim.base, data, tmp_path / "b")
        served = sim.metrics().get("vllm:request_success_total", 0) + sim.metrics().get("vllm:num_requests_running", 0)
    finally:
        stop_sim(sim)
    assert wrong.returncode == 2 and "--model 'llama-typo' is not served" in wrong.stderr
    assert "it serves: tiny-1b" in wrong.stderr
    assert root.returncode == 2 and f"--base-url {sim.base}/v1" in root.stderr
    assert "Traceback" not in wrong.stderr + root.stderr
    assert served == 0 and not (tmp_path / "a" / "summary.json").exists()


def test_max_requests_and_duration_bound_the_replay(tmp_path: Path):
    sim = start_sim(tmp_path, "--offload", "none", "--gpu-kv-gb", "0.2", "--tpot-ms", "50")
    try:
        data = dataset(tmp_path / "d.jsonl", sessions=8, huge=0)
        capped = replay(f"{sim.base}/v1", data, tmp_path / "capped", "--max-requests", "7")
        timed = replay(f"{sim.base}/v1", data, tmp_path / "timed", "--duration", "1.5", "--concurrency", "4")
    finally:
        stop_sim(sim)
    assert capped.returncode == 0, capped.stderr
    s, recs = load(tmp_path / "capped")
    assert s["status"] == "complete" and s["stop_reason"]["code"] == "max-requests" and len(recs) == 7
    assert "replay (complete, max-requests)" in capped.stdout
    assert timed.returncode == 0, timed.stderr
    s, recs = load(tmp_path / "timed")
    assert s["status"] == "complete" and s["stop_reason"]["code"] == "duration"
    assert 0 < len(recs) < 40  # 8 users x 5 turns at 8 x 50 ms a reply need well over 1.5 s at concurrency 4
    starts = [r["start_unix_s"] for r in recs]
    # no request was dispatched after the deadline (the first started after the run's own t0). A record's start is
    # stamped just after the dispatch decision, so on a loaded machine it can trail the deadline by the event loop's
    # latency (5 ms seen on 2 busy cores: 1.505 s); a replay that ignored the deadline would span the whole dataset,
    # over 4 s here, so 0.2 s of slack still catches it
    assert max(starts) - min(starts) < 1.5 + 0.2
    assert all(r["status"] == "ok" for r in recs)  # in flight at the deadline: finished within --read-timeout
