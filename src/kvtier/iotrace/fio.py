"""Distil an I/O trace into one fio job that reproduces its mix on a device.

What carries over, from the operations on the chosen tiers (default: the storage tier, Tier-2):

* block sizes: each object of S bytes is moved as pieces of at most ``max_bs`` (kvtier's file tier
  issues one call per ``--io-chunk-mb``), so S becomes floor(S/max_bs) I/Os of max_bs and one of the
  rest rounded up to 4 KiB. The pieces' sizes, grouped on a grid of four steps per power of two,
  become ``bssplit`` (reads, then writes), in percent of I/Os, summing to 100 in each direction;
* read/write mix: ``rwmixread`` from the pieces' counts (fio's mix counts I/Os, not bytes);
* rate: ``rate=`` the trace's mean read and write bytes/s over its duration (``--no-rate``: unpaced);
* duration: ``runtime=`` the trace's (at least 1 s), ``time_based``;
* direct I/O (``direct=1``) on a file of the working set's size under ``directory=``.

What does not: the trace records completion times, not queue depth (``iodepth`` is a flag), and it
records objects, not offsets (``rw=randrw`` over one file: kvtier's many per-entry files look like
large random I/O to the device).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvtier.config.iotrace import TraceFioConfig
from kvtier.errors import DatasetError
from kvtier.tracefile import IOTrace
from kvtier.units import GiB, MiB

ALIGN = 4096


def _grid(n: int) -> int:
    """Round a piece size up to 4 KiB, then up to a grid of four steps per power of two."""
    n = max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)
    if n <= 4 * ALIGN:
        return n
    e = int(math.floor(math.log2(n)))
    step = max(ALIGN, (1 << e) // 4)
    return (n + step - 1) // step * step


def _pieces(sizes: np.ndarray, max_bs: int) -> dict[int, int]:
    """I/O size -> count, for objects moved in pieces of at most max_bs."""
    counts: dict[int, int] = {}
    full = sizes // max_bs
    rest = sizes % max_bs
    n_full = int(full.sum())
    if n_full:
        counts[max_bs] = n_full
    for r, c in zip(*np.unique(rest[rest > 0], return_counts=True)):
        g = min(_grid(int(r)), max_bs)
        counts[g] = counts.get(g, 0) + int(c)
    return counts


def _fio_size(n: int) -> str:
    for unit, div in (("g", GiB), ("m", MiB), ("k", 1024)):
        if n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def bssplit(counts: dict[int, int]) -> str:
    """fio bssplit for one direction: sizes with whole percents summing to 100 (largest remainders);
    sizes that round to 0 % are folded into their nearest kept neighbour."""
    total = sum(counts.values())
    if total == 0:
        return ""
    items = sorted(counts.items())
    exact = [c * 100 / total for _, c in items]
    pct = [int(x) for x in exact]
    for i in sorted(range(len(items)), key=lambda i: exact[i] - pct[i], reverse=True)[: 100 - sum(pct)]:
        pct[i] += 1
    kept = [(size, p) for (size, _), p in zip(items, pct) if p > 0]
    return ":".join(f"{_fio_size(s)}/{p}" for s, p in kept)


FREE_SPACE_SHARE = 0.9
"""Most of the target's free space a job's file may take: fio lays the whole file out before it starts."""


def fit_free_space(size: int, cfg: TraceFioConfig) -> tuple[int, str | None]:
    """The job file's size against the free space under ``--directory`` (when it exists): a size given with
    --size-gb that does not fit is refused; the working set's is scaled down to FREE_SPACE_SHARE of the free
    space, and the note says so (the job then covers a smaller working set than the trace)."""
    import shutil

    from kvtier.errors import ConfigError

    try:
        free = shutil.disk_usage(cfg.directory).free
    except OSError:
        return size, f"--directory {cfg.directory} does not exist here: its free space was not checked"
    room = int(free * FREE_SPACE_SHARE) // MiB * MiB
    if size <= room:
        return size, None
    if cfg.size_gb:
        raise ConfigError(
            f"--size-gb {cfg.size_gb:g}: {size} bytes exceed {FREE_SPACE_SHARE:.0%} of the {free} bytes free under "
            f"{cfg.directory}; lower it, or name another --directory"
        )
    if room < MiB:
        raise ConfigError(f"--directory {cfg.directory}: {free} bytes free: no room for a fio file")
    return room, (
        f"size scaled down from the working set's {size} bytes to {room} ({FREE_SPACE_SHARE:.0%} of the {free} bytes "
        f"free under {cfg.directory}): the job reuses a smaller file than the trace's working set"
    )


def _job(
    cfg: TraceFioConfig,
    size: int,
    runtime_s: float,
    name: str,
    r_counts: dict[int, int],
    w_counts: dict[int, int],
    depth: int,
) -> list[str]:
    """The job's [global] and job sections: direct I/O on one file of ``size`` under --directory, unique data,
    time-based; the mix and block sizes of the reads and writes counted (fio's mix counts I/Os, not bytes)."""
    r_ios, w_ios = sum(r_counts.values()), sum(w_counts.values())
    rw = "randrw" if r_ios and w_ios else ("randread" if r_ios else "randwrite")
    lines = [
        "[global]",
        f"ioengine={cfg.ioengine}",
        "direct=1",
        f"directory={cfg.directory}",
        "filename=kvtier-trace.fio.dat",
        f"size={_fio_size(size)}",
        "; kvtier writes data no array can deduplicate or compress (every 4 KiB block unique): so does this job",
        "refill_buffers=1",
        "randrepeat=0",
        "dedupe_percentage=0",
        "buffer_compress_percentage=0",
        "time_based=1",
        f"runtime={max(1, math.ceil(runtime_s))}",
        "group_reporting=1",
        "",
        f"[{name}]",
        f"rw={rw}",
    ]
    if rw == "randrw":
        lines.append(f"rwmixread={round(100 * r_ios / (r_ios + w_ios))}")
    split = ",".join([bssplit(r_counts), bssplit(w_counts)]) if rw == "randrw" else bssplit(r_counts or w_counts)
    if rw == "randwrite":
        split = "," + split  # bssplit's read part empty: the sizes are the writes'
    return [*lines, f"bssplit={split}", f"iodepth={depth}", "norandommap=1"]


def distil(trace: IOTrace, cfg: TraceFioConfig) -> tuple[str, dict[str, Any]]:
    """The job file's text and the figures it was made from."""
    tiers = [int(t) for t in cfg.tiers.split(",")]
    m = np.isin(trace.tier, tiers)
    if not m.any():
        have = ", ".join(f"Tier-{t}" for t in sorted(set(trace.tier.tolist())))
        raise DatasetError(f"{trace.path}: no operations on Tier-{cfg.tiers} (the trace has {have}); see --tiers")
    max_bs = cfg.max_bs_mb * MiB
    sizes, ops = trace.size[m], trace.op[m]
    r_counts, w_counts = _pieces(sizes[ops == 0], max_bs), _pieces(sizes[ops == 1], max_bs)
    r_ios, w_ios = sum(r_counts.values()), sum(w_counts.values())
    dur = max(trace.duration_s, 1.0)
    r_bytes, w_bytes = int(sizes[ops == 0].sum()), int(sizes[ops == 1].sum())
    working = dict(zip(trace.key[m].tolist(), sizes.tolist()))
    ws = int(sum(working.values()))
    size = int(cfg.size_gb * GiB) if cfg.size_gb else max(GiB, ws)
    size = (size + MiB - 1) // MiB * MiB
    size, size_note = fit_free_space(size, cfg)
    rwmix = round(100 * r_ios / (r_ios + w_ios))
    largest = max([*r_counts, *w_counts])
    labels = [f"Tier-{t}" for t in tiers]
    figures: dict[str, Any] = {
        "tiers": labels,
        "operations": int(m.sum()),
        "read_ios": r_ios,
        "write_ios": w_ios,
        "read_bytes": r_bytes,
        "write_bytes": w_bytes,
        "duration_s": round(dur, 3),
        "read_bytes_per_s": round(r_bytes / dur, 1),
        "write_bytes_per_s": round(w_bytes / dur, 1),
        "working_set_bytes": ws,
        "rwmixread": rwmix,
        "iodepth": cfg.iodepth,
        "largest_io_bytes": largest,
        "buffer_bytes": largest * cfg.iodepth,
        "size_bytes": size,
        "size_note": size_note,
    }
    lines = [
        f"; fio job distilled by kvtier trace fio from {trace.path}",
        f"; {figures['operations']} operations on {', '.join(labels)} over {dur:.3f} s: "
        f"{r_bytes} bytes read, {w_bytes} bytes written ({len(working)} objects, {ws} bytes)",
        f"; objects moved in pieces of at most {cfg.max_bs_mb} MiB: {r_ios} reads and {w_ios} writes",
        f"; iodepth {cfg.iodepth} is a choice (--iodepth): the trace records completions, not queue depth",
        *([f"; {size_note}"] if size_note else []),
        "",
        *_job(cfg, size, dur, "kv-trace", r_counts, w_counts, cfg.iodepth),
    ]
    if cfg.rate:
        rr, wr = int(r_bytes / dur), int(w_bytes / dur)
        lines.append(f"rate={max(rr, 1) if r_ios else ''},{max(wr, 1) if w_ios else ''}")
    return "\n".join(lines) + "\n", figures


def _hist_counts(h: dict[str, Any] | None) -> dict[int, int]:
    """Request sizes from a KiB histogram: each bucket's I/Os at its lower bound (at least 4 KiB), in bytes."""
    out: dict[int, int] = {}
    for b in (h or {}).get("buckets", []):
        size = max(int(b["low"] or 0) * 1024, ALIGN) // ALIGN * ALIGN
        out[size] = out.get(size, 0) + int(b["count"] or 0)
    return {k: v for k, v in out.items() if v}


def distil_latency(section: dict[str, Any], source: str, cfg: TraceFioConfig) -> tuple[str, dict[str, Any]]:
    """A fio job from a latency trace (``--enable-latency-tracing``'s section, or ``kvtier trace attach
    --output``): the block layer's request sizes per direction (bssplit; a histogram knows each size to its
    power-of-two bucket), their mix (rwmixread), the queue depth the device saw (iodepth: the p95 bucket's upper
    bound, less the request being issued), and the writes per fsync the process issued (fsync=)."""
    h = section.get("histograms") or {}
    r_counts, w_counts = _hist_counts(h.get("size_read_kb")), _hist_counts(h.get("size_write_kb"))
    r_ios, w_ios = sum(r_counts.values()), sum(w_counts.values())
    if not r_ios and not w_ios:
        raise DatasetError(f"{source}: the latency trace has no block requests (size_read_kb, size_write_kb)")
    qd = (h.get("queue_depth") or {}).get("p95_bucket") or {}
    depth = max(1, min(int(qd.get("high") or 1), 1024))
    writes = int((h.get("syscall_write_us") or {}).get("count") or 0)
    syncs = int((h.get("fsync_us") or {}).get("count") or 0)
    per_sync = round(writes / syncs) if writes and syncs else 0
    dur = float(section.get("duration_s") or 60.0)
    size = int(cfg.size_gb * GiB) if cfg.size_gb else GiB
    size, size_note = fit_free_space(size, cfg)
    rwmix = round(100 * r_ios / (r_ios + w_ios))
    figures: dict[str, Any] = {
        "tiers": [str(d) for d in section.get("devices") or []],
        "read_ios": r_ios,
        "write_ios": w_ios,
        "rwmixread": rwmix,
        "iodepth": depth,
        "writes_per_fsync": per_sync,
        "duration_s": dur,
        "read_bytes_per_s": 0.0,
        "write_bytes_per_s": 0.0,
        "buffer_bytes": max([*r_counts, *w_counts]) * depth,
        "size_bytes": size,
        "size_note": size_note,
    }
    lines = [
        f"; fio job distilled by kvtier trace fio from the latency trace {source}",
        f"; {r_ios} block reads and {w_ios} block writes on {', '.join(figures['tiers']) or 'the traced devices'}"
        f" over {dur:.1f} s; queue depth p95 under {depth}"
        + (f"; {per_sync} writes per fsync ({writes} writes, {syncs} fsyncs)" if per_sync else ""),
        "; sizes are the histograms' power-of-two buckets; unpaced: a latency trace counts requests, not their timing",
        *([f"; {size_note}"] if size_note else []),
        "",
        *_job(cfg, size, dur, "kv-latency-trace", r_counts, w_counts, depth),
    ]
    if per_sync and w_ios:
        lines.append(f"fsync={per_sync}")
    return "\n".join(lines) + "\n", figures


def latency_section(data: Any, source: str) -> dict[str, Any] | None:
    """The latency trace in a JSON file: a ``trace attach --output`` section, or a bench result's
    ``latency_tracing``; None when the file holds neither."""
    if isinstance(data, dict) and isinstance(data.get("histograms"), dict):
        return data
    lt = data.get("latency_tracing") if isinstance(data, dict) else None
    if isinstance(lt, dict) and isinstance(lt.get("histograms"), dict):
        return lt
    return None


__all__ = ["distil", "distil_latency", "latency_section", "bssplit"]
