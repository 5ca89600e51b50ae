"""The Redis and S3 tiers against real servers on loopback (redis-server; moto's S3 server), started
on OS-chosen ports: waterfall invariants checked against what the server itself holds (STRLEN/DBSIZE,
a bucket listing), cleanup of only our own keys and objects, and a server killed mid-run."""

from __future__ import annotations

import shutil
import threading

import pytest

from kvtier.engine.backend import aligned_buffer
from kvtier.engine.file import FileTier
from kvtier.engine.memory import MemoryTier
from kvtier.engine.tiered import StoreConfig, TieredStore
from kvtier.errors import StorageError, TierUnavailable
from kvtier.localservers import redis_server, s3_server
from kvtier.telemetry.clock import IOTiming
from tests.conftest import TINY_TEMPLATES

redis = pytest.importorskip("redis", reason="redis-py is not installed (the test extra installs it)")
pytest.importorskip("boto3", reason="boto3 is not installed (the test extra installs it)")
pytestmark = pytest.mark.usefixtures("aws_credentials")  # rserver, s3: tests/integration/conftest.py

MiB = 1 << 20
NEEDS_REDIS = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server is not installed (scripts/install-tools.sh)"
)


def _verified(noise, key: str, data: bytes, n: int) -> bool:  # type: ignore[no-untyped-def]
    """The entry's bytes as the run wrote them: every block verified (engine/noise.py), the padding included."""
    return len(data) >= n and noise.verify(key, data[: -(-n // 4096) * 4096]) is None


def _fill(store: TieredStore, noise, sizes: list[int]) -> list[str]:  # type: ignore[no-untyped-def]
    buf = aligned_buffer(MiB)
    keys = []
    for i, n in enumerate(sizes):
        key = f"entry-{i}"
        store.put(key, lambda k=key, n=n: noise.chunks(k, n, 4 * MiB), n, buf)
        keys.append(key)
    return keys


def _read_back(tier, key: str, buf: memoryview) -> bytes:  # type: ignore[no-untyped-def]
    return b"".join(bytes(c) for c in tier.export(key, buf, IOTiming()))


@NEEDS_REDIS
def test_redis_waterfall_matches_what_the_server_holds(rserver, noise, cache_dir):
    from kvtier.engine.redis_tier import RedisTier

    client = redis.Redis.from_url(rserver.url)
    client.set("someone-else:key", b"not ours")
    tier = RedisTier(rserver.url, 24 * MiB, connections=4, part_bytes=MiB)
    store = TieredStore([MemoryTier(4 * MiB), tier, FileTier(cache_dir, 512 * MiB)], StoreConfig())
    sizes = [3 * MiB + 123, 2 * MiB, 5 * MiB + 7, 700_000, 4 * MiB, 6 * MiB, 1 * MiB, 3 * MiB]
    keys = _fill(store, noise, sizes)
    usage = store.usage()
    assert usage["redis"]["entries"] > 0 and usage["storage"]["entries"] > 0  # the waterfall went through Redis
    for name, u in usage.items():
        assert u["used_bytes"] <= u["capacity_bytes"], name
    store.check_accounting()  # used == entries' sizes == the sum of STRLEN the server answers
    ours = tier.server_keys()
    assert len(ours) == client.dbsize() - 1  # every key but the foreign one is ours
    in_redis = {tier._base(k) for k in keys if store.location(k) == "redis"}
    assert {k.rsplit(":", 1)[0] for k in ours} == in_redis  # no part of an entry that left Redis stays behind
    buf = aligned_buffer(1536 * 1024)  # smaller than an entry, not a multiple of a part: parts split across reads
    for key, n in zip(keys, sizes, strict=True):
        if store.location(key) == "redis":
            assert _verified(noise, key, _read_back(tier, key, buf), n)
    store.close()
    assert client.dbsize() == 1 and client.get("someone-else:key") == b"not ours"
    assert tier.cleanup_problems == []


@NEEDS_REDIS
def test_redis_below_the_file_tier_gets_whole_entries_from_a_reused_buffer(rserver, noise, cache_dir):
    """--tier-order cpu,storage,redis: demotions read the file through one reused buffer; every part
    must reach Redis before the buffer is overwritten."""
    from kvtier.engine.redis_tier import RedisTier

    tier = RedisTier(rserver.url, 64 * MiB, connections=2, part_bytes=MiB)
    store = TieredStore([FileTier(cache_dir, 8 * MiB), tier], StoreConfig())
    sizes = [5 * MiB + 1, 3 * MiB, 4 * MiB, 2 * MiB]
    keys = _fill(store, noise, sizes)  # _fill's buffer is 1 MiB: a 5 MiB file is read in 5 pieces
    moved = [(k, n) for k, n in zip(keys, sizes, strict=True) if store.location(k) == "redis"]
    assert moved
    buf = aligned_buffer(3 * MiB)
    for key, n in moved:
        assert _verified(noise, key, _read_back(tier, key, buf), n)
    store.check_accounting()
    store.close()


@NEEDS_REDIS
def test_redis_password_comes_from_the_environment(monkeypatch):
    from kvtier.engine.redis_tier import RedisTier

    with redis_server(extra=("--requirepass", "s3cret-pw")) as srv:
        monkeypatch.delenv("KVTIER_REDIS_PASSWORD", raising=False)
        monkeypatch.delenv("REDISCLI_AUTH", raising=False)
        with pytest.raises(StorageError, match="KVTIER_REDIS_PASSWORD"):
            RedisTier(srv.url, 64 * MiB)
        monkeypatch.setenv("KVTIER_REDIS_PASSWORD", "s3cret-pw")
        tier = RedisTier(srv.url, 64 * MiB)
        assert tier.server["version"]
        tier.close()


@NEEDS_REDIS
def test_redis_refusing_for_memory_is_a_full_tier_and_the_entry_falls_through(noise, cache_dir):
    from kvtier.engine.redis_tier import RedisTier

    with redis_server(maxmemory_mb=12) as srv:  # the server's limit is below the tier's capacity
        tier = RedisTier(srv.url, 64 * MiB, connections=2, part_bytes=MiB)
        assert tier.server["maxmemory_bytes"] == 12 * MiB
        store = TieredStore([tier, FileTier(cache_dir, 256 * MiB)], StoreConfig())
        _fill(store, noise, [4 * MiB] * 5)
        where = [store.location(f"entry-{i}") for i in range(5)]
        assert where[0] == "redis" and "storage" in where[1:]  # OOM from the server: the next tier took it
        store.check_accounting()
        assert redis.Redis.from_url(srv.url).dbsize() == len(tier.server_keys())  # no parts of refused writes
        store.close()


@NEEDS_REDIS
def test_redis_killed_mid_run_stops_the_bench_as_partial(tmp_path):
    from kvtier.bench import run
    from kvtier.config.bench import BenchConfig
    from kvtier.config.tuning import Tuning
    from kvtier.results.envelope import Status, StopCode

    with redis_server() as srv:
        cfg = BenchConfig(
            model="tiny-1b",
            num_users=4,
            duration=30,
            gpu_mem_gb=0,
            cpu_mem_gb=0.004,  # entries go on to Redis at once
            redis_url=srv.url,
            redis_mem_gb=0.5,
            generation_mode="none",
            seed=3,
            cache_dir=str(tmp_path),
            progress="none",
            noise_mb=16,
            io_chunk_mb=4,
            tuning=Tuning.model_validate({"user_templates": TINY_TEMPLATES}),
        )
        killer = threading.Timer(1.5, srv.kill)
        killer.start()
        try:
            result = run(cfg, handle_signals=False)
        finally:
            killer.cancel()
    assert result.status == Status.partial
    assert result.stop_reason.code == StopCode.tier_unavailable
    assert result.elapsed_s < 20  # stopped when the server went, not at --duration
    assert result.tiers["redis"].write.ops > 0  # it was used before it died
    assert sum(t.read.errors + t.write.errors for t in result.tiers.values()) > 0  # the failures are counted
    assert any("cleanup-failed" == w.code for w in result.warnings)  # its keys could not be removed: said


@NEEDS_REDIS
def test_bench_with_redis_and_s3_tiers_end_to_end(rserver, s3, tmp_path):
    """kvtier bench over cpu > redis > storage > s3: a complete run whose result names the servers,
    books each remote tier's operations, leaves both servers as found, and prices fetches from them."""
    import boto3

    from kvtier.bench import run
    from kvtier.config.bench import BenchConfig
    from kvtier.config.tuning import Tuning
    from kvtier.plan.measured import read_costs
    from kvtier.results.envelope import Status

    before = redis.Redis.from_url(rserver.url).dbsize()
    cfg = BenchConfig(
        model="tiny-1b",
        num_users=3,
        duration=300,  # bounded by work, not time: a short window on a loaded host may not reach every tier
        max_requests=60,
        gpu_mem_gb=0,
        cpu_mem_gb=0.004,
        redis_url=rserver.url,
        redis_mem_gb=0.03,
        storage_capacity_gb=0.03,
        s3_endpoint=s3.url,
        s3_bucket="kvtier-bench-e2e",
        s3_capacity_gb=1,
        generation_mode="none",
        seed=5,
        cache_dir=str(tmp_path),
        output=str(tmp_path / "r.json"),
        xlsx_output=str(tmp_path / "r.xlsx"),
        progress="none",
        noise_mb=16,
        io_chunk_mb=4,
        tuning=Tuning.model_validate({"user_templates": TINY_TEMPLATES}),
    )
    result = run(cfg, handle_signals=False)
    assert result.status == Status.complete, result.stop_reason
    assert result.storage.tier_order == ["cpu", "redis", "storage", "s3"]
    assert set(result.storage.remote_tiers) == {"redis", "s3"}
    assert result.storage.gds is not None and result.storage.gds.used is False
    for name in ("redis", "storage", "s3"):
        assert result.tiers[name].write.ops > 0, name  # the waterfall reached every tier
        assert result.tier_usage_at_end[name].used_bytes <= result.tier_usage_at_end[name].capacity_bytes
    assert result.errors.tier_operations == {}
    costs = {c.tier for c in read_costs(result)}
    assert costs == {n for n, t in result.tiers.items() if t.read.ops}
    assert redis.Redis.from_url(rserver.url).dbsize() == before
    listed = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1").list_objects_v2(Bucket="kvtier-bench-e2e")
    assert listed.get("KeyCount", 0) == 0
    assert (tmp_path / "r.xlsx").stat().st_size > 0


def test_s3_waterfall_multipart_ranged_reads_and_cleanup(s3, noise, cache_dir):
    import boto3

    from kvtier.engine.s3_tier import S3Tier

    client = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1")
    tier = S3Tier(s3.url, "kvtier-test", 64 * MiB, prefix="runs", connections=4, part_bytes=5 * MiB)
    client.put_object(Bucket="kvtier-test", Key="runs/not-ours", Body=b"x")  # same prefix, other run
    store = TieredStore(
        [MemoryTier(4 * MiB), FileTier(cache_dir, 12 * MiB), tier],
        StoreConfig(tier_target_ratios={"storage": 0.5}),  # --s3-cold-threshold 0.5
    )
    assert store.usage()["storage"]["capacity_bytes"] == 12 * MiB
    sizes = [11 * MiB + 5, 3 * MiB, 2 * MiB, 4 * MiB, 700_000, 3 * MiB]
    keys = _fill(store, noise, sizes)
    usage = store.usage()
    assert usage["s3"]["entries"] > 0
    assert usage["storage"]["used_bytes"] <= 12 * MiB * 0.5 or usage["storage"]["entries"] == 1
    store.check_accounting()  # used == entries == the bucket listing under our prefix
    listed = tier.listing()
    assert sum(listed.values()) == usage["s3"]["used_bytes"] and len(listed) == usage["s3"]["entries"]
    buf = aligned_buffer(2 * MiB)  # ranged GETs of 2 MiB
    for key, n in zip(keys, sizes, strict=True):
        if store.location(key) == "s3":
            assert _verified(noise, key, _read_back(tier, key, buf), n)
    assert store.location("entry-0") == "s3"  # 11 MiB: a multipart upload of 5 MiB parts, read in 6 ranges
    store.close()
    left = [o["Key"] for o in client.list_objects_v2(Bucket="kvtier-test").get("Contents", [])]
    assert left == ["runs/not-ours"]
    assert not client.list_multipart_uploads(Bucket="kvtier-test").get("Uploads")


def test_s3_server_gone_is_tier_unavailable_and_close_says_so(noise):
    pytest.importorskip("moto", reason="moto is not installed (the test extra installs it)")
    from kvtier.engine.s3_tier import S3Tier

    with s3_server() as srv:
        tier = S3Tier(srv.url, "kvtier-gone", 64 * MiB, connections=2, timeout_s=3)
        tier.write("a", noise.chunks("a", MiB, MiB), MiB)
        srv.kill()
        with pytest.raises(TierUnavailable):
            tier.write("b", noise.chunks("b", MiB, MiB), MiB)
        with pytest.raises(StorageError):
            tier.read("a", aligned_buffer(MiB))
        tier.close()  # never raises
        assert tier.cleanup_problems and "not removed" in tier.cleanup_problems[-1]


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_sim_offloads_to_the_remote_tier_and_hits_it(kind, request, tmp_path):
    """kvtier sim --offload redis|s3: chunks spill from a tiny CPU staging tier to the real server, a
    later request's prefix is loaded back from it, and the server is left as found."""
    from tests.integration.test_sim import offload_round_trip, start_sim

    if kind == "redis":
        srv = request.getfixturevalue("rserver")
        args = ["--redis-url", srv.url, "--redis-mem-gb", "0.5"]
        held = lambda: len(redis.Redis.from_url(srv.url).keys("kvtier:*"))  # noqa: E731
    else:
        import boto3

        srv = request.getfixturevalue("s3")
        args = ["--s3-endpoint", srv.url, "--s3-bucket", "kvtier-sim", "--s3-capacity-gb", "1"]
        client = boto3.client("s3", endpoint_url=srv.url, region_name="us-east-1")
        held = lambda: client.list_objects_v2(Bucket="kvtier-sim").get("KeyCount", 0)  # noqa: E731
    s = start_sim(tmp_path, "--offload", kind, *args, "--staging-gb", "0.01")
    offload_round_trip(s, lambda: held() > 0, f"the {kind} server")
    assert held() == 0


class DropsPrefix:
    """An HTTP proxy on loopback in front of the real S3 server that removes ``prefix`` from every query (an
    S3 endpoint that ignores Prefix lists the whole bucket); everything else is forwarded as received."""

    def __init__(self, upstream: str) -> None:
        import http.client
        import http.server
        import urllib.parse

        up = urllib.parse.urlsplit(upstream)
        self.listings = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                path, _, query = self.path.partition("?")
                kept = [p for p in query.split("&") if p and not p.lower().startswith("prefix=")]
                if len(kept) != len([p for p in query.split("&") if p]):
                    proxy.listings += 1
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "expect")}
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
                conn.request(self.command, path + ("?" + "&".join(kept) if kept else ""), body, headers)
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_s3_cleanup_behind_an_endpoint_that_ignores_prefix_deletes_only_ours(s3, noise):
    """#28 medium 2: an S3 endpoint that ignores Prefix made a 4 s bench delete the whole bucket. The tier keeps
    only listed keys under its run's prefix, deletes those, leaves the rest and says so."""
    import boto3

    from kvtier.engine.s3_tier import S3Tier

    direct = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1")
    proxy = DropsPrefix(s3.url)
    try:
        tier = S3Tier(proxy.url, "kvtier-noprefix", 64 * MiB, prefix="runs", connections=2, part_bytes=5 * MiB)
        for k in ("teamB/precious", "runs/other-run/entry"):
            direct.put_object(Bucket="kvtier-noprefix", Key=k, Body=b"not ours")
        for i in range(3):
            tier.write(f"e{i}", noise.chunks(f"e{i}", MiB, MiB), MiB)
        assert len(tier.listing()) == 3 and tier.stored_bytes() == 3 * tier.stored_size(MiB)
        tier.close()
    finally:
        proxy.close()
    left = sorted(o["Key"] for o in direct.list_objects_v2(Bucket="kvtier-noprefix").get("Contents", []))
    assert left == ["runs/other-run/entry", "teamB/precious"]  # ours gone, the others untouched
    assert proxy.listings >= 1  # the listings really went out without Prefix
    assert any("does not honour Prefix" in p and "teamB/precious" in p for p in tier.cleanup_problems), (
        tier.cleanup_problems
    )


def _shared_cfg(tmp_path, name: str, **remote: object):  # type: ignore[no-untyped-def]
    from kvtier.config.bench import BenchConfig
    from kvtier.config.tuning import Tuning

    return BenchConfig(
        model="tiny-1b", num_users=3, duration=3, gpu_mem_gb=0, cpu_mem_gb=0, storage_capacity_gb=0.03,
        remote_namespace=f"shared:{name}", remote_ttl=600, generation_mode="none", seed=5,
        cache_dir=str(tmp_path), output=str(tmp_path / f"r-{name}-{len(list(tmp_path.iterdir()))}.json"),
        progress="none", noise_mb=16, io_chunk_mb=4,
        tuning=Tuning.model_validate({"user_templates": TINY_TEMPLATES}), **remote,
    )  # fmt: skip


@NEEDS_REDIS
def test_two_runs_on_a_shared_redis_namespace_hit_each_others_entries_and_leave_the_rest(rserver, tmp_path):
    """#31: with --remote-namespace shared:NAME a later run reads the entries an earlier one wrote (cross-writer
    hits), every key carries the TTL, runs leave the namespace, and kvtier clean --remote empties it alone."""
    from kvtier.bench import run
    from kvtier.results.envelope import Status
    from tests.conftest import kvtier_cmd

    client = redis.Redis.from_url(rserver.url)
    client.set("someone-else:key", b"not ours")
    client.set("kvtier:shared:other:x", b"another namespace")
    results = []
    for _ in range(2):
        r = run(_shared_cfg(tmp_path, "t31", redis_url=rserver.url, redis_mem_gb=0.03), handle_signals=False)
        assert r.status == Status.complete, r.stop_reason
        results.append(r)
    first, second = (r.summary.cache_stats for r in results)
    assert first.remote_cross_writer_hits == 0 and second.remote_cross_writer_hits > 0, (first, second)
    assert results[1].storage.remote_tiers["redis"]["namespace"] == "shared:t31"
    keys = [k.decode() for k in client.scan_iter("kvtier:shared:t31:*")]
    assert keys, "the runs left the namespace to its TTL"
    ttls = [client.pttl(k) for k in keys]
    assert all(0 < t <= 600_000 for t in ttls), ttls[:5]
    import subprocess

    p = subprocess.run(
        [*kvtier_cmd(), "clean", "--remote", "--remote-namespace", "shared:t31", "--redis-url", rserver.url],
        capture_output=True, text=True,
    )  # fmt: skip
    assert p.returncode == 0 and f"removed {len(keys)} keys under kvtier:shared:t31" in p.stdout, p.stdout + p.stderr
    assert not list(client.scan_iter("kvtier:shared:t31:*"))
    assert client.get("someone-else:key") == b"not ours" and client.get("kvtier:shared:other:x") is not None
    client.delete("someone-else:key", "kvtier:shared:other:x")


def test_two_runs_on_a_shared_s3_namespace_hit_each_others_entries(s3, tmp_path):
    import boto3

    from kvtier.bench import run
    from kvtier.results.envelope import Status
    from tests.conftest import kvtier_cmd

    client = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1")
    remote = {"s3_endpoint": s3.url, "s3_bucket": "kvtier-shared", "s3_capacity_gb": 1}
    results = [run(_shared_cfg(tmp_path, "s31", **remote), handle_signals=False) for _ in range(2)]
    assert all(r.status == Status.complete for r in results), [r.stop_reason for r in results]
    assert results[1].summary.cache_stats.remote_cross_writer_hits > 0
    objs = client.list_objects_v2(Bucket="kvtier-shared").get("Contents", [])
    assert objs and all(o["Key"].startswith("kvtier/shared/s31/") for o in objs)
    head = client.head_object(Bucket="kvtier-shared", Key=objs[0]["Key"])
    assert float(head["Metadata"]["kvtier-expires"]) > 0 and head["Metadata"]["kvtier-writer"]
    client.put_object(Bucket="kvtier-shared", Key="teamB/precious", Body=b"x")
    import subprocess

    p = subprocess.run(
        [*kvtier_cmd(), "clean", "--remote", "--remote-namespace", "shared:s31", "--s3-bucket", "kvtier-shared",
         "--s3-endpoint", s3.url],
        capture_output=True, text=True,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    left = [o["Key"] for o in client.list_objects_v2(Bucket="kvtier-shared").get("Contents", [])]
    assert left == ["teamB/precious"]
