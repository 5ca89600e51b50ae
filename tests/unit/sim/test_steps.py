"""The sim's engine runs one step at a time, as vLLM's does (sim/server.py ``_steps``): a prefill shares its step with
the decoding batch and pays ``step_share`` of the batch's step, a decode-only step keeps the engine busy for that
share of it (a prefill arriving later starts at once), and decoding sequences stall while a chunk runs. The times
checked are modelled sleeps: each assertion is on the side a slow host cannot break (a lower bound), or has a margin
of half a second."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from kvtier.config import SimConfig
from kvtier.errors import ConfigError
from kvtier.modelmaker import Geometry, make_model
from kvtier.sim.server import SimEngine
from kvtier.sim.servers import resolve_settings


def engine(share: float, tpot_ms: float, prefill_tps: float = 1e7, **kw: object) -> SimEngine:
    cfg = SimConfig(**{"preset": "cpu-test", "tpot_ms": tpot_ms, "prefill_tps": prefill_tps, "block_tokens": 16})
    s = dataclasses.replace(resolve_settings(cfg), step_share=share, batch_slowdown=0.0, prefill_overhead_ms=0.0, **kw)
    return SimEngine(s, None)


async def decode(e: SimEngine, prompt: list[int], max_tokens: int, stamps: list[float]) -> None:
    gen = e.generate(prompt, max_tokens)
    try:
        await gen.__anext__()

        def emit(_: int) -> bool:
            stamps.append(time.perf_counter())
            return True

        await gen.asend(emit)
    finally:
        await gen.aclose()


async def ttft(e: SimEngine, prompt: list[int], after_s: float) -> float:
    await asyncio.sleep(after_s)
    gen = e.generate(prompt, 1)
    t0 = time.perf_counter()
    try:
        await gen.__anext__()
        return time.perf_counter() - t0
    finally:
        await gen.aclose()


def _ttft_beside_a_batch(share: float, tpot_ms: float) -> float:
    e = engine(share, tpot_ms)

    async def main() -> float:
        stamps: list[float] = []
        bg = asyncio.create_task(decode(e, list(range(32)), 4, stamps))
        t = await ttft(e, list(range(1000, 1032)), tpot_ms / 1e3 * 1.3)  # inside the batch's second step
        await bg
        return t

    return asyncio.run(main())


def test_a_prefill_beside_a_decoding_batch_pays_a_whole_step_when_they_add():
    """share 1 (a CPU: one forward pass computes both): the prefill waits for the step under way, then its own step
    lasts its compute plus the batch's step: at least one step (1 s) in all."""
    assert _ttft_beside_a_batch(1.0, 1000.0) >= 1.0


def test_a_prefill_beside_a_decoding_batch_starts_at_once_when_the_batch_costs_the_engine_nothing():
    """share 0: the batch's steps are all delivery (detokenizing, streaming): a prefill that arrives inside one starts
    its own step at once and its compute is microseconds."""
    assert _ttft_beside_a_batch(0.0, 1000.0) < 0.5


def test_decoding_sequences_stall_while_a_prefill_chunk_runs():
    """A 4,000-token prompt at 4,000 tokens/s is one second of compute in one step: the decoding sequence's next token
    comes after it, not every 20 ms."""
    e = engine(1.0, 20.0, prefill_tps=4000.0, max_num_batched_tokens=8192, gpu_kv_tokens=16 * 400)

    async def main() -> list[float]:
        stamps: list[float] = []
        bg = asyncio.create_task(decode(e, list(range(32)), 40, stamps))
        await asyncio.sleep(0.1)
        await ttft(e, list(range(5000, 9000)), 0.0)
        await bg
        return stamps

    stamps = asyncio.run(main())
    assert max(b - a for a, b in zip(stamps, stamps[1:])) >= 1.0


def test_a_calibrated_sim_counts_its_own_handling_against_the_measured_one():
    """The measured fixed cost and handling (per token and per character) are latency, less what the sim itself
    already spent on the request; a preset has none."""
    e = engine(0.0, 10.0)
    assert e.handling_s(1000, 0.0) == 0.0  # a preset: its fixed cost is engine time
    s = dataclasses.replace(e.s, timing_source="measured", prefill_overhead_ms=10.0, prefill_prompt_s=1e-6,
                            prefill_char_s=2e-7, prompt_chars_per_token=5.0)  # fmt: skip
    m = SimEngine(s, None)
    assert abs(m.handling_s(1000, 0.0, chars=2000) - (0.010 + 0.001 + 0.0004)) < 1e-12
    assert abs(m.handling_s(1000, 0.0) - (0.010 + 0.001 + 0.001)) < 1e-12  # characters as the calibration's text
    assert abs(m.handling_s(1000, 0.004, chars=2000) - 0.0074) < 1e-12
    assert m.handling_s(1000, 1.0, chars=2000) == 0.0
    # handling twice as long while sequences run (a host-bound engine's API server shares its cores)
    h = SimEngine(dataclasses.replace(s, handling_load=1.0), None)
    assert abs(h.handling_s(1000, 0.0, chars=2000) - 0.0114) < 1e-12  # nothing running: as measured alone
    h._running.append(object())  # type: ignore[arg-type]  # one sequence running
    assert abs(h.handling_s(1000, 0.0, chars=2000) - (0.010 + 2 * 0.0014)) < 1e-12


def test_the_twin_of_a_served_folder_holds_its_bytes_per_token(tmp_path: Path) -> None:
    """--hf-config: the sim sizes its caches by a config.json's KV geometry (a kvtier model make folder: 1 KiB a
    token), not a catalog model's; with --model too it is refused."""
    folder = make_model(tmp_path / "m", Geometry())
    s = resolve_settings(SimConfig(preset="cpu-test", hf_config=str(folder)))
    assert s.model.kv_bytes_per_token == Geometry().kv_bytes_per_token == 1024
    with pytest.raises(ConfigError, match="--hf-config"):
        resolve_settings(SimConfig(preset="cpu-test", hf_config=str(folder), model="tiny-1b"))


def test_the_fetch_gate_prices_recompute_with_attention_over_the_prefix():
    """The gate compares a fetch with recomputing the tokens after the GPU's hit at the engine's own rate: with the
    calibration's attention term, recomputing 2,048 tokens after 12,288 held ones is far slower than its linear
    rate (a gate on the linear rate recomputed prefixes kvtier's CPU tier in vLLM loads)."""
    e = engine(0.0, 10.0, prefill_tps=100_000.0)
    assert e.recompute_tps(2048, 12288) == pytest.approx(100_000.0)  # a preset: linear
    m = SimEngine(dataclasses.replace(e.s, prefill_pair_s=3e-9), None)
    slow = 2048 / (2048 / 100_000.0 + 3e-9 * 2048 * (12288 + 1024))
    assert m.recompute_tps(2048, 12288) == pytest.approx(slow) and slow < 100_000.0 / 1.5
