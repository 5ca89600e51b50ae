"""Synthetic users (MLPerf KV Cache spec section 4.1) and the requests they make.

Each user draws a profile (chatbot / coding / document), a QoS class (15/35/50 % interactive /
responsive / batch by default) and its own context, generation and think-time scales from a
``numpy.random.Generator`` spawned from the run seed, so the same seed yields the same request
sequence per user whatever the timing of the run. A request's context is uniform in
[context/4, context] and its generation uniform in [generation/4, generation], as in the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from kvtier.config.bench import Tuning

PREFILL_ONLY_CONTEXT_TOKENS = 10_000
"""Requests with at least this much context are prefill-only (no decode reads), per the spec."""

QOS_CLASSES = ("interactive", "responsive", "batch")
PROFILES = ("chatbot", "coding", "document")


@dataclass(frozen=True)
class UserProfile:
    user_id: int
    profile: str
    qos: str
    priority: int
    context_tokens: int
    generation_tokens: int
    think_time_s: float


@dataclass(frozen=True)
class Request:
    user_id: int
    seq: int
    key: str
    qos: str
    priority: int
    phase: str  # "prefill" | "prefill_decode"
    context_tokens: int
    generate_tokens: int
    think_before_s: float


def make_users(num_users: int, tuning: Tuning, seed: int, first_id: int = 0) -> list[UserProfile]:
    """Profiles for users ``first_id .. first_id+num_users-1`` (stable per id and seed)."""
    users = []
    dist = tuning.qos_distribution
    for uid in range(first_id, first_id + num_users):
        rng = user_rng(seed, uid, stream=0)
        profile = PROFILES[int(rng.integers(0, len(PROFILES)))]
        t = tuning.user_templates[profile]  # type: ignore[index]
        r = rng.random()
        qos = "interactive" if r < dist.interactive_probability else (
            "responsive" if r < dist.responsive_threshold else "batch")
        users.append(UserProfile(
            user_id=uid, profile=profile, qos=qos, priority=tuning.qos_profiles[qos].priority,  # type: ignore[index]
            context_tokens=int(rng.integers(int(t.context_range.low), int(t.context_range.high) + 1)),
            generation_tokens=int(rng.integers(int(t.generation_range.low), int(t.generation_range.high) + 1)),
            think_time_s=float(rng.uniform(t.think_time_range.low, t.think_time_range.high)),
        ))
    return users


def user_rng(seed: int, user_id: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, user_id, stream]))


def requests_for(user: UserProfile, seed: int) -> Iterator[Request]:
    """The user's endless, deterministic request sequence."""
    rng = user_rng(seed, user.user_id, stream=1)
    seq = 0
    while True:
        ctx = int(rng.integers(max(1, user.context_tokens // 4), user.context_tokens + 1))
        gen = int(rng.integers(max(1, user.generation_tokens // 4), user.generation_tokens + 1))
        think = user.think_time_s * float(rng.uniform(0.8, 1.2))
        phase = "prefill" if ctx >= PREFILL_ONLY_CONTEXT_TOKENS else "prefill_decode"
        yield Request(user.user_id, seq, f"user{user.user_id}_req_{seq:06d}", user.qos, user.priority,
                      phase, ctx, gen, think)
        seq += 1
