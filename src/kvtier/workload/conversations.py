"""Multi-turn conversations and shared system prompts for synthetic users.

Each user holds at most one live conversation. After a turn it ends with probability
``conversation.end_conversation_probability`` (0.2), or when it reaches ``max_turns_per_conv`` (50)
turns or ``max_context_tokens`` tokens; the user then starts a new one. With prefix caching on, a
conversation opens with a shared system prompt with probability
``prefix_cache.system_prompt_hit_probability`` (0.2), drawn from min(``num_system_prompts``,
``max_prefix_entries``) prompts; a prompt shorter than ``min_prefix_length`` tokens is not shared but
is part of the first turn's own context. Turn n's new tokens are the previous reply plus the user's
new message (the profile's context draw). The ConversationManager keeps conversation *metadata* for
at most ``conversation.max_conversations`` conversations (LRU); evicting one forgets its history (the
next turn of that user starts a new conversation) but leaves its KV in the store until the store
evicts it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvtier.keys import KeyScope
from kvtier.workload.layout import KVRef, Layout, segment_chunks, system_prompt_key
from kvtier.workload.users import Request, UserProfile, draws, phase_for, user_rng

SHARED_STREAM = 2**31 - 1
"""Pseudo user id of random streams shared by all users (system prompts)."""


@dataclass
class Conversation:
    conv_id: str
    user_id: int
    system_prompt: str | None
    system_tokens: int
    turns: int = 0
    segments: list[tuple[str, int]] = field(default_factory=list)  # chunked layout
    turn_keys: list[tuple[str, int]] = field(default_factory=list)  # entry layout: (key, tokens)
    last_reply_tokens: int = 0

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.segments)


class ConversationManager:
    """Conversation metadata for all users, bounded by conversation.max_conversations (LRU)."""

    def __init__(self, max_conversations: int) -> None:
        self.max_conversations = max_conversations
        self._convs: OrderedDict[str, Conversation] = OrderedDict()
        self._lock = threading.Lock()
        self.started = 0
        self.evicted = 0

    def start(self, conv: Conversation) -> None:
        with self._lock:
            self._convs[conv.conv_id] = conv
            self.started += 1
            while len(self._convs) > self.max_conversations:
                self._convs.popitem(last=False)
                self.evicted += 1

    def touch(self, conv_id: str) -> bool:
        """Mark a conversation used; False if its metadata was evicted."""
        with self._lock:
            if conv_id not in self._convs:
                return False
            self._convs.move_to_end(conv_id)
            return True

    def end(self, conv_id: str) -> None:
        with self._lock:
            self._convs.pop(conv_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._convs)


@dataclass(frozen=True)
class ConversationSettings:
    layout: Layout = "entry"
    chunk_tokens: int = 256
    multi_turn: bool = True
    prefix_caching: bool = True
    end_probability: float = 0.2
    max_turns_per_conv: int = 50
    max_context_tokens: int = 131072
    num_system_prompts: int = 8
    system_prompt_tokens: tuple[int, int] = (256, 2048)
    system_prompt_probability: float = 0.2
    min_prefix_length: int = 50
    key_scope: str = ""  # before every conversation id: the seed's, in a shared remote namespace (ids name content)
    prompt_seed: int | None = None  # the system prompts' seed (a shared namespace's own); None: the run's seed


def system_prompts(settings: ConversationSettings, seed: int) -> list[tuple[str, int]]:
    rng = user_rng(seed, SHARED_STREAM, stream=7)
    lo, hi = settings.system_prompt_tokens
    return [(f"system-{i}", int(rng.integers(lo, hi + 1))) for i in range(settings.num_system_prompts)]


def conversation_requests(
    user: UserProfile, seed: int, settings: ConversationSettings, scope: KeyScope, manager: ConversationManager
) -> Iterator[Request]:
    """The user's endless, deterministic stream of (multi-turn) requests in the chosen layout."""
    rng = user_rng(seed, user.user_id, stream=2)
    prompts = system_prompts(settings, seed if settings.prompt_seed is None else settings.prompt_seed)
    prompts = prompts if settings.prefix_caching else []
    conv: Conversation | None = None
    n_conv = 0
    for seq, (new_user_tokens, gen, think) in enumerate(draws(user, seed)):
        if conv is not None and not manager.touch(conv.conv_id):
            conv = None  # metadata evicted: history forgotten
        if conv is None:
            sp: str | None = None
            sp_tokens = 0
            if prompts and rng.random() < settings.system_prompt_probability:
                sp, sp_tokens = prompts[int(rng.integers(0, len(prompts)))]
            shared = sp is not None and sp_tokens >= settings.min_prefix_length
            conv_id = f"{settings.key_scope}conv_u{user.user_id}_{n_conv:05d}"
            conv = Conversation(conv_id, user.user_id, sp if shared else None, sp_tokens)
            n_conv += 1
            if shared:
                conv.segments.append((str(sp), sp_tokens))
            else:  # no prompt, or one too short to share: it is part of the first turn's own context
                conv.last_reply_tokens = sp_tokens
            manager.start(conv)
        conv.turns += 1
        new_tokens = new_user_tokens + conv.last_reply_tokens
        req = _turn_request(user, seq, conv, new_tokens, gen, think, settings, scope)
        conv.last_reply_tokens = gen
        yield req
        if (
            not settings.multi_turn
            or conv.turns >= settings.max_turns_per_conv
            or conv.tokens + gen >= settings.max_context_tokens
            or rng.random() < settings.end_probability
        ):
            manager.end(conv.conv_id)
            conv = None


def _turn_request(
    user: UserProfile,
    seq: int,
    conv: Conversation,
    new_tokens: int,
    gen: int,
    think: float,
    settings: ConversationSettings,
    scope: KeyScope,
) -> Request:
    key = f"{conv.conv_id}_turn_{conv.turns}"
    base = Request(
        user_id=user.user_id,
        seq=seq,
        key=key,
        qos=user.qos,
        priority=user.priority,
        phase="prefill",
        context_tokens=0,
        generate_tokens=gen,
        think_before_s=think,
        conversation=conv.conv_id,
        turn=conv.turns,
        new_tokens=new_tokens,
    )
    if settings.layout == "entry":
        reads = []
        if conv.system_prompt is not None:
            reads.append(KVRef(system_prompt_key(conv.system_prompt), conv.system_tokens, "prefix"))
        reads += [KVRef(k, n, "history") for k, n in conv.turn_keys]
        conv.turn_keys.append((key, new_tokens))
        conv.segments.append((f"{conv.conv_id}/t{conv.turns}", new_tokens))
        return dataclasses.replace(
            base,
            phase=phase_for(new_tokens),
            context_tokens=conv.tokens,
            reads=tuple(reads),
            writes=(KVRef(key, new_tokens, "context"),),
            decode_key=key,
            decode_tokens=new_tokens,
        )
    cached = segment_chunks(conv.segments, settings.chunk_tokens, scope, conv.system_prompt)
    conv.segments.append((f"{conv.conv_id}/t{conv.turns}", new_tokens))
    full = segment_chunks(conv.segments, settings.chunk_tokens, scope, conv.system_prompt)
    new_chunks = tuple(KVRef(r.key, r.tokens, "context") for r in full[len(cached) :])
    return dataclasses.replace(
        base,
        phase=phase_for(conv.tokens),
        context_tokens=conv.tokens,
        reads=tuple(cached),
        prefix_reads=True,
        writes=new_chunks,
    )
