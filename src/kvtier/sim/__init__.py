"""kvtier sim: a simulated OpenAI-compatible server whose offload tier is the real kvtier engine.

Library use::

    from kvtier.config import SimConfig
    from kvtier.sim import serve

    serve(SimConfig(preset="h100-llama3.1-8b", offload="cpu", port=8000))  # until SIGINT/SIGTERM

``start_sim`` (async) binds and returns the running server instead, for embedding and tests;
``serve_cache`` / ``start_cache_server`` do the same for ``kvtier cache-server``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.config.sim import CacheServerConfig, SimConfig
    from kvtier.sim.servers import RunningServer, RunningSim


def serve(config: SimConfig) -> None:
    """Run the simulated server until SIGINT/SIGTERM."""
    from kvtier.sim.servers import serve as _serve

    _serve(config)


def serve_cache(config: CacheServerConfig) -> None:
    """Run the cache server until SIGINT/SIGTERM."""
    from kvtier.sim.servers import serve_cache as _serve_cache

    _serve_cache(config)


async def start_sim(config: SimConfig) -> RunningSim:
    from kvtier.sim.servers import start_sim as _start

    return await _start(config)


async def start_cache_server(config: CacheServerConfig) -> RunningServer:
    from kvtier.sim.servers import start_cache_server as _start

    return await _start(config)


__all__ = ["serve", "serve_cache", "start_sim", "start_cache_server"]
