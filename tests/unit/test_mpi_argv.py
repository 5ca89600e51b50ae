"""#54 item 4: one mpirun command builder (mpi.py ``mpirun_argv``) for kvtier bench --num-clients, kvtier mlperf run
and kvtier launch --client-ranks."""

from __future__ import annotations

import os
import sys

import pytest

from kvtier.errors import ConfigError
from kvtier.mpi import mpirun_argv

ROOT = ["--allow-run-as-root"] if os.geteuid() == 0 else []


def test_one_rank_on_no_named_host_is_the_command_alone_run_by_this_interpreter():
    assert mpirun_argv(["kvtier", "bench", "--x"], 1) == [sys.executable, "-m", "kvtier", "bench", "--x"]
    assert mpirun_argv(["/bin/true"], 1) == ["/bin/true"]


def test_ranks_on_this_host_oversubscribe_and_survive_a_lost_rank():
    argv = mpirun_argv(["kvtier", "replay"], 3, mpirun="/usr/bin/mpirun")
    assert argv == ["/usr/bin/mpirun", *ROOT, "--oversubscribe", "--mca", "btl", "self,vader", "--mca",
                    "oob_tcp_if_include", "lo", "--enable-recovery", "-np", "3", sys.executable, "-m", "kvtier",
                    "replay"]  # fmt: skip


def test_ranks_over_named_hosts_are_spread_evenly_or_refused():
    argv = mpirun_argv(["kvtier", "bench"], 4, hosts=["a", "b"])
    assert argv[argv.index("--host") + 1] == "a:2,b:2" and "--oversubscribe" not in argv
    assert "btl" not in argv  # across hosts the transports and interfaces are the user's (OMPI_MCA_* variables)
    assert mpirun_argv(["kvtier", "bench"], 1, hosts=["a"])[: 3 + len(ROOT)][-2:] == ["--host", "a:1"]
    with pytest.raises(ConfigError, match="3 ranks do not divide over 2 hosts"):
        mpirun_argv(["kvtier", "bench"], 3, hosts=["a", "b"])


def test_over_named_hosts_the_user_names_the_interface_and_only_there():
    """#58 item 5: with --hosts the ranks need TCP between hosts; kvtier mlperf run --mpi-interface names the
    interfaces (or CIDRs) their transport and mpirun's wire-up use, instead of OMPI_MCA_* variables."""
    from pydantic import ValidationError

    from kvtier.config.mlperf import MlperfConfig
    from kvtier.mlperf.run import bench_argv

    argv = mpirun_argv(["kvtier", "bench"], 4, hosts=["a", "b"], interface="eth1,10.0.0.0/24")
    at = argv.index("btl_tcp_if_include")
    assert argv[at - 1 : at + 5] == ["--mca", "btl_tcp_if_include", "eth1,10.0.0.0/24", "--mca",
                                     "oob_tcp_if_include", "eth1,10.0.0.0/24"]  # fmt: skip
    cfg = MlperfConfig(num_processes=2, hosts="a,b", mpi_interface="eth1")
    try:
        argv = bench_argv(cfg, ["kvtier", "bench"])
    except ConfigError as e:  # no mpirun or mpi4py here: the builder above is what it would call
        pytest.skip(f"mlperf run's own argv needs Open MPI here: {e}")
    assert argv[argv.index("oob_tcp_if_include") + 1] == "eth1"
    with pytest.raises(ValidationError, match="--mpi-interface: only with --hosts"):
        MlperfConfig(num_processes=2, mpi_interface="eth1")
    with pytest.raises(ValidationError, match="interface names or CIDRs"):
        MlperfConfig(num_processes=2, hosts="a,b", mpi_interface="eth1 --mca x")
    with pytest.raises(ValidationError, match="interface names or CIDRs"):
        MlperfConfig(num_processes=2, hosts="a,b", mpi_interface="-np")  # never read as an mpirun option
    with pytest.raises(ValidationError, match="only with --hosts"):
        MlperfConfig(num_processes=2, hosts=" , ", mpi_interface="eth1")  # no host named
