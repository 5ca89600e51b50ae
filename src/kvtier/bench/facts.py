"""The sections of a bench result about where it ran rather than what it measured: the bytes the
kernel and the devices saw beside ours (process_io, device), memory against its documented bound, the
storage tier's facts (with --gds's outcome), the workload's source and the I/O trace's figures."""

from __future__ import annotations

from typing import Any

from kvtier.bench.plan import Plan
from kvtier.bench.runner import RunOutcome
from kvtier.bench.setup import Components
from kvtier.bench.tier_setup import host_tier_bytes
from kvtier.engine.device import DeviceNoise
from kvtier.results.bench import OPS
from kvtier.telemetry.host import peak_rss_bytes
from kvtier.telemetry.recorder import Recorder
from kvtier.units import GiB

PROCESS_BASE_BYTES = 256 * 1024**2
"""Allowance for the interpreter, numpy, threads and bookkeeping in the documented memory bound."""


def ratio(a: float, b: float, digits: int = 6) -> float | None:
    return round(a / b, digits) if b else None


def storage_bytes_on_disk(comp: Components, rec: Recorder) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Per direction: bytes the completed file-tier operations put on disk (header and padding
    included), and [ops, bytes] of those cancelled by the end of the run."""
    ft = comp.file_tier
    on_disk = {op: sum(ft.stored_size(s.nbytes) for s in rec.ops.get(("storage", op), [])) for op in OPS}
    cancelled = {op: rec.cancelled.get(("storage", op), [0, 0]) for op in OPS}
    return on_disk, cancelled


def process_io_section(run: RunOutcome, disk: tuple[dict[str, int], dict[str, list[int]]]) -> dict[str, Any]:
    """What the kernel says this process read and wrote, beside what the storage tier did (``disk``:
    storage_bytes_on_disk)."""
    delta = {k: run.io_after.get(k, 0) - run.io_before.get(k, 0) for k in ("read_bytes", "write_bytes")}
    on_disk, cancelled = disk
    expect = {op: on_disk[op] + cancelled[op][1] for op in OPS}
    return {
        "storage_tier_bytes_written_on_disk": on_disk["write"],
        "storage_tier_bytes_read_on_disk": on_disk["read"],
        "cancelled_ops": {"write": cancelled["write"][0], "read": cancelled["read"][0]},
        "cancelled_bytes": {"write": cancelled["write"][1], "read": cancelled["read"][1]},
        "process_write_bytes": delta["write_bytes"],
        "process_read_bytes": delta["read_bytes"],
        "write_ratio": ratio(delta["write_bytes"], expect["write"], 4),
        "read_ratio": ratio(delta["read_bytes"], expect["read"], 4),
    }


def memory_section(plan: Plan, comp: Components) -> dict[str, Any]:
    cpu_cap = host_tier_bytes(plan)[0] if not plan.config.io_trace_log else int(plan.config.cpu_mem_gb * GiB)
    writers = comp.noise.writer_buffer_bytes  # the writers' buffers, filled as far as their largest chunk
    if comp.device is not None:  # --gpu-native: the pinned host buffers device chunks bounce through
        writers += comp.device.bounce_bytes
    bound = comp.noise.nbytes + plan.io_slots * plan.io_chunk_bytes + writers + cpu_cap + PROCESS_BASE_BYTES
    peak = peak_rss_bytes()
    return {
        "peak_rss_bytes": peak,
        "bound_bytes": bound,
        "noise_buffer_bytes": comp.noise.nbytes,
        "io_slots": plan.io_slots,
        "io_chunk_bytes": plan.io_chunk_bytes,
        "cpu_tier_capacity_bytes": cpu_cap,
        "writer_buffer_bytes": writers,
        "within_bound": peak <= bound,
    }


def gds_section(comp: Components) -> dict[str, Any] | None:
    """storage.gds: what --gds resolved to, then, where the GDS tier ran, kvikio's account of the run
    (``used`` is then the evidence's, not the probe's: engine/gds.py)."""
    if not comp.gds:
        return None
    outcome = getattr(comp.file_tier, "outcome", None)
    return {**comp.gds, **outcome()} if comp.gds["used"] and outcome is not None else dict(comp.gds)


def gpu_native_section(comp: Components) -> dict[str, Any] | None:
    """storage.gpu_native: the device the entries were made in and read back into, and each byte's path."""
    dm, source = comp.device, comp.source
    if dm is None or not isinstance(source, DeviceNoise):
        return None
    return {
        "device": dm.name,
        "stand_in": dm.stand_in,
        "pinned_bounce": dm.pinned,
        "source": source.describe(),
        "paths": dm.paths.section(),
    }


