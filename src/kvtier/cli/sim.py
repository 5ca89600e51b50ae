"""``kvtier sim``: run the simulated OpenAI-compatible server until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kvtier.errors import ConfigError


def load_presets() -> dict[str, dict[str, Any]]:
    text = resources.files("kvtier.sim").joinpath("presets.yaml").read_text()
    return yaml.safe_load(text)


def run_loop(coro: Any, kind: str) -> None:
    """Run a server's main coroutine on uvloop when installed (--event-loop auto), else asyncio."""
    from kvtier.replay.client import event_loop_kind, loop_factory  # noqa: PLC0415

    with asyncio.Runner(loop_factory=loop_factory(event_loop_kind(kind))) as runner:
        runner.run(coro)


async def serve_until_signal(port_file: str | None, port: int) -> None:
    """Announce the port (for scripts and tests), then wait for SIGINT or SIGTERM."""
    if port_file:
        Path(port_file).write_text(f"{port}\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def add_tier_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--cpu-offload-gb", type=float, default=4.0)
    a("--nvme-dir", help="directory of the NVMe offload tier")
    a("--nvme-offload-gb", type=float, default=8.0)
    a("--staging-gb", type=float, default=0.5, help="CPU staging tier in front of NVMe, GB")
    a("--direct-io", choices=["auto", "on", "off"], default="auto")


def make_offload(args: argparse.Namespace, model: Any) -> Any:
    """The in-process offload tier for --offload cpu|nvme (flags checked here)."""
    from kvtier.sim.model import Offload, OffloadConfig  # noqa: PLC0415

    if args.offload == "nvme" and (not args.nvme_dir or not Path(args.nvme_dir).is_dir()):
        raise ConfigError(f"--nvme-dir: give an existing directory for --offload nvme (got {args.nvme_dir!r})")
    return Offload(OffloadConfig(args.offload, args.cpu_offload_gb, args.nvme_dir, args.nvme_offload_gb,
                                 args.staging_gb, 256, args.direct_io), scope_for(model), model.kv_bytes_per_token,
                   args.seed)


def scope_for(model: Any) -> Any:
    from kvtier.keys import KeyScope  # noqa: PLC0415

    return KeyScope(model_name=model.key, kv_dtype=model.dtype, attention_layout=model.attention, chunk_size=256)


def add_sim_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("sim", help="simulated OpenAI-compatible server: modelled GPU, real offload tier")
    a = p.add_argument
    a("--preset", default="h100-llama3.1-8b", help="latency preset from sim/presets.yaml (default h100-llama3.1-8b)")
    a("--model", help="catalog model whose KV bytes per token size the caches (default: the preset's)")
    a("--served-model-name", help="name clients send as 'model' (default: --model)")
    a("--gpu-kv-gb", type=float, help="GPU memory for KV cache, GB")
    a("--prefill-tps", type=float, help="prefill throughput, tokens/s")
    a("--tpot-ms", type=float, help="time per output token of a lone sequence, ms")
    a("--prefill-overhead-ms", type=float, help="fixed cost per prefill, ms")
    a("--batch-slowdown", type=float, help="TPOT grows by this fraction per extra running sequence")
    a("--max-num-seqs", type=int, default=256, help="running sequences at most (default 256)")
    a("--offload", choices=["none", "cpu", "nvme", "remote"], default="none",
      help="remote: the shared tier of a kvtier cache-server (--cache-server SOCKET)")
    a("--cache-server", help="Unix socket of a kvtier cache-server, for --offload remote")
    add_tier_flags(p)
    a("--host", default="127.0.0.1")
    a("--event-loop", choices=["auto", "uvloop", "asyncio"], default="auto", help="uvloop when installed (auto)")
    a("--port", type=int, default=8000, help="0 = any free port (printed)")
    a("--port-file", help="write the bound port here once the server accepts requests")
    a("--replica-id", help="value of the x-kvtier-replica header (default host:port)")
    a("--seed", type=int, default=0)
    p.set_defaults(func=run_sim)


