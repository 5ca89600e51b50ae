"""The planner's answers as typed reports: what ``kvtier plan ... --json`` prints, as library calls.

Each function takes numbers in base units (bytes, bytes/s, seconds, tokens) and a ModelSpec, and
returns a pydantic model; the CLI parses units, calls these, and prints a table or the JSON dump.
Formulas: costs.py (placement economics and capacity, on the ground floor), plan/measured.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier import costs
from kvtier.modelspec import ModelSpec, geometry
from kvtier.plan.measured import TierReadCost
from kvtier.results.plan import (
    BreakevenReport,
    BytesReport,
    CapacityReport,
    CatalogReport,
    CatalogRow,
    FetchReport,
    FetchRow,
    FetchSource,
    GateReport,
    GateRow,
    LinkCosts,
    TierHolds,
    TokensNeed,
)

# -- bytes -----------------------------------------------------------------------------------------


def catalog_report(catalog: Mapping[str, ModelSpec]) -> CatalogReport:
    return CatalogReport(
        models=[
            CatalogRow(
                model=key,
                attention=m.attention,
                layers=m.num_layers,
                kv_heads=m.kv_heads,
                head_dim=m.head_dim,
                dtype=m.dtype,
                kv_bytes_per_token=m.kv_bytes_per_token,
                gib_per_million_tokens=round(costs.gib_per_million_tokens(m), 3),
                geometry=geometry(key),
            )
            for key, m in catalog.items()
        ]
    )


def bytes_report(m: ModelSpec, tensor_parallel: int = 1) -> BytesReport:
    kvpt = costs.kv_bytes_per_token(m, tensor_parallel)
    return BytesReport(
        model=m.key,
        attention=m.attention,
        dtype=m.dtype,
        tensor_parallel=tensor_parallel,
        kv_bytes_per_token=kvpt,
        kv_kib_per_token=kvpt / 1024,
        entry_shape_per_token=list(m.entry_shape(1)),
        gib_per_million_tokens=costs.gib_per_million_tokens(m, tensor_parallel),
    )


# -- breakeven -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """A network link as the user wrote it (labels) and in base units."""

    bw_label: str
    bw_bytes_per_s: float
    rtt_label: str
    rtt_s: float


def breakeven_report(
    m: ModelSpec,
    context: int,
    prefill_tps: float,
    hbm_bytes_per_s: float,
    stages: int,
    links: Sequence[Link],
    compression: float = 1.0,
    tensor_parallel: int = 1,
) -> BreakevenReport:
    """Decode placement costs per link and the fetch-vs-recompute break-even (kvtier/costs.py)."""
    kvpt = costs.kv_bytes_per_token(m, tensor_parallel)
    rec = costs.recompute_s(context, prefill_tps)
    be = costs.breakeven_bandwidth(kvpt, prefill_tps)
    be_c = costs.breakeven_bandwidth(kvpt, prefill_tps, compression)
    rows = []
    for link in links:
        bw, rtt = link.bw_bytes_per_s, link.rtt_s
        try:
            exact: float | None = costs.breakeven_bandwidth_exact(context, kvpt, prefill_tps, rtt, compression)
            note = ""
        except costs.NoBreakEven as e:
            exact, note = None, str(e)
        fc = costs.fetch_s(context, kvpt, bw, rtt, compression)
        rows.append(
            LinkCosts(
                net_bw=link.bw_label,
                net_bw_bytes_per_s=bw,
                rtt=link.rtt_label,
                rtt_s=rtt,
                decode_local_s_per_token=costs.decode_local_s(context, kvpt, hbm_bytes_per_s, stages, rtt),
                stream_remote_s_per_token=costs.stream_remote_s(context, kvpt, bw, rtt),
                query_shipping_s_per_token=costs.query_shipping_s(m.num_layers, rtt),
                fetch_s=costs.fetch_s(context, kvpt, bw, rtt),
                fetch_compressed_s=fc,
                recompute_s=rec,
                breakeven_exact_bytes_per_s=exact,
                breakeven_exact_note=note,
                min_context_for_fetch_tokens=costs.min_context_for_fetch(kvpt, bw, rtt, prefill_tps, compression),
                verdict="fetch" if fc < rec else "recompute",
            )
        )
    return BreakevenReport(
        model=m.key,
        kv_bytes_per_token=kvpt,
        context_tokens=context,
        kv_bytes=context * kvpt,
        prefill_tokens_per_s=prefill_tps,
        hbm_bytes_per_s=hbm_bytes_per_s,
        stages=stages,
        compression=compression,
        recompute_s=rec,
        breakeven_bytes_per_s=be,
        breakeven_compressed_bytes_per_s=be_c,
        breakeven_gbit_per_s=be * 8 / 1e9,
        breakeven_compressed_gbit_per_s=be_c * 8 / 1e9,
        links=rows,
    )


# -- gate ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GateCase:
    label: str
    bw_bytes_per_s: float
    rtt_s: float
    compression: float = 1.0


def gate_report(
    m: ModelSpec, context: int, prefill_tps: float, cases: Sequence[GateCase], tensor_parallel: int = 1
) -> GateReport:
    """The fetch gate (costs.should_fetch) for each case."""
    kvpt = costs.kv_bytes_per_token(m, tensor_parallel)
    rows = []
    for c in cases:
        d = costs.should_fetch(context, kvpt, c.bw_bytes_per_s, c.rtt_s, prefill_tps, c.compression)
        rows.append(
            GateRow(
                case=c.label,
                net_bw_bytes_per_s=c.bw_bytes_per_s,
                rtt_s=c.rtt_s,
                compression=c.compression,
                fetch_s=round(d.fetch_s, 4),
                recompute_s=round(d.recompute_s, 4),
                verdict=d.verdict,
                reason=d.reason,
            )
        )
    return GateReport(
        model=m.key, kv_bytes_per_token=kvpt, context_tokens=context, prefill_tokens_per_s=prefill_tps, cases=rows
    )


# -- capacity --------------------------------------------------------------------------------------


def capacity_report(
    m: ModelSpec,
    tokens: int | None,
    headroom: float,
    tiers_bytes: Mapping[str, float],
    tokens_per_user: int,
    target_usage: float,
    tensor_parallel: int = 1,
) -> CapacityReport:
    """Bytes for ``tokens`` cached tokens, and what each tier (name -> bytes) holds at ``target_usage``."""
    kvpt = costs.kv_bytes_per_token(m, tensor_parallel)
    need = None
    if tokens is not None:
        plan = costs.bytes_for_tokens(m, tokens, headroom, tensor_parallel)
        need = TokensNeed(
            tokens=tokens, kv_bytes=plan.kv_bytes, with_headroom_bytes=plan.with_headroom_bytes, headroom=headroom
        )
    tiers = {
        name: TierHolds(
            capacity_bytes=b,
            tokens=int(b * target_usage / kvpt),
            users=costs.users_per_tier(m, b, tokens_per_user, target_usage, tensor_parallel),
        )
        for name, b in tiers_bytes.items()
    }
    return CapacityReport(
        model=m.key,
        kv_bytes_per_token=kvpt,
        gib_per_million_tokens=costs.gib_per_million_tokens(m, tensor_parallel),
        tokens=need,
        tiers=tiers,
    )


# -- measured fetch costs --------------------------------------------------------------------------


def fetch_report(
    tier_costs: Sequence[TierReadCost],
    source: FetchSource,
    m: ModelSpec,
    prefill_tps: float,
    contexts: Sequence[int],
    tensor_parallel: int = 1,
) -> FetchReport:
    """Fetch vs recompute per tier and context from measured reads; the verdict is on p95."""
    kvpt = costs.kv_bytes_per_token(m, tensor_parallel)
    rows = []
    for tc in tier_costs:
        for ctx in contexts:
            nbytes = ctx * kvpt
            f_p95 = tc.fetch_s(nbytes, True)
            rec = costs.recompute_s(ctx, prefill_tps)
            rows.append(
                FetchRow(
                    tier=tc.tier,
                    context_tokens=ctx,
                    kv_bytes=nbytes,
                    measured_mean_op_bytes=tc.mean_bytes,
                    measured_read_mean_ms=tc.mean_ms,
                    measured_read_p95_ms=tc.p95_ms,
                    fetch_mean_s=tc.fetch_s(nbytes, False),
                    fetch_p95_s=f_p95,
                    recompute_s=rec,
                    verdict="fetch" if f_p95 < rec else "recompute",
                    extrapolated=tc.extrapolated(nbytes),
                )
            )
    return FetchReport(source=source, model=m.key, kv_bytes_per_token=kvpt, rows=rows)


__all__ = [
    "catalog_report",
    "bytes_report",
    "breakeven_report",
    "gate_report",
    "capacity_report",
    "fetch_report",
    "Link",
    "GateCase",
    "FetchSource",
    "CatalogReport",
    "BytesReport",
    "BreakevenReport",
    "GateReport",
    "CapacityReport",
    "FetchReport",
]
