"""``kvtier launch``: start a tier's processes in order, run the replay through them, tear down.

Order: the cache sidecar (CPU/NVMe tiers; exactly one) -> health; every replica -> health; with
``--replicas`` >= 2, Caddy in front -> health through it; then ``kvtier replay`` against Caddy (or
the only replica), scraping every replica's and the sidecar's /metrics; then teardown, also on
failure and Ctrl+C. One result folder: replay/ (requests.jsonl, summary.json), metrics/ (each
process's final /metrics), logs/, launch.json (profile, commands, ports) and the Caddyfile.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, KvtierError, exit_code_for

FORBIDDEN = ("--base-url", "--output", "--metrics-url")


def add_launch_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("launch", help="start a tier's sidecar, replicas and Caddy, run a replay through them, stop",
                       description="kvtier launch --tier gpu|cpu|nvme --engine vllm|sim [--build nvidia|amd] "
                                   "[--replicas N] [--dry-run] --output OUTDIR -- <replay arguments>")
    a = p.add_argument
    a("--tier", choices=["gpu", "cpu", "nvme"], required=True)
    a("--engine", choices=["vllm", "sim"], required=True)
    a("--build", choices=["nvidia", "amd"], default="nvidia")
    a("--replicas", type=int, default=1)
    a("--dry-run", action="store_true", help="print every command, one per line; start nothing")
    a("--output", help="result folder")
    a("--profiles", help="profiles YAML (default: the packaged kvtier/launch/profiles.yaml)")
    a("--nvme-dir", help="folder of the NVMe tier's files (default OUTDIR/nvme)")
    a("--sim-model", help="catalog model that sizes the simulator's KV (default: the profile's sim_model)")
    a("replay_args", nargs=argparse.REMAINDER, help="-- [replay] <replay arguments without --base-url/--output>")
    p.set_defaults(func=run_launch)


def _replay_namespace(args: list[str], base_url: str, output: str, metrics: list[str]) -> argparse.Namespace:
    from kvtier.cli.replay import add_replay_parser  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="kvtier launch -- replay")
    add_replay_parser(parser.add_subparsers(dest="command"))
    extra = ["--base-url", base_url, "--output", output]
    for m in metrics:
        extra += ["--metrics-url", m]
    try:
        return parser.parse_args(["replay", *args, *extra])
    except SystemExit as e:
        raise ConfigError(f"replay arguments after --: {' '.join(args)!r} do not parse (see the message above)") from e


def _split_replay_args(raw: list[str]) -> list[str]:
    args = list(raw)
    if args and args[0] == "--":
        args = args[1:]
    if args and args[0] == "replay":
        args = args[1:]
    for a in args:
        if a.split("=", 1)[0] in FORBIDDEN:
            raise ConfigError(f"replay arguments: {a.split('=', 1)[0]} is set by kvtier launch (it points the replay at "
                              "Caddy or the only replica, and writes into OUTDIR/replay)")
    return args


def _root(url: str) -> str:
    return url[: -len("/metrics")] if url.endswith("/metrics") else url


def _kvtier_argv(argv: list[str]) -> list[str]:
    """Profiles say `kvtier ...`; run it with this interpreter, so the run uses this installation."""
    return [sys.executable, "-m", "kvtier", *argv[1:]] if argv and argv[0] == "kvtier" else argv


def _show(env: dict[str, str], argv: list[str]) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv)])


def run_launch(a: argparse.Namespace) -> int:
    from kvtier.launch.caddy import POLICY, caddy_plan, caddyfile  # noqa: PLC0415
    from kvtier.launch.procs import Supervisor, free_ports  # noqa: PLC0415
    from kvtier.launch.profiles import load_profiles, pick, resolve  # noqa: PLC0415

    if a.replicas < 1:
        raise ConfigError("--replicas: must be >= 1")
    if not a.output and not a.dry_run:
        raise ConfigError("--output: required (the run's result folder)")
    replay_args = _split_replay_args(a.replay_args)
    profiles, source = load_profiles(a.profiles)
    name, profile = pick(profiles, a.engine, a.build, a.tier, source)
    if a.sim_model:
        profile = profile.model_copy(update={"sim_model": a.sim_model})

    out = Path(a.output or "OUTDIR").resolve()
    host = "127.0.0.1"
    ports = free_ports(a.replicas + 4)
    replica_ports, (sidecar_port, sidecar_http_port, lb_port, admin_port) = ports[: a.replicas], ports[a.replicas:]
    sidecar_port = profile.sidecar_port or sidecar_port
    sidecar_http_port = profile.sidecar_http_port or sidecar_http_port
    # short (Unix socket paths are limited to ~108 bytes) and created only when processes start
    sockdir = Path(tempfile.gettempdir()) / f"kvtier-launch-{os.getpid()}-{secrets.token_hex(3)}"
    nvme_dir = Path(a.nvme_dir).resolve() if a.nvme_dir else out / "nvme"
    # the replay's --model names the served model; parse the replay arguments before anything starts
    front = f"http://{host}:{lb_port}" if a.replicas >= 2 else f"http://{host}:{replica_ports[0]}"
    values = {"model": "", "host": host, "workdir": str(out), "sidecar_port": str(sidecar_port),
              "sidecar_http_port": str(sidecar_http_port), "sidecar_socket": str(sockdir / "cache.sock"),
              "nvme_dir": str(nvme_dir)}
    replay_ns = _replay_namespace(replay_args, front + "/v1", str(out / "replay"), [])
    if not replay_ns.model:
        raise ConfigError("replay arguments: --model is required (it is also the served model name)")
    values["model"] = replay_ns.model
    sidecar, replicas = resolve(profile, values, replica_ports)
    metrics_roots = [_root(p.metrics) for p in [*([sidecar] if sidecar else []), *replicas] if p.metrics]
    replay_ns.metrics_url = metrics_roots  # scrape every replica and the sidecar, never Caddy
    cfile = caddyfile(a.tier, lb_port, admin_port, [f"{host}:{p}" for p in replica_ports]) if a.replicas >= 2 else None

    plans = [*([sidecar] if sidecar else []), *replicas]
    commands = [(p.name, p.env, _kvtier_argv(p.argv)) for p in plans]
    cp = caddy_plan(out / "Caddyfile", out / "caddy-home", lb_port) if cfile and not a.dry_run else None
    caddy_cmd = cp.argv if cp else (["caddy", "run", "--config", str(out / "Caddyfile"), "--adapter", "caddyfile"]
                                    if cfile else None)
    replay_cmd = ["kvtier", "replay", *replay_args, "--base-url", front + "/v1", "--output", str(out / "replay"),
                  *[x for m in metrics_roots for x in ("--metrics-url", m)]]
    if a.dry_run:
        print(f"# kvtier launch --dry-run: profile {name} ({source}); ports are examples chosen free now",
              file=sys.stderr)
        for _, env, argv in commands:
            print(_show(env, argv))
        if caddy_cmd:
            print(shlex.join(caddy_cmd))
        print(shlex.join(replay_cmd))
        if cfile:
            print("# Caddyfile:\n" + "\n".join("# " + line for line in cfile.splitlines()), file=sys.stderr)
        return 0

    # the dataset is checked before any process starts (errors name file and line)
    from kvtier.replay.datasets import load_sessions  # noqa: PLC0415

    if not replay_ns.dataset:
        raise ConfigError("replay arguments: --dataset is required")
    load_sessions(replay_ns.dataset, replay_ns.dataset_format)
    out.mkdir(parents=True, exist_ok=True)
    sockdir.mkdir(mode=0o700)
    if a.tier == "nvme":
        nvme_dir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "profile": name, "profile_source": source, "resolved_profile": profile.model_dump(),
        "tier": a.tier, "engine": a.engine, "build": a.build, "replicas": a.replicas,
        "lb_policy": POLICY[a.tier] if cfile else None, "front_url": front,
        "processes": [{"name": n, "env": env, "argv": argv} for n, env, argv in commands],
        "caddy": caddy_cmd, "replay": replay_cmd, "events": [],
        "ports": {"replicas": replica_ports, "sidecar": sidecar_port if sidecar else None,
                  "sidecar_http": sidecar_http_port if sidecar else None, "caddy": lb_port if cfile else None,
                  "caddy_admin": admin_port if cfile else None},
        "endpoints": {p.name: f"{host}:{port}" for p, port in zip(replicas, replica_ports)},
    }
    if cfile:
        (out / "Caddyfile").write_text(cfile)

    def event(what: str) -> None:
        record["events"].append({"t_unix_s": round(time.time(), 3), "event": what})
        print(f"kvtier launch: {what}", file=sys.stderr, flush=True)

    def save_record() -> None:
        (out / "launch.json").write_text(json.dumps(record, indent=2) + "\n")

    sup = Supervisor(out / "logs")

    def on_term(signum: int, frame: Any) -> None:  # noqa: ARG001
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    rc = 1
    try:
        for plan, (_, _, argv) in zip(plans, commands):
            proc = sup.start(plan, argv)
            record.setdefault("pids", {})[plan.name] = proc.popen.pid
            if plan is sidecar:  # exactly one sidecar, healthy before any replica connects to it
                dt = sup.wait_healthy(proc, plan.health, plan.startup_timeout_s)
                event(f"sidecar healthy after {dt:.1f} s ({plan.health})")
        for plan, proc in zip(replicas, sup.procs[len(plans) - len(replicas):]):
            dt = sup.wait_healthy(proc, plan.health, plan.startup_timeout_s)
            event(f"{plan.name} healthy after {dt:.1f} s ({plan.health})")
        if cp is not None:
            proc = sup.start(cp)
            record["pids"]["caddy"] = proc.popen.pid
            dt = sup.wait_healthy(proc, cp.health, cp.startup_timeout_s)
            event(f"caddy healthy after {dt:.1f} s (lb_policy {POLICY[a.tier]}, {front})")
        save_record()
        from kvtier.cli.replay import run_replay  # noqa: PLC0415

        event(f"replay: {shlex.join(replay_cmd)}")
        rc = run_replay(replay_ns)
        signal.signal(signal.SIGTERM, on_term)  # the replay's event loop restored the default handlers
        event(f"replay finished with exit status {rc}")
        _save_metrics(out / "metrics", [p for p in plans if p.metrics])
    except KeyboardInterrupt:
        event("interrupted: tearing down")
        rc = 130
    except KvtierError as e:
        rc = exit_code_for(e)
        record["error"] = str(e)
        raise
    finally:
        # teardown must finish: a second Ctrl+C or SIGTERM is ignored while it runs
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sup.stop_all()
        signal.signal(signal.SIGINT, old_int)
        event("all processes stopped")
        record["exit_status"] = rc
        save_record()
        signal.signal(signal.SIGTERM, old_term)
        shutil.rmtree(sockdir, ignore_errors=True)
    return rc


def _save_metrics(folder: Path, plans: list[Any]) -> None:
    """Each process's final /metrics text, beside the replay's scraped series."""
    folder.mkdir(parents=True, exist_ok=True)
    for p in plans:
        try:
            with urllib.request.urlopen(p.metrics, timeout=10) as r:
                (folder / f"{p.name}.prom").write_bytes(r.read())
        except OSError as e:
            (folder / f"{p.name}.prom").write_text(f"# not reachable at the end of the run: {e}\n")
