"""The bench result from known raw samples: every figure checked against its formula (docs/metrics.md),
and the file it makes loads back into the same typed result."""

from __future__ import annotations

import datetime as dt

import pytest

from kvtier.bench.results import build_result
from kvtier.bench.runner import RunOutcome
from kvtier.bench.service import CUT
from kvtier.bench.setup import build_components, derive
from kvtier.config.bench import BenchConfig
from kvtier.engine.backend import IOTiming
from kvtier.report import load
from kvtier.report.envelope import Status, StopCode, StopReason
from kvtier.report.writers import write_json
from kvtier.telemetry.recorder import Recorder, RequestRecord

MS = 1_000_000


def record(
    ok=True,
    qos="interactive",
    gen=10,
    submit=0,
    storage_done=5 * MS,
    end=8 * MS,
    tr=100,
    tw=50,
    hits=1,
    misses=1,
    error="",
):
    return RequestRecord(
        user=0,
        qos=qos,
        phase="prefill_decode",
        context_tokens=150,
        generate_tokens=gen,
        submit_ns=submit,
        start_ns=submit + MS,
        storage_done_ns=storage_done,
        end_ns=end,
        storage_ns=storage_done - submit - MS,
        generation_ns=end - storage_done,
        bytes_read=tr * 10,
        bytes_written=tw * 10,
        decode_bytes_read=0,
        tokens_read=tr,
        tokens_written=tw,
        hits=hits,
        misses=misses,
        ok=ok,
        error=error,
        new_tokens=50,
        turn=1,
    )


@pytest.fixture
def built(tmp_path):
    cfg = BenchConfig(
        model="tiny-1b",
        num_users=2,
        duration=10,
        gpu_mem_gb=0,
        cpu_mem_gb=0.01,
        seed=5,
        cache_dir=str(tmp_path),
        noise_mb=4,
        io_chunk_mb=1,
        generation_mode="none",
    )
    plan = derive(cfg)
    rec = Recorder()
    comp = build_components(plan, rec)
    yield plan, comp, rec
    comp.close()


def test_summary_figures_follow_their_formulas(built, tmp_path):
    plan, comp, rec = built
    for _i in range(4):  # storage reads: 1 MB each, device 2 ms + host 1 ms
        rec.tier_op("storage", "read", "request", 1_000_000, IOTiming(host_ns=MS, device_ns=2 * MS))
    rec.tier_op("storage", "write", "demotion", 4096, IOTiming(host_ns=0, device_ns=600 * MS))  # slow write
    rec.tier_op("cpu", "write", "request", 2048, IOTiming(host_ns=0, device_ns=MS))
    rec.requests += [
        record(),
        record(qos="batch", end=20 * MS),
        record(ok=False, error="storage_error: x"),
        record(ok=False, error=CUT),
    ]
    rec.count("demotions", 3)
    wall_ns = 2_000 * MS
    run = RunOutcome(
        start_ns=0,
        load_end_ns=wall_ns,
        end_ns=wall_ns,
        stop=StopReason(code=StopCode.interrupted, message="interrupted (SIGINT)"),
        status=Status.partial,
        abandoned_requests=2,
        io_before={},
        io_after={},
        users=plan.workload.users,
    )
    r = build_result(plan, comp, rec, run, dt.datetime(2026, 1, 1, tzinfo=dt.UTC))

    assert (r.requests_completed, r.requests_failed, r.requests_cut_at_stop, r.requests_abandoned) == (2, 1, 1, 2)
    s = r.summary
    assert s.avg_throughput_tokens_per_sec == pytest.approx(20 / 2.0)  # generated tokens of ok requests / wall
    assert s.storage_throughput_tokens_per_sec == pytest.approx(2 * 150 / 2.0)  # (read + written) tokens / wall
    assert s.requests_per_second == pytest.approx(1.0)
    assert s.storage_read_bytes_per_sec == pytest.approx(4_000_000 / 2.0)
    assert s.end_to_end_latency_ms.count == 2 and s.end_to_end_latency_ms.max == 20.0
    assert s.end_to_end_latency_ms.p50 == pytest.approx((8 + 20) / 2)  # linear interpolation
    cs = s.cache_stats
    assert cs.cache_hits == 4 and cs.cache_hit_rate == 0.5 and cs.demotions == 3  # hits over all requests
    assert cs.percentile_ms("storage_read_device", "p95") == 2.0 and cs.percentile_ms("storage_read_host", "p50") == 1.0
    assert cs.percentile_ms("storage_read", "p99") == 3.0  # host + device
    assert cs.prefill_bytes_written_gb == pytest.approx(2048 / 2**30, abs=1e-6)  # cause "request" only
    st = r.tiers["storage"]
    assert st.read.ops == 4 and st.read.device_bandwidth_bytes_per_sec == pytest.approx(4e6 / 8e-3)
    assert st.write.by_cause["demotion"].ops == 1 and "request" not in st.write.by_cause
    health = cs.storage_health  # latency profile: write p95 600 ms > 500 fails; read 2 ms < 200 passes
    assert health.profile == "latency" and health.overall_status == "FAIL"
    assert {c.name: c.passed for c in health.criteria} == {
        "Storage Tier Write Device P95 < 500ms": False,
        "Storage Tier Read Device P95 < 200ms": True,
        "CPU RAM P95 < 150ms": True,
        "Cache Hit Rate > 30%": True,
    }
    q = s.qos_metrics["interactive"]
    assert q.requests == 1 and q.failed == 1 and q.sla_compliance == 1.0  # 5 ms service <= 50 ms target
    assert s.qos_metrics["batch"].requests == 1
    assert r.status == "partial" and r.stop_reason.code == "interrupted"
    assert "run-not-complete" in {w.code for w in r.warnings}
    assert r.config.seed == 5 and r.model.kv_bytes_per_token_per_rank == 24_576

    path = write_json(r, tmp_path / "r.json")
    assert load(path) == r  # the file loads back into the same typed result


def test_throughput_profile_checks_bandwidth(built):
    plan, comp, rec = built
    plan.config = plan.config.model_copy(update={"performance_profile": "throughput"})
    rec.tier_op("storage", "write", "request", 2**30, IOTiming(0, 100 * MS))
    run = RunOutcome(
        0,
        1_000 * MS,
        1_000 * MS,
        StopReason(code=StopCode.duration, message="d"),
        Status.complete,
        0,
        {},
        {},
        plan.workload.users,
    )
    h = build_result(plan, comp, rec, run, dt.datetime.now(dt.UTC)).summary.cache_stats.storage_health
    assert [(c.name, c.actual, c.passed) for c in h.criteria] == [("Storage KV Write Bandwidth", 1.0, True)]
    assert h.overall_status == "PASS"


def test_failed_run_has_no_throughput_and_says_so(built):
    plan, comp, rec = built
    rec.requests.append(record(ok=False, error="tier_full: x"))
    run = RunOutcome(
        0, MS, MS, StopReason(code=StopCode.duration, message="d"), Status.failed, 0, {}, {}, plan.workload.users
    )
    r = build_result(plan, comp, rec, run, dt.datetime.now(dt.UTC))
    assert r.summary.end_to_end_latency_ms.count == 0 and r.summary.end_to_end_latency_ms.p95 is None
    assert {"errors-seen", "run-not-complete"} <= {w.code for w in r.warnings}
