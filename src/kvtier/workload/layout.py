"""How a conversation's KV is laid out in the store, and what each turn reads and writes.

Two layouts (``--kv-layout``):

* ``entry`` — the MLPerf reference's semantics. Turn n of a conversation writes one entry
  ``{conversation_id}_turn_{n}`` holding the KV of that turn's *new* context tokens, and before
  its first token reads every earlier turn's entry of the conversation (the reference reloads all
  previous turns) plus, with prefix caching, the shared system prompt's entry
  ``kv_system_{sha256[:16]}``. Decode then re-reads the turn's entry once and once per decode
  batch (``decode.batch_size`` tokens).
* ``chunked`` — what vLLM + LMCache do. The conversation's token sequence (system prompt, then
  each turn's new tokens, which include the previous reply) is cut into fixed chunks of
  ``--kv-chunk-tokens`` (256) tokens keyed by prefix-chained hashes (``kvtier.keys``), so equal
  prefixes — the same system prompt in many conversations, the same history within one — share
  chunks. A turn looks up its cached prefix chunk by chunk and stops at the first miss; the
  missed chunk and all after it are recomputed and written, as are the turn's new full chunks.
  The partial tail chunk is not stored (it is recomputed next turn). Decode reads nothing from
  the offload tiers (the KV being generated stays in GPU memory).

Read amplification = bytes read by a request / bytes of its new context tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvtier.keys import KeyScope, chain_hash

Layout = Literal["entry", "chunked"]


@dataclass(frozen=True, slots=True)
class KVRef:
    """One KV object a request reads or writes."""

    key: str
    tokens: int
    kind: str  # prefix (system prompt) | history | rag | context | trace


def system_prompt_key(prompt_id: str) -> str:
    return f"kv_system_{hashlib.sha256(prompt_id.encode()).hexdigest()[:16]}"


def segment_chunks(
    segments: Sequence[tuple[str, int]], chunk_tokens: int, scope: KeyScope, prefix_segment: str | None = None
) -> list[KVRef]:
    """Keys of the full chunks of a token sequence given as (segment id, length) runs.

    A chunk's hash chains its parent's hash and the (segment id, start, end) runs it covers,
    which is equivalent to hashing the tokens when a segment id names its token content.
    Chunks lying wholly inside ``prefix_segment`` (the system prompt) are of kind "prefix".
    """
    out: list[KVRef] = []
    parent: bytes | None = None
    seg_i, seg_off = 0, 0
    total = sum(n for _, n in segments)
    for _ in range(total // chunk_tokens):
        runs: list[str] = []
        need = chunk_tokens
        only_prefix = True
        while need > 0:
            sid, n = segments[seg_i]
            take = min(need, n - seg_off)
            runs.append(f"{sid}[{seg_off}:{seg_off + take}]")
            only_prefix &= sid == prefix_segment
            seg_off += take
            need -= take
            if seg_off == n:
                seg_i, seg_off = seg_i + 1, 0
        parent = chain_hash(parent, runs)
        out.append(KVRef(scope.key(parent), chunk_tokens, "prefix" if only_prefix else "history"))
    return out


def hash_id_chunks(hash_ids: Sequence[int], input_tokens: int, block_tokens: int, scope: KeyScope) -> list[KVRef]:
    """Keys of a trace request's blocks (Mooncake ``hash_ids``: prefix-aware block ids)."""
    keys = scope.keys_for_hashes(hash_ids)
    refs = []
    for i, k in enumerate(keys):
        tokens = min(block_tokens, input_tokens - i * block_tokens)
        refs.append(KVRef(k, max(tokens, 1), "trace"))
    return refs
