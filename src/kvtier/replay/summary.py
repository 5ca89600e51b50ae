"""Per-request records -> the replay summary (every field in docs/metrics.md, 'kvtier replay')."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import numpy as np

from kvtier import stats
from kvtier.results.outcome import NOT_COUNTED, failed_count, tally
from kvtier.results.replay import ReplayRecord, offload_sources, tpot_s


def _stats(xs: list[float]) -> dict[str, float | int | None]:
    """A summary in seconds (kvtier.stats: the same percentile rule as every other result)."""
    return stats.summarize(xs, scale=1.0, digits=6)


CONTEXT_LENGTH_WORDS = re.compile(
    r"context length|context_length|max_model_len|maximum context|context window|too long|too many tokens", re.I
)


def http_cause(status: int, body: str) -> str:
    """The cause of a refused request (results/outcome.py), from its HTTP status and the server's words:
    context-length (a prompt over the model length: vLLM answers 400), model-not-found (404 naming a
    model), not-found, rate-limited (429), server-error (5xx), bad-request (any other 4xx)."""
    if status in (400, 413, 422) and CONTEXT_LENGTH_WORDS.search(body):
        return "context-length"
    if status == 404:
        return "model-not-found" if "model" in body.lower() else "not-found"
    if status == 429:
        return "rate-limited"
    if status >= 500:
        return "server-error"
    return "bad-request"


def record_cause(r: ReplayRecord) -> str:
    """A failed record's cause (results/outcome.py); records of files written before causes were kept get
    one from their status and HTTP status."""
    cause = r.get("cause")
    if isinstance(cause, str) and cause:
        return cause
    if r["status"] == "ok":  # ok without a TTFT: a file written before settle() made it an error
        return "no-output"
    if r["status"] == "cut":
        return "cut-at-stop"
    if r["status"] == "timeout":
        return "timeout"
    status = r.get("http_status")
    if isinstance(status, int) and status != 200:
        return http_cause(status, str(r.get("error") or ""))
    return "connection"


def summarize(records: list[ReplayRecord], users_total: int, turns_per_user: int, wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == "ok" and r["ttft_s"] is not None]
    failures = tally(
        (record_cause(r), r.get("error") or "", r.get("http_status") if r.get("http_status") != 200 else None)
        for r in records
        if r["status"] != "ok" or r["ttft_s"] is None  # every record is ok, failed by cause, or cut: they add up
    )
    tpots = [
        v for r in ok if (v := tpot_s(r["e2e_s"] or 0.0, r["ttft_s"] or 0.0, r.get("completion_tokens"))) is not None
    ]
    first: dict[str, float] = {}
    for r in ok:
        if r["turn"] == 0:
            first[r["user"]] = r["ttft_s"] or 0.0
    changes: list[float] = []
    by_turn: dict[int, list[float]] = defaultdict(list)
    for r in ok:
        t0 = first.get(r["user"])
        if r["turn"] > 0 and t0:
            c = ((r["ttft_s"] or 0.0) - t0) / t0 * 100
            changes.append(c)
            by_turn[r["turn"]].append(c)
    per_user: dict[str, list[ReplayRecord]] = defaultdict(list)
    for r in records:
        per_user[r["user"]].append(r)
    complete = sum(1 for rs in per_user.values() if len(rs) == turns_per_user and all(r["status"] == "ok" for r in rs))
    # a session whose request the run's own end cut is incomplete, not in error (cut is not failed: outcome.py)
    error = sum(1 for rs in per_user.values() if any(r["status"] not in ("ok", "cut") for r in rs))
    incomplete = users_total - complete - error
    in_tok = sum(r.get("prompt_tokens") or 0 for r in ok)
    out_tok = sum(r.get("completion_tokens") or 0 for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    replicas: dict[str, int] = defaultdict(int)
    for r in records:
        if replica := r.get("replica"):
            replicas[replica] += 1
    return {
        "requests_total": len(records),
        "requests_ok": len(ok),
        "requests_failed": failed_count(failures),
        "requests_cut_at_stop": sum(f.count for c, f in failures.items() if c in NOT_COUNTED),
        "failures": {c: f.model_dump() for c, f in failures.items()},
        "ttft_s": _stats([r["ttft_s"] or 0.0 for r in ok]),  # set on every ok record
        "tpot_s_mean": round(float(np.mean(tpots)), 6) if tpots else None,
        "e2e_s": _stats([r["e2e_s"] or 0.0 for r in ok]),
        "input_tokens_per_s": round(in_tok / wall_s, 3) if wall_s > 0 else None,
        "output_tokens_per_s": round(out_tok / wall_s, 3) if wall_s > 0 else None,
        "requests_per_s": round(len(ok) / wall_s, 4) if wall_s > 0 else None,
        "client_cached_token_fraction": round(cached / in_tok, 6) if in_tok else None,
        "ttft_degradation": {
            "median_pct": round(float(np.median(changes)), 3) if changes else None,
            "p95_pct": round(float(stats.percentile(changes, 95) or 0.0), 3) if changes else None,
            "by_turn_median_pct": {str(k): round(float(np.median(v)), 3) for k, v in sorted(by_turn.items())},
            "ttft_s_by_turn_p50": {
                str(k): round(float(np.median([r["ttft_s"] for r in ok if r["turn"] == k])), 6)
                for k in sorted({r["turn"] for r in ok})
            },
        },
        "sessions": {"total": users_total, "complete": complete, "incomplete": incomplete, "error": error},
        "requests_by_replica": dict(replicas),
        "ttft_decomposition": {
            **ttft_decomposition(ok),
            "dropped": sum(1 for r in records if r.get("decomposition_dropped")),
        },
    }


CLOSURE = 0.05
"""The server's parts close on the client's TTFT when they sum within this fraction of it."""


def _shares(tokens: dict[str, int]) -> dict[str, float]:
    total = sum(tokens.values())
    return {k: round(v / total, 6) for k, v in sorted(tokens.items())} if total else {}


def hits_that_did_not_pay(rows: list[ReplayRecord]) -> tuple[int, int, float | None, float | None]:
    """(requests an offload tier served, those whose fetch took longer than recomputing the tokens the tiers gave
    would have at the replay's own prefill rate, that rate, and over all those requests Σ fetch / Σ that recompute):
    the rate is Σ recomputed tokens / Σ recompute seconds over the same requests (the GPU's wait included, as plan
    value measures it). The last is the hits' time as one figure: above 1, the tiers' hits made TTFT worse than
    having no tier."""
    recomputed = sum((r.get("prompt_sources") or {}).get("recomputed", 0) for r in rows)
    seconds = sum((r.get("server_ttft_parts") or {}).get("recompute", 0.0) for r in rows)
    rate = recomputed / seconds if recomputed and seconds > 0 else None
    hits = not_paying = 0
    fetch = avoided = 0.0
    for r in rows:
        served = sum(offload_sources(r.get("prompt_sources") or {}).values())
        if not served:
            continue
        hits += 1
        took = (r.get("server_ttft_parts") or {}).get("fetch", 0.0)
        fetch += took
        if rate is not None:
            avoided += served / rate
            not_paying += took > served / rate
    ratio = round(fetch / avoided, 4) if avoided > 0 else None
    return hits, not_paying, None if rate is None else round(rate, 1), ratio


def ttft_decomposition(ok: list[ReplayRecord]) -> dict[str, Any]:
    """Where the ok requests' TTFT went, from the server's decomposition (records without one are left out):
    mean seconds by part and the prompt's token share by source, per turn and over all; the share of requests
    whose parts — the server's, and the two transits where the server's stamps share the client's clock — sum
    within CLOSURE of the client's TTFT (and the share from the server's parts alone); the client's overhead
    beyond the server's TTFT, and the transits' medians."""
    with_parts = [r for r in ok if r.get("server_ttft_parts") is not None and r["ttft_s"]]
    tokens: dict[str, int] = defaultdict(int)
    by_turn: dict[int, list[ReplayRecord]] = defaultdict(list)
    closed = closed_server = 0
    overhead: list[float] = []
    to_server: list[float] = []
    to_client: list[float] = []
    for r in with_parts:
        ttft, server = r["ttft_s"] or 0.0, r.get("server_ttft_s") or 0.0
        closed_server += abs(ttft - server) <= CLOSURE * ttft
        transit = r.get("transit_s")
        accounted = server
        if transit:
            to_server.append(transit["to_server"])
            to_client.append(transit["to_client"])
            accounted += transit["to_server"] + transit["to_client"]
        closed += abs(ttft - accounted) <= CLOSURE * ttft
        overhead.append(ttft - server)
        for k, v in (r.get("prompt_sources") or {}).items():
            tokens[k] += v
        by_turn[r["turn"]].append(r)
    turns = []
    for turn, rs in sorted(by_turn.items()):
        parts: dict[str, list[float]] = defaultdict(list)
        t_tokens: dict[str, int] = defaultdict(int)
        for r in rs:
            for k, secs in (r.get("server_ttft_parts") or {}).items():
                parts[k].append(secs)
            for k, n in (r.get("prompt_sources") or {}).items():
                t_tokens[k] += n
        turns.append(
            {
                "turn": turn,
                "requests": len(rs),
                "ttft_s_mean": round(float(np.mean([r["ttft_s"] or 0.0 for r in rs])), 6),
                "server_ttft_s_mean": round(float(np.mean([r.get("server_ttft_s") or 0.0 for r in rs])), 6),
                "seconds_mean": {k: round(float(np.mean(v)), 6) for k, v in parts.items()},
                "token_share": _shares(t_tokens),
            }
        )
    hits, not_paying, rate, fetch_over = hits_that_did_not_pay(with_parts)
    return {
        "requests": len(with_parts),
        "offload_hits": hits,
        "hits_not_paying": not_paying,
        "prefill_tokens_per_s": rate,
        "offload_fetch_over_recompute": fetch_over,
        "closure_within_5pct": round(closed / len(with_parts), 6) if with_parts else None,
        "client_overhead_s_p50": round(float(np.median(overhead)), 6) if overhead else None,
        "closure_server_only_within_5pct": round(closed_server / len(with_parts), 6) if with_parts else None,
        "transit_measured": len(to_server),
        "transit_to_server_s_p50": round(float(np.median(to_server)), 6) if to_server else None,
        "transit_to_client_s_p50": round(float(np.median(to_client)), 6) if to_client else None,
        "token_share": _shares(tokens),
        "by_turn": turns,
    }
