"""What happens while a launch runs (launch/orchestrate.py ``execute`` drives it): launch.json as the run
goes (``LaunchRecord``), vLLM's pre-flight, the checks that the server answering a health URL is the
process started for it, ports that must be free, the replay over MPI ranks, the sidecar's share of the NVMe
device's bytes, and each process's final /metrics."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import LaunchError, exit_code_for
from kvtier.launch.caddy import lb_policy
from kvtier.launch.engines import EngineCheck, check_engines
from kvtier.launch.procs import port_in_use
from kvtier.launch.profiles import ProcPlan
from kvtier.results.envelope import (
    ResultWarning,
    Status,
    StopCode,
    StopReason,
    WarningCode,
    collect_host,
    iso,
    utc_now,
    warning,
)
from kvtier.results.io import open_append
from kvtier.results.launch import LaunchResult
from kvtier.telemetry.host import proc_io

if TYPE_CHECKING:
    from kvtier.launch.resolved import LaunchPlan

HOST = "127.0.0.1"
"""Every process of a launch binds loopback only."""


class LaunchRecord:
    """launch.json as the run goes: saved once the processes are healthy and again at the end."""

    def __init__(self, lp: LaunchPlan) -> None:
        self.lp = lp
        self.started = utc_now()
        self.events: list[dict[str, Any]] = []
        self.pids: dict[str, int] = {}
        self.error: str | None = None
        self.engines: EngineCheck | None = None
        self.device: dict[str, Any] | None = None  # the NVMe tier's devices over the replay (diskstats)
        self.warnings: list[ResultWarning] = list(lp.warnings)
        self.hardware: dict[str, Any] | None = None  # the replay's host CPU and GPU samples
        self.faults: list[dict[str, Any]] | None = None  # --fault: each injected and its miss storm
        self.injector: Any = None  # the --fault thread while the replay runs (stopped at teardown)

    def event(self, what: str) -> None:
        self.events.append({"t_unix_s": round(time.time(), 3), "event": what})
        print(f"kvtier launch: {what}", file=sys.stderr, flush=True)

    def result(self, status: Status, stop: StopReason, exit_status: int | None) -> LaunchResult:
        lp, cfg = self.lp, self.lp.config
        return LaunchResult.model_validate(
            {
                "status": status,
                "stop_reason": stop,
                "started_at": iso(self.started),
                "finished_at": iso(utc_now()),
                "host": collect_host({"output": str(lp.out), "nvme": str(lp.nvme_dir) if cfg.tier == "nvme" else None}),
                "profile": lp.profile_name,
                "profile_source": lp.profile_source,
                "resolved_profile": lp.profile.model_dump(),
                "tier": cfg.tier,
                "engine": cfg.engine,
                "build": cfg.build,
                "replicas": cfg.replicas,
                "lb_policy": lb_policy(lp.route_tier, cfg.lb_policy) if lp.caddyfile else None,
                "front_url": lp.front_url,
                "processes": [{"name": n, "env": env, "argv": argv} for n, env, argv in lp.commands],
                "caddy": lp.caddy_argv,
                "replay": lp.replay_argv,
                "events": self.events,
                "ports": {**lp.ports, "replicas": lp.replica_ports},
                "endpoints": {p.name: f"{HOST}:{port}" for p, port in zip(lp.replicas, lp.replica_ports, strict=True)},
                "pids": self.pids,
                "devices": lp.devices(),
                "sizes": lp.sizes,
                "policies": lp.policies(),
                "engines": self.engines.as_dict() if self.engines is not None else None,
                "device": self.device,
                "hardware": self.hardware,
                "faults": self.faults,
                "warnings": self.warnings,
                "error": self.error,
                "exit_status": exit_status,
                "config": cfg,
            }
        )

    def save(self, result: LaunchResult) -> None:
        from kvtier.results.io import write_json

        write_json(result, self.lp.out / "launch.json")


FINAL_METRICS_S = 15.0
"""The most one process's last /metrics read may take, all of it (a server that dribbles cannot hold teardown)."""


