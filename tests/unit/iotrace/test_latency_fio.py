"""#42 item 4: `kvtier trace fio` distils a fio job from a latency trace (bench --enable-latency-tracing or
trace attach --output): request sizes as bssplit, rwmixread, iodepth from the queue depth seen, fsync= from the
traced process's writes per fsync. Synthetic histograms, so this runs where bpftrace cannot attach."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvtier.config.iotrace import TraceFioConfig
from kvtier.errors import DatasetError
from kvtier.iotrace.fio import distil_latency, latency_section


def hist(*buckets: tuple[int, int, int]) -> dict[str, object]:
    b = [{"low": lo, "high": hi, "count": n} for lo, hi, n in buckets]
    return {"count": sum(n for *_, n in buckets), "buckets": b, "p95_bucket": {"low": b[-1]["low"],
                                                                                "high": b[-1]["high"]}}  # fmt: skip


SECTION = {
    "devices": ["nvme0n1"],
    "duration_s": 30.0,
    "histograms": {
        "size_read_kb": hist((128, 256, 300), (64, 128, 100)),
        "size_write_kb": hist((4, 8, 50), (512, 1024, 50)),
        "queue_depth": hist((4, 8, 90), (16, 32, 10)),
        "syscall_write_us": hist((8, 16, 200)),
        "fsync_us": hist((256, 512, 50)),
    },
}


def test_the_job_follows_the_trace(tmp_path: Path):
    cfg = TraceFioConfig(trace="t.json", output=str(tmp_path / "j.fio"), directory=str(tmp_path))
    text, f = distil_latency(SECTION, "t.json", cfg)
    assert "rw=randrw" in text and "rwmixread=80" in text  # 400 reads of 500 requests
    assert "bssplit=64k/25:128k/75,4k/50:512k/50" in text
    assert f["iodepth"] == 32 and "iodepth=32" in text  # the p95 bucket's upper bound
    assert "fsync=4" in text and f["writes_per_fsync"] == 4  # 200 writes, 50 fsyncs
    assert "runtime=30" in text and "direct=1" in text
    if shutil.which("fio"):
        (tmp_path / "j.fio").write_text(text)
        assert subprocess.run(["fio", "--parse-only", str(tmp_path / "j.fio")], capture_output=True).returncode == 0


def test_a_result_or_a_section_is_read_and_anything_else_refused(tmp_path: Path):
    assert latency_section(SECTION, "x") is SECTION
    assert latency_section({"latency_tracing": SECTION}, "x") is SECTION
    assert latency_section({"latency_tracing": None}, "x") is None
    cfg = TraceFioConfig(trace="t.json", output=str(tmp_path / "j.fio"), directory=str(tmp_path))
    with pytest.raises(DatasetError, match="no block requests"):
        distil_latency({"histograms": {"fsync_us": hist((1, 2, 3))}}, "t.json", cfg)
