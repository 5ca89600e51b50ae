"""kvtier sim as a real server on 127.0.0.1: OpenAI API, errors, metrics, GPU cache and real offload."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import kvtier_cmd

STARTUP_S = 60.0
"""How long a sim or cache-server may take to answer with its port (a few seconds when idle)."""


class Sim:
    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc, self.port = proc, port
        self.base = f"http://127.0.0.1:{port}"

    def post(self, path: str, body: Any, raw: bytes | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), dict(e.headers)

    def stream(self, body: dict[str, Any]) -> list[str]:
        req = urllib.request.Request(
            self.base + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return [line.decode().strip() for line in r if line.strip()]

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.base + "/metrics", timeout=10).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
        return out


def start_sim(tmp_path: Path, *args: str) -> Sim:
    port_file = tmp_path / f"port-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        kvtier_cmd() + ["sim", "--preset", "cpu-test", "--port", "0", "--port-file", str(port_file), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + STARTUP_S  # a loaded 2-core CI host once took over 10 s to import and bind
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return Sim(proc, int(port_file.read_text()))
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read() if proc.stderr else "sim died")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"sim did not start within {STARTUP_S} s")


def stop_sim(sim: Sim) -> tuple[int, str]:
    sim.proc.send_signal(signal.SIGTERM)
    _, err = sim.proc.communicate(timeout=20)
    return sim.proc.returncode, err


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Sim]:
    s = start_sim(tmp_path, "--offload", "cpu", "--cpu-offload-gb", "0.5")
    yield s
    stop_sim(s)


KV_BYTES_PER_CHUNK = 256 * 24_576  # tiny-1b: 256-token offload chunks


def wait_until(cond: Any, what: str, timeout_s: float = 15.0) -> None:
    """Poll ``cond()`` until true; a timeout is a failure naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def wait_stored(sim: Sim, chunks: int) -> None:
    """The store after prefill is asynchronous: wait until the offload tier holds ``chunks`` chunks."""

    def held() -> float:
        m = sim.metrics()
        return m.get("lmcache_mp_l1_memory_usage_bytes", 0.0) + m.get("lmcache_mp_l2_usage_bytes", 0.0)

    wait_until(lambda: held() >= chunks * KV_BYTES_PER_CHUNK, f"{chunks} chunks in the offload tier")


def chat(text: str, max_tokens: int = 3, **kw: Any) -> dict[str, Any]:
    return {"model": "tiny-1b", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **kw}


def test_models_health_and_replica_header(sim: Sim):
    with urllib.request.urlopen(sim.base + "/v1/models") as r:
        assert r.headers["x-kvtier-replica"] == f"127.0.0.1:{sim.port}"
        assert json.loads(r.read())["data"][0]["id"] == "tiny-1b"
    with urllib.request.urlopen(sim.base + "/health") as r:
        assert r.status == 200