def read_metrics_page(url: str, deadline_s: float = FINAL_METRICS_S) -> str:
    """``url``'s text, at most MAX_METRICS_BYTES (the scraper's cap) and within ``deadline_s`` in all; ValueError
    past the size, TimeoutError past the deadline."""
    from kvtier.replay.scrape import MAX_METRICS_BYTES

    end = time.monotonic() + deadline_s
    body = bytearray()
    with urllib.request.urlopen(url, timeout=min(10.0, deadline_s)) as r:
        while chunk := r.read1(1 << 16):  # what one recv brings: the deadline is checked between them
            body += chunk
            if len(body) > MAX_METRICS_BYTES:
                raise ValueError(f"/metrics larger than {MAX_METRICS_BYTES} bytes: not kept")
            if time.monotonic() > end:
                raise TimeoutError(f"/metrics not read within {deadline_s:g} s: not kept")
    return body.decode("utf-8", "replace")


def save_metrics(folder: Path, plans: list[ProcPlan], deadline_s: float = FINAL_METRICS_S) -> None:
    """Each process's final /metrics text, beside the replay's scraped series: bounded in size and time, written
    through the atomic writer (never through a link planted at the name)."""
    from kvtier.results.io import write_text_atomic

    folder.mkdir(parents=True, exist_ok=True)
    for p in plans:
        if not p.metrics:
            continue
        try:
            text = read_metrics_page(p.metrics, deadline_s)
        except (OSError, ValueError) as e:
            text = f"# not saved at the end of the run: {e}\n"
        write_text_atomic(folder / f"{p.name}.prom", text, flag="launch metrics")


def ports_of(lp: LaunchPlan, p: ProcPlan) -> list[int]:
    if p is lp.sidecar:
        return [x for x in (lp.ports["sidecar"], lp.ports["sidecar_http"]) if x]
    return [lp.replica_ports[lp.replicas.index(p)]]


def refuse_busy_ports(name: str, ports: list[int]) -> None:
    """A port already in use means another server would answer our health checks: refuse to start."""
    busy = [port for port in ports if port_in_use(port, HOST)]
    if busy:
        raise LaunchError(
            f"{name}: port {', '.join(map(str, busy))} on {HOST} is already in use by another "
            "process; stop it (or change the profile's port) and run again"
        )


def _get_json(url: str) -> tuple[Any, dict[str, str]]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read(1 << 20)), dict(r.headers)


def starting(name: str) -> Callable[[float, str], None]:
    """A line every 10 s while a process starts (a model loading for minutes is not silence)."""

    def say(seconds: float, state: str) -> None:
        print(f"kvtier launch: {name} starting: {seconds:.0f} s, {state}", file=sys.stderr, flush=True)

    return say


def identify(lp: LaunchPlan, p: ProcPlan) -> Callable[[], str | None]:
    """A check that the server answering ``p``'s health URL is ``p`` (None) or why not: a replica
    lists the served model (and, for a sim replica, names itself in x-kvtier-replica); a kvtier
    cache server names its socket. An LMCache sidecar says only that its engine is healthy: that, its
    process being alive, and its ports free before it started, are the checks."""
    root = p.health.rsplit("/", 1)[0]
    model = lp.replay.model
    if p is not lp.sidecar:
        expected_id = f"{HOST}:{lp.replica_ports[lp.replicas.index(p)]}"

        def replica() -> str | None:
            try:
                body, headers = _get_json(root + "/v1/models")
            except (OSError, ValueError) as e:
                return f"GET /v1/models failed: {e}"
            ids = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)] if isinstance(body, dict) else []
            if model not in ids:
                return f"the server there serves {ids}, not {model!r}"
            rid = {k.lower(): v for k, v in headers.items()}.get("x-kvtier-replica")
            if lp.config.engine == "sim" and rid != expected_id:
                return f"the server there is replica {rid!r}, not {expected_id!r}"
            return None

        return replica

    def cache_server() -> str | None:
        try:
            body, _ = _get_json(p.health)
        except (OSError, ValueError) as e:
            return f"GET {p.health} failed: {e}"
        if lp.config.engine != "sim" and lp.profile.offload != "kvtier-shared":  # LMCache's /healthcheck
            ok = isinstance(body, dict) and body.get("status") == "healthy"
            return None if ok else f"the server there is not a healthy LMCache server ({str(body)[:120]})"
        if not isinstance(body, dict) or body.get("socket") != str(lp.sockdir / "cache.sock"):
            return f"the server there is not this run's kvtier cache-server ({str(body)[:120]})"
        return None

    return cache_server


