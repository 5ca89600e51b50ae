"""What a replay dataset can teach before it runs: how much of its prompts an offload tier could serve.

Each virtual user's turns are tokenized as they will be sent (each message once: role, text content,
tool calls; the chat template's few tokens are not counted) and cut into blocks of ``block_tokens``
(LMCache's chunk, 256 by default). A block is named by the hash of its whole prefix (``keys.chunk_hash``,
the one prefix-chaining rule), so equal names mean equal prefixes. Taking the requests user by user,
turn by turn, each full block is:

* **history reuse**: its prefix was already sent by an earlier request of the *same session* (the
  conversation so far — what multi-turn offload serves);
* **cross-session reuse**: first sent by *another* session (shared system prompts, tool schemas);
* **new**: never sent before (must be prefilled by someone), as is each prompt's partial last block.

Also: the KV bytes of each session's longest prompt at the served model's bytes per token (when the
model is in kvtier's catalog: ``--kv-model``, else ``--model``), and the working set over time — the
distinct blocks sent so far, in tokens and bytes — as the dataset is walked in that order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.keys import chunk_hash
from kvtier.replay.datasets import Turn, VirtualUser


def _message_text(m: dict[str, Any]) -> str:
    content = m.get("content")
    text = content if isinstance(content, str) else json.dumps(content, sort_keys=True) if content else ""
    extra = {k: m[k] for k in ("tool_calls", "name", "tool_call_id") if m.get(k)}
    return f"{m.get('role', '')}: {text}" + (" " + json.dumps(extra, sort_keys=True) if extra else "")


def turn_tokens(turn: Turn, encode: Callable[[str], list[int]], cache: dict[str, list[int]]) -> list[int]:
    """A turn's prompt as token ids, each message as it is sent (``cache`` keeps each text's ids: a
    conversation resends its history every turn)."""
    tokens: list[int] = []
    for m in turn.messages:
        text = _message_text(m)
        ids = cache.get(text)
        if ids is None:
            ids = cache[text] = encode(text)
        tokens += ids
    return tokens


def reuse_opportunity(
    users: Sequence[VirtualUser],
    encode: Callable[[str], list[int]],
    block_tokens: int = 256,
    kv_bytes_per_token: int | None = None,
    points: int = 50,
    prompt_tokens: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """The figures of the module docstring; ``prompt_tokens``, when given, is filled with each virtual
    user's prompt sizes, turn by turn (the replay checks them against the server's max_model_len)."""
    cache: dict[str, list[int]] = {}
    first_session: dict[bytes, str] = {}
    hist = cross = new = total = 0
    session_max: dict[str, int] = {}
    series: list[tuple[int, int]] = []  # (requests so far, distinct blocks so far)
    requests = 0
    for u in users:
        for turn in u.turns:
            tokens = turn_tokens(turn, encode, cache)
            n = len(tokens)
            if prompt_tokens is not None:
                prompt_tokens.setdefault(u.user_id, []).append(n)
            total += n
            session_max[u.session_id] = max(session_max.get(u.session_id, 0), n)
            parent: bytes | None = None
            full = n // block_tokens
            for b in range(full):
                parent = chunk_hash(parent, tokens[b * block_tokens : (b + 1) * block_tokens])
                owner = first_session.get(parent)
                if owner is None:
                    first_session[parent] = u.session_id
                    new += block_tokens
                elif owner == u.session_id:
                    hist += block_tokens
                else:
                    cross += block_tokens
            new += n - full * block_tokens
            requests += 1
            series.append((requests, len(first_session)))
    step = max(1, len(series) // points)
    sampled = series[step - 1 :: step]
    if series and sampled[-1] != series[-1]:
        sampled.append(series[-1])
    per_session = np.array(list(session_max.values()), dtype=np.float64)
    bpt = kv_bytes_per_token

    def frac(x: int) -> float | None:
        return round(x / total, 6) if total else None

    return {
        "block_tokens": block_tokens,
        "requests": requests,
        "prompt_tokens": total,
        "history_reuse_tokens": hist,
        "cross_session_reuse_tokens": cross,
        "new_tokens": new,
        "history_reuse_fraction": frac(hist),
        "cross_session_reuse_fraction": frac(cross),
        "new_fraction": frac(new),
        "kv_bytes_per_token": bpt,
        "session_max_prompt_tokens": {
            "mean": round(float(per_session.mean()), 1) if per_session.size else None,
            "p50": float(np.percentile(per_session, 50)) if per_session.size else None,
            "max": int(per_session.max()) if per_session.size else None,
        },
        "kv_bytes_per_session": None
        if bpt is None or not per_session.size
        else {
            "mean": int(per_session.mean() * bpt),
            "p50": int(np.percentile(per_session, 50) * bpt),
            "max": int(per_session.max() * bpt),
        },
        "working_set": [
            {
                "requests": r,
                "tokens": blocks * block_tokens,
                "bytes": None if bpt is None else blocks * block_tokens * bpt,
            }
            for r, blocks in sampled
        ],
    }


__all__ = ["reuse_opportunity", "turn_tokens"]
