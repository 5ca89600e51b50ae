"""``kvtier plan sweep``: a trace replayed against the sim across a grid of placements, each trial a result.

Each point of the grid (CPU GB x NVMe GB x concurrency) runs ``trials`` times. A trial starts a fresh
``kvtier sim`` on a port of 127.0.0.1 the OS chose, its offload tiers kvtier's real engine:

* CPU 0, NVMe 0: ``--offload none`` (the GPU prefix cache alone);
* CPU c, NVMe 0: ``--offload cpu --cpu-offload-gb c``;
* NVMe n: ``--offload nvme --nvme-offload-gb n --staging-gb c`` (the CPU tier in front of the files; with
  CPU 0 the smallest staging tier, ``MIN_STAGING_GB``, which the trial's ``sim_argv`` records),

then ``kvtier replay`` of the dataset against it into ``POINT/trial-N/`` (a replay result folder), then stops
the sim and removes its files. sweep.json (a ``SweepResult``) is rewritten after every trial, so a sweep cut by
``--budget`` (no trial starts that the mean trial time so far says would end past it), Ctrl+C or a crash
resumes: a trial is kept (``reused``) only when its folder holds a complete replay result *and* its
``trial.json`` — what defined the trial: the point, the sim's preset, model and GPU size, the dataset (its
resolved path, and the size and mtime of its files), the replay's settings, a ``--calibration`` ladder's SHA-256 —
equals this sweep's for that trial;
any other is run again. The sweep's folders are handled through descriptors: the point and trial folders are
made 0700 and opened without following links; a point or trial that is a symlink (or not a folder) is refused
(``ConfigError``), and a stale trial folder is removed through its point folder's descriptor (``rmtree`` with
``dir_fd``), so nothing outside the sweep's folder is ever deleted.
Status: complete when every trial ran complete; partial when the budget or Ctrl+C left some unrun, or some
trial's replay was not complete (its own status says why).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, DatasetError
from kvtier.launch.procs import Supervisor, free_ports
from kvtier.launch.profiles import ProcPlan
from kvtier.results.envelope import (
    Status,
    StopCode,
    StopReason,
    WarningCode,
    collect_host,
    iso,
    utc_now,
    warning,
)
from kvtier.results.io import write_json
from kvtier.results.sweep import SweepGrid, SweepResult, SweepTrial

MIN_STAGING_GB = 0.05
"""The CPU staging tier of an NVMe point swept at CPU 0 GB: a few chunks, so the NVMe tier serves."""
SIM_START_S = 60.0


@dataclass(frozen=True)
class Point:
    cpu_gb: float
    nvme_gb: float
    concurrency: int

    @property
    def name(self) -> str:
        return f"cpu{self.cpu_gb:g}-nvme{self.nvme_gb:g}-c{self.concurrency}"

    def offload_args(self, nvme_dir: Path) -> list[str]:
        if self.nvme_gb > 0:
            staging = self.cpu_gb if self.cpu_gb > 0 else MIN_STAGING_GB
            return [
                "--offload",
                "nvme",
                "--nvme-offload-gb",
                f"{self.nvme_gb:g}",
                "--staging-gb",
                f"{staging:g}",
                "--nvme-dir",
                str(nvme_dir),
            ]
        if self.cpu_gb > 0:
            return ["--offload", "cpu", "--cpu-offload-gb", f"{self.cpu_gb:g}"]
        return ["--offload", "none"]


def grid_points(g: SweepGrid) -> list[Point]:
    return [Point(c, n, k) for k in g.concurrency for n in g.nvme_gb for c in g.cpu_gb]


def _kvtier() -> list[str]:
    return [sys.executable, "-m", "kvtier"]


def _replay_status(folder: Path) -> str | None:
    """The status of the replay result in ``folder``, or None when there is none it can read."""
    from kvtier.results import load
    from kvtier.results.replay import ReplayResult

    try:
        r = load(folder)
    except DatasetError:
        return None
    return r.status.value if isinstance(r, ReplayResult) else None


TRIAL_FILE = "trial.json"
"""In each trial folder: what defined the trial (``trial_descriptor``), written before it runs."""


def _dataset_identity(path: Path) -> dict[str, Any]:
    """The dataset as a trial saw it: its resolved path and each file's size and mtime (a folder's files, sorted),
    so a resumed sweep keeps no trial of a dataset since changed or replaced under the same name."""
    root = path.resolve()
    if root.is_dir():
        files = sorted(f for f in root.rglob("*") if f.is_file())
        stats = [(str(f.relative_to(root)), f.stat()) for f in files[:MAX_DATASET_FILES]]
    else:
        stats = [("", root.stat())] if root.exists() else []
    digest = hashlib.blake2b(digest_size=16)
    for name, st in stats:
        digest.update(f"{len(name)}:{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return {"path": str(root), "files": len(stats), "files_digest": digest.hexdigest()}


MAX_DATASET_FILES = 100_000


def trial_descriptor(g: SweepGrid, p: Point, trial: int) -> dict[str, Any]:
    """Everything that decides a trial's result, as recorded in its ``trial.json`` (ports and scratch paths are not)."""
    return {
        "version": 1,
        "point": p.name,
        "cpu_gb": p.cpu_gb,
        "nvme_gb": p.nvme_gb,
        "concurrency": p.concurrency,
        "trial": trial,
        "preset": g.preset,
        "sim_model": g.sim_model,
        "gpu_kv_gb": g.gpu_kv_gb,
        "dataset": _dataset_identity(Path(g.dataset)),
        "dataset_format": g.dataset_format,
        "num_rounds": g.num_rounds,
        "max_tokens_cap": g.max_tokens_cap,
        "duration_s": g.duration_s,
        "replay_args": list(g.replay_args),
        # a calibrated sweep's trials hold for that ladder's bytes only (absent for an uncalibrated one, as before)
        **({"calibration": _file_digest(Path(g.calibration))} if g.calibration else {}),
    }


