"""kvtier plan retention: the exact LRU hit curve and retention window, against a brute-force LRU."""

from __future__ import annotations

import json
import random
import subprocess
from collections import OrderedDict

import pytest

from kvtier.errors import DatasetError
from kvtier.plan.retention import (
    AccessStream,
    closed_loop_order,
    retention_report,
    stream_from_trace,
    stream_from_users,
)
from tests.conftest import SHARED_DATA, kvtier_cmd

MOONCAKE = SHARED_DATA / "mooncake_fast25" / "conversation_trace.jsonl"
MINISWE = SHARED_DATA / "lmcache_agent_trace" / "miniswe"
needs_data = pytest.mark.skipif(not (MOONCAKE.exists() and MINISWE.exists()), reason="../shared/data not present")


def _random_stream(seed: int, requests: int = 120) -> AccessStream:
    """Requests of 1-6 blocks of varied sizes drawn from a small pool (so blocks recur at many distances)."""
    rng = random.Random(seed)
    sizes = {k: rng.choice([16, 64, 64, 256]) for k in range(40)}
    s = AccessStream(unit="s", block_tokens=64)
    t = 0.0
    for _ in range(requests):
        t += rng.random()
        s.add_request([(k, sizes[k]) for k in rng.sample(range(40), rng.randint(1, 6))], t)
    return s


def _brute(s: AccessStream, caps: list[int]):
    """A real waterfall of LRU tiers in tokens (evict-until-fit, demote to the next tier, promote on a hit): the
    tokens each tier serves, and per request (once the whole waterfall has evicted) the age of the oldest held
    block's last access."""
    tiers: list[OrderedDict] = [OrderedDict() for _ in caps]
    used = [0] * len(caps)
    served = [0] * len(caps)
    seen_at: dict = {}
    windows: list[float] = []
    evicted = False

    def put(i: int, k, size: int) -> None:
        nonlocal evicted
        if i == len(caps):
            evicted = True
            return
        tiers[i][k] = size
        used[i] += size
        while used[i] > caps[i]:
            old, osize = tiers[i].popitem(last=False)
            used[i] -= osize
            put(i + 1, old, osize)

    for pos, (k, size) in enumerate(zip(s.keys, s.tokens)):
        for i, tier in enumerate(tiers):
            if k in tier:
                served[i] += size
                used[i] -= tier.pop(k)
                break
        put(0, k, size)
        seen_at[k] = s.request_time[s.request[pos]]
        if pos + 1 == len(s.keys) or s.request[pos + 1] != s.request[pos]:
            if evicted:
                held = [k2 for tier in tiers for k2 in tier]
                windows.append(s.request_time[s.request[pos]] - min(seen_at[k2] for k2 in held))
    return served, windows


