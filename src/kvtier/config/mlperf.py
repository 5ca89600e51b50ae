"""Configuration of ``kvtier mlperf datasize|run`` (the MLPerf Storage v3.0 KV cache submission workflow)."""

from __future__ import annotations

import re

from pydantic import model_validator

from kvtier.config.base import StrictModel, flag

_INTERFACES = re.compile(r"[A-Za-z0-9_.:/][A-Za-z0-9_.:/-]*(,[A-Za-z0-9_.:/][A-Za-z0-9_.:/-]*)*")


class MlperfConfig(StrictModel):
    """Inputs of ``kvtier mlperf``. The workload parameters (duration, trials, delay, seed, users, model,
    config) are the CLOSED rules' unless given, and giving one needs ``--open``."""

    workloads: str = flag("1,2,3", "options to run: 1 (llama3.1-8b, 200 users), 2 (8b, 100 users, 4 GB CPU), 3 (70b)")
    num_processes: int = flag(1, "instances (MPI ranks) in all; with --hosts, dealt evenly over them", ge=1, le=4096)
    hosts: str | None = flag(None, "comma-separated hosts for mpirun --host (default: this host)")
    mpi_interface: str | None = flag(
        None,
        "with --hosts: the network interfaces or CIDRs Open MPI's ranks and wire-up use, comma-separated (eth1 or "
        "10.0.0.0/24; btl_tcp_if_include and oob_tcp_if_include). On one host they use loopback and shared memory",
    )
    cache_dir: str | None = flag(None, "storage tier directory on the device under test (rank_<r>/ per instance)")
    results_dir: str | None = flag(None, "where option_<o>/trial_<t>/ and kvcache_run_summary.json go (run)")
    open: bool = flag(False, "an OPEN submission: the overrides below are allowed, and the summary says so")
    duration: int | None = flag(None, "seconds per trial (CLOSED: 300)", ge=1)
    trials: int | None = flag(None, "trials per option (CLOSED: 3)", ge=1, le=100)
    inter_option_delay: float | None = flag(None, "seconds between options (CLOSED: 20)", ge=0)
    seed: int | None = flag(None, "base seed; rank r uses seed + r (CLOSED: 42)")
    num_users: int | None = flag(None, "users per instance instead of the option's (OPEN only)", ge=1)
    model: str | None = flag(None, "model instead of the option's (OPEN only)")
    config: str | None = flag(None, "YAML in the reference config.yaml layout (OPEN only; CLOSED uses the defaults)")
    mpi_timeout: float = flag(600.0, "seconds a rank waits for the others (see kvtier bench --mpi-timeout)", gt=0)
    output: str | None = flag(None, "datasize: also write the estimate as JSON here")

    @model_validator(mode="after")
    def _interface_with_hosts(self) -> MlperfConfig:
        if self.mpi_interface is not None:
            if not (self.hosts or "").replace(",", "").strip():
                raise ValueError("--mpi-interface: only with --hosts (on one host the ranks use loopback)")
            if not _INTERFACES.fullmatch(self.mpi_interface):
                raise ValueError(f"--mpi-interface {self.mpi_interface!r}: interface names or CIDRs, comma-separated")
        return self


__all__ = ["MlperfConfig"]


class MlperfShimConfig(StrictModel):
    """``kvtier mlperf shim DIR``."""

    dir: str = flag(..., "the folder mlpstorage is pointed at (created if missing)", cli=False)
    force: bool = flag(False, "replace the files the folder already holds (the old ones are kept as NAME.bak)")


class MlperfCompareConfig(StrictModel):
    """``kvtier mlperf compare SUMMARY``."""

    summary: str = flag(..., "kvcache_run_summary*.json of mlpstorage or kvtier mlperf run", cli=False)
    json_output: str | None = flag(None, "also write the comparison as JSON here", aliases=("--json",))
    model: str | None = flag(
        None,
        "the run's model as mlpstorage names its folder, for which published rows are comparable (default: from the "
        "summary's path .../kv_cache/MODEL/run/..., or kvtier's summary; else llama3.1-8b, every CLOSED run's)",
    )
