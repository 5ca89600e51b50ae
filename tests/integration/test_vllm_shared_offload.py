"""Two real vLLM replicas (the CPU build) sharing one set of kvtier tiers: ``kvtier cache-server`` as the
run's cache sidecar, every replica's kvtier offloading spec pointed at its socket (kvtier/vllm/blockserver.py).

One server for the module, an NVMe tier behind a 24-block CPU staging tier, and two replicas with 8,192-token KV
caches. A prompt replica A computed is served on replica B from the shared tier — from the files once it was demoted
there, from the staging tier while it is recent — with the answer A computed, as both engines' counters and the
server's say; when the server dies the replicas keep serving (misses, counted), and they find it again when it
is back. Everything skips, with the reason, where the engine is not installed.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.launch.procs import free_ports
from kvtier.replay.scrape import Snapshot, parse_snapshot
from tests.integration.test_real_vllm import ENGINE_PYTHON, PROBLEM, STARTUP_S
from tests.integration.test_vllm_offload import BLOCK, KV_TOKENS, MAX_LEN, delta

pytest.importorskip("tokenizers")
pytestmark = [pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or ""), pytest.mark.slow, pytest.mark.engine]

STAGING_BLOCKS = 24


@dataclass
class Shared:
    a: str
    b: str
    server_argv: list[str]
    server_url: str
    server: subprocess.Popen[bytes]
    dir: Path
    rnd: random.Random

    def prompt(self, tag: str, words: int = 700) -> list[str]:
        return [f"{tag}{self.rnd.randrange(100000)}" for _ in range(words)]

    def server_metrics(self) -> Snapshot:
        with urllib.request.urlopen(self.server_url + "/metrics", timeout=10) as r:
            return parse_snapshot(r.read().decode())

    def wait_stored(self, blocks: int, timeout_s: float = 60.0) -> None:
        """Until the server has placed ``blocks`` blocks in all (the engines store after they compute) and none is
        still pending (placed, its store not yet reported complete: a lookup of one answers pending, and vLLM
        then defers the request and labels part of its hit external_unspecified)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = self.server_metrics()
            placed, pending = (
                m.get("kvtier_block_server_stored_blocks_total") or 0,
                m.get("kvtier_block_server_pending_blocks"),
            )
            if placed >= blocks and pending == 0:
                return
            time.sleep(0.1)
        raise AssertionError(f"the server did not take {blocks} blocks (and complete them) within {timeout_s} s")

    def restart_server(self) -> None:
        self.server = subprocess.Popen(self.server_argv, stderr=open(self.dir / "server.log", "ab"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.server_metrics()
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError("the cache server did not come back")


def ask(url: str, words: list[str], request_id: str | None = None) -> tuple[dict, str]:
    body = json.dumps({"model": "tiny", "prompt": " ".join(words), "max_tokens": 1, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
    req = urllib.request.Request(url + "/v1/completions", body, headers)
    with urllib.request.urlopen(req, timeout=300) as r:
        j = json.loads(r.read())
    return j["usage"], j["choices"][0]["text"]


def metrics(url: str) -> Snapshot:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_snapshot(r.read().decode())


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    from kvtier.launch import cpu_engine
    from kvtier.launch.devices import cpu_inventory
    from kvtier.modelmaker import Geometry, make_model
    from kvtier.vllm import engine_pythonpath, kv_transfer_arg

    d = tmp_path_factory.mktemp("shared")
    model = make_model(d / "tiny", Geometry())
    nvme = d / "nvme"
    nvme.mkdir()
    sockdir = Path(tempfile_dir()) / f"kvtier-test-{time.monotonic_ns()}"
    sockdir.mkdir(mode=0o700)
    sock = sockdir / "cache.sock"
    block_bytes = BLOCK * Geometry().kv_bytes_per_token
    http, pa, pb = free_ports(3)
    argv = [sys.executable, "-m", "kvtier", "cache-server", "--offload", "nvme",
            "--staging-gb", str(STAGING_BLOCKS * block_bytes / 2**30), "--nvme-dir", str(nvme),
            "--nvme-offload-gb", "0.25", "--socket", str(sock), "--port", str(http)]  # fmt: skip
    s = Shared("", "", argv, f"http://127.0.0.1:{http}", None, d, random.Random(5))  # type: ignore[arg-type]
    s.restart_server()
    cores = cpu_inventory(None).devices
    extra = ["--kv-transfer-config", kv_transfer_arg({"cache_server": str(sock)})]
    # B also writes its per-request log (kvtier/vllm/reqlog.py): its hits from the shared server, by tier
    extra_b = ["--kv-transfer-config", kv_transfer_arg({"cache_server": str(sock), "request_log": str(d / "b.jsonl")})]
    env = {"PYTHONPATH": engine_pythonpath(str(d / "pylib"))}
    kv = KV_TOKENS * Geometry().kv_bytes_per_token
    a = cpu_engine.start(str(ENGINE_PYTHON), str(model), pa, d, kv, MAX_LEN, cores, name="a", extra=extra, env=env)
    b = cpu_engine.start(str(ENGINE_PYTHON), str(model), pb, d, kv, MAX_LEN, cores, name="b", extra=extra_b, env=env)
    try:
        a.wait_healthy(STARTUP_S)
        b.wait_healthy(STARTUP_S)
        s.a, s.b = a.url, b.url
        yield s
    finally:
        a.stop()
        b.stop()
        s.server.send_signal(signal.SIGTERM)
        s.server.wait(timeout=30)
        # the server's file tier kept the run-folder rules and removed its own folder at a clean stop
        assert not any(nvme.iterdir()), list(nvme.iterdir())
        sockdir.rmdir()


def tempfile_dir() -> str:
    import tempfile

    return tempfile.gettempdir()


def test_a_prompt_replica_a_computed_is_served_on_replica_b_from_the_shared_files_and_staging(shared: Shared):
    s = shared
    first, second, third = s.prompt("one"), s.prompt("two"), s.prompt("three")
    answers = {}
    stored = s.server_metrics().get("kvtier_block_server_stored_blocks_total") or 0
    for words in (first, second, third):  # each ~2,300 tokens, 17 whole blocks: the first ends up in the files
        usage, answers[words[0]] = ask(s.a, words)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        stored += usage["prompt_tokens"] // BLOCK
        s.wait_stored(stored)
    for words, source in ((first, "disk"), (third, "host")):
        before_b, before_srv = metrics(s.b), s.server_metrics()
        usage, text = ask(s.b, words, request_id=f"shared-{source}")
        after_b, after_srv = metrics(s.b), s.server_metrics()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached == usage["prompt_tokens"] // BLOCK * BLOCK  # every whole block came from the shared tier
        assert text == answers[words[0]]  # B, which never saw the prompt, answers with the KV A computed
        # B's own counters: over the connector, from the tier the server said, not from B's own cache
        assert delta(before_b, after_b, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == cached
        # what the server says it read, by tier, beside B's labels: a failure names which of the two moved
        seen = {
            t: delta(before_srv, after_srv, "kvtier_block_server_loaded_shards_total", tier=t)
            for t in ("cpu", "storage")
        }
        labels = {
            s: delta(before_b, after_b, "vllm:prompt_tokens_cached_by_source_total", source=s) for s in ("host", "disk")
        }
        held = {t: after_srv.get("kvtier_block_server_tier_blocks", tier=t) for t in ("cpu", "storage")}
        assert labels[source] == cached, f"{source}: B labelled {labels}, the server read {seen} blocks, holds {held}"
        assert delta(before_b, after_b, "vllm:prefix_cache_hits_total") == 0
        tier = "storage" if source == "disk" else "cpu"
        assert delta(before_b, after_b, "kvtier:offload_loaded_blocks_total", tier=tier) == cached // BLOCK
        # the server's: loaded by an engine other than the one that stored them
        assert delta(before_srv, after_srv, "kvtier_block_server_cross_replica_loads_total") == cached // BLOCK
        # B's own record of the request: its prompt from the shared server's tier, by name
        from kvtier.results.engine_log import EngineLogTail

        log = EngineLogTail([str(s.dir / "b.jsonl")])
        deadline = time.monotonic() + 30
        while f"shared-{source}" not in log.by_id and time.monotonic() < deadline:
            time.sleep(0.1)
            log.poll()
        rec = log.by_id[f"shared-{source}"]
        assert rec.tier_tokens == {f"shared-{tier}": cached} and rec.load.blocks == {f"shared-{tier}": cached // BLOCK}
    assert s.server_metrics().get("kvtier_block_server_failed_loads_total") == 0


def test_replicas_serve_through_a_dead_cache_server_and_find_it_again(shared: Shared):
    s = shared
    s.server.send_signal(signal.SIGKILL)
    s.server.wait(timeout=30)
    before = metrics(s.a)
    lonely = s.prompt("alone")
    usage, _ = ask(s.a, lonely)  # no server: a plain prefill, not a failed request
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    after = metrics(s.a)
    assert delta(before, after, "kvtier:offload_server_errors_total") > 0
    for run in s.dir.glob("nvme/kvtier-run-*"):  # the killed server's folder: stale, as kvtier clean finds it
        from kvtier.engine.runs import remove_stale_run

        assert not remove_stale_run(run)
    s.restart_server()  # empty, on the same socket
    time.sleep(1.5)  # past the clients' reconnect interval
    again = s.prompt("back")
    usage, text = ask(s.a, again)
    s.wait_stored(usage["prompt_tokens"] // BLOCK)
    usage, text_b = ask(s.b, again)
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] // BLOCK * BLOCK
    assert text_b == text
