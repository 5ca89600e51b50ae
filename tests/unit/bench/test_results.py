"""The bench result from known raw samples: every figure checked against its formula (docs/metrics.md),
and the file it makes loads back into the same typed result."""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

import pytest

from kvtier.bench.results import build_result
from kvtier.bench.runner import RunOutcome
from kvtier.bench.service import CUT
from kvtier.bench.setup import build_components, derive
from kvtier.config.bench import BenchConfig
from kvtier.results import load
from kvtier.results.envelope import Status, StopCode, StopReason
from kvtier.results.io import write_json
from kvtier.telemetry.clock import IOTiming
from kvtier.telemetry.recorder import BenchRequest, Recorder

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
    return BenchRequest(
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


def finished(plan, wall_ns: int, status: Status = Status.complete) -> RunOutcome:
    """A run that ended on --duration after ``wall_ns``."""
    stop = StopReason(code=StopCode.duration, message="d")
    return RunOutcome(0, wall_ns, wall_ns, stop, status, 0, {}, {}, plan.workload.users)


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
    # the reference's formula: generated tokens / the sum of the requests' storage times (2 x 4 ms)
    assert s.storage_throughput_tokens_per_sec == pytest.approx(20 / 0.008)
    assert (s.total_requests, s.total_tokens, s.elapsed_time, s.total_storage_io_time) == (2, 20, 2.0, 0.008)
    assert s.storage_kv_tokens_per_sec == pytest.approx(2 * 150 / 2.0)  # kvtier's: (read + written) tokens / wall
    assert s.requests_per_second == pytest.approx(1.0)
    assert s.storage_read_bytes_per_sec == pytest.approx(4_000_000 / 2.0)
    assert s.end_to_end_latency_ms.count == 2 and s.end_to_end_latency_ms.max == 20.0
    assert s.end_to_end_latency_ms.p50 == pytest.approx((8 + 20) / 2)  # linear interpolation
    cs = s.cache_stats
    assert cs.cache_hits == 4 and cs.cache_hit_rate == 0.5 and cs.demotions == 3  # hits over all requests
    assert cs.percentile_ms("storage_read_device", "p95") == 2.0 and cs.percentile_ms("storage_read_host", "p50") == 1.0
    assert cs.percentile_ms("storage_read", "p99") == 3.0  # host + device
    assert cs.prefill_bytes_written_gb == pytest.approx(2048 / 2**30, abs=1e-6)  # cause "request" only
    # the reference's counters: the requests' own reads and writes; writes into each tier of any cause
    assert (cs.read_iops, cs.write_iops, cs.total_read_bytes, cs.total_write_bytes) == (4, 1, 4_000_000, 2048)
    assert (cs.offloads_cpu, cs.offloads_storage, cs.prefill_writes) == (1, 1, 1)
    assert cs.read_write_ratio == pytest.approx(4_000_000 / 2048, rel=1e-6)
    assert cs.tier_storage_read_bandwidth_gbps == pytest.approx(4e6 / 2**30 / 2.0, abs=1e-6)
    assert cs.tier_cpu_write_bandwidth_gbps == pytest.approx(2048 / 2**30 / 2.0, abs=1e-6)
    assert cs.storage_tokens_processed == pytest.approx((4096 + 4e6) / 24_576, abs=1e-3)
    assert (cs.storage_entries, cs.cpu_entries, cs.gpu_entries, cs.common_phrase_hits) == (0, 0, 0, 0)
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
    assert not q.no_data and q.total_requests == 1 and q.latency_ms.p95 == 8.0  # the reference's: end to end
    assert (q.sla.target_p95_ms, q.sla.actual_p95_ms, q.sla.compliance, q.sla.met) == (50, 8.0, 1.0, True)
    assert s.qos_metrics["responsive"].no_data and s.qos_metrics["responsive"].sla.met is None
    assert s.qos_metrics["batch"].requests == 1
    assert r.status == "partial" and r.stop_reason.code == "interrupted"
    assert "run-not-complete" in {w.code for w in r.warnings}
    assert r.config.seed == 5 and r.model.kv_bytes_per_token_per_rank == 24_576
    # the reference's top-level raw data, in seconds
    assert r.end_to_end_latencies == [0.008, 0.020] and r.storage_latencies == [0.004, 0.004]
    assert r.total_storage_io_latency == 0.008 and r.generation_latencies == [0.003, 0.015]
    assert [(p.timestamp, p.throughput_tokens_per_sec) for p in r.throughput_timeline] == [(1.0, 20.0), (2.0, 10.0)]
    assert r.prefill_latencies == [0.0, 0.0] and r.decode_latencies == []
    assert s.autoscaling_stats == [] and s.autoscaling_summary is None

    path = write_json(r, tmp_path / "r.json")
    assert load(path) == r  # the file loads back into the same typed result


def test_throughput_profile_checks_bandwidth(built):
    plan, comp, rec = built
    plan.config = plan.config.model_copy(update={"performance_profile": "throughput"})
    rec.tier_op("storage", "write", "request", 2**30, IOTiming(0, 100 * MS))
    run = finished(plan, 1_000 * MS)
    h = build_result(plan, comp, rec, run, dt.datetime.now(dt.UTC)).summary.cache_stats.storage_health
    assert [(c.name, c.actual, c.passed) for c in h.criteria] == [("Storage KV Write Bandwidth", 1.0, True)]
    assert h.overall_status == "PASS"


def test_failed_run_has_no_throughput_and_says_so(built):
    plan, comp, rec = built
    rec.requests.append(record(ok=False, error="tier_full: x"))
    run = finished(plan, MS, Status.failed)
    r = build_result(plan, comp, rec, run, dt.datetime.now(dt.UTC))
    assert r.summary.end_to_end_latency_ms.count == 0 and r.summary.end_to_end_latency_ms.p95 is None
    assert {"requests-failed", "run-not-complete"} <= {w.code for w in r.warnings}
    assert r.errors.failures["tier-full"].count == 1 and r.errors.failures["tier-full"].first_message == "tier_full: x"


def test_failed_work_above_the_rate_makes_a_run_that_ran_to_its_end_failed(built):
    """The status rule (results/outcome.py): 2 of 100 failed is over 1 %: failed, too-many-failures; cut
    requests are listed but not counted; 1 of 100 is within it: complete, with requests-failed."""
    plan, comp, rec = built
    rec.requests.extend([record() for _ in range(98)] + [record(ok=False, error="tier_full: no room")] * 2)
    rec.requests.extend([record(ok=False, error=CUT)] * 5)
    r = build_result(plan, comp, rec, finished(plan, 1000 * MS), dt.datetime.now(dt.UTC))
    assert r.status == Status.failed and r.stop_reason.code == StopCode.too_many_failures
    assert "2.0% of 100 requests failed, above --max-failure-rate 0.01" in r.stop_reason.message
    assert {c: f.count for c, f in r.errors.failures.items()} == {"cancelled": 5, "tier-full": 2}
    w = next(w for w in r.warnings if w.code == "requests-failed")
    assert w.model_extra is not None and w.model_extra["failed"] == 2 and w.model_extra["attempted"] == 100
    rec.requests[:] = [record() for _ in range(99)] + [record(ok=False, error="storage_error: EIO")]
    r = build_result(plan, comp, rec, finished(plan, 1000 * MS), dt.datetime.now(dt.UTC))
    assert r.status == Status.complete and r.stop_reason.code == StopCode.duration
    assert "requests-failed" in {w.code for w in r.warnings} and "io-error" in r.errors.failures
    loose = plan.config.model_copy(update={"max_failure_rate": 0.5})
    rec.requests[:] = [record() for _ in range(60)] + [record(ok=False, error="tier_full: x")] * 40
    r = build_result(dataclasses.replace(plan, config=loose), comp, rec, finished(plan, MS), dt.datetime.now(dt.UTC))
    assert r.status == Status.complete


def test_a_partial_run_stays_partial_whatever_failed(built):
    plan, comp, rec = built
    rec.requests.extend([record(ok=False, error="tier_full: x")] * 3)
    run = finished(plan, MS, Status.partial)
    run.stop = StopReason(code=StopCode.interrupted, message="SIGINT")
    r = build_result(plan, comp, rec, run, dt.datetime.now(dt.UTC))
    assert r.status == Status.partial and r.stop_reason.code == StopCode.interrupted


def test_the_mlperf_table_from_two_instances_equals_the_hand_computation(built):
    """MLPerf's table: sums of throughput and bandwidth, the highest p95 read (kvtier.results.mlperf)."""
    from kvtier.results.mlperf import run_figures

    plan, comp, _ = built
    results = []
    for read_ms, n_reads, gen in ((2, 4, 10), (7, 2, 30)):
        rec = Recorder()
        for _ in range(n_reads):
            rec.tier_op("storage", "read", "request", 2**30 // 4, IOTiming(host_ns=0, device_ns=read_ms * MS))
        rec.tier_op("storage", "write", "request", 2**30 // 2, IOTiming(host_ns=0, device_ns=MS))
        rec.requests += [record(gen=gen), record(gen=gen)]
        run = finished(plan, 2_000 * MS)
        results.append(build_result(plan, comp, rec, run, dt.datetime.now(dt.UTC)))
    f = run_figures(results)
    # by hand: storage time 4 ms per request -> 2*gen / 0.008 tokens/s per instance; bytes / 2**30 / 2 s
    assert f.throughput_tokens_per_sec == pytest.approx(20 / 0.008 + 60 / 0.008)
    assert f.read_bandwidth_gibps == pytest.approx(1.0 / 2 + 0.5 / 2)
    assert f.write_bandwidth_gibps == pytest.approx(0.5 / 2 + 0.5 / 2)
    assert f.p95_read_latency_ms == 7.0 and f.instances == 2


def test_requests_cut_at_the_end_alone_are_said_in_a_sentence_of_their_own():
    """#44 item 3: with nothing failed, the closing line read "10 cut at the run's end, not counted as failed",
    orphaned; it says what was cut now, and stays a parenthesis beside real failures."""
    from kvtier.results.outcome import Failure, in_words

    cut = {"cancelled": Failure(count=10, first_message="cut")}
    assert in_words(cut, 14) == "10 requests in flight were cut at the run's end: not counted as failed"
    both = {**cut, "tier-full": Failure(count=2, first_message="x")}
    want = "2 of 16 requests failed: tier-full 2 (and 10 cut at the run's end, not counted as failed)"
    assert in_words(both, 14) == want


def test_a_run_that_completes_nothing_says_what_its_requests_needed(tmp_path):
    """#58 item 17: a Mooncake-trace bench whose first prompts needed ~3 GiB of KV each (llama3.1-8b) ran and said
    only `run failed (duration)`. It now names what the requests needed, the tiers' sizes, and what to change."""
    from kvtier.bench import run
    from kvtier.config.bench import BenchConfig

    trace = Path(__file__).resolve().parents[3].parent / "shared/data/mooncake_fast25/conversation_trace.jsonl"
    if not trace.is_file():
        pytest.skip(f"{trace}: the shared Mooncake trace is not on this machine")
    cfg = BenchConfig(model="llama3.1-8b", trace_path=str(trace), trace_format="mooncake", duration=1,
                      gpu_mem_gb=0, cpu_mem_gb=0, storage_capacity_gb=20, generation_mode="none",
                      cache_dir=str(tmp_path), output=str(tmp_path / "r.json"))  # fmt: skip
    r = run(cfg)
    assert r.requests_completed == 0
    (w,) = [w for w in r.warnings if w.code == "nothing-completed"]
    extra = w.model_extra or {}
    assert extra["requests_started"] > 0 and extra["largest_entry_bytes"] > 2**30  # a prompt of 8k+ tokens
    assert extra["tier_capacity_bytes"]["storage"] > 0
    assert "no request completed" in w.message and "GiB of KV for its prompt of" in w.message
    assert "--duration" in w.message
