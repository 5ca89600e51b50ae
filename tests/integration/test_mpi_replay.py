"""kvtier replay over real mpirun ranks against a real kvtier sim on 127.0.0.1: the virtual users split
exactly (none lost or doubled), rank 0 alone scrapes, and the pooled summary is computed over the union
of every rank's records."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvtier.config.replay import ReplayConfig
from kvtier.replay.driver import prepare
from tests.conftest import NEEDS_MPI, kvtier_cmd, replay_summary
from tests.integration.test_launch import conversations
from tests.integration.test_sim import start_sim, stop_sim

pytestmark = [*NEEDS_MPI, pytest.mark.slow]


def test_users_split_exactly_and_the_summary_pools_the_union(tmp_path: Path):
    data = conversations(tmp_path / "data", users=5, turns=3)
    out = tmp_path / "out"
    sim = start_sim(tmp_path, "--gpu-kv-gb", "0.5")
    try:
        args = ["--base-url", f"{sim.base}/v1", "--model", "tiny-1b", "--dataset", str(data), "--num-rounds", "3"]
        args += [
            "--min-chunk-rounds",
            "0",
            "--concurrency",
            "3",
            "--gap-scale",
            "0",
            "--scrape-interval",
            "0.5",
            "--output",
            str(out),
        ]
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        p = subprocess.run(
            ["mpirun", *root, "--oversubscribe", "-np", "2", *kvtier_cmd(), "replay", *args],
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        stop_sim(sim)
    assert p.returncode == 0, p.stdout + p.stderr
    single = prepare(
        ReplayConfig(base_url="http://x/v1", model="m", dataset=str(data), num_rounds=3, min_chunk_rounds=0)
    )
    expected = sorted(u.user_id for u in single.users)
    per_rank = [
        [json.loads(x) for x in (out / f"rank_{r}" / "requests.jsonl").read_text().splitlines()] for r in (0, 1)
    ]
    users = [{x["user"] for x in rows} for rows in per_rank]
    assert not users[0] & users[1] and sorted(users[0] | users[1]) == expected  # none lost, none doubled
    union = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(union) == sum(len(rows) for rows in per_rank) == len(expected) * 3
    assert {x["rank"] for x in union} == {0, 1}
    s = replay_summary(out / "summary.json")
    assert s["status"] == "complete" and s["lost_ranks"] == [] and len(s["ranks"]) == 2
    assert s["summary"]["sessions"]["total"] == len(expected) == s["summary"]["sessions"]["complete"]
    assert s["concurrency"]["requested"] == 3 and [r["virtual_users"] for r in s["ranks"]] == [3, 2]
    ttft = np.asarray([x["ttft_s"] for x in union if x["status"] == "ok"])
    assert s["summary"]["ttft_s"]["p50"] == pytest.approx(float(np.percentile(ttft, 50)), abs=1e-5)
    rank1 = replay_summary(out / "rank_1" / "summary.json")
    assert rank1["server_metrics"] == [] and len(s["server_metrics"]) == 1  # rank 0 alone scrapes


def test_launch_drives_its_replica_with_client_ranks(tmp_path: Path):
    """kvtier launch --client-ranks 2: the replay runs as two MPI ranks against the launched sim; the
    pooled summary carries the launch identity and no process is left behind."""
    from tests.integration.test_launch import assert_no_orphans, launch

    data = conversations(tmp_path / "data", users=4, turns=3)
    out = tmp_path / "run"
    flags = ["--tier", "gpu", "--engine", "sim", "--client-ranks", "2"]
    replay = ["--model", "m", "--dataset", str(data), "--num-rounds", "3", "--min-chunk-rounds", "0"]
    replay += ["--concurrency", "2", "--warmup", "0"]
    p = launch(out, *flags, replay=replay)
    assert p.returncode == 0, p.stderr[-3000:]
    s = replay_summary(out / "replay" / "summary.json")
    assert [r["rank"] for r in s["ranks"]] == [0, 1] and s["summary"]["sessions"]["complete"] == 4
    assert s["server"]["launch"]["profile"] == "sim-nvidia-gpu" and s["status"] == "complete"
    rows = [json.loads(x) for x in (out / "replay" / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and {r["rank"] for r in rows} == {0, 1}
    record = json.loads((out / "launch.json").read_text())
    assert record["replay"][:2] == ["kvtier", "replay"] and record["exit_status"] == 0
    assert any("mpirun" in e["event"] for e in record["events"])
    assert_no_orphans(out)
