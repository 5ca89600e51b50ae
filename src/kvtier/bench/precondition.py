"""--precondition: write the storage device towards steady state before the measured run.

Flash drives slow down once every block has been written (garbage collection starts), so a
benchmark on a fresh drive flatters it. Preconditioning writes ``--precondition-size-gb`` (default:
twice the storage tier's capacity, as the reference) as 1 GiB files of noise through the file tier's
own write path (O_DIRECT when in use, fsync per file) with ``--precondition-threads`` writers
(default: the CPU count, as the reference), deleting each file once written (so at most one file
per writer occupies the device), and reports what it did. Nothing of it enters the run's statistics.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvtier.engine.backend import aligned_buffer
from kvtier.engine.file import FileTier
from kvtier.engine.noise import NoiseBuffer
from kvtier.errors import StorageError

GiB = 1024**3


def precondition(
    tier: FileTier, noise: NoiseBuffer, size_bytes: int, threads: int, chunk_bytes: int, stop: threading.Event
) -> dict[str, Any]:
    files = max(1, -(-size_bytes // GiB))
    keys = [f"precondition-{i:06d}" for i in range(files)]
    written = [0] * threads
    errors: list[str] = []

    def work(w: int) -> None:
        buf = aligned_buffer(chunk_bytes)  # one per thread: the stamped chunks are copied into it
        for i in range(w, files, threads):
            if stop.is_set():
                return
            n = min(GiB, size_bytes - i * GiB)
            try:
                tier.write(keys[i], _until(stop, noise.chunks(keys[i], n, chunk_bytes, out=buf)), n)
                written[w] += n
            except StorageError as e:
                errors.append(str(e))
                return
            finally:
                tier.delete(keys[i])

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(w,), name=f"kvtier-precondition-{w}") for w in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    seconds = time.perf_counter() - t0
    total = sum(written)
    return {
        "requested_bytes": size_bytes,
        "written_bytes": total,
        "files": files,
        "threads": threads,
        "seconds": round(seconds, 3),
        "bytes_per_sec": round(total / seconds, 1) if seconds > 0 else None,
        "completed": total == size_bytes and not errors,
        "errors": errors[:5],
    }


def _until(stop: threading.Event, chunks):  # type: ignore[no-untyped-def]
    for c in chunks:
        if stop.is_set():
            raise StorageError("precondition interrupted")
        yield c
