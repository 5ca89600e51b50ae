"""kvtier replay --synthetic --target-hit-rate against a real kvtier sim (sglang #37359: a controlled, reproducible
prefix-cache hit rate): the server is primed, its counters checked before anything is measured, the measured run's
rate held to the target; a working set no cache holds measures nothing and says why."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import kvtier_cmd
from tests.integration.test_sim import start_sim, stop_sim

pytestmark = pytest.mark.slow


def _replay(base: str, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    p = subprocess.run(
        [*kvtier_cmd(), "replay", "--base-url", f"{base}/v1", "--model", "tiny-1b", "--synthetic", "--users", "2",
         "--turns", "3", "--isl", "1024", "--osl", "2", "--concurrency", "2", "--output", str(out),
         "--progress", "none", "--scrape-interval", "0.5", *extra],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    return p, json.loads((out / "summary.json").read_text())


def test_a_target_hit_rate_is_primed_checked_and_held(tmp_path: Path):
    sim = start_sim(tmp_path, "--offload", "cpu", "--cpu-offload-gb", "0.5")
    try:
        p, s = _replay(sim.base, tmp_path / "ok", "--target-hit-rate", "0.5")
        c = s["summary"]["hit_rate_control"]
        assert p.returncode == 0 and s["status"] == "complete", p.stderr
        # one document per user, 512 tokens of each 1,024-token prompt: the counters say half, within 0.02
        assert (c["documents"], c["prefix_tokens"], c["own_tokens"], c["primed"]) == (2, 512, 512, 2)
        assert c["check_ok"] and abs(c["check_rate"] - 0.5) <= 0.02
        assert c["within"] and abs(c["rate"] - 0.5) <= 0.02 and s["summary"]["requests_ok"] == 6
        # the primed and checked requests are not the measured run's: its counters count its six requests only
        m = s["server_metrics"][0]
        prompt = sum(
            json.loads(x)["prompt_tokens"] for x in (tmp_path / "ok" / "requests.jsonl").read_text().splitlines()
        )
        assert m["prefix_cache_queries"] == prompt

        # a working set of 64 documents of 1,024 tokens: more than the sim's GPU and CPU tiers hold between two uses
        p, s = _replay(sim.base, tmp_path / "off", "--target-hit-rate", "0.5", "--working-set", "65536")
        c = s["summary"]["hit_rate_control"]
        assert p.returncode == 1 and s["status"] == "failed" and s["stop_reason"]["code"] == "hit-rate-off-target"
        assert not c["check_ok"] and c["check_rate"] < 0.48 and "working set (65,536 tokens" in c["problem"]
        assert s["summary"]["requests_total"] == 0  # nothing measured
    finally:
        stop_sim(sim)
