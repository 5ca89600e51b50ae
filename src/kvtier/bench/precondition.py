"""--precondition: write the storage device towards steady state before the measured run.

Flash drives slow down once every block has been written (garbage collection starts), so a
benchmark on a fresh drive flatters it. Preconditioning writes ``--precondition-size-gb`` (default:
twice the storage tier's capacity, as the reference) as 1 GiB entries of unique noise into the storage
tier through the store (the file tier's own write path: O_DIRECT when in use, fsync per file) with
``--precondition-threads`` writers (default: the CPU count, as the reference). The written data *stays
on the device*: each file is a filler entry of the tier (engine/tiered.py ``place(..., filler=True)``),
oldest in its LRU, removed only when the tier needs its room — once the tier is full the later files
push out the earlier ones, and during the load the run's own entries push out what is left. Deleting each
file as soon as it was written (what kvtier did before) undoes the steady state on a filesystem mounted
with ``discard``, where every delete reaches the drive as a trim; the run warns of such a mount
(``discard-mount``). Nothing of it enters the run's statistics; ``setup.precondition`` says what stayed.
"""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

from kvtier.engine.backend import aligned_buffer
from kvtier.engine.noise import NoiseBuffer
from kvtier.engine.tiered import NullSink, TieredStore
from kvtier.errors import StorageError
from kvtier.units import GiB

PREFIX = "precondition-"


def precondition(
    store: TieredStore,
    tier: str,
    noise: NoiseBuffer,
    size_bytes: int,
    threads: int,
    chunk_bytes: int,
    stop: threading.Event,
) -> dict[str, Any]:
    files = max(1, -(-size_bytes // GiB))
    keys = [f"{PREFIX}{i:06d}" for i in range(files)]
    written = [0] * threads
    errors: list[str] = []
    sink = store.sink
    store.sink = NullSink()  # outside the run's statistics

    def work(w: int) -> None:
        buf = aligned_buffer(chunk_bytes)  # one per thread, for the demotions a placement causes
        for i in range(w, files, threads):
            if stop.is_set():
                return
            n = min(GiB, size_bytes - i * GiB)
            source = partial(_until, stop, noise.chunks(keys[i], n, chunk_bytes))
            try:
                store.place(keys[i], tier, source, n, buf, filler=True)
                written[w] += n
            except StorageError as e:
                errors.append(str(e))
                return

    t0 = time.perf_counter()
    try:
        ts = [threading.Thread(target=work, args=(w,), name=f"kvtier-precondition-{w}") for w in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        store.sink = sink
    seconds = time.perf_counter() - t0
    total = sum(written)
    kept = store.filler_bytes()
    return {
        "requested_bytes": size_bytes,
        "written_bytes": total,
        "files": files,
        "threads": threads,
        "seconds": round(seconds, 3),
        "bytes_per_sec": round(total / seconds, 1) if seconds > 0 else None,
        "completed": total == size_bytes and not errors,
        "errors": errors[:5],
        "shortfall_bytes": size_bytes - total,
        "kept_bytes": kept,  # still on the device when the load began (removed as the tier needs room)
        "kept_files": store.filler_entries(),
    }


def _until(stop: threading.Event, chunks):  # type: ignore[no-untyped-def]
    for c in chunks:
        if stop.is_set():
            raise StorageError("precondition interrupted")  # a file cut short is not kept as an entry
        yield c
