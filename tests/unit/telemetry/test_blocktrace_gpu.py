"""Block-layer tracing (bpftrace) and GPU telemetry (NVML): parsing, and degrading without the real parts.

The histogram fixture follows bpftrace's printed hist() layout ([low, high) buckets with K/M suffixes,
single-value [0]/[1] buckets). No GPU exists here, so NVML's sampling is driven by a stand-in object;
the real nvidia-ml-py (test extra) is used for the no-driver path."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.telemetry.blocktrace import BlockTracer, dev_numbers, parse_histograms, program, summarize
from kvtier.telemetry.gpu import GpuSampler

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def test_bpftrace_histograms_parse():
    h = parse_histograms((FIXTURES / "bpftrace_hist.txt").read_text())
    assert set(h) == {"d2c_read_us", "d2c_write_us", "size_write_kb"}
    assert h["d2c_read_us"][-1] == {"low": 1024, "high": 2048, "count": 1}
    assert h["d2c_write_us"][:2] == [{"low": 0, "high": 1, "count": 2}, {"low": 1, "high": 2, "count": 1}]
    assert h["d2c_write_us"][-1] == {"low": 2 * 1024**2, "high": 4 * 1024**2, "count": 1}
    s = summarize(h)
    assert s["d2c_read_us"]["count"] == 41
    assert s["d2c_read_us"]["p50_bucket"] == {"low": 32, "high": 64}  # the 21st of 41 is in [32, 64)
    assert s["d2c_read_us"]["p99_bucket"] == {"low": 1024, "high": 2048}
    assert s["size_write_kb"]["p95_bucket"] == {"low": 512, "high": 1024}


def test_program_filters_on_the_devices():
    text = program([(259 << 20) | 1, (8 << 20)])
    assert f"args->dev == {(259 << 20) | 1} || args->dev == {8 << 20}" in text
    assert "@d2c_read_us = hist(" in text and "@q2d_write_us = hist(" in text


def test_dev_numbers_from_sysfs(tmp_path: Path):
    (tmp_path / "block" / "nvme0n1").mkdir(parents=True)
    (tmp_path / "block" / "nvme0n1" / "dev").write_text("259:0\n")
    assert dev_numbers(["nvme0n1", "missing"], tmp_path) == [259 << 20]


def test_tracing_degrades_without_bpftrace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bpftrace on it
    t = BlockTracer.start(["vda"])
    assert t.reason == "bpftrace is not installed (apt-get install bpftrace; scripts/install-tools.sh)"
    assert t.stop() == {}
    t = BlockTracer.start([], bpftrace="/bin/true")
    assert t.reason == "no block device under the storage tier to trace"


def test_tracing_degrades_when_probes_cannot_attach(tmp_path: Path):
    """A bpftrace that exits at once, as the real one does in a container (no tracefs, no RLIMIT_MEMLOCK)."""
    fake = tmp_path / "bpftrace"
    fake.write_text("#!/bin/sh\necho 'ERROR: tracepoint not found: block:block_rq_insert' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    if os.geteuid() != 0:
        pytest.skip("the attach path runs as root (else the root check answers first)")
    t = BlockTracer.start(["vda"], attach_s=2.0, bpftrace=str(fake))
    assert t.reason == "bpftrace could not attach its probes: ERROR: tracepoint not found: block:block_rq_insert"


def test_gpu_telemetry_without_nvml_is_null_with_a_code():
    g = GpuSampler(0.05)
    g.start()
    s = g.stop()
    assert s["available"] is False and s["gpus"] == [] and s["timeline"] == []
    assert s["code"] in ("nvml-not-installed", "nvml-unavailable", "no-nvidia-device") and s["reason"]


class _FakeNvml:
    """Two devices; the second does not report power (figures it lacks must be null, not zero)."""

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        if h == 1:
            raise RuntimeError("not supported")
        return 350_000

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=40 + h, memory=10)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=(h + 1) * 2**30, total=141 * 2**30)


def test_gpu_sampling_per_device():
    g = GpuSampler(0.05, nvml=_FakeNvml())
    g.start()
    s = g.stop()
    assert s["available"] and s["code"] is None and len(s["timeline"]) >= 2
    a, b = s["gpus"]
    assert a["mean_power_w"] == 350.0 and a["mean_utilization_pct"] == 40 and a["max_memory_used_bytes"] == 2**30
    assert b["mean_power_w"] is None and b["max_power_w"] is None and b["memory_total_bytes"] == 141 * 2**30


def test_the_program_watches_kvtiers_thread_only_where_its_pid_is_the_hosts(monkeypatch):
    """bpftrace's tid is the host's: inside a PID namespace kvtier's own pid could name an unrelated host thread, whose
    exit would end the trace early. There only the time bound (and the parent-death signal) ends it."""
    from kvtier.telemetry import blocktrace

    monkeypatch.setattr(blocktrace, "_in_pid_namespace", lambda: False)
    text = blocktrace.program([8 << 20], watch=1234, max_s=90)
    assert "sched_process_exit /tid == 1234/ { exit(); }" in text and "interval:s:90 { exit(); }" in text
    monkeypatch.setattr(blocktrace, "_in_pid_namespace", lambda: True)
    text = blocktrace.program([8 << 20], watch=1234, max_s=90)
    assert "sched_process_exit" not in text and "interval:s:90 { exit(); }" in text