def test_chat_stream_with_usage_and_non_stream(sim: Sim):
    lines = sim.stream(chat("hello there", 4, stream=True, stream_options={"include_usage": True}))
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(x[len("data: ") :]) for x in lines[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(1 for e in events if e["choices"] and e["choices"][0]["delta"].get("content")) == 4
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == 4
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    status, body, headers = sim.post("/v1/chat/completions", chat("hello there", 5))
    assert status == 200 and body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 5
    assert headers["x-kvtier-replica"]
    status, body, _ = sim.post("/v1/completions", {"model": "tiny-1b", "prompt": "once upon a time", "max_tokens": 2})
    assert status == 200 and body["object"] == "text_completion" and body["choices"][0]["text"]


@pytest.mark.parametrize(
    "body,raw,status,param",
    [
        (None, b"{not json", 400, None),
        ([1, 2], None, 400, None),
        ({"messages": []}, None, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, None, 400, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, None, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**7}, None, 400, "max_tokens"),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, None, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors_and_server_stays_up(sim: Sim, body, raw, status, param):
    code, err, _ = sim.post("/v1/chat/completions", body, raw)
    assert code == status and err["error"]["param"] == param and err["error"]["message"]
    assert sim.post("/v1/chat/completions", chat("still alive"))[0] == 200


def long_prompt(tag: str, words: int = 700) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


def test_gpu_prefix_hit_then_eviction_then_offload_hit(sim: Sim):
    a = long_prompt("alpha")
    _, r1, _ = sim.post("/v1/chat/completions", chat(a))
    _, r2, _ = sim.post("/v1/chat/completions", chat(a))
    assert r2["kvtier"]["gpu_hit_tokens"] > 0 and r2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    n_alpha = r1["usage"]["prompt_tokens"] // 256
    wait_stored(sim, n_alpha)  # the store path runs after prefill
    _, rb, _ = sim.post("/v1/chat/completions", chat(long_prompt("beta")))  # pushes alpha out of the GPU cache
    wait_stored(sim, n_alpha + rb["usage"]["prompt_tokens"] // 256)
    _, r3, _ = sim.post("/v1/chat/completions", chat(a))
    # alpha lost its tail first (blocks are freed in reverse, as vLLM's free queue does): its head still hits the
    # GPU, the rest comes back from the offload tier
    assert 0 < r3["kvtier"]["gpu_hit_tokens"] < r2["kvtier"]["gpu_hit_tokens"]
    assert r3["kvtier"]["external_tokens"] >= 256 and r3["kvtier"]["load_s"] > 0
    m = sim.metrics()
    ext = sum(r["kvtier"]["external_tokens"] for r in (r1, r2, r3))
    assert m["vllm:external_prefix_cache_hits_total"] == ext
    assert m["lmcache_mp_num_chunks_loaded_total"] >= ext // 256
    for name in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_count",
        "vllm:request_prefill_time_seconds_sum",
        "lmcache_mp_l1_memory_usage_bytes",
    ):
        assert name in m, name
    assert not any(k.endswith("_created") for k in m)


def test_without_offload_a_gpu_miss_is_recomputed(tmp_path: Path):
    s = start_sim(tmp_path, "--offload", "none")
    try:
        a = long_prompt("alpha")
        s.post("/v1/chat/completions", chat(a))
        s.post("/v1/chat/completions", chat(long_prompt("beta")))
        _, r, _ = s.post("/v1/chat/completions", chat(a))
        assert r["kvtier"]["external_tokens"] == 0
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == r["kvtier"]["gpu_hit_tokens"]
    finally:
        stop_sim(s)


def offload_round_trip(s: Sim, spilled: Any, where: str) -> None:
    """Prompt alpha, then beta, then alpha again through a sim whose offload tier sits behind a tiny
    staging tier: alpha's chunks must spill past staging (``spilled()``, to ``where``) and alpha's
    prefix must come back from the offload tier; the sim must then stop cleanly."""
    try:
        a = long_prompt("alpha")
        _, ra, _ = s.post("/v1/chat/completions", chat(a))
        n_alpha = ra["usage"]["prompt_tokens"] // 256
        wait_stored(s, n_alpha)
        assert spilled(), f"chunks spilled from the small staging tier to {where}"
        _, rb, _ = s.post("/v1/chat/completions", chat(long_prompt("beta")))
        wait_stored(s, n_alpha + rb["usage"]["prompt_tokens"] // 256)
        _, r, _ = s.post("/v1/chat/completions", chat(a))
        assert r["kvtier"]["external_tokens"] >= 256
    finally:
        code, err = stop_sim(s)
    assert code == 0, err


def test_nvme_offload_uses_real_files_and_cleans_up(tmp_path: Path):
    d = tmp_path / "nvme"
    d.mkdir()
    s = start_sim(tmp_path, "--offload", "nvme", "--nvme-dir", str(d), "--nvme-offload-gb", "1", "--staging-gb", "0.01")
    offload_round_trip(s, lambda: bool(list(d.rglob("*.kv"))), "files")
    assert list(d.iterdir()) == []


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_plain_curl_stream(sim: Sim):
    out = subprocess.run(
        [
            "curl",
            "-sN",
            sim.base + "/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(chat("hi", 2, stream=True)),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.stdout.strip().endswith("data: [DONE]") and out.stdout.count("data: ") == 5


def test_openai_sdk_if_installed(sim: Sim):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=sim.base + "/v1", api_key="none")
    r = client.chat.completions.create(model="tiny-1b", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.usage.completion_tokens == 3
    chunks = list(
        client.chat.completions.create(
            model="tiny-1b",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 3


def test_bad_flags(tmp_path: Path):
    p = subprocess.run(kvtier_cmd() + ["sim", "--preset", "nope"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "unknown preset" in p.stderr
    p = subprocess.run(
        kvtier_cmd() + ["sim", "--offload", "nvme", "--nvme-dir", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2 and "--nvme-dir" in p.stderr


def test_http10_stream_and_client_leaving_mid_stream(sim: Sim):
    out = subprocess.run(
        ["curl", "-sN", "--http1.0", sim.base + "/v1/chat/completions", "-d", json.dumps(chat("hi", 3, stream=True))],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.stdout.strip().endswith("data: [DONE]") and out.stdout.count('"content":"') == 4  # role + 3
    import socket

    body = json.dumps(chat("leave early", 2000, stream=True)).encode()
    with socket.create_connection(("127.0.0.1", sim.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        got = b""
        while got.count(b"data: ") < 5:
            got += sock.recv(65536)
    wait_until(lambda: not sim.metrics()["vllm:num_requests_running"], "the left client's slot to be freed", 10)
    m = sim.metrics()
    assert m["vllm:num_requests_running"] == 0  # the sequence left the batch and freed its slot
    assert 4 <= m["vllm:generation_tokens_total"] < 2000  # it stopped decoding for a gone client
    assert sim.post("/v1/chat/completions", chat("still alive"))[0] == 200


def start_cache_server(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], Path, int]:
    sock = tmp_path / "cache.sock"
    port_file = tmp_path / "cache.port"
    proc = subprocess.Popen(
        kvtier_cmd() + ["cache-server", "--socket", str(sock), "--port-file", str(port_file), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return proc, sock, int(port_file.read_text())
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read() if proc.stderr else "cache-server died")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"cache-server did not start within {STARTUP_S} s")


def test_two_replicas_share_one_cache_server(tmp_path: Path):
    cache, sock, cport = start_cache_server(tmp_path, "--cpu-offload-gb", "0.2")
    a = b = None
    try:
        a = start_sim(tmp_path, "--offload", "remote", "--cache-server", str(sock), "--replica-id", "A")
        b = start_sim(tmp_path, "--offload", "remote", "--cache-server", str(sock), "--replica-id", "B")
        text = long_prompt("shared")
        _, ra, ha = a.post("/v1/chat/completions", chat(text))
        assert ha["x-kvtier-replica"] == "A" and ra["kvtier"]["external_tokens"] == 0

        def stored_chunks() -> float:
            text = urllib.request.urlopen(f"http://127.0.0.1:{cport}/metrics", timeout=10).read().decode()
            return sum(
                float(x.split()[-1]) for x in text.splitlines() if x.startswith("lmcache_mp_num_chunks_stored_total")
            )

        # A's store after prefill reaches the cache server asynchronously
        wait_until(lambda: stored_chunks() >= ra["usage"]["prompt_tokens"] // 256, "A's chunks in the cache server")
        _, rb, hb = b.post("/v1/chat/completions", chat(text))
        assert hb["x-kvtier-replica"] == "B" and rb["kvtier"]["gpu_hit_tokens"] == 0
        assert rb["kvtier"]["external_tokens"] >= 256 and rb["kvtier"]["load_s"] > 0  # B fetched what A stored
        assert b.metrics()["vllm:external_prefix_cache_hits_total"] == rb["kvtier"]["external_tokens"]
        text_m = urllib.request.urlopen(f"http://127.0.0.1:{cport}/metrics", timeout=10).read().decode()
        loaded = sum(
            float(x.rsplit(" ", 1)[1])
            for x in text_m.splitlines()
            if x.startswith("lmcache_mp_num_chunks_loaded_total")
        )
        assert loaded * 256 >= rb["kvtier"]["external_tokens"]
        # the cache server goes away: replicas keep serving, recomputing, and count the failures
        cache.send_signal(signal.SIGTERM)
        cache.wait(timeout=20)
        code, _, _ = b.post("/v1/chat/completions", chat(long_prompt("after")))
        assert code == 200 and b.metrics()["kvtier_sim:offload_errors"] >= 1
    finally:
        for s in (a, b):
            if s is not None:
                stop_sim(s)
        if cache.poll() is None:
            cache.kill()
    assert not sock.exists()  # removed by the cache server on exit


def test_remote_offload_refuses_a_cache_server_of_another_model(tmp_path: Path):
    """The cache server's slots are the first replica's chunks (here the test model's, no --block-bytes); a replica of
    a model whose chunks do not fit them is refused at start, both geometries and the flags that size slots named."""
    cache, sock, _ = start_cache_server(tmp_path, "--cpu-offload-gb", "0.1")
    first = None
    try:
        first = start_sim(tmp_path, "--offload", "remote", "--cache-server", str(sock), "--replica-id", "A")
        p = subprocess.run(
            kvtier_cmd()
            + [
                "sim",
                "--preset",
                "cpu-test",
                "--model",
                "llama3.1-8b",
                "--gpu-kv-gb",
                "1",
                "--port",
                "0",
                "--offload",
                "remote",
                "--cache-server",
                str(sock),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 2 and "the engine has 33554432 bytes" in p.stderr and "--block-bytes" in p.stderr
        p = subprocess.run(
            kvtier_cmd() + ["sim", "--port", "0", "--offload", "remote"], capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 2 and "--cache-server" in p.stderr
    finally:
        if first is not None:
            stop_sim(first)
        cache.send_signal(signal.SIGTERM)
        cache.wait(timeout=20)


def test_a_side_by_side_run_can_tell_a_fresh_server_from_a_warmed_one(sim: Sim):
    """#56 item 1: benchmarks/sim_vs_vllm.py replays only against a server whose prefix cache has looked nothing up
    (vLLM's counter, which the sim keeps); the check reads 0 on a fresh sim and not after one request."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from _common import prior_queries

    assert prior_queries(sim.base) == 0
    code, _, _ = sim.post("/v1/chat/completions", chat("a prompt the cache looks up " * 40))
    assert code == 200 and prior_queries(sim.base) > 0
