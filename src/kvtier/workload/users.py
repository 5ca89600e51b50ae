"""Synthetic users (MLPerf KV Cache spec section 4.1) and the requests they make.

Each user draws a profile (chatbot / coding / document), a QoS class (15/35/50 % interactive /
responsive / batch by default) and its own context, generation and think-time scales from a
``numpy.random.Generator`` spawned from the run seed, so the same seed yields the same request
sequence per user whatever the timing of the run. A request's context is uniform in
[context/4, context] and its generation uniform in [generation/4, generation], as in the reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvtier.config.tuning import QoSClass, QoSDistribution, Tuning
from kvtier.workload.layout import KVRef

PREFILL_ONLY_CONTEXT_TOKENS = 10_000
"""Requests with at least this much context are prefill-only (no decode reads), per the spec."""

QOS_CLASSES: tuple[QoSClass, ...] = ("interactive", "responsive", "batch")
Profile = Literal["chatbot", "coding", "document"]
PROFILES: tuple[Profile, ...] = ("chatbot", "coding", "document")


@dataclass(frozen=True)
class UserProfile:
    user_id: int
    profile: Profile
    qos: QoSClass
    priority: int
    context_tokens: int
    generation_tokens: int
    think_time_s: float


@dataclass(frozen=True)
class Request:
    """One inference request and the KV objects it touches (see workload/layout.py).

    ``reads`` are looked up before the first token; with ``prefix_reads`` the lookup stops at
    the first miss and the missed object and all after it are recomputed (written). ``writes``
    are the KV the prefill produces. ``decode_key`` is re-read once plus once per decode batch
    (reference semantics); None means no decode reads from the offload tiers.
    """

    user_id: int
    seq: int
    key: str
    qos: str
    priority: int
    phase: str  # "prefill" | "prefill_decode"
    context_tokens: int
    generate_tokens: int
    think_before_s: float
    reads: tuple[KVRef, ...] = ()
    prefix_reads: bool = False
    writes: tuple[KVRef, ...] = ()
    decode_key: str | None = None
    decode_tokens: int = 0
    new_tokens: int = 0
    conversation: str | None = None
    turn: int = 1
    arrival_s: float | None = None
    rag_reads: tuple[KVRef, ...] = ()  # retrieved chunks read before the first token (the RAG burst)


def make_users(num_users: int, tuning: Tuning, seed: int, first_id: int = 0) -> list[UserProfile]:
    """Profiles for users ``first_id .. first_id+num_users-1`` (stable per id and seed)."""
    users = []
    profiles = [p for p in PROFILES if p in tuning.user_templates]  # all three unless a config drops some
    for uid in range(first_id, first_id + num_users):
        rng = user_rng(seed, uid, stream=0)
        profile = profiles[int(rng.integers(0, len(profiles)))]
        t = tuning.user_templates[profile]
        qos = draw_qos(rng, tuning.qos_distribution)
        users.append(
            UserProfile(
                user_id=uid,
                profile=profile,
                qos=qos,
                priority=tuning.qos_profiles[qos].priority,
                context_tokens=int(rng.integers(int(t.context_range.low), int(t.context_range.high) + 1)),
                generation_tokens=int(rng.integers(int(t.generation_range.low), int(t.generation_range.high) + 1)),
                think_time_s=float(rng.uniform(t.think_time_range.low, t.think_time_range.high)),
            )
        )
    return users


def draw_qos(rng: np.random.Generator, dist: QoSDistribution) -> QoSClass:
    """One QoS class: interactive below ``interactive_probability``, responsive below
    ``responsive_threshold``, batch above (one uniform draw from ``rng``)."""
    r = rng.random()
    if r < dist.interactive_probability:
        return "interactive"
    return "responsive" if r < dist.responsive_threshold else "batch"


def user_rng(seed: int, user_id: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, user_id, stream]))


def draws(user: UserProfile, seed: int) -> Iterator[tuple[int, int, float]]:
    """The user's endless, deterministic (new context tokens, generate tokens, think seconds) draws."""
    rng = user_rng(seed, user.user_id, stream=1)
    while True:
        ctx = int(rng.integers(max(1, user.context_tokens // 4), user.context_tokens + 1))
        gen = int(rng.integers(max(1, user.generation_tokens // 4), user.generation_tokens + 1))
        yield ctx, gen, user.think_time_s * float(rng.uniform(0.8, 1.2))


def phase_for(context_tokens: int) -> str:
    return "prefill" if context_tokens >= PREFILL_ONLY_CONTEXT_TOKENS else "prefill_decode"
