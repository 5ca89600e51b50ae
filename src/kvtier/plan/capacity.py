"""Capacity planning: bytes for N cached tokens, users a tier holds, cost of a million tokens."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.modelspec import ModelSpec

GiB = 2**30


def kv_bytes_per_token(model: ModelSpec, tensor_parallel: int = 1) -> float:
    """Bytes per token one tensor-parallel rank stores (``ModelSpec.kv_bytes_per_token_per_rank``)."""
    return float(model.kv_bytes_per_token_per_rank(tensor_parallel))


@dataclass(frozen=True)
class TierPlan:
    tokens: int
    kv_bytes: float
    with_headroom_bytes: float


def bytes_for_tokens(model: ModelSpec, tokens: int, headroom: float = 0.25, tensor_parallel: int = 1) -> TierPlan:
    """Capacity to hold ``tokens`` cached tokens, with eviction headroom (a tier filled to 1/(1+h))."""
    if tokens < 0 or headroom < 0:
        raise ValueError("tokens and headroom must be >= 0")
    b = tokens * kv_bytes_per_token(model, tensor_parallel)
    return TierPlan(tokens, b, b * (1 + headroom))


def users_per_tier(
    model: ModelSpec, tier_bytes: float, tokens_per_user: float, target_usage: float = 0.8, tensor_parallel: int = 1
) -> int:
    """How many users' KV (``tokens_per_user`` each) fit in a tier filled to ``target_usage``."""
    per_user = tokens_per_user * kv_bytes_per_token(model, tensor_parallel)
    if per_user <= 0:
        raise ValueError("tokens_per_user must be > 0")
    return int(tier_bytes * target_usage // per_user)


def gib_per_million_tokens(model: ModelSpec, tensor_parallel: int = 1) -> float:
    return 1e6 * kv_bytes_per_token(model, tensor_parallel) / GiB
