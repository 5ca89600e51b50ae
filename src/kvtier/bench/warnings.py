"""The warnings a finished bench run implies (set-up warnings come first, from plan and components): what
was excluded, what the page cache or the mount may have done to the figures, work that failed or was
dropped, and doubts about the measurement itself. Every code is in docs/metrics.md."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvtier.bench.facts import DEVICE_OTHER_TRAFFIC_WARN, gds_section
from kvtier.bench.plan import Plan
from kvtier.bench.runner import RunOutcome
from kvtier.bench.setup import Components
from kvtier.results.envelope import ResultWarning, Status, StopReason, WarningCode, warning
from kvtier.telemetry.host import mem_total_bytes, mount_options
from kvtier.telemetry.recorder import Recorder
from kvtier.units import GiB


@dataclass(frozen=True)
class Finished:
    """What a rule reads of a finished run."""

    plan: Plan
    comp: Components
    rec: Recorder
    run: RunOutcome
    tiers: dict[str, dict[str, Any]]
    verdict: tuple[Status, StopReason, list[ResultWarning]]
    dropped: dict[str, Any]


Rule = Callable[[Finished], Iterable[ResultWarning]]


def _rag(f: Finished) -> Iterable[ResultWarning]:
    if f.plan.config.enable_rag:
        yield warning(
            WarningCode.rag_ingest_excluded,
            "--enable-rag: the RAG corpus was ingested before the run; its writes are reported in "
            "summary.rag_stats.ingest and excluded from the tier statistics",
        )


def _prepopulated(f: Finished) -> Iterable[ResultWarning]:
    if n := f.run.prepopulated_entries:
        yield warning(
            WarningCode.prepopulation_excluded,
            f"--decode-only: {n} entries were written before the run and are excluded from the statistics",
            entries=n,
        )


def _precondition(f: Finished) -> Iterable[ResultWarning]:
    pre: dict[str, Any] = dict(f.run.setup.get("precondition") or {})
    if pre and not pre.get("completed"):
        req, got = int(pre["requested_bytes"]), int(pre["written_bytes"])
        errs = [str(e) for e in pre.get("errors") or []]
        why = f": {errs[0]}" if errs else " (stopped)"
        yield warning(
            WarningCode.precondition_short,
            f"--precondition wrote {got / GiB:.2f} of the {req / GiB:.2f} GB asked{why}; the device is less "
            "conditioned than asked (setup.precondition)",
            requested_bytes=req,
            written_bytes=got,
            shortfall_bytes=req - got,
        )


def _page_cache(f: Finished) -> Iterable[ResultWarning]:
    written = f.tiers["storage"]["write"]["bytes"] if "storage" in f.tiers else 0
    if not f.comp.file_tier.direct and written < 0.5 * mem_total_bytes():
        yield warning(
            WarningCode.working_set_fits_page_cache,
            "working set fits in page cache and direct I/O is off: reads may be served from RAM (fadvise DONTNEED "
            "is applied, but check process_io)",
            storage_bytes_written=written,
            mem_total_bytes=mem_total_bytes(),
        )


def _discard(f: Finished) -> Iterable[ResultWarning]:
    folder = f.comp.file_tier.directory
    if not f.comp.trace_mode and "discard" in mount_options(folder):
        yield warning(
            WarningCode.discard_mount,
            f"{folder}: its filesystem is mounted with 'discard': every deleted entry reaches the drive as a trim at "
            "once, which frees flash blocks and moves it away from the steady state a preconditioned drive is "
            "measured in (mount without discard and run fstrim between runs)",
            path=str(folder),
        )


def _gds(f: Finished) -> Iterable[ResultWarning]:
    gds = gds_section(f.comp)
    if gds is not None and f.comp.gds["used"] and not gds["used"]:
        yield warning(
            WarningCode.gds_off,
            f"--gds {gds['requested']}: the file tier's payload did not go by GPUDirect Storage: {gds['reason']}",
            reason=gds["reason"],
        )


def _foreign(f: Finished) -> Iterable[ResultWarning]:
    if foreign := f.rec.counters.get("remote_foreign_entries", 0):
        yield warning(
            WarningCode.remote_foreign_entries,
            f"{foreign} lookups in the shared namespace {f.plan.config.remote_namespace} found something that is not "
            "the entry its key names (size, part count or expiry): counted as misses (foreign-entry), never read as "
            "hits. Another writer with other settings, or a hostile one, shares the namespace",
            remote_foreign_entries=foreign,
        )


def _host_short(f: Finished) -> Iterable[ResultWarning]:
    for name, short in f.comp.store.host_short().items():
        yield warning(
            WarningCode.host_memory_short,
            f"the {name} tier stopped growing at {short['capacity_bytes'] / GiB:.2f} of its "
            f"{short['configured_bytes'] / GiB:.2f} GiB: the host had {short['host_available_bytes'] / GiB:.2f} GiB "
            f"available and keeps {short['host_floor_bytes'] / GiB:.2f} GiB; entries made room within the smaller "
            "tier from then on (its figures are those of a smaller tier than asked)",
            tier=name,
            **short,
        )


def _errors(f: Finished) -> Iterable[ResultWarning]:
    if n := sum(f.rec.errors.values()):
        yield warning(
            WarningCode.errors_seen,
            f"{n} tier operations failed; see 'errors.tier_operations'",
            tier_operation_errors=n,
        )


def _failures(f: Finished) -> Iterable[ResultWarning]:
    return f.verdict[2]  # the verdict's own: what failed, by cause


def _requests_dropped(f: Finished) -> Iterable[ResultWarning]:
    cfg, load = f.plan.config, dict[str, Any](f.run.load)
    if not load.get("requests_dropped"):
        return
    ok = [r for r in f.rec.requests if r.ok]
    storage_s = sum(r.storage_ns for r in ok) / 1e9
    gen_s = sum(r.generation_ns for r in ok) / 1e9
    if cfg.io_trace_log or gen_s > storage_s:  # the workers' time went to the modelled generation, not the device
        busy = (
            f"the workers spent {gen_s:,.1f} s in the modelled generation (--generation-mode {cfg.generation_mode}) "
            f"against {storage_s:,.1f} s of storage I/O"
            + (", none of it real (--io-trace-log)" if cfg.io_trace_log else "")
            + ": the offered load was beyond what the run served (--generation-mode none, fewer --num-users, or "
            "--arrival closed)"
        )
    else:
        busy = (
            "the offered load was beyond what the storage served (fewer --num-users, or --arrival closed, measure it "
            "below saturation)"
        )
    yield warning(
        WarningCode.requests_dropped,
        f"{load['requests_dropped']} requests were dropped, not failed: under open arrival (the reference's) users "
        f"keep offering requests whatever the device does, and a request that finds --max-queued "
        f"{load['max_queued']} waiting is dropped with the KV it would have moved "
        f"({load['requests_dropped_bytes'] / GiB:.2f} GB): {busy}",
        requests_dropped=load["requests_dropped"],
        requests_dropped_bytes=load["requests_dropped_bytes"],
    )


def _stores_dropped(f: Finished) -> Iterable[ResultWarning]:
    d = f.dropped
    if d["stores_dropped"]:
        yield warning(
            WarningCode.stores_dropped,
            f"{d['stores_dropped']} stores ({d['stores_dropped_bytes'] / GiB:.2f} GB) were dropped: no tier could "
            "take them (" + ", ".join(f"{c} {n}" for c, n in d["stores_dropped_by_cause"].items()) + "); their "
            "requests completed and later reads of them missed (not failures)",
            **d,
        )


def _nothing_completed(f: Finished) -> Iterable[ResultWarning]:
    """A run that completed no request says why (#58 item 17: a Mooncake-trace bench whose first prompts needed
    about 5 GB of KV each ran 15 s and said only ``run failed (duration)``): what its requests waited for, how much
    the largest needed, and the tier size that would hold one."""
    started = f.rec.requests
    if f.rec.ok_requests or not started:
        return
    need = max(f.plan.entry_bytes(r.context_tokens) for r in started)
    room_s = f.rec.counters.get("reserve_wait_ns", 0) / 1e9
    expired = f.rec.counters.get("reserve_waits_expired", 0)
    slot_s = sum(r.alloc_wait_ns for r in started) / 1e9
    sizes = {name: u["capacity_bytes"] for name, u in f.comp.store.usage().items()}
    allocs = f.plan.config.max_concurrent_allocs
    tiers = ", ".join(f"{n} {c / GiB:.1f} GiB" for n, c in sizes.items()) or "none"
    waited = (
        f"requests waited {room_s:.1f} s in all for room in a tier ({expired} waits gave up: the room was held by "
        "writes in flight or entries in use)"
        if room_s
        else "no request waited for room in a tier"
    )
    hold = max(sizes.values(), default=0) >= need
    yield warning(
        WarningCode.nothing_completed,
        f"no request completed ({len(started)} started): {waited}; the largest needed {need / GiB:.2f} GiB of KV "
        f"for its prompt of {max(r.context_tokens for r in started):,} tokens; the tiers hold {tiers}"
        + (
            f"; a tier of at least {need / GiB:.1f} GiB holds one such entry"
            + (
                f", {allocs * need / GiB:.1f} GiB the {allocs} written at once (--max-concurrent-allocs)"
                if allocs
                else ""
            )
            + " (--cpu-mem-gb, --storage-capacity-gb), or fewer --num-users, or a longer --duration"
            if not hold or room_s
            else "; a longer --duration, or fewer --num-users"
        ),
        requests_started=len(started),
        largest_entry_bytes=need,
        reserve_wait_s=round(room_s, 3),
        reserve_waits_expired=expired,
        alloc_wait_s=round(slot_s, 3),
        tier_capacity_bytes=sizes,
    )


def _not_complete(f: Finished) -> Iterable[ResultWarning]:
    status, stop, _ = f.verdict
    if status != Status.complete:
        yield warning(
            WarningCode.run_not_complete,
            f"run is {status.value}: {stop.message}",
            status=status.value,
            stop_code=stop.code.value,
        )


RULES: tuple[Rule, ...] = (
    _rag,
    _prepopulated,
    _precondition,
    _page_cache,
    _discard,
    _gds,
    _foreign,
    _host_short,
    _errors,
    _failures,
    _requests_dropped,
    _stores_dropped,
    _nothing_completed,
    _not_complete,
)
"""The rules over a finished run, in the order their warnings are listed."""


def run_warnings(
    plan: Plan,
    comp: Components,
    rec: Recorder,
    run: RunOutcome,
    tiers: dict[str, dict[str, Any]],
    verdict: tuple[Status, StopReason, list[ResultWarning]],
    dropped: dict[str, Any],
) -> list[ResultWarning]:
    """Warnings the finished run implies: the set-up's (from plan and components) first, then each rule's."""
    f = Finished(plan, comp, rec, run, tiers, verdict, dropped)
    return [*plan.warnings, *comp.warnings, *(w for rule in RULES for w in rule(f))]


def measurement_warnings(
    latency_tracing: dict[str, Any] | None, io_trace: dict[str, Any] | None, device: dict[str, Any]
) -> list[ResultWarning]:
    """Warnings about the measurement itself: no block-layer histograms, an I/O trace with holes, a
    storage device that other traffic shared."""
    warnings: list[ResultWarning] = []
    if latency_tracing is not None and not latency_tracing.get("traced"):
        warnings.append(
            warning(
                WarningCode.latency_tracing_unavailable,
                f"--enable-latency-tracing: no block-layer histograms: {latency_tracing.get('reason')}; "
                "the device section's diskstats figures stand in",
                reason=latency_tracing.get("reason"),
            )
        )
    if io_trace is not None and (io_trace["error"] or io_trace["rows_dropped"]):
        warnings.append(
            warning(
                WarningCode.io_trace_incomplete,
                f"the I/O trace misses {io_trace['rows_dropped']} operations: "
                f"{io_trace['error'] or 'written after the end'}",
                rows_dropped=io_trace["rows_dropped"],
            )
        )
    shared = {
        op: f for op, f in (device["other_traffic_fraction"] or {}).items() if f and f > DEVICE_OTHER_TRAFFIC_WARN
    }
    if shared:
        warnings.append(
            warning(
                WarningCode.device_shared,
                "the storage device moved more than ours: "
                + ", ".join(f"{op} {f:.0%} not from this run" for op, f in shared.items())
                + f" ({', '.join(device['devices'])}); its figures include other traffic",
                devices=device["devices"],
                other_traffic_fraction=device["other_traffic_fraction"],
            )
        )
    return warnings
