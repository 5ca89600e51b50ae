"""The typed result of ``kvtier launch`` (launch.json; docs/metrics.md describes each field)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kvtier.config.launch import LaunchConfig
from kvtier.results.envelope import Envelope, Section
from kvtier.results.replay import Hardware


class ProcessCommand(Section):
    name: str
    env: dict[str, str]
    argv: list[str]


class LaunchEvent(Section):
    t_unix_s: float
    event: str


class LaunchPorts(Section):
    replicas: list[int]
    sidecar: int | None
    sidecar_http: int | None
    caddy: int | None


class LaunchDevices(Section):
    """Which GPUs the launch used and where that list came from (launch/devices.py)."""

    source: str
    available: list[str]
    per_replica: dict[str, list[str]]
    variable: str | None  # CUDA_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES (None: the sim uses no device)
    notes: list[str]


class LaunchSizes(Section):
    """The sizes given to the processes, in the units of their flags (LMCache's --l1-size-gb, max_capacity_gb)."""

    l1_gb: float
    l1_source: str
    l2_gb: float | None
    l2_source: str | None
    staging_gb: float | None = None  # the nvme tier's CPU staging (kvtier, vllm-native); absent in older results
    staging_source: str | None = None
    tensor_parallel_size: int
    sidecar_max_workers: int
    # what moves the KV to the tier: none (gpu tier), lmcache, vllm-native or kvtier (absent in older results)
    offload_engine: str | None = None
    # --build cpu: the dummy-weight model folder, its KV bytes per token and the KV cache each replica got
    model_dir: str | None = None
    kv_bytes_per_token: int | None = None
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None


class LaunchPolicies(Section):
    kv_load_failure_policy: str | None
    eviction_policy: str | None
    lb_policy: str | None


MAX_RUN_S = 1e7
"""No run lasts longer (116 days): a time beyond it in a result file is not one (a plot cannot draw 1e308)."""
MAX_UNIX_S = 1e11
"""A Unix time past this (the year 5138) in a result file is not one."""


class StormWindow(Section):
    """Requests started in one window of a fault (launch/faults.py): before it, or in its zero-hit window."""

    requests: int
    failed: int
    offload_hit_rate: float | None  # prompt tokens an offload tier served / all prompt tokens (ok requests)
    ttft_s_p95: float | None
    queue_s_mean: float | None  # the server's queue wait (the sim's decomposition; None without it)
    queue_s_p95: float | None


class StormPoint(Section):
    t: float = Field(ge=0, le=MAX_RUN_S)  # seconds after the replay started: the bin's start
    requests: int = Field(ge=0)
    offload_hit_rate: float | None = Field(ge=0, le=1)
    ttft_s_p95: float | None = Field(ge=0, le=MAX_RUN_S)


class FaultOutcome(Section):
    """One injected fault and the miss storm it caused (``kvtier launch --fault``; docs/metrics.md)."""

    kind: str
    at_s: float = Field(ge=0, le=MAX_RUN_S)  # after the replay started
    down_unix_s: float = Field(ge=0, le=MAX_UNIX_S)  # when the part was killed
    up_unix_s: float | None = Field(ge=0, le=MAX_UNIX_S)  # when it answered its health check again (None: never)
    downtime_s: float | None = Field(ge=0, le=MAX_RUN_S)
    error: str | None  # why it did not come back
    basis: Literal["prompt_sources", "cached_tokens"]  # what says a token came from the offload tier
    baseline: StormWindow
    # the kill to the first request an offload tier served again (None: none did)
    zero_hit_s: float | None = Field(ge=0, le=MAX_RUN_S)
    storm: StormWindow  # the requests started in the zero-hit window
    # the kill to the hit rate back at recovered_at x the baseline's (None: not)
    recovered_after_s: float | None = Field(ge=0, le=MAX_RUN_S)
    recovered_at: float = Field(ge=0, le=1)
    timeline: list[StormPoint]
    # the replay's first request: the timeline's t = 0
    timeline_start_unix_s: float | None = Field(default=None, ge=0, le=MAX_UNIX_S)

    def sentence(self) -> str:
        """The miss storm in words (``kvtier launch`` prints it; ``kvtier report`` shows it)."""
        f = self

        def pct(x: float | None) -> str:
            return "—" if x is None else f"{x:.1%}"

        def sec(x: float | None) -> str:
            return "—" if x is None else f"{x:.3g} s"

        b, st = f.baseline, f.storm
        if f.error:
            return f"fault {f.kind}@{f.at_s:g}: the part did not come back ({f.error.splitlines()[0]})"
        window = (
            "no request was served by the offload tier again"
            if f.zero_hit_s is None
            else f"zero-hit window {sec(f.zero_hit_s)}"
        )
        back = (
            f"hit rate back to {f.recovered_at:.0%} of {pct(b.offload_hit_rate)} after {sec(f.recovered_after_s)}"
            if f.recovered_after_s is not None
            else f"hit rate not back to {f.recovered_at:.0%} of {pct(b.offload_hit_rate)} by the end"
        )
        return (
            f"fault {f.kind}@{f.at_s:g}: down {sec(f.downtime_s)}; {window} ({st.requests} requests, TTFT p95 "
            f"{sec(st.ttft_s_p95)} vs {sec(b.ttft_s_p95)} before, queue mean {sec(st.queue_s_mean)} vs "
            f"{sec(b.queue_s_mean)}); {back}"
        )


class LaunchResult(Envelope):
    """One ``kvtier launch`` run. The replay's own result is OUTDIR/replay/summary.json."""

    benchmark: Literal["kvtier launch"] = "kvtier launch"
    profile: str
    profile_source: str
    resolved_profile: dict[str, Any]
    tier: Literal["gpu", "cpu", "nvme"]
    engine: Literal["vllm", "sim"]
    build: Literal["nvidia", "amd", "cpu"]
    replicas: int
    lb_policy: str | None
    front_url: str
    processes: list[ProcessCommand]
    caddy: list[str] | None
    replay: list[str]
    events: list[LaunchEvent]
    ports: LaunchPorts
    endpoints: dict[str, str]
    pids: dict[str, int]
    # None only in launch.json files written before these were recorded
    devices: LaunchDevices | None = None
    sizes: LaunchSizes | None = None
    policies: LaunchPolicies | None = None
    engines: dict[str, Any] | None = None  # the pre-flight check (launch/engines.py; None for the sim)
    device: dict[str, Any] | None = None  # NVMe tier: its devices over the replay (telemetry/diskstats.py)
    hardware: Hardware | None = None  # the replay's host CPU and GPU telemetry (results/replay.py Hardware)
    faults: list[FaultOutcome] | None = None  # --fault: each fault injected and its miss storm
    error: str | None
    exit_status: int | None
    config: LaunchConfig


__all__ = ["FaultOutcome", "LaunchResult", "StormPoint", "StormWindow"]
