"""#41 item 2: a shared Redis/S3 namespace does not trust its writers. What another writer left under a key is
read only when it is the entry the key names (total size, part count, a bounded description and expiry);
anything else is a miss counted as ``remote_foreign_entries``, never a hit, and costs no read of its parts.
And every key of a shared namespace carries the writer's model, dtype and layout, so two models never meet.
Real redis-server and moto's S3 server on loopback, OS-chosen ports."""

from __future__ import annotations

import time

import pytest

from kvtier.engine.backend import aligned_buffer
from kvtier.engine.redis_tier import RedisTier
from kvtier.engine.tiered import StoreConfig, TieredStore
from kvtier.errors import ForeignEntry
from tests.conftest import TINY_TEMPLATES

redis = pytest.importorskip("redis", reason="redis-py is not installed (the test extra installs it)")
pytest.importorskip("boto3", reason="boto3 is not installed (the test extra installs it)")
pytestmark = pytest.mark.usefixtures("aws_credentials")  # rserver, s3: tests/integration/conftest.py

MiB = 1 << 20
ENTRY = 8 * MiB


class Counts:
    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.errors: list[BaseException] = []

    def tier_op(self, *a: object) -> None:
        pass

    def tier_error(self, tier: str, op: str, cause: str, nbytes: int, error: BaseException) -> None:
        self.errors.append(error)

    def tier_cancelled(self, *a: object) -> None:
        pass

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n


def _redis(url: str, ns: str, scope: str = "m") -> RedisTier:
    return RedisTier(url, 256 * MiB, connections=2, part_bytes=MiB, namespace=ns, ttl_s=600, scope=scope)


def _write(tier, key: str, nbytes: int, noise) -> None:  # type: ignore[no-untyped-def]
    tier.write(key, noise.chunks(key, nbytes, 4 * MiB), nbytes)


def _gets(client) -> int:  # type: ignore[no-untyped-def]
    return int(client.info("commandstats").get("cmdstat_get", {}).get("calls", 0))


