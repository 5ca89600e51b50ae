"""#42 item 2 (part): the submission text leads each option with the figure the spec says to use at its CPU tier,
puts kvtier's truth beside the published columns, and the verdict names a CLOSED run that lacks options."""

from __future__ import annotations

import pytest

from kvtier.config.mlperf import MlperfConfig
from kvtier.mlperf.run import Instance, Trial, submission_line, summarize_option, verdict
from kvtier.results.mlperf import OptionSummary


def option(o: int, per_trial: list[list[Instance]]) -> OptionSummary:
    from unittest import mock

    trials = [Trial(f"trial_{i}", 1.0, 0, [], None, []) for i in range(len(per_trial))]
    with mock.patch("kvtier.mlperf.run._instances", side_effect=per_trial):
        return summarize_option(o, trials, len(per_trial[0]))


def inst(read: float, tok: float, decode: float, req_p95: float | None) -> Instance:
    io_p95 = None if req_p95 is None else req_p95 * 2  # the storage I/O time per request: reads and writes
    return Instance(read, read / 4, 2.0, 9.0, tok * 3, tok, "complete", decode, req_p95, io_p95)


def test_at_cpu_mem_0_decode_bytes_and_wall_clock_throughput_lead():
    s = option(1, [[inst(1.0, 100, 50.0, 900.0), inst(1.2, 120, 60.0, 1200.0)],
                   [inst(1.1, 110, 55.0, 1000.0), inst(1.1, 110, 55.0, 800.0)]])  # fmt: skip
    k = s.kvtier
    assert k.decode_bytes_read_gb == 110.0 and k.storage_read_p95_ms == 1200.0  # max over ranks and trials
    assert s.aggregated_p95_latency_ms == 2400.0  # mlpstorage v3.0's published "P95": the same max, of storage I/O
    assert k.read_bandwidth_gbps_per_rank == s.aggregated_read_bandwidth_gbps / 2
    line = submission_line("1", s)
    assert line.startswith("Option 1 (Max Storage Stress, cpu-mem-gb 0): decode bytes read 110.0 GB, wall-clock")
    assert (
        "is not the figure at cpu-mem-gb 0" in line
        and "P95 2,400.0 ms (storage I/O time per request, as published)" in line
        and "storage read p95 1,200.0 ms" in line
    )
    assert "median of the trials' decode bytes read: 110.0 (2 trials, 2 ranks)" in line


def test_at_cpu_mem_4_storage_throughput_leads():
    s = option(2, [[inst(0.5, 200, 10.0, None)]])
    line = submission_line("2", s)
    assert line.startswith("Option 2 (Storage Throughput, cpu-mem-gb 4): storage throughput 200.0 tok/s, decode")
    assert "P95 — ms" in line and "storage read p95 — ms" in line  # no storage I/O: said, not zero


def test_a_closed_run_without_every_option_is_named():
    s = option(1, [[inst(1.0, 100, 50.0, 900.0)]])
    closed = verdict(MlperfConfig(workloads="1,2"), {"1": s, "2": s}, [])
    assert any(v.startswith("closed: option(s) 3 not run") and "70B" in v for v in closed)
    assert not any("not run" in v for v in verdict(MlperfConfig(open=True, workloads="1"), {"1": s}, []))
    assert not any("not run" in v for v in verdict(MlperfConfig(), {"1": s, "2": s, "3": s}, []))


def test_a_multi_rank_run_without_mpi4py_or_mpirun_stops_before_starting_any_rank(
    tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """#44 item 5: without mpi4py, mpirun once started every rank, each printed the same error among PMIx noise, and
    the summary blamed a lost rank. Both are checked first: exit 4 (UnsupportedError) with the install line."""
    import sys

    from kvtier.errors import UnsupportedError
    from kvtier.mlperf.run import bench_argv, run

    (tmp_path / "mpirun").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "mpirun").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # its import fails, as where the extra is not installed
    cfg = MlperfConfig(num_processes=2, cache_dir=str(tmp_path / "c"), results_dir=str(tmp_path / "r"))
    with pytest.raises(
        UnsupportedError, match=r"--num-processes 2: mpi4py is not installed: pip install 'kvtier\[mpi\]'"
    ):
        run(cfg)
    assert not (tmp_path / "r").exists()  # nothing started, nothing written
    assert bench_argv(MlperfConfig(num_processes=1), ["kvtier", "bench"])[1:] == ["-m", "kvtier", "bench"]  # no mpirun
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    with pytest.raises(UnsupportedError, match="mpirun \\(Open MPI\\) is not installed"):
        bench_argv(cfg, ["kvtier", "bench"])
