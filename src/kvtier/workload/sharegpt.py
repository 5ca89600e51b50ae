"""ShareGPT conversations as multi-turn users, with real turn lengths.

Accepted: a JSON array of records, each with ``conversations: [{from, value}, ...]`` (``from`` in
human/user, gpt/assistant/chatgpt/bard/model; system messages and other roles are skipped), or a
single-turn record with ``prompt`` and ``response`` (as in some ShareGPT-derived samples). Extra
fields are ignored; a record without a usable human → assistant pair is skipped and counted. A file
that is not JSON, not an array, or holds no usable conversation is a DatasetError naming it.

Token counts come from the tokenizer given (kvtier.tokenizer: tiktoken's cl100k encoding when the
``tokenizer`` extra is installed, else chars/4); the result says which. The YAML ``sharegpt``
section can cap a turn's context and reply tokens.

``sharegpt_messages`` is the one ShareGPT reader: the bench counts tokens from its messages and
``kvtier replay`` sends them as chat history.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import DatasetError
from kvtier.keys import KeyScope
from kvtier.tokenizer import Tokenizer
from kvtier.workload.conversations import Conversation, ConversationManager, ConversationSettings, _turn_request
from kvtier.workload.formats import elsewhere
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


def sharegpt_messages(rec: object) -> list[dict[str, str]]:
    """A record's usable messages as ``[{role: user|assistant, content}]``, in order.

    Roles: human/user -> user; gpt/assistant/chatgpt/bard/model -> assistant (``from`` or ``role``,
    text in ``value`` or ``content``); other roles, empty texts and non-objects are skipped, and
    so is a reply with no user message before it (the conversation's opening, or a second reply
    in a row). A single-turn ``prompt``/``response`` record gives one exchange."""
    if not isinstance(rec, dict):
        return []
    msgs = rec.get("conversations")
    if not isinstance(msgs, list):
        prompt, response = rec.get("prompt"), rec.get("response")
        if isinstance(prompt, str) and isinstance(response, str) and prompt and response:
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return []
    out: list[dict[str, str]] = []
    for m in msgs:
        if not isinstance(m, dict):
            continue
        role = str(m.get("from", m.get("role", ""))).lower()
        text = m.get("value", m.get("content"))
        if not isinstance(text, str) or not text:
            continue
        if role in USER_ROLES:
            out.append({"role": "user", "content": text})
        elif role in ASSISTANT_ROLES and out and out[-1]["role"] == "user":
            out.append({"role": "assistant", "content": text})
    return out


def sharegpt_id(rec: object, index: int) -> str:
    """A record's id (``id`` or ``conversation_id``), else ``record<index>``."""
    if isinstance(rec, dict):
        rid = rec.get("id") or rec.get("conversation_id")
        if rid:
            return str(rid)
    return f"record{index}"


def read_sharegpt_records(p: Path) -> list[object]:
    """The records of a ShareGPT JSON file (a JSON array); DatasetError naming the file otherwise."""
    try:
        raw = p.read_text(encoding="utf-8")
    except OSError as e:
        raise DatasetError(f"{p}: cannot read: {e.strerror}") from e
    except UnicodeDecodeError:
        raise DatasetError(f"{p}: not UTF-8 text") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{p}:{e.lineno}: not valid JSON ({e.msg})" + elsewhere(p, ("sharegpt",))) from None
    except RecursionError:
        raise DatasetError(f"{p}: JSON nested too deeply") from None
    if not isinstance(data, list):
        raise DatasetError(f"{p}: expected a JSON array of conversations, got {type(data).__name__}")
    return data


def load_sharegpt(
    path: str | Path,
    max_conversations: int,
    tokenizer: Tokenizer,
    *,
    max_context_tokens: int = 0,
    max_generation_tokens: int = 0,
) -> Dataset:
    """At most ``max_conversations`` usable conversations as (user tokens, reply tokens) turns;
    consecutive user messages form one turn's context. Caps of 0 mean none."""
    p = Path(path)
    data = read_sharegpt_records(p)
    convs: list[DatasetConversation] = []
    skipped = 0
    for i, rec in enumerate(data):
        if len(convs) >= max_conversations:
            break
        turns = _turns(sharegpt_messages(rec), tokenizer, max_context_tokens, max_generation_tokens)
        if not turns:
            skipped += 1
            continue
        convs.append(DatasetConversation(sharegpt_id(rec, i), tuple(turns)))
    if not convs:
        raise DatasetError(f"{p}: no usable conversation (need human/user then gpt/assistant messages)")
    return Dataset(str(p), convs, tokenizer.name, skipped)


def _turns(
    messages: list[dict[str, str]], tokenizer: Tokenizer, max_context: int, max_generation: int
) -> list[tuple[int, int]]:
    turns: list[tuple[int, int]] = []
    pending = 0
    for m in messages:
        n = tokenizer.count(m["content"])
        if m["role"] == "user":
            pending += n
        else:
            turns.append(
                (min(pending, max_context) if max_context else pending, min(n, max_generation) if max_generation else n)
            )
            pending = 0
    return turns


def dataset_requests(
    user: UserProfile,
    convs: list[DatasetConversation],
    seed: int,
    cycles: int,
    settings: ConversationSettings,
    scope: KeyScope,
    manager: ConversationManager,
) -> Iterator[Request]:
    """Replay the user's share of the dataset, turn by turn, ``cycles`` times (0: over and over
    until the run ends, as the reference's --replay-cycles 0)."""
    rng = user_rng(seed, user.user_id, stream=5)
    seq = 0
    if not convs:
        return
    for cycle in itertools.count() if cycles == 0 else range(cycles):
        for dc in convs:
            conv = Conversation(f"{dc.conv_id}_c{cycle}_u{user.user_id}", user.user_id, None, 0)
            manager.start(conv)
            for user_tokens, reply_tokens in dc.turns:
                if conv.turns and not manager.touch(conv.conv_id):
                    break  # metadata evicted: the rest of this conversation is dropped
                conv.turns += 1
                think = user.think_time_s * float(rng.uniform(0.8, 1.2))
                req = _turn_request(
                    user, seq, conv, user_tokens + conv.last_reply_tokens, reply_tokens, think, settings, scope
                )
                conv.last_reply_tokens = reply_tokens
                seq += 1
                yield req
            manager.end(conv.conv_id)
