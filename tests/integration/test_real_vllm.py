"""kvtier against a real vLLM: the CPU build (vllm-cpu 0.32.0, installed by scripts/install-engines.sh cpu,
which scripts/test.sh runs) serving a ``kvtier model make`` folder with dummy weights on 127.0.0.1.

One server for this module (fixture ``real_vllm``: ~1-2 minutes to start on 2 cores); the launch test, which
starts its own two replicas behind Caddy, is in test_real_vllm_launch.py. Everything skips, with the reason, where
the engine is not installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.launch.engines import check_engines
from kvtier.launch.procs import free_ports
from kvtier.replay.scrape import parse
from tests.conftest import REPO, SHARED_DATA, kvtier_cmd, replay_summary

pytest.importorskip("tokenizers")

ENGINE_PYTHON = Path(os.environ.get("KVTIER_VLLM_CPU_PYTHON", REPO / ".engines-cpu" / "bin" / "python"))
MINISWE = SHARED_DATA / "lmcache_agent_trace" / "miniswe"
KV_TOKENS, MAX_LEN = 32768, 16384
STARTUP_S = 900


def _engine_problem() -> str | None:
    if not ENGINE_PYTHON.exists():
        return f"vllm-cpu is not installed ({ENGINE_PYTHON} missing: bash scripts/install-engines.sh cpu)"
    chk = check_engines(needs_lmcache=False, python=str(ENGINE_PYTHON), cpu_build=True)
    return None if chk.ok else "; ".join(chk.problems)


PROBLEM = _engine_problem()
pytestmark = [pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or ""), pytest.mark.slow, pytest.mark.engine]


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    model_dir: Path
    log: Path
    kv_cache_bytes: int

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return parse(r.read().decode())


@pytest.fixture(scope="module")  # stopped after this module: an idle vLLM's workers still take CPU from later tests
def real_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from kvtier.launch import cpu_engine
    from kvtier.launch.devices import cpu_inventory
    from kvtier.modelmaker import Geometry, make_model

    d = tmp_path_factory.mktemp("vllm")
    model = make_model(d / "tiny", Geometry())
    (port,) = free_ports(1)
    kv_bytes = KV_TOKENS * Geometry().kv_bytes_per_token
    srv = cpu_engine.start(str(ENGINE_PYTHON), str(model), port, d, kv_bytes, MAX_LEN, cpu_inventory(None).devices)
    try:
        srv.wait_healthy(STARTUP_S)
        yield Server(srv.url, model, srv.log, kv_bytes)
    finally:
        srv.stop()


def _trace() -> Path:
    if not MINISWE.exists():
        pytest.skip("../shared/data not present")
    return sorted(MINISWE.glob("*.jsonl"))[0]


def _replay(server: Server, out: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*kvtier_cmd(), "replay", "--base-url", server.url + "/v1", "--model", "tiny", "--output", str(out),
         "--metrics-url", server.url, "--progress", "none", "--scrape-interval", "1", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_kvtier_bytes_per_token_is_what_vllm_allocates(real_vllm: Server):
    """vLLM's KV cache in tokens = --kv-cache-memory-bytes / kvtier's KV bytes per token for the folder."""
    from kvtier.modelspec import spec_from_hf_config

    m = re.search(r"CPU KV cache size: ([\d,]+) tokens", real_vllm.log.read_text())
    assert m, real_vllm.log.read_text()[-2000:]
    tokens = int(m.group(1).replace(",", ""))
    assert tokens == real_vllm.kv_cache_bytes // spec_from_hf_config(str(real_vllm.model_dir)).kv_bytes_per_token


def test_replay_of_an_agent_trace_fills_every_field_and_hit_rates_match_the_counters(real_vllm: Server, tmp_path):
    before = real_vllm.metrics()
    out = tmp_path / "r"
    p = _replay(real_vllm, out, "--dataset", str(_trace()), "--tokenizer", f"hf:{real_vllm.model_dir}",
                "--num-rounds", "3", "--concurrency", "2", "--max-requests", "6", "--warmup", "0")  # fmt: skip
    after = real_vllm.metrics()
    assert p.returncode == 0, p.stderr
    s = replay_summary(out / "summary.json")
    assert s["status"] == "complete" and s["dataset"]["tokenizer"].startswith("hf:")
    recs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and all(r["status"] == "ok" and r["http_status"] == 200 for r in recs)
    for r in recs:
        for k in ("ttft_s", "e2e_s", "prompt_tokens", "completion_tokens", "cached_tokens", "start_unix_s"):
            assert r[k] is not None, (k, r)
    # later turns of a session extend its earlier prompts: the server says so in usage.prompt_tokens_details
    assert any(r["cached_tokens"] > 0 for r in recs if r["turn"] > 0)
    # the scraper's figure is the counters' delta over the run (nothing else used this server meanwhile)
    (m,) = s["server_metrics"]
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    assert queries > 0 and m["prefix_cache_hit_rate_overall"] == pytest.approx(hits / queries, abs=1e-4)
    assert m["kv_cache_usage_perc_mean"] is not None and m["ttft_server_s_mean"] is not None


def test_a_prompt_over_the_model_length_is_a_context_length_failure(real_vllm: Server, tmp_path):
    out = tmp_path / "long"
    p = _replay(real_vllm, out, "--synthetic", "--users", "1", "--turns", "1", "--isl", str(MAX_LEN + 500),
                "--osl", "4", "--tokenizer", f"hf:{real_vllm.model_dir}")  # fmt: skip
    assert p.returncode == 1, p.stderr
    s = replay_summary(out / "summary.json")
    assert s["status"] == "failed" and s["stop_reason"]["code"] == "too-many-failures"
    assert {w["code"] for w in s["warnings"]} >= {"prompts-exceed-context", "requests-failed"}
    (r,) = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert r["status"] == "error" and r["cause"] == "context-length" and r["http_status"] == 400


@pytest.mark.serial  # 64 tokens a TPOT stream: with 8, every stream of a sweep came in one burst in 1 run of 11
def test_ladder_of_the_real_vllm_is_verified_by_its_counters_and_superlinear(real_vllm: Server, tmp_path):
    """kvtier ladder against the CPU build: cold and GPU points, each verified by vLLM's own prefix-cache counters;
    no offload tier (the CPU build has none, and the ladder says so rather than assume one)."""
    out = tmp_path / "ladder.json"
    p = subprocess.run(
        [*kvtier_cmd(), "ladder", "--base-url", real_vllm.url + "/v1", "--model", "tiny", "--tokenizer",
         f"hf:{real_vllm.model_dir}", "--contexts", "256,2048,8192", "--new-tokens", "16,512", "--repeats", "2",
         "--tpot-concurrency", "1,2", "--tpot-tokens", "64", "--output", str(out), "--quiet"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    r = json.loads(out.read_text())
    # complete; or partial for one reason only: the machine was noisy enough that the fit's errors passed their
    # bounds (said, with the host's load: #56), which is not what this test is about
    unreliable = r["fit"] is not None and bool(r["fit"]["unreliable"])
    assert (p.returncode, r["status"]) == (0, "complete") or (p.returncode, r["status"], unreliable) == (
        1, "partial", True), p.stdout + p.stderr + json.dumps(r["warnings"])  # fmt: skip
    assert r["server"]["kind"] == "vllm" and r["server"]["tiers"] == []
    assert r["server"]["block_tokens"] == 128 and r["server"]["gpu_kv_tokens"] == KV_TOKENS
    # the grid, and a cell whose repeats spread past 20 % measured again (cold and gpu: 2 points a round); a TPOT
    # sweep measured again ("tpot sweep") adds no points
    assert {pt["source"] for pt in r["points"]} == {"cold", "gpu"}
    cells_again = sum(v for k, v in r["remeasured"].items() if k.startswith("context "))
    assert len(r["points"]) == 3 * 2 * 2 * 2 + 2 * cells_again, r["remeasured"]
    assert all(pt["verified"] for pt in r["points"]), [pt["why"] for pt in r["points"] if not pt["verified"]]
    for pt in r["points"]:  # the counters' deltas, not usage, verified each one
        assert pt["shown"]["basis"] == "counters"
        if pt["source"] == "gpu":
            assert pt["shown"]["gpu_hit_tokens"] >= pt["context_tokens"] - 128
    med = {(c["source"], c["context_tokens"], c["new_tokens"]): c["ttft_s_median"] for c in r["cells"]}
    assert med[("gpu", 8192, 16)] < med[("cold", 8192, 16)] / 3  # a hit skips most of the prefill
    f = r["fit"]
    assert f is not None and f["timing"]["source"] == "measured" and f["timing"]["fetch"] == []
    assert f["prefill_fit_median_abs_rel_err"] < 0.25
    assert f["timing"]["decode"]["tpot_s"] > 0, (r["tpot"], f["timing"]["figures"])
