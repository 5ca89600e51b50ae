"""The Redis tier on a real Redis Cluster (three masters on loopback, started here, no replicas): the tier finds
the cluster by itself, hashes entries over every master's slots while each entry's parts share one slot, reads
back what it wrote, cleans every master, and — a master lost mid-run — fails that master's entries (counted as
errors, the run partial for the bench, recomputed by the sim) and serves the others' unchanged, never a wrong
block. kvtier bench, kvtier sim and kvtier's vLLM tiers build the same RedisTier (kvtier/tiers.py), so these
runs cover all three; the replicas sharing across hosts are in test_fabric.py."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.engine.backend import aligned_buffer
from kvtier.engine.redis_tier import RedisTier
from kvtier.engine.resp import RespConnection, key_slot
from kvtier.errors import TierUnavailable
from kvtier.localservers import LocalCluster, redis_cluster
from tests.conftest import TINY_TEMPLATES

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server is not installed (scripts/install-tools.sh)"
)
KiB = 1024


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with redis_cluster(3) as c:
        yield c


def _ask(url: str, *cmd: str | int) -> object:
    c = RespConnection(url, None, 10.0)
    try:
        return c.call(*cmd)
    finally:
        c.close()


def _content(i: int, n: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(256)) * (n // 256)


def _write(tier: RedisTier, n: int, size: int = 256 * KiB) -> None:
    buf = aligned_buffer(size)
    for i in range(n):
        buf[:] = _content(i, size)
        tier.write(f"entry-{i}", [buf], size)


def test_the_tier_spreads_entries_over_every_master_and_keeps_each_in_one_slot(cluster: LocalCluster):
    tier = RedisTier(cluster.url, 1 << 30, connections=4, part_bytes=64 * KiB)
    try:
        assert tier.server["cluster_masters"] == 3
        _write(tier, 24)
        held = [_ask(n.url, "DBSIZE") for n in cluster.nodes]
        assert all(isinstance(h, int) and h > 0 for h in held), held  # entries hashed over every master's slots
        assert sum(held) == 24 * 4  # type: ignore[arg-type]  # 4 parts of 64 KiB each, no description (own keys)
        names = tier.server_keys()
        assert len(names) == 24 * 4
        for k in names[:12]:  # kvtier's slot is the server's (CRC16 of the hash tag)
            assert _ask(cluster.url, "CLUSTER", "KEYSLOT", k) == key_slot(k)
        by_entry: dict[str, set[int]] = {}
        for k in names:
            by_entry.setdefault(k.rsplit(":", 1)[0], set()).add(key_slot(k))
        assert len(by_entry) == 24 and all(len(s) == 1 for s in by_entry.values())  # one pipeline per entry
        out = aligned_buffer(256 * KiB)
        for i in range(24):
            tier.read(f"entry-{i}", out)
            assert bytes(out) == _content(i, 256 * KiB), i
        assert tier.stored_bytes() == 24 * 256 * KiB
    finally:
        tier.close()
    assert [_ask(n.url, "DBSIZE") for n in cluster.nodes] == [0, 0, 0]  # every master cleaned


def test_a_shared_namespace_on_a_cluster_serves_another_writers_entries(cluster: LocalCluster):
    a = RedisTier(cluster.url, 1 << 30, part_bytes=64 * KiB, namespace="cl1", scope="m")
    b = RedisTier(cluster.url, 1 << 30, part_bytes=64 * KiB, namespace="cl1", scope="m")
    try:
        _write(a, 6)
        out = aligned_buffer(256 * KiB)
        for i in range(6):
            got = b.read_shared(f"entry-{i}", out, 256 * KiB)
            assert got is not None and got[0] == 256 * KiB and got[2] is True, i  # another writer's entry
            assert bytes(out) == _content(i, 256 * KiB)
        assert b.read_shared("entry-99", out, 256 * KiB) is None
        assert b.present(["entry-0", "entry-5", "entry-99"]) == [True, True, False]  # one pipeline per master
        assert a.purge() == 6 * 5  # 4 parts and a description each, on whichever master holds them
    finally:
        a.close()
        b.close()


def test_a_master_lost_fails_its_entries_and_serves_the_rest_never_a_wrong_block(cluster: LocalCluster):
    tier = RedisTier(cluster.url, 1 << 30, connections=2, part_bytes=64 * KiB, timeout_s=5.0)
    try:
        _write(tier, 30)
        lost = cluster.nodes[1]
        lost_slots = [s for s in _ask(cluster.url, "CLUSTER", "SLOTS") if s[2][1] == lost.port]  # type: ignore[union-attr, index]
        lo, hi = lost_slots[0][0], lost_slots[0][1]
        on_lost = {i for i in range(30) if lo <= key_slot(tier._base(f"entry-{i}")) <= hi}
        assert 0 < len(on_lost) < 30
        lost.kill()
        out = aligned_buffer(256 * KiB)
        failed = set()
        for i in range(30):
            out[:] = b"\0" * len(out)
            try:
                tier.read(f"entry-{i}", out)
            except TierUnavailable:
                failed.add(i)
                continue
            assert bytes(out) == _content(i, 256 * KiB), i  # what is served is the entry, byte for byte
        assert failed == on_lost  # exactly the lost master's entries fail; the others are served
        shared = RedisTier(cluster.url, 1 << 30, namespace="cl2")  # a scheduler's question, with a master lost:
        try:  # None for the keys it held (could not ask), an answer for the rest
            answers = shared.present([f"entry-{i}" for i in range(30)])
            assert {i for i, a in enumerate(answers) if a is None} == {
                i for i in range(30) if lo <= key_slot(shared._base(f"entry-{i}")) <= hi
            } and all(a is False for a in answers if a is not None)
        finally:
            shared.close()
        with pytest.raises(TierUnavailable):  # and a write to its slots fails too (counted by the caller)
            buf = aligned_buffer(256 * KiB)
            for i in sorted(on_lost):
                tier.write(f"entry-{i}", [buf], len(buf))
        assert tier.stalled_operations(0.0) == 0
    finally:
        tier.close()
    assert tier.cleanup_problems  # the lost master's keys could not be listed: said, not hidden
    assert [_ask(n.url, "DBSIZE") for n in cluster.nodes if n is not cluster.nodes[1]] == [0, 0]


def _bench_cfg(tmp_path: Path, url: str, duration: float):  # type: ignore[no-untyped-def]
    from kvtier.config.bench import BenchConfig
    from kvtier.config.tuning import Tuning

    return BenchConfig(
        model="tiny-1b",
        num_users=3,
        duration=duration,
        gpu_mem_gb=0,
        cpu_mem_gb=0.004,  # entries go on to the cluster at once
        redis_url=url,
        redis_mem_gb=0.5,
        generation_mode="none",
        seed=5,
        cache_dir=str(tmp_path),
        progress="none",
        noise_mb=16,
        io_chunk_mb=4,
        tuning=Tuning.model_validate({"user_templates": TINY_TEMPLATES}),
    )


def test_bench_on_a_cluster_completes_names_its_masters_and_leaves_them_clean(cluster: LocalCluster, tmp_path):
    from kvtier.bench import run
    from kvtier.results.envelope import Status

    result = run(_bench_cfg(tmp_path, cluster.url, 3), handle_signals=False)
    assert result.status == Status.complete, result.stop_reason
    assert result.storage.remote_tiers["redis"]["cluster_masters"] == 3
    assert result.tiers["redis"].write.ops > 0 and result.tiers["redis"].read.ops > 0
    assert result.errors.tier_operations == {}
    assert [_ask(n.url, "DBSIZE") for n in cluster.nodes] == [0, 0, 0]


def test_bench_with_a_master_lost_mid_run_stops_partial_and_counts_the_failures(cluster: LocalCluster, tmp_path):
    from kvtier.bench import run
    from kvtier.results.envelope import Status, StopCode
    from kvtier.telemetry.recorder import Recorder

    rec = Recorder()

    def kill_once_written() -> None:  # the master goes mid-run: after the run's first write to the cluster completed
        import time

        # (a part of an entry on a node was not enough: killed then, the first write itself failed, 0 writes served)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not rec.ops.get(("redis", "write")):
            time.sleep(0.05)
        cluster.nodes[2].kill()

    killer = threading.Thread(target=kill_once_written, daemon=True)
    killer.start()
    result = run(_bench_cfg(tmp_path, cluster.url, 30), handle_signals=False, recorder=rec)
    killer.join(5)
    assert result.status == Status.partial
    assert result.stop_reason.code == StopCode.tier_unavailable
    assert str(cluster.nodes[2].port) in result.stop_reason.message  # names the master that went
    assert result.tiers["redis"].write.ops > 0  # the cluster served before the master went
    assert sum(t.read.errors + t.write.errors for t in result.tiers.values()) > 0  # the failures are counted


def test_sim_offloads_to_a_cluster_and_recomputes_what_a_lost_master_held(cluster: LocalCluster, tmp_path):
    from tests.integration.test_sim import chat, long_prompt, offload_round_trip, start_sim, stop_sim, wait_until

    def held() -> int:
        return sum(_ask(n.url, "DBSIZE") for n in cluster.nodes if n.proc.poll() is None)  # type: ignore[misc]

    args = ["--offload", "redis", "--redis-url", cluster.url, "--redis-mem-gb", "0.5", "--staging-gb", "0.01"]
    offload_round_trip(start_sim(tmp_path, *args), lambda: held() > 0, "the cluster")
    assert held() == 0
    s = start_sim(tmp_path, *args, "--remote-timeout", "2")
    try:
        prompts = [long_prompt(f"p{i}") for i in range(4)]
        for p in prompts:
            assert s.post("/v1/chat/completions", chat(p))[0] == 200
        wait_until(lambda: held() > 0, "chunks on the cluster")
        cluster.nodes[0].kill()
        for p in prompts:  # every request is answered: what the lost master held is recomputed
            code, r, _ = s.post("/v1/chat/completions", chat(p))
            assert code == 200, r
        m = s.metrics()
    finally:
        code, err = stop_sim(s)
    assert code == 0, err
    assert m.get("kvtier_sim:offload_errors", 0) >= 1, m  # the failed fetches and stores are counted