def _file_digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise ConfigError(f"--calibration {path}: {e.strerror}") from None


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_sweep_dir(parent_fd: int, name: str, where: Path) -> int:
    """The folder ``name`` under ``parent_fd``, made 0700 when missing, opened without following a link: a symlink
    or a non-folder in its place is not the sweep's (ConfigError naming it)."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        pass
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ConfigError(
                f"{where / name}: a symlink or not a folder where the sweep keeps its own folders; refused (remove it, "
                "or give another --output)"
            ) from None
        raise ConfigError(f"{where / name}: cannot use it: {e.strerror}") from None


def _recorded(trial_fd: int) -> dict[str, Any] | None:
    """The trial folder's ``trial.json`` (read without following a link), or None when absent or unreadable."""
    try:
        fd = os.open(TRIAL_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=trial_fd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_TRIAL_FILE + 1)
    try:
        got = json.loads(raw) if len(raw) <= MAX_TRIAL_FILE else None
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


MAX_TRIAL_FILE = 1 << 20


def _is_dir_entry(parent_fd: int, name: str) -> bool | None:
    """True: a real folder; False: something else (a link, a file); None: nothing there."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return stat.S_ISDIR(st.st_mode)


def prepare_trial(out: Path, point: str, trial: int, descriptor: dict[str, Any]) -> bool:
    """Keep or clear ``out/point/trial-N`` through descriptors (module docstring); True when the trial there is
    complete and was run as ``descriptor`` says (kept), False when the folder is now new and empty, with
    ``trial.json`` written."""
    name = f"trial-{trial}"
    out_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        point_fd = open_sweep_dir(out_fd, point, out)
        try:
            kind = _is_dir_entry(point_fd, name)
            if kind:
                trial_fd = open_sweep_dir(point_fd, name, out / point)
                try:
                    same = _recorded(trial_fd) == descriptor
                finally:
                    os.close(trial_fd)
                if same and _replay_status(out / point / name) == "complete":
                    return True
                shutil.rmtree(name, dir_fd=point_fd)  # fd-based: never follows a link out of the sweep
            elif kind is False:
                os.unlink(name, dir_fd=point_fd)  # a link or a file in a trial's place: the entry goes, not its target
            trial_fd = open_sweep_dir(point_fd, name, out / point)
            try:
                fd = os.open(
                    TRIAL_FILE,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                    dir_fd=trial_fd,
                )
                with os.fdopen(fd, "w") as f:
                    json.dump(descriptor, f, indent=1)
            finally:
                os.close(trial_fd)
            return False
        finally:
            os.close(point_fd)
    finally:
        os.close(out_fd)


def run_trial(g: SweepGrid, p: Point, trial: int, out: Path) -> SweepTrial:
    """One trial: a fresh sim with the point's tiers, the replay against it, the sim stopped (module docstring)."""
    folder = out / p.name / f"trial-{trial}"
    rel = str(folder.relative_to(out))
    nvme = Path(g.nvme_dir) / f"{p.name}-{trial}"
    port = free_ports(1)[0]
    sim_argv = _kvtier() + [
        "sim",
        "--preset",
        g.preset,
        "--model",
        g.sim_model,
        "--served-model-name",
        "m",
        "--gpu-kv-gb",
        f"{g.gpu_kv_gb:g}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *p.offload_args(nvme),
        *(["--calibration", g.calibration] if g.calibration else []),
        *(["--accept-unreliable"] if g.calibration and g.accept_unreliable else []),
    ]
    base = {
        "point": p.name,
        "cpu_gb": p.cpu_gb,
        "nvme_gb": p.nvme_gb,
        "concurrency": p.concurrency,
        "trial": trial,
        "path": rel,
        "sim_argv": sim_argv,
    }
    if prepare_trial(out, p.name, trial, trial_descriptor(g, p, trial)):
        return SweepTrial(**base, status="complete", reused=True, wall_s=None)
    if p.nvme_gb > 0:
        nvme.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    # the launch's process handling for the sim and the replay: each in its own group with a log, dying with this
    # process, stopped by group (SIGTERM: a replay still running writes its partial result)
    sim = ProcPlan("sim", sim_argv, {}, f"http://127.0.0.1:{port}/health", None, SIM_START_S)
    sup = Supervisor(folder)
    try:
        sup.wait_healthy(sup.start(sim), sim.health, SIM_START_S)
        replay = _kvtier() + [
            "replay",
            "--base-url",
            f"http://127.0.0.1:{port}/v1",
            "--model",
            "m",
            "--dataset",
            g.dataset,
            "--dataset-format",
            g.dataset_format,
            "--concurrency",
            str(p.concurrency),
            "--num-rounds",
            str(g.num_rounds),
            "--output",
            str(folder),
            "--progress",
            "none",
            "--warmup",
            "0",
            *(["--max-tokens-cap", str(g.max_tokens_cap)] if g.max_tokens_cap else []),
            *(["--duration", f"{g.duration_s:g}"] if g.duration_s else []),
            *g.replay_args,
        ]
        rc = sup.start(ProcPlan("replay", replay, {}, "", None, 0.0)).popen.wait()  # its log: replay.log
    except KeyboardInterrupt:
        interrupted, rc = True, 130
    else:
        interrupted = False
    finally:
        sup.stop_all()
        shutil.rmtree(nvme, ignore_errors=True)
    status = _replay_status(folder)
    err = None if status is not None else f"kvtier replay exited with status {rc} and no result; log {rel}/replay.log"
    t = SweepTrial(**base, status=status or "failed", reused=False, wall_s=round(time.monotonic() - t0, 3), error=err)
    if interrupted:  # the replay, stopped by SIGTERM, wrote what it had: the trial is kept as its result says
        raise SweepInterrupted(t)
    return t


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl+C during a trial; ``trial`` is what that trial left."""

    def __init__(self, trial: SweepTrial) -> None:
        super().__init__()
        self.trial = trial


def run_sweep(g: SweepGrid, out: Path, say: Callable[[str], None] = lambda s: None) -> SweepResult:
    """Every trial of the grid within the budget, sweep.json rewritten after each (module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    Path(g.nvme_dir).mkdir(parents=True, exist_ok=True)
    started, t0 = utc_now(), time.monotonic()
    todo = [(p, k) for p in grid_points(g) for k in range(g.trials)]
    done: list[SweepTrial] = []
    stop = StopReason(code=StopCode.grid_finished, message="every trial of the grid ran")
    ran: list[float] = []

    def result(final: bool) -> SweepResult:
        left = [
            SweepTrial(
                point=p.name,
                cpu_gb=p.cpu_gb,
                nvme_gb=p.nvme_gb,
                concurrency=p.concurrency,
                trial=k,
                path=f"{p.name}/trial-{k}",
                status="not-run",
                reused=False,
                wall_s=None,
                sim_argv=[],
            )
            for p, k in todo[len(done) :]
        ]
        trials = done + left
        bad = [t for t in trials if t.status != "complete"]
        status = Status.complete if final and not bad and stop.code == StopCode.grid_finished else Status.partial
        if final and done and all(t.status == "failed" for t in done):
            status = Status.failed
        warnings = []
        if bad:
            warnings.append(
                warning(
                    WarningCode.run_not_complete,
                    f"{len(bad)} of {len(trials)} trials are not complete: "
                    + ", ".join(f"{t.path} {t.status}" for t in bad[:8]),
                    trials=len(bad),
                )
            )
        return SweepResult(
            status=status if final else Status.partial,
            stop_reason=stop if final else StopReason(code=StopCode.running, message="the sweep is running"),
            started_at=iso(started),
            finished_at=iso(utc_now()),
            host=collect_host({"output": str(out)}),
            warnings=warnings,
            grid=g,
            trials=trials,
            wall_s=round(time.monotonic() - t0, 3),
        )

    try:
        for i, (p, k) in enumerate(todo):
            if g.budget_s and ran:
                mean = sum(ran) / len(ran)
                if time.monotonic() - t0 + mean > g.budget_s:
                    stop = StopReason(
                        code=StopCode.budget,
                        message=f"--budget {g.budget_s:g} s: {len(todo) - i} trials left at {mean:.1f} s each",
                    )
                    break
            t = run_trial(g, p, k, out)
            done.append(t)
            if t.wall_s is not None:
                ran.append(t.wall_s)
            say(
                f"{p.name} trial {k}: {t.status}{' (kept from an earlier run)' if t.reused else ''}"
                + (f" in {t.wall_s:.1f} s" if t.wall_s is not None else "")
            )
            write_json(result(final=False), out / "sweep.json")
    except KeyboardInterrupt as e:
        if isinstance(e, SweepInterrupted):
            done.append(e.trial)
        stop = StopReason(code=StopCode.interrupted, message="interrupted: the trials not run are listed as not-run")
    final = result(final=True)
    write_json(final, out / "sweep.json")
    return final


__all__ = ["Point", "grid_points", "run_sweep", "run_trial", "MIN_STAGING_GB"]
