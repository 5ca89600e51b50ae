"""``kvtier sim`` and ``kvtier cache-server``: parse the flags (SimConfig / CacheServerConfig), serve."""

from __future__ import annotations

import argparse
import sys

from kvtier.cli.args import add_config_arguments, config_from_args
from kvtier.config.sim import CacheServerConfig, SimConfig


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


def run_cache_server(args: argparse.Namespace) -> int:
    import logging
    import signal
    import time

    from kvtier.results.io import write_text_atomic
    from kvtier.vllm.blockserver import BlockServer
    from kvtier.vllm.settings import VllmOffloadSettings

    cfg = config_from_args(args, CacheServerConfig)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = BlockServer(VllmOffloadSettings.of_tier_config(cfg, cfg.offload), cfg.socket, cfg.host, cfg.port)
    bound = server.start()
    stopping: list[int] = []  # the handlers only append: no lock is taken inside a signal handler
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    try:
        print(
            f"kvtier cache-server: {cfg.offload} tier on {cfg.socket} (health/metrics http://{cfg.host}:{bound})",
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
