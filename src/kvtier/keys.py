"""Canonical, versioned cache keys for KV chunks.

A key identifies KV bytes, so it must change whenever anything that changes those bytes (or who
may read them) changes: the tokens (through a prefix-chained chunk hash), the model and its
revision, the tokenizer revision, the KV dtype, the attention layout, the parallel layout
(world size and this rank), the object group (e.g. a layer group or K/V split), the chunk size, and
a cache salt that scopes a tenant.

Encoding: every field is written as ``<length>:<utf-8 bytes>`` (netstring-like) into a blake2b
hash, so no choice of field values can make two different field tuples encode alike
("a" + "b:c" and "a:b" + "c" differ). The key is ``kvt<version>_<model slug>_<64 hex>``: only
``[a-z0-9_-]``, no dots or slashes, so it is safe as a file name.

Prefix-chained chunk hashes: chunk i's hash covers chunk i's token ids *and* chunk i-1's hash, so
equal hashes mean equal whole prefixes (what vLLM's block hashes and LMCache's chunk keys do).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

KEY_VERSION = 1
_ROOT = b"kvtier-prefix-root-v1"


def _field(h: hashlib.blake2b, value: object) -> None:
    """Length-prefixed (netstring-like) field: no two field sequences encode alike."""
    data = value if isinstance(value, bytes) else str(value).encode("utf-8")
    h.update(str(len(data)).encode())
    h.update(b":")
    h.update(data)


def chain_hash(parent: bytes | None, parts: Iterable[bytes | str]) -> bytes:
    """32-byte hash of one chunk's content ``parts`` chained to its parent's hash (None: the first).

    The one prefix-chaining rule: token ids (``chunk_hash``), a trace's block ids
    (``KeyScope.keys_for_hashes``) and the bench's token segment runs (``workload.layout``) all
    hash through it, so equal hashes mean equal whole prefixes whatever names the content."""
    h = hashlib.blake2b(digest_size=32)
    _field(h, parent if parent is not None else _ROOT)
    for p in parts:
        _field(h, p)
    return h.digest()


def chunk_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """32-byte hash of one chunk of token ids chained to its parent's hash (None for the first chunk)."""
    return chain_hash(parent, (np.asarray(token_ids, dtype="<i8").tobytes(),))


def prefix_chunk_hashes(token_ids: Sequence[int], chunk_size: int, include_partial: bool = False) -> list[bytes]:
    """Chained hashes of consecutive ``chunk_size`` token chunks (the partial tail only if asked)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    hashes: list[bytes] = []
    parent: bytes | None = None
    n = len(token_ids)
    end = n if include_partial else n - n % chunk_size
    for start in range(0, end, chunk_size):
        parent = chunk_hash(parent, token_ids[start : start + chunk_size])
        hashes.append(parent)
    return hashes


def _slug(text: str, most: int = 40, empty: str = "model") -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s[:most].strip("-") or empty


def key_prefix(model_name: str, revision: str | None = None) -> str:
    """What every key of ``model_name`` starts with (of one ``revision`` of it, when given): how ``kvtier cache-server
    flush`` finds a model's blocks, or one weights generation's, among the others'. By the names' slugs: two models
    whose names reduce to the same slug share a prefix."""
    rev = f"r-{_slug(revision, 24, 'rev')}_" if revision else ""
    return f"kvt{KEY_VERSION}_{_slug(model_name)}_{rev}"


@dataclass(frozen=True)
class KeyScope:
    """Everything besides the tokens that decides what a KV chunk's bytes are and who may use them."""

    model_name: str
    model_revision: str = ""
    tokenizer_revision: str = ""
    kv_dtype: str = "float16"
    attention_layout: str = "gqa"
    world_size: int = 1
    kv_rank: int = 0
    object_group: str = "kv"
    chunk_size: int = 256
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.kv_rank < self.world_size:
            raise ValueError(f"kv_rank {self.kv_rank} must be in [0, world_size={self.world_size})")
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {self.chunk_size}")

    def key(self, chunk: bytes) -> str:
        """The storage key of one chunk hash in this scope."""
        h = hashlib.blake2b(digest_size=32)
        _field(h, f"kvtier-key-v{KEY_VERSION}")
        for name, value in asdict(self).items():
            _field(h, name)
            _field(h, value)
        _field(h, chunk)
        return f"{key_prefix(self.model_name, self.model_revision or None)}{h.hexdigest()}"

    def tag(self) -> str:
        """This scope as one name (model slug and a hash of every field): what a shared namespace hashes into
        every key of a writer, so writers of different models, dtypes or layouts never meet under one key."""
        h = hashlib.blake2b(digest_size=16)
        _field(h, f"kvtier-scope-v{KEY_VERSION}")
        for name, value in asdict(self).items():
            _field(h, name)
            _field(h, value)
        return f"{_slug(self.model_name)}-{h.hexdigest()}"

    def keys_for_tokens(self, token_ids: Sequence[int], include_partial: bool = False) -> list[str]:
        return [self.key(c) for c in prefix_chunk_hashes(token_ids, self.chunk_size, include_partial)]

    def keys_for_hashes(self, hashes: Iterable[bytes | int | str]) -> list[str]:
        """Keys for externally given chunk ids (e.g. a trace's hash_ids), chained in order."""
        out: list[str] = []
        parent: bytes | None = None
        for hid in hashes:
            parent = chain_hash(parent, (str(hid),))
            out.append(self.key(parent))
        return out