def storage_section(comp: Components) -> dict[str, Any]:
    ft = comp.file_tier
    return {
        "cache_dir": comp.cache_dir,
        "run_dir": str(ft.directory),
        "direct_io": ft.direct,
        "direct_io_supported": ft.direct_io_supported,
        "capacity_bytes": ft.capacity_bytes,
        "detected_free_bytes": ft.detected_free_bytes,
        "tier_order": comp.store.tier_names,
        "gds": gds_section(comp),
        "remote_tiers": {t.name: getattr(t, "server", {}) for t in comp.remote},
        "payload": comp.noise.describe(),
        "gpu_native": gpu_native_section(comp),
    }


def source_section(plan: Plan) -> dict[str, Any]:
    w = plan.workload
    if w.trace is not None:
        t = w.trace
        return {
            "kind": "trace",
            "format": t.format,
            "files": t.files,
            "requests": len(t.requests),
            "skipped_rows": t.skipped_rows,
            "block_tokens": t.block_tokens,
        }
    if w.dataset is not None:
        d = w.dataset
        return {
            "kind": "dataset",
            "format": "sharegpt",
            "path": d.path,
            "conversations": len(d.conversations),
            "turns": sum(len(c.turns) for c in d.conversations),
            "tokenizer": d.tokenizer,
            "skipped_records": d.skipped_records,
        }
    return {"kind": "synthetic", "profiles": sorted(plan.config.tuning.user_templates)}


DEVICE_OTHER_TRAFFIC_WARN = 0.10  # a device share above this not ours: the run's figures are in doubt


def device_section(
    comp: Components, run: RunOutcome, resolution: str, disk: tuple[dict[str, int], dict[str, list[int]]]
) -> dict[str, Any]:
    """What the devices under the storage tier did over the load (diskstats), beside our own bytes."""
    ft = comp.file_tier
    sampler = run.device
    base: dict[str, Any] = {"path": str(ft.directory), "resolution": resolution}
    if sampler is None:
        return {**base, "devices": [], "totals": None, "timeline": [], "ours": None, "other_traffic_fraction": None}
    on_disk, cancelled = disk
    ours = {op: on_disk[op] + cancelled[op][1] for op in OPS}
    totals = sampler.totals()
    device = {"read": int(totals.get("read_bytes", 0)), "write": int(totals.get("write_bytes", 0))}
    other = {
        op: (round(max(0.0, 1 - ours[op] / device[op]), 4) if device[op] else None) for op in OPS
    }  # a direct-I/O run's bytes all reach the device: the rest is someone else's (or metadata)
    seconds = max(float(totals.get("seconds") or 0.0), 1e-9)
    return {
        **base,
        "devices": sampler.devices,
        "interval_s": sampler.interval_s,
        "totals": totals,
        "timeline": sampler.timeline(),
        "ours": {
            "storage_read_bytes_on_disk": ours["read"],
            "storage_write_bytes_on_disk": ours["write"],
        },
        "other_traffic_fraction": other,
        "sampler_cpu_seconds": round(sampler.cpu_seconds, 6),
        "sampler_cpu_fraction": round(sampler.cpu_seconds / seconds, 6),
    }


def io_trace_section(comp: Components, rec: Recorder, run: RunOutcome) -> dict[str, Any] | None:
    """The trace file's figures; rows by tier and operation come from the recorder (same events)."""
    stats = comp.io_trace_stats
    if stats is None:
        return None
    from kvtier.tracefile import OPERATIONS, TIER_LABELS

    load_s = (run.load_end_ns - run.start_ns) / 1e9
    by = {f"{TIER_LABELS.get(t, t)} {OPERATIONS[o]}": len(v) for (t, o), v in sorted(rec.ops.items()) if v}
    return {**stats, "rows_per_sec": round(int(stats["rows"]) / load_s, 1) if load_s > 0 else None, "by_tier_op": by}
