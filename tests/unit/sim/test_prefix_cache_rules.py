"""The simulator's prefix cache follows vLLM's rules where they decide hit rates: the block size, the last
token always computed, and a finished request's blocks freed tail first (its history loses its end first)."""

from __future__ import annotations

import pytest

from kvtier.modelmaker import BOS, CHAT_TEMPLATE, IM_END, IM_START
from kvtier.sim.model import GpuPrefixCache, block_hashes
from kvtier.sim.tokens import render_kvtier_model_chat


def test_a_finished_request_loses_its_tail_blocks_before_its_head():
    cache = GpuPrefixCache(capacity_blocks=6, block_tokens=4)
    a = block_hashes(list(range(16)), 4)  # 4 blocks
    assert cache.acquire(a, 0) == 0
    cache.release(a, 0)
    b = block_hashes(list(range(100, 108)), 4)  # 2 more blocks fit beside a; the next 2 evict
    assert cache.acquire(b, 2) == 0
    assert cache.match(a) == 2  # a's first two blocks stay: the tail went first
    cache.release(b, 2)


def test_making_room_never_evicts_the_blocks_the_request_hits():
    cache = GpuPrefixCache(capacity_blocks=4, block_tokens=4)
    a = block_hashes(list(range(8)), 4)  # 2 blocks, freed first: the oldest in the LRU
    b = block_hashes(list(range(50, 58)), 4)
    for blocks in (a, b):
        assert cache.acquire(blocks, 0) == 0
        cache.release(blocks, 0)
    longer = block_hashes(list(range(16)), 4)  # a's 2 blocks + 2 new: b's must go, not a's
    assert cache.acquire(longer, 0) == 2
    assert cache.match(b) == 0 and cache.match(a) == 2
    assert cache.acquire(block_hashes(list(range(100, 104)), 4), 0) is None  # all 4 pinned: no room, nothing changed
    assert cache.match(longer) == 4


def test_blocks_are_of_the_given_size():
    ids = list(range(300))
    assert len(block_hashes(ids, 128)) == 2 and len(block_hashes(ids, 16)) == 18
    assert block_hashes(ids, 128)[0] != block_hashes(ids, 16)[0]


def test_the_kvtier_model_template_renders_as_the_jinja_template_does():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None}]  # fmt: skip
    want = f"{BOS}{IM_START}system\nbe brief{IM_END}\n{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n{IM_END}\n"
    assert render_kvtier_model_chat(msgs) == want + f"{IM_START}assistant\n"
    jinja2 = pytest.importorskip("jinja2")  # the engine renders the template with Jinja, as transformers does
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders chat templates
    got = env.from_string(CHAT_TEMPLATE).render(messages=msgs, bos_token=BOS, add_generation_prompt=True)
    assert got == render_kvtier_model_chat(msgs)