def run_sim(args: argparse.Namespace) -> int:
    from aiohttp import web  # noqa: PLC0415

    from kvtier.modelspec import build_catalog, resolve_model  # noqa: PLC0415
    from kvtier.sim.model import RemoteOffload  # noqa: PLC0415
    from kvtier.sim.server import SimEngine, SimSettings, make_app  # noqa: PLC0415

    presets = load_presets()
    if args.preset not in presets:
        raise ConfigError(f"--preset: unknown preset {args.preset!r} (known: {', '.join(sorted(presets))})")
    pr = presets[args.preset]
    model = resolve_model(args.model or pr["model"], build_catalog())

    def pick(name: str) -> float:
        v = getattr(args, name)
        v = pr[name] if v is None else v
        if v is None or v < 0 or (name in ("gpu_kv_gb", "prefill_tps") and v <= 0):
            raise ConfigError(f"--{name.replace('_', '-')}: must be > 0, got {v}")
        return float(v)

    if args.max_num_seqs < 1:
        raise ConfigError("--max-num-seqs: must be >= 1")
    offload: Any = None
    if args.offload == "remote":
        if not args.cache_server:
            raise ConfigError("--offload remote: give --cache-server SOCKET (the Unix socket of kvtier cache-server)")
        offload = RemoteOffload(args.cache_server, scope_for(model), model.kv_bytes_per_token)
    elif args.offload != "none":
        offload = make_offload(args, model)

    async def main() -> None:
        settings = SimSettings(model, args.served_model_name or args.model or pr["model"], pick("gpu_kv_gb"),
                               pick("prefill_tps"), pick("tpot_ms"), pick("prefill_overhead_ms"),
                               pick("batch_slowdown"), args.max_num_seqs, args.replica_id or "", args.seed)
        runner = None
        if isinstance(offload, RemoteOffload):
            await offload.connect()
        try:
            # the replica id defaults to host:port, known only after binding
            engine = SimEngine(settings, offload)
            app = make_app(engine)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, args.host, args.port)
            await site.start()
            port = runner.addresses[0][1]
            if not args.replica_id:
                object.__setattr__(engine.s, "replica_id", f"{args.host}:{port}")
            print(f"kvtier sim: {engine.s.served_model_name} on http://{args.host}:{port}/v1 "
                  f"(replica {engine.s.replica_id}, GPU {engine.gpu.capacity} blocks, offload {args.offload}, "
                  f"tokenizer {engine.tokenizer})", file=sys.stderr, flush=True)
            await serve_until_signal(args.port_file, port)
        finally:
            if runner is not None:
                await runner.cleanup()
            if offload is not None:
                await offload.aclose()

    try:
        run_loop(main(), args.event_loop)
    except OSError as e:
        raise ConfigError(f"--port: cannot listen on {args.host}:{args.port}: {e.strerror}") from e
    finally:
        if offload is not None:
            offload.close()
    return 0


def add_cache_server_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("cache-server", help="one offload tier (CPU RAM or NVMe) shared by sim replicas over a Unix socket")
    a = p.add_argument
    a("--model", default="llama3.1-8b", help="catalog model whose KV bytes per token size the chunks")
    a("--offload", choices=["cpu", "nvme"], default="cpu")
    add_tier_flags(p)
    a("--socket", required=True, help="Unix socket path for the data API (replicas: --cache-server PATH)")
    a("--host", default="127.0.0.1", help="address of /health and /metrics")
    a("--event-loop", choices=["auto", "uvloop", "asyncio"], default="auto", help="uvloop when installed (auto)")
    a("--port", type=int, default=0, help="TCP port of /health and /metrics (0 = any free port)")
    a("--port-file", help="write the TCP port here once the server accepts requests")
    a("--seed", type=int, default=0)
    p.set_defaults(func=run_cache_server)


def run_cache_server(args: argparse.Namespace) -> int:
    from aiohttp import web  # noqa: PLC0415

    from kvtier.modelspec import build_catalog, resolve_model  # noqa: PLC0415
    from kvtier.sim.cacheserver import make_cache_app  # noqa: PLC0415

    model = resolve_model(args.model, build_catalog())
    sock = Path(args.socket)
    if not sock.parent.is_dir():
        raise ConfigError(f"--socket: directory {sock.parent} does not exist")
    if sock.exists():
        if not sock.is_socket():
            raise ConfigError(f"--socket: {sock} exists and is not a socket")
        sock.unlink()  # a stale socket of an earlier run
    offload = make_offload(args, model)

    async def main() -> None:
        runner = web.AppRunner(make_cache_app(offload, str(sock)), access_log=None)
        await runner.setup()
        try:
            await web.UnixSite(runner, str(sock)).start()
            await web.TCPSite(runner, args.host, args.port).start()
            port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
            print(f"kvtier cache-server: {args.offload} tier for {model.key} on {sock} (health/metrics "
                  f"http://{args.host}:{port})", file=sys.stderr, flush=True)
            await serve_until_signal(args.port_file, port)
        finally:
            await runner.cleanup()

    try:
        run_loop(main(), args.event_loop)
    except OSError as e:
        raise ConfigError(f"cache-server: cannot listen ({e})") from e
    finally:
        offload.close()
        if sock.is_socket():
            sock.unlink()
    return 0
