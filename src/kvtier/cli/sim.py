"""``kvtier sim`` and ``kvtier cache-server``: parse the flags (SimConfig / CacheServerConfig), serve."""

from __future__ import annotations

import argparse
import sys

from kvtier.cli.args import add_config_arguments, config_from_args
from kvtier.config.sim import CacheFlushConfig, CacheServerConfig, SimConfig
from kvtier.errors import ConfigError


def add_sim_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse's private generic
    p = sub.add_parser("sim", help="simulated OpenAI-compatible server: modelled GPU, real offload tier")
    add_config_arguments(p, SimConfig)
    p.set_defaults(func=run_sim)


def run_sim(args: argparse.Namespace) -> int:
    from kvtier.sim import serve

    serve(config_from_args(args, SimConfig))
    return 0


def add_cache_server_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "cache-server",
        help="one set of offload tiers (CPU RAM, NVMe, Redis, S3) shared over a Unix socket by sim replicas and vLLM "
        "replicas running kvtier's spec",
    )
    add_config_arguments(p, CacheServerConfig)
    p.set_defaults(func=run_cache_server)
    actions = p.add_subparsers(dest="cache_server_action", metavar="{flush}")
    f = actions.add_parser(
        "flush",
        help="drop one model's blocks (or one weights generation's, --revision) from a running cache server",
    )
    add_config_arguments(f, CacheFlushConfig)
    f.set_defaults(func=run_cache_flush)


def run_cache_flush(args: argparse.Namespace) -> int:
    """Ask a running cache server to drop the idle blocks of --model (of --revision only, when given) and say how many;
    blocks in flight are left and counted (run it again once the engines of that generation have stopped)."""
    from kvtier.keys import key_prefix
    from kvtier.vllm import messages as m
    from kvtier.vllm.client import ServerDown, ServerLink
    from kvtier.vllm.settings import VllmOffloadSettings

    cfg = config_from_args(args, CacheFlushConfig)
    where = VllmOffloadSettings.from_extra(
        {"cache_server": cfg.cache_server, "cache_server_token_file": cfg.cache_server_token_file}
    )  # the engines' own checks of the address and the token file
    prefix = key_prefix(cfg.model, cfg.revision)
    link = ServerLink(cfg.cache_server, m.Hello(role="admin", engine="kvtier cache-server flush"), 30.0,
                      token=where.cache_server_token())  # fmt: skip
    try:
        link.open()
        r = link.call(m.Flush(prefix=prefix), m.FlushReply)
    except (OSError, ServerDown) as e:
        raise ConfigError(f"--cache-server {cfg.cache_server}: {e}") from None
    finally:
        link.close()
    gen = f" revision {cfg.revision!r}" if cfg.revision else " (every revision)"
    print(f"flushed {r.dropped} blocks of {cfg.model!r}{gen} (keys {prefix}*); {r.busy} in flight left")
    return 0


def run_cache_server(args: argparse.Namespace) -> int:
    import logging
    import signal
    import time

    from kvtier.results.io import write_text_atomic
    from kvtier.vllm import messages as m
    from kvtier.vllm.blockserver import BlockServer
    from kvtier.vllm.settings import VllmOffloadSettings

    cfg = config_from_args(args, CacheServerConfig)
    if cfg.world_size != 1 and cfg.block_bytes is None:
        raise ConfigError("--world-size: sizes the slots with --block-bytes; give both or neither")
    listen, token = _listen_and_token(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = VllmOffloadSettings.of_tier_config(cfg, cfg.offload)
    slot = None if cfg.block_bytes is None else m.BlockGeometry(cfg.block_bytes, 1, cfg.world_size)
    server = BlockServer(settings, cfg.socket, cfg.host, cfg.port, listen, token, slot, cfg.keys_per_s)
    bound = server.start()
    stopping: list[int] = []  # the handlers only append: no lock is taken inside a signal handler
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    try:
        where = [*([cfg.socket] if cfg.socket else []), *([f"tcp port {server.listen_port}"] if listen else [])]
        print(
            f"kvtier cache-server: {cfg.offload} tier on {' and '.join(where)} (health/metrics http://{cfg.host}:{bound})",
            file=sys.stderr,
            flush=True,
        )
        if cfg.port_file:
            write_text_atomic(cfg.port_file, f"{bound}\n", "--port-file")
        while not stopping:
            time.sleep(0.2)
    finally:
        server.close()
    return 0


def _listen_and_token(cfg: CacheServerConfig) -> tuple[tuple[str, int] | None, bytes | None]:
    """--listen as (host, port) and --token-file's token, each checked before anything starts."""
    from kvtier.vllm.protocol import read_token, tcp_address

    listen = None
    if cfg.listen is not None:
        try:
            listen = tcp_address(f"tcp://{cfg.listen}", listen=True)
        except ValueError:
            raise ConfigError(f"--listen {cfg.listen!r}: HOST:PORT (an IPv6 host in brackets)") from None
    if cfg.token_file is None:
        return listen, None
    try:
        return listen, read_token(cfg.token_file, "--token-file")
    except ValueError as e:
        raise ConfigError(str(e)) from None
