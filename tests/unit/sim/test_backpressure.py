"""A streaming client that does not read pauses its sequence (the server buffers at most a bound for
it) instead of decoding ahead into memory; when it reads again every token still arrives."""

from __future__ import annotations

import asyncio

from kvtier.config import SimConfig
from kvtier.sim.server import SimEngine
from kvtier.sim.servers import resolve_settings


def run_sequence(replies: list[bool | None], max_tokens: int) -> tuple[int, list[int], SimEngine]:
    """Decode ``max_tokens`` with an emit that answers ``replies`` in turn (then True); returns the
    tokens sent, the indices emit was called with, and the engine."""
    engine = SimEngine(resolve_settings(SimConfig(preset="cpu-test", tpot_ms=0.1)), None)
    calls: list[int] = []

    def emit(i: int) -> bool | None:
        calls.append(i)
        return replies[len(calls) - 1] if len(calls) <= len(replies) else True

    async def main() -> int:
        gen = engine.generate(list(range(40)), max_tokens)
        try:
            await gen.__anext__()
            _, n = await gen.asend(emit)
            return int(n)
        finally:
            await gen.aclose()

    return asyncio.run(main()), calls, engine


def test_a_paused_client_gets_every_token_once_it_reads():
    n, calls, engine = run_sequence([None] * 30, 10)
    assert n == 10  # token 0 with the prefill, 1..9 after the pause: none lost
    assert calls[:31] == [1] * 31 and calls[31:] == list(range(2, 10))  # token 1 waited, then the rest in order
    assert engine.running == 0 and engine.gpu.used_blocks == 0


def test_a_client_that_is_gone_stops_the_decoding():
    n, calls, engine = run_sequence([True, True, False], 1000)
    assert n == 3 and calls == [1, 2, 3]
    assert engine.running == 0 and engine.gpu.used_blocks == 0
