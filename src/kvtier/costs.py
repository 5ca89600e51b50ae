"""The placement cost model, on the ground floor (no I/O; the sim and the planner both ask it): when does a
shared or offloaded KV store pay, and how many bytes does a number of tokens take?

Notation: ctx = context tokens, kvpt = KV bytes per token, bw = link bandwidth (bytes/s),
rtt = round trip (s), tps = prefill throughput (tokens/s), c = compression ratio (>= 1).

Per generated token (why KV must stay next to compute during decode):
  decode_local    = ctx*kvpt/hbm_bw + stages*rtt     (attention reads local HBM; pipeline hops)
  stream_remote   = ctx*kvpt/bw + rtt                (stream the whole KV from a store every token)
  query_shipping  = layers*rtt                       (ship queries to the store, one hop per layer)
Per request (where a store can pay: fetch a cached prefix once):
  fetch           = rtt + ctx*kvpt/(bw*c)
  recompute       = ctx/tps
Break-even bandwidth (fetch = recompute):
  closed form (long contexts, rtt negligible):  bw* = kvpt*tps/c
  exact, rtt-aware:  bw*(ctx) = ctx*kvpt / (c*(ctx/tps - rtt)), defined only when ctx/tps > rtt;
  when recompute is faster than one round trip no bandwidth makes fetching pay: we refuse
  (NoBreakEven) rather than return a number — the gate fails closed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.errors import KvtierError
from kvtier.modelspec import ModelSpec
from kvtier.units import GiB


class NoBreakEven(KvtierError):
    """Fetching can never beat recompute for these inputs (recompute < one round trip)."""


def _check(**vals: float) -> None:
    for k, v in vals.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v)):
            raise ValueError(f"{k} must be a finite number, got {v!r}")
        if k in ("rtt_s", "ctx") and v < 0:
            raise ValueError(f"{k} must be >= 0, got {v}")
        if k not in ("rtt_s", "ctx") and v <= 0:
            raise ValueError(f"{k} must be > 0, got {v}")


def decode_local_s(ctx: int, kvpt: float, hbm_bw: float, stages: int = 1, rtt_s: float = 0.0) -> float:
    _check(ctx=ctx, kvpt=kvpt, hbm_bw=hbm_bw, rtt_s=rtt_s)
    return ctx * kvpt / hbm_bw + stages * rtt_s


def stream_remote_s(ctx: int, kvpt: float, net_bw: float, rtt_s: float) -> float:
    _check(ctx=ctx, kvpt=kvpt, net_bw=net_bw, rtt_s=rtt_s)
    return ctx * kvpt / net_bw + rtt_s


def query_shipping_s(layers: int, rtt_s: float) -> float:
    _check(layers=layers, rtt_s=rtt_s)
    return layers * rtt_s


def fetch_s(ctx: int, kvpt: float, net_bw: float, rtt_s: float, compression: float = 1.0) -> float:
    _check(ctx=ctx, kvpt=kvpt, net_bw=net_bw, rtt_s=rtt_s, compression=compression)
    return rtt_s + ctx * kvpt / (net_bw * compression)


def recompute_s(ctx: int, prefill_tps: float) -> float:
    _check(ctx=ctx, prefill_tps=prefill_tps)
    return ctx / prefill_tps


def breakeven_bandwidth(kvpt: float, prefill_tps: float, compression: float = 1.0) -> float:
    """Closed form, bytes/s: above it fetching a long prefix beats recomputing it."""
    _check(kvpt=kvpt, prefill_tps=prefill_tps, compression=compression)
    return kvpt * prefill_tps / compression


def breakeven_bandwidth_exact(
    ctx: int, kvpt: float, prefill_tps: float, rtt_s: float, compression: float = 1.0
) -> float:
    """RTT-aware break-even for one context length, bytes/s; raises NoBreakEven when none exists."""
    _check(ctx=ctx, kvpt=kvpt, prefill_tps=prefill_tps, rtt_s=rtt_s, compression=compression)
    slack = ctx / prefill_tps - rtt_s
    if slack <= 0:
        raise NoBreakEven(
            f"recompute of {ctx} tokens takes {ctx / prefill_tps * 1e3:.3g} ms, not more than one "
            f"round trip ({rtt_s * 1e3:.3g} ms): no bandwidth makes fetching pay; recompute"
        )
    return ctx * kvpt / (compression * slack)


def breakeven_bandwidth_numeric(
    ctx: int, kvpt: float, prefill_tps: float, rtt_s: float, compression: float = 1.0, rel_tol: float = 1e-12
) -> float:
    """The same crossover found by bisection on fetch_s(bw) = recompute_s (a cross-check of the algebra)."""
    target = recompute_s(ctx, prefill_tps)
    if fetch_s(ctx, kvpt, 1e30, rtt_s, compression) >= target:
        raise NoBreakEven(f"recompute ({target * 1e3:.3g} ms) is not slower than one round trip: recompute")
    lo, hi = 1.0, 1.0
    while fetch_s(ctx, kvpt, hi, rtt_s, compression) > target:
        hi *= 2
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        if fetch_s(ctx, kvpt, mid, rtt_s, compression) > target:
            lo = mid
        else:
            hi = mid
    return hi


def min_context_for_fetch(
    kvpt: float, net_bw: float, rtt_s: float, prefill_tps: float, compression: float = 1.0
) -> float | None:
    """Smallest context (tokens) from which fetching beats recompute at this bandwidth; None if never."""
    _check(kvpt=kvpt, net_bw=net_bw, rtt_s=rtt_s, prefill_tps=prefill_tps, compression=compression)
    per_token_gain = 1.0 / prefill_tps - kvpt / (net_bw * compression)
    if per_token_gain <= 0:
        return None
    return rtt_s / per_token_gain


@dataclass(frozen=True)
class GateDecision:
    fetch: bool
    fetch_s: float
    recompute_s: float
    reason: str

    @property
    def verdict(self) -> str:
        return "fetch" if self.fetch else "recompute"


def should_fetch(
    ctx: int, kvpt: float, bw: float, rtt_s: float, prefill_tps: float, compression: float = 1.0
) -> GateDecision:
    """The fetch gate: fetch a cached prefix only when it is strictly faster than recomputing it.

    Fails closed: inputs that are missing, non-finite or non-positive give "recompute" with the
    reason, never an exception, because the caller is a serving path that must decide something.
    ``bw`` and ``rtt_s`` should be *measured* end-to-end fetch figures, not link rates.
    """
    try:
        f = fetch_s(ctx, kvpt, bw, rtt_s, compression)
        r = recompute_s(ctx, prefill_tps)
    except (ValueError, TypeError) as e:
        return GateDecision(False, math.inf, math.nan, f"invalid input ({e}): recompute")
    if ctx == 0:
        return GateDecision(False, f, r, "nothing to fetch")
    if f < r:
        return GateDecision(True, f, r, f"fetch {f:.4g} s < recompute {r:.4g} s")
    return GateDecision(False, f, r, f"fetch {f:.4g} s >= recompute {r:.4g} s")


# -- capacity: bytes for N cached tokens, users a tier holds, GiB per million tokens ----------------------
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
