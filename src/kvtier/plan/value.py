"""``kvtier plan value``: does a KV tier pay? The placement model's hit_rate × (reprefill − fetch) against the
tier's cost, fed by measurement.

From a replay against the sim (its folder: summary.json and requests.jsonl with the server's TTFT
decomposition), per offload tier:

* tokens served = Σ the tier's share of the ok requests' prompts (``prompt_sources``), and per hour over the
  replay's wall time; its hit rate = those tokens / all prompt tokens;
* prefill avoided = tokens served / the prefill rate (measured: Σ recompute seconds / Σ recomputed tokens of
  the same replay, the GPU's wait included; or ``--prefill-tps`` given);
* fetch cost = the replay's own fetch seconds, split among the tiers by the tokens each served (the
  decomposition times the fetch as a whole), or with ``--fetch-from BENCH`` the bench's measured read
  bandwidth of that tier (bytes = tokens × the model's KV bytes per token);
* latency saved per request that hit = (prefill avoided − fetch) / requests that hit it;
* with ``--gpu-cost`` ($/GPU-hour) the value of the GPU time saved *net of the fetch* (prefill avoided − fetch:
  a tier whose fetches take as long as the recompute they replace is worth nothing), with ``--store-cost``
  ($/GB-month) and ``--store-gb TIER=GB`` the tier's cost, whether it pays, and the break-even hit rate (the
  value is linear in the hit rate: break-even = hit rate × cost / value; none when the value is not positive,
  since no hit rate makes it pay).

Every input is marked measured or given, and nothing absent is guessed: a figure whose input is missing is
null.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.errors import DatasetError
from kvtier.results.ladder import TwinError
from kvtier.results.plan import Input, LadderCheckRow, TierValue, ValueReport
from kvtier.results.records import RequestRecord, read_records
from kvtier.results.replay import ReplayResult, offload_sources

HOURS_PER_MONTH = 730.0


def economics(hit_rate: float, value: float | None, cost: float | None) -> dict[str, Any]:
    """A tier's value and cost per hour, whether it pays, and the break-even hit rate (the value is linear in the
    hit rate: break-even = hit rate x cost / value); None where an input is absent. ``value`` is the GPU time
    saved net of the fetch: a tier whose value is not positive does not pay at any cost and has no break-even."""
    if value is None:
        pays = None
    elif value <= 0:
        pays = False
    else:
        pays = None if cost is None else value >= cost
    breakeven = None
    if value is not None and value > 0 and cost is not None:
        breakeven = round(hit_rate * cost / value, 6)
    return {
        "value_usd_per_hour": None if value is None else round(value, 6),
        "cost_usd_per_hour": None if cost is None else round(cost, 6),
        "pays": pays,
        "breakeven_hit_rate": breakeven,
    }


def in_time(hit_rate: float, avoided: float | None, fetch: float | None) -> str | None:
    """Whether a tier's hits paid in time, in words, with its hit rate beside its fetch time (a high hit rate alone
    reads as success): None where the prefill avoided or the fetch is not known."""
    if avoided is None or fetch is None or avoided <= 0:
        return None
    ratio = fetch / avoided
    if ratio > 1:
        return (
            f"hits, but the fleet got slower: it served {hit_rate:.1%} of the prompt tokens and fetching them took "
            f"{ratio:.2f}x the prefill they replaced — without this tier TTFT would have been lower"
        )
    return f"pays in time: it served {hit_rate:.1%} of the prompt tokens, fetched in {ratio:.2f}x the prefill replaced"


def gpu_value(gpu_cost: float | None, saved_s_per_hour: float | None) -> float | None:
    """$/hour of the GPU seconds a tier saves per hour, net of its fetches (``saved_s_per_hour`` = prefill avoided -
    fetch); None without a GPU cost or a saving."""
    if not gpu_cost or saved_s_per_hour is None:
        return None
    return gpu_cost * saved_s_per_hour / 3600.0


Term = tuple[float, bool]
"""One of the two times a saving is the difference of, per hour, and whether the twin predicted it (else it came
from elsewhere: a given prefill rate, a bench's bandwidth, and carries no band)."""


def with_twin(
    row: TierValue,
    err: TwinError | None,
    avoided: Term | None,
    fetch: Term | None,
    hits_per_hour: float,
    gpu_cost: float | None,
    cost: float | None,
    terms_are_columns: bool = True,
) -> TierValue:
    """``row`` with the times a calibrated twin predicted as the intervals its measured error allows (results/ladder.py
    ``TwinError``). The saving avoided - fetch is bounded as a difference of two times each off by its own ratio —
    [avoided x low - fetch x high, avoided x high - fetch x low], a term the twin did not predict held as it is — so a
    tier whose fetch nearly equals the prefill it replaces gets an interval that holds zero; then the latency saved
    per hit and the value; ``pays_tie`` where the value's interval holds the store's cost (zero without one): the
    twin cannot tell whether the tier pays. ``terms_are_columns``: the two terms are the row's prefill-avoided and
    fetch columns (a ladder's saving is a difference of two prefills instead, shown only as the saving)."""
    if err is None or avoided is None or fetch is None or not (avoided[1] or fetch[1]):
        return row

    def band(t: Term) -> tuple[float, float]:
        return err.band(t[0]) if t[1] else (t[0], t[0])

    ab, fb = band(avoided), band(fetch)
    saved = (ab[0] - fb[1], ab[1] - fb[0])
    value = None if not gpu_cost else (gpu_cost * saved[0] / 3600.0, gpu_cost * saved[1] / 3600.0)

    def r6(b: tuple[float, float] | None) -> tuple[float, float] | None:
        return None if b is None else (round(b[0], 6), round(b[1], 6))

    return row.model_copy(
        update={
            "prefill_s_avoided_per_hour_band": r6(ab) if terms_are_columns and avoided[1] else None,
            "fetch_s_per_hour_band": r6(fb) if terms_are_columns and fetch[1] else None,
            "gpu_s_saved_per_hour_band": r6(saved),
            "latency_saved_per_hit_s_band": r6((saved[0] / hits_per_hour, saved[1] / hits_per_hour))
            if hits_per_hour
            else None,
            "value_usd_per_hour_band": r6(value),
            "pays_tie": value is not None and value[0] < (cost if cost is not None else 0.0) <= value[1],
        }
    )


def fetch_shares(r: RequestRecord, served_by: dict[str, int]) -> dict[str, float]:
    """How a request's fetch divides among the tiers that served it: by each tier's own read time where the engine
    measured it (``engine.load_io_s``), else by the tokens each served."""
    io = {k: v for k, v in (r.engine.load_io_s if r.engine else {}).items() if k in served_by and v > 0}
    weights: dict[str, float] = io if io else {k: float(v) for k, v in served_by.items()}
    total = sum(weights.values())
    return {k: v / total for k, v in weights.items()} if total else {}


def decomposed_records(folder: Path) -> tuple[list[RequestRecord], ReplayResult]:
    """The ok records of a replay folder that carry the sim's TTFT decomposition, and the replay's result."""
    from kvtier.results import load

    result = load(folder)
    if not isinstance(result, ReplayResult):
        raise DatasetError(f"{folder}: a {result.benchmark} result, not a kvtier replay")
    base = folder if folder.is_dir() else folder.parent
    path = base / "requests.jsonl"
    if not path.is_file():
        raise DatasetError(f"{path}: missing (plan value reads the per-request records beside summary.json)")
    rows = [r for _, r in read_records(path) if r.ok and r.server_ttft_parts is not None]
    if not rows:
        raise DatasetError(
            f"{path}: no ok request carries the server's TTFT decomposition (a replay against kvtier sim has it; "
            "against a real vLLM, kvtier's offload spec with request_log and kvtier replay --engine-log, which "
            "kvtier launch passes, measure it in the engine; else --ladder prices the cached tokens)"
        )
    return rows, result


def no_offload_hits(folder: Path, requests: int, prompt: int, recomputed: int) -> str:
    """Why a replay has no tier to value, and what to change: nothing was served from an offload tier."""
    reused = prompt - recomputed
    why = (
        f"{reused:,} of its {prompt:,} prompt tokens were reused and every one came from the server's GPU cache: the "
        "GPU held every prefix, so nothing was pushed out to the offload tier (replay more requests, or give "
        "kvtier sim a smaller --gpu-kv-gb that still holds the longest prompt, so prefixes overflow into it)"
        if reused
        else f"all {prompt:,} prompt tokens were computed: no prefix was reused (a dataset with multi-turn sessions "
        "has reuse; see the replay's reuse_opportunity)"
    )
    return (
        f"{folder}: no offload tier served any of the {requests} ok requests, so there is no tier to value: "
        f"{why}; or the server has no offload tier (kvtier sim --offload cpu)"
    )


def value_report(
    replay: str | Path,
    prefill_tps: float | None = None,
    gpu_cost: float | None = None,
    store_cost: float | None = None,
    store_gb: dict[str, float] | None = None,
    fetch_bw: dict[str, float] | None = None,
    kv_bytes_per_token: int | None = None,
) -> ValueReport:
    """The value of each offload tier a replay's requests were served from (module docstring).
    ``fetch_bw``: bytes/s per tier measured by a bench (with ``kv_bytes_per_token``), else the replay's own."""
    folder = Path(replay)
    rows, result = decomposed_records(folder)
    twin = result.summary.twin  # against a calibrated sim: its times carry the calibration's error
    wall = float(result.wall_s)
    store_gb = store_gb or {}
    tokens: dict[str, int] = {}
    hits: dict[str, int] = {}
    prompt = recomputed = 0
    fetch_s = recompute_s = 0.0
    fetch_by_tier: dict[str, float] = {}
    measured_in_engine = 0
    for r in rows:
        src = r.prompt_sources or {}
        parts = r.server_ttft_parts or {}
        prompt += sum(src.values())
        recomputed += src.get("recomputed", 0)
        fetch_s += parts.get("fetch", 0.0)
        recompute_s += parts.get("recompute", 0.0)
        served_by = offload_sources(src)
        for k, v in served_by.items():
            tokens[k] = tokens.get(k, 0) + v
            hits[k] = hits.get(k, 0) + 1
        for k, share in fetch_shares(r, served_by).items():
            fetch_by_tier[k] = fetch_by_tier.get(k, 0.0) + parts.get("fetch", 0.0) * share
        measured_in_engine += r.decomposition == "measured-in-engine"
    if not tokens:
        raise DatasetError(no_offload_hits(folder, len(rows), prompt, recomputed))
    inputs: list[Input] = []
    if prefill_tps is not None:
        rate: float | None = prefill_tps
        inputs.append(Input(name="prefill rate", value=prefill_tps, unit="tokens/s", source="given"))
    elif recomputed and recompute_s > 0:
        rate = recomputed / recompute_s
        note = "the replay's recomputed tokens / recompute seconds (the GPU's wait included)"
        inputs.append(Input(name="prefill rate", value=round(rate, 1), unit="tokens/s", source="measured", note=note))
    else:
        rate = None
        inputs.append(Input(name="prefill rate", value=None, unit="tokens/s", source="absent"))
    if fetch_bw:
        inputs.append(
            Input(
                name="fetch",
                value=None,
                unit="bytes/s per tier",
                source="measured",
                note="the bench's read bandwidth of each tier (--fetch-from)",
            )
        )
    else:
        note = (
            "each hit's wait for its loads, measured in the engine (admitted -> loaded), split among its tiers by "
            "their reads' own time"
            if measured_in_engine
            else "the replay's fetch seconds, each request's split among its tiers by the tokens each served"
        )
        inputs.append(Input(name="fetch", value=round(fetch_s, 6), unit="s in all", source="measured", note=note))
    inputs.append(Input(name="GPU cost", value=gpu_cost, unit="$/GPU-hour", source="given" if gpu_cost else "absent"))
    inputs.append(
        Input(name="store cost", value=store_cost, unit="$/GB-month", source="given" if store_cost else "absent")
    )
    out = []
    hour = 3600.0 / wall if wall > 0 else 0.0
    for tier, n in sorted(tokens.items(), key=lambda kv: -kv[1]):
        per_hour = n * hour
        avoided = per_hour / rate if rate else None
        if fetch_bw and tier in fetch_bw and kv_bytes_per_token:
            fetch = per_hour * kv_bytes_per_token / fetch_bw[tier]
        elif not fetch_bw:
            fetch = fetch_by_tier.get(tier, 0.0) * hour
        else:
            fetch = None
        saved = avoided - fetch if avoided is not None and fetch is not None else None
        per_hit = saved / (hits[tier] * hour) if saved is not None and hits[tier] and hour else None
        value = gpu_value(gpu_cost, saved)
        gb = store_gb.get(tier)
        cost = store_cost * gb / HOURS_PER_MONTH if store_cost and gb else None
        hit_rate = n / prompt if prompt else 0.0
        out.append(
            with_twin(
                TierValue(
                    tier=tier,
                    tokens_served=n,
                    hit_rate=round(hit_rate, 6),
                    requests_hit=hits[tier],
                    tokens_per_hour=round(per_hour, 1),
                    prefill_s_avoided_per_hour=None if avoided is None else round(avoided, 3),
                    fetch_s_per_hour=None if fetch is None else round(fetch, 3),
                    gpu_s_saved_per_hour=None if saved is None else round(saved, 3),
                    latency_saved_per_hit_s=None if per_hit is None else round(per_hit, 6),
                    in_time=in_time(hit_rate, avoided, fetch),
                    **economics(hit_rate, value, cost),
                ),
                twin.error if twin else None,
                None if avoided is None else (avoided, prefill_tps is None),  # the twin's recompute rate, not given
                None if fetch is None else (fetch, not fetch_bw),  # the twin's fetch seconds, not a bench's bandwidth
                hits[tier] * hour,
                gpu_cost,
                cost,
            )
        )
    return ValueReport(
        source=str(folder),
        requests=len(rows),
        wall_s=round(wall, 3),
        prompt_tokens=prompt,
        inputs=inputs,
        tiers=out,
        decomposition="measured-in-engine" if measured_in_engine == len(rows) else "sim",
        twin_error=twin.error if twin else None,
    )


def engine_measured(replay: str | Path) -> bool:
    """Whether a replay's ok requests carry parts measured in the engine (``--engine-log``), not the sim's."""
    try:
        rows, _ = decomposed_records(Path(replay))
    except DatasetError:
        return False
    return all(r.decomposition == "measured-in-engine" for r in rows)


def ladder_check(replay: str | Path, ladder: str | Path) -> list[LadderCheckRow]:
    """The engine-measured fetch (per tier) and recompute of a replay's requests beside what the ladder's curves
    predict for the same requests (their tokens by source): the ladder's error on this replay."""
    from kvtier.results.ladder import load_fitted

    rows, _ = decomposed_records(Path(replay))
    _, fit = load_fitted(str(ladder), "--ladder")
    timing = fit.timing
    measured: dict[str, float] = {}
    predicted: dict[str, float | None] = {}
    count: dict[str, int] = {}
    for r in rows:
        src = r.prompt_sources or {}
        parts = r.server_ttft_parts or {}
        served_by = offload_sources(src)
        new = src.get("recomputed", 0)
        items: list[tuple[str, float, float | None]] = [
            ("recompute", parts.get("recompute", 0.0), timing.prefill.compute_s(new, sum(src.values()) - new))
        ]
        for tier, share in fetch_shares(r, served_by).items():
            model = timing.fetch_for(tier)
            items.append(
                (f"fetch:{tier}", parts.get("fetch", 0.0) * share, model.seconds(served_by[tier]) if model else None)
            )
        for part, m, p in items:
            measured[part] = measured.get(part, 0.0) + m
            count[part] = count.get(part, 0) + 1
            before = predicted.get(part, 0.0)
            predicted[part] = None if p is None or before is None else before + p
    out = []
    for part in sorted(measured):
        m, p = measured[part], predicted[part]
        err = None if p is None or m <= 0 else round((p - m) / m, 6)
        out.append(
            LadderCheckRow(
                part=part,
                requests=count[part],
                measured_s=round(m, 6),
                ladder_s=None if p is None else round(p, 6),
                error=err,
            )
        )
    return out


def usage_records(folder: Path) -> tuple[list[RequestRecord], ReplayResult]:
    """The ok records of a replay against any server (a real vLLM too), and the replay's result: where a record has
    no prompt sources (the sim's extension), its prompt is split by usage.prompt_tokens_details.cached_tokens into
    ``gpu`` (cached: usage cannot tell the GPU's hits from an offload tier's) and ``recomputed``."""
    from kvtier.results import load

    result = load(folder)
    if not isinstance(result, ReplayResult):
        raise DatasetError(f"{folder}: a {result.benchmark} result, not a kvtier replay")
    path = (folder if folder.is_dir() else folder.parent) / "requests.jsonl"
    rows = []
    for _, r in read_records(path):
        if not r.ok or not r.prompt_tokens:
            continue
        if not r.prompt_sources:
            if r.cached_tokens is None:
                continue
            split = {"gpu": r.cached_tokens, "recomputed": r.prompt_tokens - r.cached_tokens}
            r = r.model_copy(update={"prompt_sources": split})
        rows.append(r)
    if not rows:
        raise DatasetError(
            f"{path}: no ok request reports usage.prompt_tokens_details.cached_tokens (vLLM needs "
            "--enable-prompt-tokens-details)"
        )
    return rows, result


def ladder_value_report(
    replay: str | Path,
    ladder: str | Path,
    gpu_cost: float | None = None,
    store_cost: float | None = None,
    store_gb: dict[str, float] | None = None,
) -> ValueReport:
    """What the prefix cache saved a replay against any server (a real vLLM too: no per-request decomposition),
    derived from a ladder of that server: each ok request's cached tokens c (usage.prompt_tokens_details) of its
    prompt p saved prefill_s(p, 0) − prefill_s(p − c, c) (results/ladder.py ``PrefillModel``). The cached tokens
    cannot be told apart by tier from usage, so they are one row, ``cache``; a fetch from an offload tier is not
    charged (the ladder's fetch curves say what it costs where the server's counters split the hits). Every
    derived figure is marked ``derived``, not measured per request."""
    from kvtier.results.ladder import load_fitted, twin_error

    folder = Path(replay)
    _, fit = load_fitted(str(ladder), "--ladder")
    err = twin_error(fit, ladder)
    pm = fit.timing.prefill
    usable, result = usage_records(folder)
    wall = float(result.wall_s)
    hour = 3600.0 / wall if wall > 0 else 0.0
    prompt = sum(r.prompt_tokens or 0 for r in usable)
    cached_of = [(r.prompt_tokens or 0) - (r.prompt_sources or {}).get("recomputed", 0) for r in usable]
    cached = sum(cached_of)
    if not cached:
        raise DatasetError(
            f"{folder}: none of the {len(usable)} ok requests had a cached prompt token (usage.prompt_tokens_details."
            "cached_tokens): the prefix cache saved nothing to value (a dataset with multi-turn sessions has reuse; "
            "see the replay's reuse_opportunity)"
        )
    hit = [(r.prompt_tokens or 0, c) for r, c in zip(usable, cached_of) if c]
    cold, rest = sum(pm.seconds(p) for p, _ in hit), sum(pm.seconds(p - c, c) for p, c in hit)
    saved = cold - rest
    longest = fit.timing.range.max_prompt_tokens if fit.timing.range else None
    extrapolated = sum(1 for r in usable if longest is not None and (r.prompt_tokens or 0) > longest)
    note = f"the ladder's fitted prefill ({ladder}); {extrapolated} prompts longer than it measured (extrapolated)"
    inputs = [
        Input(
            name="prefill",
            value=round(pm.s_per_token, 9),
            unit="s/token (+ attention term)",
            source="derived",
            note=note,
        ),
        Input(
            name="cached tokens",
            value=float(cached),
            unit="tokens",
            source="measured",
            note="usage.prompt_tokens_details.cached_tokens of each ok request",
        ),
        Input(name="GPU cost", value=gpu_cost, unit="$/GPU-hour", source="given" if gpu_cost else "absent"),
        Input(name="store cost", value=store_cost, unit="$/GB-month", source="given" if store_cost else "absent"),
    ]
    value = gpu_value(gpu_cost, saved * hour)
    gb = (store_gb or {}).get("cache")
    cost = store_cost * gb / HOURS_PER_MONTH if store_cost and gb else None
    rate = cached / prompt if prompt else 0.0
    row = TierValue(
        tier="cache",
        tokens_served=cached,
        hit_rate=round(rate, 6),
        requests_hit=len(hit),
        tokens_per_hour=round(cached * hour, 1),
        prefill_s_avoided_per_hour=round(saved * hour, 3),
        fetch_s_per_hour=None,
        gpu_s_saved_per_hour=round(saved * hour, 3),
        latency_saved_per_hit_s=round(saved / len(hit), 6) if hit else None,
        **economics(rate, value, cost),
    )
    return ValueReport(
        source=str(folder),
        requests=len(usable),
        wall_s=round(wall, 3),
        prompt_tokens=prompt,
        inputs=inputs,
        # the saving as a difference of the fit's two prefills: the whole prompt's and the rest after the hit
        tiers=[with_twin(row, err, (cold * hour, True), (rest * hour, True), len(hit) * hour, gpu_cost, cost, False)],
        twin_error=err,
    )


__all__ = [
    "ValueReport",
    "TierValue",
    "Input",
    "value_report",
    "ladder_value_report",
    "ladder_check",
    "engine_measured",
    "usage_records",
    "economics",
    "gpu_value",
]
