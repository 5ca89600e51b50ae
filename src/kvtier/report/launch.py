"""The typed result of ``kvtier launch`` (launch.json; docs/metrics.md describes each field)."""

from __future__ import annotations

from typing import Any, Literal

from kvtier.config.launch import LaunchConfig
from kvtier.report.envelope import Envelope, Section


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


class LaunchResult(Envelope):
    """One ``kvtier launch`` run. The replay's own result is OUTDIR/replay/summary.json."""

    benchmark: Literal["kvtier launch"] = "kvtier launch"
    profile: str
    profile_source: str
    resolved_profile: dict[str, Any]
    tier: Literal["gpu", "cpu", "nvme"]
    engine: Literal["vllm", "sim"]
    build: Literal["nvidia", "amd"]
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
    error: str | None
    exit_status: int | None
    config: LaunchConfig


__all__ = ["LaunchResult"]
