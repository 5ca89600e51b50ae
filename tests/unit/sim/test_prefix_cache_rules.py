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
    held: list = []
    assert cache.match(a) == 0 and cache.grow(held, a, 4)
    cache.free(held)
    b = block_hashes(list(range(100, 108)), 4)  # 2 blocks and 2 being filled: 2 fit beside a, 2 evict
    held_b: list = []
    assert cache.grow(held_b, b, 4) and held_b[2:] == [None, None]
    assert cache.match(a) == 2  # a's first two blocks stay: the tail went first
    cache.free(held_b)


def test_making_room_never_evicts_the_blocks_the_request_hits():
    cache = GpuPrefixCache(capacity_blocks=4, block_tokens=4)
    a = block_hashes(list(range(8)), 4)  # 2 blocks, freed first: the oldest in the LRU
    b = block_hashes(list(range(50, 58)), 4)
    for blocks in (a, b):
        held: list = []
        assert cache.grow(held, blocks, 2)
        cache.free(held)
    longer = block_hashes(list(range(16)), 4)  # a's 2 blocks + 2 new: b's must go, not a's
    held_l: list = []
    assert cache.match(longer) == 2 and cache.grow(held_l, longer, 4)
    assert cache.match(b) == 0 and cache.match(a) == 2
    other: list = []
    assert not cache.grow(other, block_hashes(list(range(100, 104)), 4), 1) and other == []  # all 4 held
    assert cache.match(longer) == 4


def test_blocks_taken_chunk_by_chunk_are_cached_as_they_are_taken():
    """vLLM registers a block when its chunk is scheduled: a second request hits only what the first holds."""
    cache = GpuPrefixCache(capacity_blocks=16, block_tokens=4)
    keys = block_hashes(list(range(32)), 4)  # 8 blocks
    first: list = []
    assert cache.grow(first, keys, 3)  # the first chunk: 3 blocks
    assert cache.match(keys) == 3
    assert cache.grow(first, keys, 8)
    assert cache.match(keys) == 8 and cache.used_blocks == 8
    second: list = []
    assert cache.grow(second, keys, 8) and cache.used_blocks == 8  # shared, not copied


def test_the_admission_gate_counts_the_whole_sequence_less_what_it_shares():
    cache = GpuPrefixCache(capacity_blocks=6, block_tokens=4)
    keys = block_hashes(list(range(16)), 4)
    running: list = []
    assert cache.grow(running, keys, 4)  # 4 of 6 held
    assert cache.admissible(keys, 4, 6)  # a 6-block sequence sharing those 4 needs 2: free
    assert not cache.admissible(block_hashes(list(range(50, 66)), 4), 0, 4)  # 4 unshared: only 2 free
    cache.free(running)  # now cached, held by none: hits on them still take free blocks
    assert cache.admissible(keys, 4, 6) and not cache.admissible(keys, 4, 7)


def test_a_block_filled_while_decoding_is_cached_and_takes_room():
    cache = GpuPrefixCache(capacity_blocks=3, block_tokens=4)
    held: list = []
    prompt = block_hashes(list(range(4)), 4)
    assert cache.grow(held, prompt, 2) and held[1] is None  # the prompt's block, and one being filled
    cache.seal(held, 1, b"gen:1")
    cache.free(held)
    assert cache.match([prompt[0], b"gen:1"]) == 2  # both cached: the generated one takes LRU room too
    other: list = []
    assert cache.grow(other, block_hashes(list(range(40, 48)), 4), 2)  # 1 never-used + the LRU's oldest
    assert cache.match([b"gen:1"]) == 0 and cache.match(prompt) == 1  # freed tail first: the generated block went


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
