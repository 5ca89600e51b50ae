"""The warnings a finished bench run implies (set-up warnings come first, from plan and components): what
was excluded, what the page cache or the mount may have done to the figures, work that failed or was
dropped, and doubts about the measurement itself. Every code is in docs/metrics.md."""

from __future__ import annotations

from typing import Any

from kvtier.bench.facts import DEVICE_OTHER_TRAFFIC_WARN, gds_section
from kvtier.bench.plan import Plan
from kvtier.bench.runner import RunOutcome
from kvtier.bench.setup import Components
from kvtier.results.envelope import ResultWarning, Status, StopReason, WarningCode, warning
from kvtier.telemetry.host import mem_total_bytes, mount_options
from kvtier.telemetry.recorder import Recorder
from kvtier.units import GiB


def run_warnings(
    plan: Plan,
    comp: Components,
    rec: Recorder,
    run: RunOutcome,
    tiers: dict[str, dict[str, Any]],
    verdict: tuple[Status, StopReason, list[ResultWarning]],
    dropped: dict[str, Any],
) -> list[ResultWarning]:
    """Warnings the finished run implies (set-up warnings come first, from plan and components)."""
    cfg = plan.config
    out = [*plan.warnings, *comp.warnings]
    if cfg.enable_rag:
        out.append(
            warning(
                WarningCode.rag_ingest_excluded,
                "--enable-rag: the RAG corpus was ingested before the "
                "run; its writes are reported in summary.rag_stats.ingest and excluded from the tier "
                "statistics",
            )
        )
    if run.prepopulated_entries:
        out.append(
            warning(
                WarningCode.prepopulation_excluded,
                f"--decode-only: {run.prepopulated_entries} entries "
                "were written before the run and are excluded from the statistics",
                entries=run.prepopulated_entries,
            )
        )
    pre: dict[str, Any] = dict(run.setup.get("precondition") or {})
    if pre and not pre.get("completed"):
        req, got = int(pre["requested_bytes"]), int(pre["written_bytes"])
        errs = [str(e) for e in pre.get("errors") or []]
        why = f": {errs[0]}" if errs else " (stopped)"
        out.append(
            warning(
                WarningCode.precondition_short,
                f"--precondition wrote {got / GiB:.2f} of the {req / GiB:.2f} GB asked{why}; the device is less "
                "conditioned than asked (setup.precondition)",
                requested_bytes=req,
                written_bytes=got,
                shortfall_bytes=req - got,
            )
        )
    written = tiers["storage"]["write"]["bytes"] if "storage" in tiers else 0
    if not comp.file_tier.direct and written < 0.5 * mem_total_bytes():
        out.append(
            warning(
                WarningCode.working_set_fits_page_cache,
                "working set fits in page cache and direct I/O "
                "is off: reads may be served from RAM (fadvise DONTNEED is applied, but check process_io)",
                storage_bytes_written=written,
                mem_total_bytes=mem_total_bytes(),
            )
        )
    if not comp.trace_mode and "discard" in mount_options(comp.file_tier.directory):
        out.append(
            warning(
                WarningCode.discard_mount,
                f"{comp.file_tier.directory}: its filesystem is mounted with 'discard': every deleted entry reaches "
                "the drive as a trim at once, which frees flash blocks and moves it away from the steady state "
                "a preconditioned drive is measured in (mount without discard and run fstrim between runs)",
                path=str(comp.file_tier.directory),
            )
        )
    gds = gds_section(comp)
    if gds is not None and comp.gds["used"] and not gds["used"]:
        out.append(
            warning(
                WarningCode.gds_off,
                f"--gds {gds['requested']}: the file tier's payload did not go by GPUDirect Storage: {gds['reason']}",
                reason=gds["reason"],
            )
        )
    foreign = rec.counters.get("remote_foreign_entries", 0)
    if foreign:
        out.append(
            warning(
                WarningCode.remote_foreign_entries,
                f"{foreign} lookups in the shared namespace {cfg.remote_namespace} found something that is not the "
                "entry its key names (size, part count or expiry): counted as misses (foreign-entry), never read as "
                "hits. Another writer with other settings, or a hostile one, shares the namespace",
                remote_foreign_entries=foreign,
            )
        )
    for name, short in comp.store.host_short().items():
        out.append(
            warning(
                WarningCode.host_memory_short,
                f"the {name} tier stopped growing at {short['capacity_bytes'] / 2**30:.2f} of its "
                f"{short['configured_bytes'] / 2**30:.2f} GiB: the host had "
                f"{short['host_available_bytes'] / 2**30:.2f} GiB available and keeps "
                f"{short['host_floor_bytes'] / 2**30:.2f} GiB; entries made room within the smaller tier from then on "
                "(its figures are those of a smaller tier than asked)",
                tier=name,
                **short,
            )
        )
    n_tier = sum(rec.errors.values())
    if n_tier:
        out.append(
            warning(
                WarningCode.errors_seen,
                f"{n_tier} tier operations failed; see 'errors.tier_operations'",
                tier_operation_errors=n_tier,
            )
        )
    status, stop, failed = verdict
    out += failed
    load: dict[str, Any] = dict(run.load)
    if load.get("requests_dropped"):
        ok = [r for r in rec.requests if r.ok]
        storage_s = sum(r.storage_ns for r in ok) / 1e9
        gen_s = sum(r.generation_ns for r in ok) / 1e9
        if cfg.io_trace_log or gen_s > storage_s:  # the workers' time went to the modelled generation, not the device
            busy = (
                f"the workers spent {gen_s:,.1f} s in the modelled generation (--generation-mode "
                f"{cfg.generation_mode}) against {storage_s:,.1f} s of storage I/O"
                + (", none of it real (--io-trace-log)" if cfg.io_trace_log else "")
                + ": the offered load was beyond what the run served (--generation-mode none, fewer "
                "--num-users, or --arrival closed)"
            )
        else:
            busy = (
                "the offered load was beyond what the storage served (fewer --num-users, or --arrival closed, "
                "measure it below saturation)"
            )
        out.append(
            warning(
                WarningCode.requests_dropped,
                f"{load['requests_dropped']} requests were dropped, not failed: under open arrival (the "
                "reference's) users keep offering requests whatever the device does, and a request that finds "
                f"--max-queued {load['max_queued']} waiting is dropped with the KV it would have moved "
                f"({load['requests_dropped_bytes'] / GiB:.2f} GB): {busy}",
                requests_dropped=load["requests_dropped"],
                requests_dropped_bytes=load["requests_dropped_bytes"],
            )
        )
    if dropped["stores_dropped"]:
        out.append(
            warning(
                WarningCode.stores_dropped,
                f"{dropped['stores_dropped']} stores ({dropped['stores_dropped_bytes'] / GiB:.2f} GB) were dropped: no "
                "tier could take them ("
                + ", ".join(f"{c} {n}" for c, n in dropped["stores_dropped_by_cause"].items())
                + "); their requests completed and later reads of them missed (not failures)",
                **dropped,
            )
        )
    if status != Status.complete:
        out.append(
            warning(
                WarningCode.run_not_complete,
                f"run is {status.value}: {stop.message}",
                status=status.value,
                stop_code=stop.code.value,
            )
        )
    return out


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