def test_redis_reads_another_writers_entry_only_when_it_is_the_entry_the_key_names(rserver, noise):
    client = redis.Redis.from_url(rserver.url)
    writer, reader = _redis(rserver.url, "trust"), _redis(rserver.url, "trust")
    buf = aligned_buffer(4 * MiB)
    try:
        _write(writer, "k-honest", ENTRY, noise)
        got = reader.read_shared("k-honest", buf, ENTRY)
        assert got is not None and got[0] == ENTRY and got[2], got  # an honest entry of another writer: a hit

        # #58 item 14: the same entry made permanent by another client (PERSIST) is not served
        _write(writer, "k-kept", ENTRY, noise)
        assert client.persist(f"{writer._base('k-kept')}:m")
        before = _gets(client)
        with pytest.raises(ForeignEntry, match="without an expiry"):
            reader.read_shared("k-kept", buf, ENTRY)
        assert _gets(client) == before  # refused before any part is read

        # 8 MiB expected, 1 byte there: a miss by cause, not a full hit
        _write(writer, "k-short", ENTRY, noise)
        meta = f"{writer._base('k-short')}:m"
        client.set(meta, f"{writer.writer} 1")
        with pytest.raises(ForeignEntry, match="1 bytes where the key names an entry of 8388608"):
            reader.read_shared("k-short", buf, ENTRY)

        # a forged description of 4M parts: refused from its bounded first bytes, no part is asked for
        client.set(meta, writer.writer + " 2" * 4_000_000)
        before = _gets(client)
        with pytest.raises(ForeignEntry, match="longer than"):
            reader.read_shared("k-short", buf, ENTRY)
        assert _gets(client) == before  # not one GET of a part (the description is read by GETRANGE)

        # parts that add up but are far more than an entry of that size has
        client.set(meta, writer.writer + " 4" * (ENTRY // 4))
        with pytest.raises(ForeignEntry):
            reader.read_shared("k-short", buf, ENTRY)
        for bad in ("w -5 8388613", "w abc", "w", "w 8388608 0"):
            client.set(meta, bad)
            with pytest.raises(ForeignEntry):
                reader.read_shared("k-short", buf, ENTRY)
        assert _gets(client) == before
    finally:
        writer.purge()
        writer.close()
        reader.close()


def test_a_foreign_entry_in_the_shared_tier_is_a_counted_miss_never_a_hit(rserver, noise):
    client = redis.Redis.from_url(rserver.url)
    writer = _redis(rserver.url, "trust-store")
    sink = Counts()
    store = TieredStore([_redis(rserver.url, "trust-store")], StoreConfig(), sink=sink)
    buf = aligned_buffer(4 * MiB)
    try:
        _write(writer, "a", ENTRY, noise)
        _write(writer, "b", ENTRY, noise)
        client.set(f"{writer._base('b')}:m", f"{writer.writer} 4096")
        assert store.get("a", buf, ENTRY).hit
        r = store.get("b", buf, ENTRY)
        assert not r.hit and r.nbytes == 0
        assert sink.counters.get("remote_foreign_entries") == 1 and sink.counters.get("remote_cross_writer_hits") == 1
        assert not sink.errors  # a foreign entry is a miss by cause, not a tier failure
        assert not store.get("a", buf).hit  # no expected size, no shared lookup: what is there cannot be checked
    finally:
        writer.purge()
        writer.close()
        store.close()


def test_writers_of_different_scopes_never_meet_under_one_key(rserver, noise):
    a, b = _redis(rserver.url, "scoped", "tiny-1b/entry"), _redis(rserver.url, "scoped", "llama2-7b/entry")
    buf = aligned_buffer(4 * MiB)
    try:
        _write(a, "conv_u0_00000_turn_1", ENTRY, noise)
        assert a._base("conv_u0_00000_turn_1") != b._base("conv_u0_00000_turn_1")
        assert b.read_shared("conv_u0_00000_turn_1", buf, ENTRY) is None  # a miss, not the other model's KV
        assert _redis(rserver.url, "scoped", "tiny-1b/entry").read_shared("conv_u0_00000_turn_1", buf, ENTRY)
    finally:
        a.purge()
        a.close()
        b.close()


def test_s3_checks_size_and_expiry_before_reading_a_byte(s3, noise):
    import boto3

    from kvtier.engine.s3_tier import S3Tier

    client = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1")
    writer = S3Tier(s3.url, "trust", 256 * MiB, namespace="t", ttl_s=600, scope="m")
    reader = S3Tier(s3.url, "trust", 256 * MiB, namespace="t", ttl_s=600, scope="m")
    buf = aligned_buffer(4 * MiB)
    try:
        _write(writer, "honest", ENTRY, noise)
        got = reader.read_shared("honest", buf, ENTRY)
        assert got is not None and got[0] == ENTRY and got[2]
        obj = writer._object("big")
        now = time.time()
        client.put_object(Bucket="trust", Key=obj, Body=b"x" * (2 * ENTRY), Metadata={
            "kvtier-writer": "w", "kvtier-expires": f"{now + 60:.3f}"})  # fmt: skip
        with pytest.raises(ForeignEntry, match="16777216 bytes where the key names an entry of 8388608"):
            reader.read_shared("big", buf, ENTRY)
        for expires in ("inf", "nan", "1e308", "abc", f"{now + 20 * 365 * 86400:.0f}"):
            client.put_object(Bucket="trust", Key=obj, Body=b"x" * ENTRY,
                              Metadata={"kvtier-writer": "w", "kvtier-expires": expires})  # fmt: skip
            with pytest.raises(ForeignEntry, match="not a time within"):
                reader.read_shared("big", buf, ENTRY)
        client.put_object(Bucket="trust", Key=obj, Body=b"x" * ENTRY,
                          Metadata={"kvtier-writer": "w", "kvtier-expires": f"{now - 1:.3f}"})  # fmt: skip
        assert reader.read_shared("big", buf, ENTRY) is None  # past its TTL: a plain miss
    finally:
        writer.purge()
        writer.close()
        reader.close()


def _shared_cfg(tmp_path, model: str, name: str, url: str):  # type: ignore[no-untyped-def]
    from kvtier.config.bench import BenchConfig
    from kvtier.config.tuning import Tuning

    return BenchConfig(
        model=model, num_users=2, duration=3, gpu_mem_gb=0, cpu_mem_gb=0, storage_capacity_gb=0.03,
        remote_namespace=f"shared:{name}", remote_ttl=600, generation_mode="none", seed=5, redis_url=url,
        redis_mem_gb=0.5, cache_dir=str(tmp_path), output=str(tmp_path / f"r-{model}.json"), progress="none",
        noise_mb=16, io_chunk_mb=4, disable_multi_turn=False,
        tuning=Tuning.model_validate({"user_templates": TINY_TEMPLATES}),
    )  # fmt: skip


def test_two_models_on_one_shared_namespace_with_one_seed_share_no_entry(rserver, tmp_path):
    """The audit's case: tiny-1b and llama2-7b runs with one seed drew the same entry-layout keys; the second
    read the first's entries as hits. Now the keys differ by model: no cross hit, nothing foreign either."""
    from kvtier.bench import run
    from kvtier.results.envelope import Status

    first = run(_shared_cfg(tmp_path, "tiny-1b", "two-models", rserver.url), handle_signals=False)
    again = run(_shared_cfg(tmp_path, "tiny-1b", "two-models", rserver.url), handle_signals=False)
    other = run(_shared_cfg(tmp_path, "llama2-7b", "two-models", rserver.url), handle_signals=False)
    assert first.status == again.status == other.status == Status.complete
    assert again.summary.cache_stats.remote_cross_writer_hits > 0  # the same model does meet its own entries
    c = other.summary.cache_stats
    assert (c.remote_cross_writer_hits, c.remote_foreign_entries) == (0, 0), c
    scopes = {r.storage.remote_tiers["redis"]["scope"] for r in (first, other)}
    assert len(scopes) == 2 and all(s.startswith(("tiny-1b", "llama2-7b")) for s in scopes), scopes
