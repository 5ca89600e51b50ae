"""kvtier launch --arms: parsing, the per-arm reduction from replay folders, and the verdict against none."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvtier.config.launch import LaunchConfig, parse_arms
from kvtier.config.replay import ReplayConfig
from kvtier.errors import ConfigError
from kvtier.launch.arms import reduce_arm, verdict
from kvtier.results.arms import ArmRun


def test_arms_parse_with_their_tiers_and_bad_ones_are_named():
    assert parse_arms(["none", "kvtier", "kvtier:nvme"], "cpu") == [
        ("none", "none", "gpu"), ("kvtier", "kvtier", "cpu"), ("kvtier:nvme", "kvtier", "nvme")]  # fmt: skip
    for bad, words in ((["none", "mooncake"], "expected none or ENGINE"), (["none", "kvtier"], "needs a tier"),
                       (["none", "none"], "named twice"), (["none:cpu"], "expected none")):  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            parse_arms(bad, "gpu")
    base = {
        "engine": "vllm",
        "build": "cpu",
        "tier": "cpu",
        "output": "o",
        "replay": ReplayConfig(model="m", dataset="d"),
    }
    with pytest.raises(ValueError, match="name none"):
        LaunchConfig(**base, arms=["kvtier"])
    with pytest.raises(ValueError, match="--offload-engine kvtier or kvtier-shared only"):
        LaunchConfig(**base, arms=["none", "lmcache"])
    with pytest.raises(ValueError, match="needs --nvme-dir"):
        LaunchConfig(**base, arms=["none", "kvtier:nvme"])
    assert LaunchConfig(**base, arms=["none", "kvtier"], rounds=2).rounds == 2


def _run(folder: Path, ttfts: list[tuple[int, float]], by_source: dict[str, float], failed: int = 0) -> ArmRun:
    """A replay folder: requests (session_turn, ttft) and one server's counters."""
    (folder / "replay").mkdir(parents=True)
    recs = [{"status": "ok", "cause": None, "turn": 0, "session_turn": t, "ttft_s": x, "prompt_tokens": 1000}
            for t, x in ttfts]  # fmt: skip
    recs += [{"status": "error", "cause": "connection", "turn": 0, "session_turn": 1, "ttft_s": None}] * failed
    (folder / "replay" / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    m = {"url": "http://127.0.0.1:1", "samples": 3, "scrape_errors": 0,
         "prompt_tokens_by_source": by_source, "prompt_tokens_cached_by_source": {"host": by_source.get("x", 0)},
         "kv_offload_load_bytes": 2e9, "kv_offload_load_time_s": 1.0}  # fmt: skip
    (folder / "replay" / "summary.json").write_text(json.dumps({"server_metrics": [m]}))
    return ArmRun(round=0, folder=str(folder), status="complete", stop="max-requests", requests=len(recs),
                  ok=len(ttfts), failed={"connection": failed} if failed else {})  # fmt: skip


def test_the_reduction_pools_later_turns_and_the_counters_and_the_verdict_needs_separate_intervals(tmp_path):
    rng = np.random.default_rng(0)
    none_t = [(0, 3.0)] + [(t, 2.0 + 0.01 * i) for i, t in enumerate([1, 2, 3] * 10)]
    fast_t = [(0, 3.0)] + [(t, 1.0 + 0.01 * i) for i, t in enumerate([1, 2, 3] * 10)]
    same_t = [(0, 3.0)] + [(t, 2.0 + 0.01 * ((i * 7) % 30)) for i, t in enumerate([1, 2, 3] * 10)]
    folders = {n: tmp_path / n for n in ("none", "fast", "same")}
    runs = {
        "none": _run(folders["none"], none_t, {"local_compute": 25000, "local_cache_hit": 6000}),
        "fast": _run(folders["fast"], fast_t, {"local_compute": 10000, "external_kv_transfer": 21000}, failed=2),
        "same": _run(folders["same"], same_t, {"local_compute": 25000, "local_cache_hit": 6000}),
    }
    stats = {n: reduce_arm(n, "kvtier" if n != "none" else "none", "cpu", None, [r], [folders[n]], rng)
             for n, r in runs.items()}  # fmt: skip
    f = stats["fast"]
    assert f.later_ttft.n == 30 and f.all_ttft.n == 31  # turn 0 is not a later turn
    assert f.later_ttft.p50_lo_s <= f.later_ttft.p50_s <= f.later_ttft.p50_hi_s
    assert f.hit_rate_by_source["external_kv_transfer"] == pytest.approx(21000 / 31000, abs=1e-6)
    assert f.failed == {"connection": 2} and f.offload.load_gb_per_s == 2.0
    assert set(f.later_ttft_p50_by_turn_s) == {"1", "2", "3"}
    v = verdict(f, stats["none"])
    assert v.pays is True and v.later_ttft_p50_ratio < 0.6 and "it pays" in v.why
    assert verdict(stats["none"], f).pays is False  # the other way round it costs
    u = verdict(stats["same"], stats["none"])
    assert u.pays is None and "cannot tell" in u.why
