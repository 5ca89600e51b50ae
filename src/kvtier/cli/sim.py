"""``kvtier sim`` and ``kvtier cache-server``: parse the flags (SimConfig / CacheServerConfig), serve."""

from __future__ import annotations

import argparse

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
        "cache-server", help="one offload tier (CPU RAM or NVMe) shared by sim replicas over a Unix socket"
    )
    add_config_arguments(p, CacheServerConfig)
    p.set_defaults(func=run_cache_server)


def run_cache_server(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, CacheServerConfig)
    if cfg.serve == "vllm":  # vLLM replicas' kvtier spec: kvtier/vllm/blockserver.py
        from kvtier.vllm.blockserver import serve as serve_blocks
        from kvtier.vllm.settings import VllmOffloadSettings

        serve_blocks(
            VllmOffloadSettings.of_tier_config(cfg, cfg.offload), cfg.socket, cfg.host, cfg.port, cfg.port_file
        )
        return 0
    from kvtier.sim import serve_cache

    serve_cache(cfg)
    return 0