def remove_stale_sockdirs() -> None:
    """Socket folders of launches that were killed (their pid is gone): empty or holding sockets only."""
    for d in Path(tempfile.gettempdir()).glob("kvtier-launch-*"):
        try:
            pid = int(d.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        if d.is_dir() and all(f.is_socket() for f in d.iterdir()):
            shutil.rmtree(d, ignore_errors=True)


def replay_over_mpi(lp: LaunchPlan, folder: str) -> Any:
    """``--client-ranks N``: mpirun -np N kvtier replay (replay/mpi.py), then rank 0's pooled summary,
    with what ran added as ``server.launch``."""
    from kvtier.child import start
    from kvtier.results import load
    from kvtier.results.replay import ReplayResult

    if shutil.which("mpirun") is None:
        raise LaunchError("--client-ranks: mpirun (Open MPI) is not installed: bash scripts/install-tools.sh mpirun")
    summary = Path(folder) / "summary.json"
    summary.unlink(missing_ok=True)
    with open_append(lp.out / "logs" / "clients.log") as log:
        clients = start(lp.client_argv, name="clients", stdout=log, group=False)
        # Ctrl+C: mpirun forwards SIGTERM to the ranks, which write their partial results
        rc = clients.finish(lp.replay.mpi_timeout + 30, sig=signal.SIGTERM)
    if not summary.exists():
        raise LaunchError(f"--client-ranks: the MPI replay wrote no summary (exit {rc}); see logs/clients.log")
    result = load(summary)
    assert isinstance(result, ReplayResult)
    result.server.launch = lp.identity(None)
    return result


def sidecar_share(name: str, pid: int, before: dict[str, int], totals: dict[str, Any]) -> dict[str, Any]:
    """The sidecar's own block-layer bytes over the replay (/proc/<pid>/io) and their share of what the
    NVMe tier's device moved: the rest was other processes (the replicas, the system, other tenants)."""
    after = proc_io(pid)
    out: dict[str, Any] = {"process": name, "pid": pid}
    for op in ("read", "write"):
        mine = after.get(f"{op}_bytes", 0) - before.get(f"{op}_bytes", 0) if after and before else None
        dev = int(totals.get(f"{op}_bytes", 0) or 0)
        out[f"{op}_bytes"] = mine
        out[f"{op}_share_of_device"] = round(min(mine / dev, 1.0), 4) if mine is not None and dev else None
    return out


def preflight_engines(lp: LaunchPlan, rec: LaunchRecord) -> None:
    """vLLM's pre-flight: the engines that will run, and LMCache's compiled module. A failed check is a
    start-up failure (launch.json written, exit code from errors.EXIT_CODES); --allow-fallback lets a
    missing compiled module through with a warning."""
    cfg = lp.config
    python = lp.commands[-1][2][0] if cfg.build == "cpu" else None  # the replica's own interpreter
    needs_lmcache = lp.sizes.get("offload_engine") == "lmcache"
    rec.engines = chk = check_engines(needs_lmcache=needs_lmcache, python=python, cpu_build=cfg.build == "cpu")
    for line in chk.lines():
        print(f"kvtier launch: engines: {line}", file=sys.stderr)
    fallback_only = chk.problems and all("compiled module" in p for p in chk.problems)
    if not chk.ok and not (cfg.allow_fallback and fallback_only):
        rec.error = "; ".join(chk.problems)
        err = LaunchError(f"engine check failed: {rec.error}")
        rec.save(
            rec.result(Status.failed, StopReason(code=StopCode.startup_failed, message=rec.error), exit_code_for(err))
        )
        raise err
    if not chk.ok:
        rec.warnings.append(
            warning(
                WarningCode.engine_fallback,
                f"--allow-fallback: {chk.problems[0]}",
                lmcache=chk.lmcache,
                torch=chk.torch,
            )
        )
