"""The sim's scheduler follows vLLM 0.32's (v1/core/sched): no blocks are reserved for tokens not yet generated,
a request that needs a block when none is free preempts the latest-started one (whose blocks are freed and
which computes its sequence anew when it starts again), the queue is first come, first served, and a long
prompt takes its blocks chunk by chunk."""

from __future__ import annotations

import asyncio

from kvtier.config import SimConfig
from kvtier.sim.server import SimEngine
from kvtier.sim.servers import resolve_settings


def engine(**kw: object) -> SimEngine:
    cfg = SimConfig(**{"preset": "cpu-test", "tpot_ms": 0.2, "prefill_tps": 1e7, "block_tokens": 16, **kw})
    return SimEngine(resolve_settings(cfg), None)


async def one(e: SimEngine, prompt: list[int], max_tokens: int, order: list[str], name: str) -> int:
    gen = e.generate(prompt, max_tokens)
    try:
        _, info = await gen.__anext__()
        order.append(name)
        _, n = await gen.asend(None)
        return int(n)
    finally:
        await gen.aclose()


def metric(e: SimEngine, name: str) -> float:
    return sum(s.value for m in e.metrics.registry.collect() for s in m.samples if s.name == name)


def test_decoding_past_the_free_blocks_preempts_the_latest_request_and_both_finish():
    """Two requests of 4 blocks each start on 12 blocks (nothing is reserved for their 100 tokens each); when
    decode runs out, the later one is preempted, the first finishes, the later computes anew and finishes."""
    e = engine(gpu_kv_tokens=13 * 16)  # 12 blocks after vLLM's null block

    async def main() -> list[int]:
        order: list[str] = []
        a = list(range(60))
        b = list(range(1000, 1060))
        return await asyncio.gather(one(e, a, 100, order, "a"), one(e, b, 100, order, "b"))

    assert asyncio.run(main()) == [100, 100]
    assert metric(e, "vllm:num_preemptions_total") >= 1
    assert e.running == 0 and e.waiting == 0 and e.gpu.used_blocks == 0


def test_the_queue_is_first_come_first_served():
    """A request whose sequence does not fit waits, and a small one behind it waits too (vLLM stops at the
    head of its waiting queue)."""
    e = engine(gpu_kv_tokens=9 * 16, tpot_ms=20)  # 8 blocks; the first request decodes for 0.4 s

    async def main() -> list[str]:
        order: list[str] = []

        async def until(cond) -> None:  # type: ignore[no-untyped-def]
            while not cond():
                await asyncio.sleep(0.001)

        big = asyncio.ensure_future(one(e, list(range(100)), 21, order, "running"))  # 7 blocks, then 8
        await until(lambda: e.running == 1)
        late_big = asyncio.ensure_future(one(e, list(range(500, 600)), 2, order, "big"))
        await until(lambda: e.waiting == 1)
        small = asyncio.ensure_future(one(e, list(range(900, 910)), 2, order, "small"))
        await until(lambda: e.waiting == 2 or "big" in order)
        both_waited = e.waiting == 2 and e.running == 1  # the small one fits in the 1 free block, yet waits
        await asyncio.gather(big, late_big, small)
        return [*order, str(both_waited)]

    assert asyncio.run(main()) == ["running", "big", "small", "True"]


def test_a_long_prompt_takes_its_blocks_chunk_by_chunk():
    """With 64-token chunks, a 200-token prompt holds 4, 8, 12 then 13 blocks as its prefill goes on."""
    e = engine(gpu_kv_tokens=64 * 16, max_num_batched_tokens=64)
    grown: list[int] = []
    grow = e.gpu.grow

    def recording(held, keys, upto):  # type: ignore[no-untyped-def]
        ok = grow(held, keys, upto)
        grown.append(len(held))
        return ok

    e.gpu.grow = recording  # type: ignore[method-assign]
    asyncio.run(one(e, list(range(200)), 1, [], "x"))
    steps = [n for i, n in enumerate(grown) if i == 0 or grown[i - 1] != n]
    assert steps == [4, 8, 12, 13], grown


def test_a_prompt_s_tokens_by_source_add_up():
    """The TTFT decomposition's tokens: the GPU hit, each loaded chunk's tokens past it (the first chunk in
    part, the last token never loaded), the rest recomputed; every prompt token counted once."""
    from kvtier.sim.server import tokens_by_source

    # 1000-token prompt, 300 on the GPU; chunks of 256: chunk 1 (256..511) from cpu, chunk 2 from storage,
    # chunk 3 from cpu; the store's tokens end at 1024 but the prompt's last token is computed: ext = 699
    out = tokens_by_source(1000, 300, 699, ["cpu", "storage", "cpu"], 1, 256)
    assert out == {"gpu": 300, "cpu": (512 - 300) + (999 - 768), "storage": 256, "recomputed": 1}
    assert sum(out.values()) == 1000
    assert tokens_by_source(10, 0, 0, [], 0, 256) == {"gpu": 0, "recomputed": 10}
