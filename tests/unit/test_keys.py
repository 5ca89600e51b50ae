"""Cache keys: deterministic, sensitive to every field, unambiguous, safe as file names."""

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.keys import KeyScope, chunk_hash, prefix_chunk_hashes

BASE = KeyScope(
    model_name="meta-llama/Llama-3.1-8B",
    model_revision="abc",
    tokenizer_revision="t1",
    kv_dtype="bfloat16",
    attention_layout="gqa",
    world_size=2,
    kv_rank=1,
    object_group="kv",
    chunk_size=256,
    cache_salt="tenant-a",
)
CHUNK = chunk_hash(None, [1, 2, 3])
SAFE = re.compile(r"^[a-z0-9_-]+$")


def test_identical_inputs_identical_keys():
    assert BASE.key(CHUNK) == dataclasses.replace(BASE).key(chunk_hash(None, [1, 2, 3]))


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_name", "meta-llama/Llama-3.1-70B"),
        ("model_revision", "abd"),
        ("tokenizer_revision", "t2"),
        ("kv_dtype", "fp8"),
        ("attention_layout", "mla"),
        ("world_size", 4),
        ("kv_rank", 0),
        ("object_group", "k"),
        ("chunk_size", 128),
        ("cache_salt", "tenant-b"),
    ],
)
def test_every_field_changes_the_key(field, value):
    assert dataclasses.replace(BASE, **{field: value}).key(CHUNK) != BASE.key(CHUNK)


def test_tokens_change_the_key_and_prefixes_chain():
    a = prefix_chunk_hashes(list(range(1000)), 256)
    b = prefix_chunk_hashes(list(range(999)) + [7], 256)
    c = prefix_chunk_hashes([0] + list(range(1, 1000)), 256)
    assert len(a) == 3  # partial tail excluded by default
    assert a == c
    assert a[:3] == b[:3]  # differs only in the partial tail
    d = prefix_chunk_hashes([5] + list(range(1, 1000)), 256)
    assert all(x != y for x, y in zip(a, d)), "a change in chunk 0 changes every later hash"
    assert len(prefix_chunk_hashes(list(range(1000)), 256, include_partial=True)) == 4


def test_no_delimiter_ambiguity():
    x = dataclasses.replace(BASE, model_revision="a", tokenizer_revision="b:c")
    y = dataclasses.replace(BASE, model_revision="a:b", tokenizer_revision="c")
    z = dataclasses.replace(BASE, model_revision="ab", tokenizer_revision="")
    assert len({x.key(CHUNK), y.key(CHUNK), z.key(CHUNK)}) == 3
    assert chunk_hash(None, [12, 3]) != chunk_hash(None, [1, 23])


@given(name=st.text(min_size=0, max_size=60), salt=st.text(max_size=30), rev=st.text(max_size=20))
def test_keys_are_safe_file_names(name, salt, rev):
    k = KeyScope(model_name=name, cache_salt=salt, model_revision=rev).key(CHUNK)
    assert SAFE.match(k) and ".." not in k and "/" not in k and len(k) < 200


def test_trace_hash_ids_chain():
    s = KeyScope(model_name="m", chunk_size=512)
    a = s.keys_for_hashes([46, 47, 48])
    b = s.keys_for_hashes([46, 47, 99])
    c = s.keys_for_hashes([45, 47, 48])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c))


def test_bad_scope():
    with pytest.raises(ValueError):
        KeyScope(model_name="m", world_size=2, kv_rank=2)
    with pytest.raises(ValueError):
        KeyScope(model_name="m", chunk_size=0)
