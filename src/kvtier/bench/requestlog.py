"""``--request-log FILE``: one JSON line per request of a bench run, for analysis outside kvtier.

Each line: ``rank`` (null outside MPI), ``user``, ``request_id`` (the request's own KV key), ``seq``
(the user's request number), ``turn`` (its conversation's turn; turn 1 reads no history), ``qos``,
``phase``, ``status`` (``ok``, ``cut`` = stopped by the end of the run, ``failed``) and ``error``,
``submit_unix_s`` (wall clock), ``queue_ms``, ``e2e_ms``, ``storage_ms`` (the request's own tier
operations), ``tier_ms`` (the same by tier), ``generation_ms``, ``context_tokens``, ``generate_tokens``,
``tokens_read``, ``tokens_written``, ``bytes_read``, ``bytes_written``, ``hits``, ``misses``, and the same
by kind in ``lookups`` (``{"history_hits": 2, "prefix_misses": 1, ...}``; kinds prefix, history, trace,
decode, rag). Requests abandoned in the queue at the end never ran and have no line. Written after the
run, in completion order.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvtier.bench.service import CUT
from kvtier.results.io import atomic_file
from kvtier.telemetry.recorder import Recorder


def write_request_log(path: str | Path, rec: Recorder, rank: int | None = None) -> int:
    """Write ``rec``'s requests to ``path``; returns the number of lines."""
    offset = time.time() - rec.clock.now_ns() / 1e9  # the recorder's clock -> wall clock
    n = 0
    with atomic_file(path, "w", "--request-log") as f:  # never through a file or link planted at the name
        for r in list(rec.requests):
            status = "ok" if r.ok else ("cut" if r.error == CUT else "failed")
            line = {
                "rank": rank,
                "user": r.user,
                "request_id": r.key,
                "seq": r.seq,
                "turn": r.turn,
                "qos": r.qos,
                "phase": r.phase,
                "status": status,
                "error": r.error or None,
                "submit_unix_s": round(offset + r.submit_ns / 1e9, 6),
                "queue_ms": round((r.start_ns - r.submit_ns) / 1e6, 4),
                "e2e_ms": round((r.end_ns - r.submit_ns) / 1e6, 4),
                "storage_ms": round(r.storage_ns / 1e6, 4),
                "tier_ms": {t: round(ns / 1e6, 4) for t, ns in r.tier_ns},
                "generation_ms": round(r.generation_ns / 1e6, 4),
                "context_tokens": r.context_tokens,
                "generate_tokens": r.generate_tokens,
                "tokens_read": r.tokens_read,
                "tokens_written": r.tokens_written,
                "bytes_read": r.bytes_read,
                "bytes_written": r.bytes_written,
                "hits": r.hits,
                "misses": r.misses,
                "lookups": {k.removeprefix("lookup_"): n for k, n in r.lookups},
            }
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
            n += 1
    return n


__all__ = ["write_request_log"]