@pytest.mark.parametrize("seed", range(6))
def test_hit_curve_and_window_equal_a_real_lru_waterfall(seed):
    s = _random_stream(seed)
    caps = [300, 500]  # tokens: a waterfall of two tiers
    r = retention_report(s, "m", 1, [("a", 300e-9), ("b", 500e-9)], samples=10_000)
    served, windows = _brute(s, caps)
    total = sum(s.tokens)
    assert [t.hit_fraction for t in r.tiers] == pytest.approx([x / total for x in served], abs=1e-6)
    # the window down to the last tier: the age of the oldest block the waterfall still holds, each request
    assert r.tiers[1].window.p50 == pytest.approx(sorted(windows)[len(windows) // 2], abs=1.0)
    assert r.tiers[1].fills_at is not None and r.tiers[1].holds_whole_trace is False
    # one tier, two ways: the simulated LRU and the exact stack distances of the curve agree
    one = retention_report(s, "m", 1, [("all", 800e-9)])
    point = next(c for c in one.curve if c.capacity_tokens == 800)
    assert one.tiers[0].hit_fraction == pytest.approx(point.hit_fraction, abs=1e-6)


def test_a_waterfall_of_equal_blocks_is_one_lru_of_the_summed_capacity():
    rng = random.Random(7)
    s = AccessStream(unit="requests", block_tokens=64)
    for i in range(300):
        s.add_request([(k, 64) for k in rng.sample(range(60), rng.randint(1, 8))], float(i))
    two = retention_report(s, "m", 1, [("a", 64 * 5e-9), ("b", 64 * 12e-9)])
    one = retention_report(s, "m", 1, [("all", 64 * 17e-9)])
    assert two.tiers[1].cumulative_hit_fraction == pytest.approx(one.tiers[0].hit_fraction, abs=1e-6)
    assert two.tiers[0].hit_fraction > 0 and two.tiers[1].hit_fraction > 0


def test_window_percentiles_match_brute_force_exactly_on_request_boundaries():
    s = _random_stream(11, requests=200)
    r = retention_report(s, "m", 1, [("one", 400e-9)], samples=10_000)
    _, windows = _brute(s, [400])
    import numpy as np

    assert r.tiers[0].window.p50 == pytest.approx(float(np.percentile(windows, 50)))
    assert r.tiers[0].window.p90 == pytest.approx(float(np.percentile(windows, 90)))


def test_curve_is_monotone_and_ends_at_every_reuse():
    s = _random_stream(3)
    r = retention_report(s, "m", 2, [])
    hits = [c.hit_fraction for c in r.curve]
    assert hits == sorted(hits) and r.curve[0].capacity_bytes == r.curve[0].capacity_tokens * 2
    assert r.curve[-1].capacity_tokens == r.distinct_tokens
    assert hits[-1] == pytest.approx(r.reused_tokens / r.accessed_tokens, abs=1e-6)
    assert r.working_set[-1].distinct_tokens == r.distinct_tokens and r.working_set[-1].requests == r.requests


def test_a_tier_larger_than_the_trace_holds_it_whole():
    s = _random_stream(4)
    r = retention_report(s, "m", 1, [("big", 1.0)])
    t = r.tiers[0]
    assert t.holds_whole_trace and t.fills_at is None and t.window.p50 is None
    assert t.hit_fraction == pytest.approx(r.reused_tokens / r.accessed_tokens, abs=1e-6)


def test_closed_loop_order_interleaves_users_and_refills_slots():
    assert closed_loop_order([2, 3, 1], 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (1, 2)]
    assert closed_loop_order([2, 2], 1) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(ValueError):
        closed_loop_order([1], 0)


def test_users_blocks_are_prefix_hashed_full_blocks():
    from kvtier.replay.datasets import Turn, VirtualUser

    def turn(*texts: str) -> Turn:
        return Turn(tuple({"role": "user", "content": t} for t in texts), 8, 0.0)

    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    u = VirtualUser("u", "s", 0, (turn("a" * 10), turn("a" * 10, "b" * 10)))
    s = stream_from_users([u], encode, 8, closed_loop_order([2], 1))
    # "user: aaaaaaaaaa" is 16 characters = 2 full blocks; the second turn repeats them and adds 2 more
    assert s.requests == 2 and s.request == [0, 0, 1, 1, 1, 1] and set(s.tokens) == {8}
    assert s.keys[:2] == s.keys[2:4] and len(set(s.keys)) == 4 and s.unit == "requests"


@needs_data
def test_mooncake_trace_reuse_matches_its_readme():
    s = stream_from_trace(str(MOONCAKE))
    r = retention_report(s, "llama3.1-8b", 131072, [("cpu", 256)])
    # README: 36.6 % of block references repeat an earlier id (by token it is close)
    assert r.requests == 12_031 and r.accesses == 288_500 and r.unit == "s"
    assert 0.35 < r.reused_tokens / r.accessed_tokens < 0.40
    assert r.tiers[0].fills_at is not None and 0 < r.tiers[0].window.p50 < r.span


def test_a_trace_without_block_ids_is_refused(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,10\n")
    with pytest.raises(DatasetError, match="no prefix-block ids"):
        stream_from_trace(str(p))


@needs_data
def test_cli_retention_on_a_dataset_json():
    p = subprocess.run(
        kvtier_cmd() + ["plan", "retention", "--model", "llama3.1-8b", "--dataset", str(MINISWE), "--tier", "cpu=2",
                        "--tier", "nvme=8", "--concurrency", "4", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["unit"] == "requests" and r["block_tokens"] == 256 and [t["tier"] for t in r["tiers"]] == ["cpu", "nvme"]
    assert r["tiers"][1]["cumulative_hit_fraction"] >= r["tiers"][0]["cumulative_hit_fraction"]


def test_cli_retention_needs_exactly_one_source():
    p = subprocess.run(
        kvtier_cmd() + ["plan", "retention", "--model", "llama3.1-8b"], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and "give exactly one" in p.stderr


@pytest.mark.parametrize("seed", range(4))
def test_fanout_protection_is_lru_where_no_block_is_shared(seed):
    """Chains that never branch (each request its own blocks) mark nothing shared: the fanout-protected cache is
    then exactly the LRU the stack distances describe, at every capacity."""
    from kvtier.plan.retention import fanout_served

    rng = random.Random(seed)
    s = AccessStream(unit="requests", block_tokens=64)
    for i in range(150):  # one growing chain per conversation, revisited in random order: no block has two successors
        conv = rng.randrange(12)
        s.add_request([((conv, j), 64) for j in range(rng.randint(1, 8))], float(i))
    r = retention_report(s, "m", 1, curve_points=8)
    for p in r.policies:
        assert p.fanout_hit_fraction == p.lru_hit_fraction
    for cap in (64, 200, 640):
        points = retention_report(s, "m", 1, tiers=[("t", cap / 1e9)]).policies
        lru = next(c for c in points if c.capacity_tokens == cap)
        assert fanout_served(s, cap) / sum(s.tokens) == pytest.approx(lru.lru_hit_fraction, abs=1e-6)


def test_fanout_protection_keeps_a_shared_prefix_that_lru_lets_go():
    """Two conversations share a 2-block system prompt; each turn adds a block of its own. In a 6-block cache LRU
    evicts the prompt while a long private history streams past; fanout protection keeps it (both continuations
    followed it), so every later turn hits it."""
    from kvtier.plan.retention import fanout_served

    s = AccessStream(unit="requests", block_tokens=1)
    for turn in range(1, 8):
        for conv in ("a", "b"):
            own = [((conv, j), 1) for j in range(turn * 3)]  # a private history growing 3 blocks a turn
            s.add_request([("sys0", 1), ("sys1", 1), *own], float(turn))
    lru = next(p for p in retention_report(s, "m", 1, tiers=[("t", 6 / 1e9)]).policies if p.capacity_tokens == 6)
    assert fanout_served(s, 6) / sum(s.tokens) > lru.lru_hit_fraction  # the prompt's blocks hit every turn
    assert fanout_served(s, 6) >= 2 * 12  # from the second turn on: 2 prompt blocks x 13 of the 14 requests
