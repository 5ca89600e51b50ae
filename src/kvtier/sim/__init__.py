"""kvtier sim: a simulated OpenAI-compatible server whose offload tier is the real kvtier engine.

Library use::

    from kvtier.config import SimConfig
    from kvtier.sim import serve

    serve(SimConfig(preset="h100-llama3.1-8b", offload="cpu", port=8000))  # until SIGINT/SIGTERM

``start_sim`` (async) binds and returns the running server instead, for embedding and tests. Its offload tier is
in process, or a shared ``kvtier cache-server`` (vllm/blockserver.py, the one cache server) reached by
sim/remote.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.config.sim import SimConfig
    from kvtier.sim.servers import RunningSim


def serve(config: SimConfig) -> None:
    """Run the simulated server until SIGINT/SIGTERM."""
    from kvtier.sim.servers import serve as _serve

    _serve(config)


async def start_sim(config: SimConfig) -> RunningSim:
    from kvtier.sim.servers import start_sim as _start

    return await _start(config)


__all__ = ["serve", "start_sim"]
