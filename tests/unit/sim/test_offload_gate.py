"""The sim's real offload tier: chunk round trip and a fetch gate that keeps measuring."""

from __future__ import annotations

from kvtier.keys import KeyScope
from kvtier.sim.model import Offload, OffloadConfig


def make(tmp_path) -> Offload:
    return Offload(OffloadConfig("cpu", cpu_offload_gb=0.05), KeyScope("tiny"), kv_bytes_per_token=1024, seed=1)


def test_store_lookup_load_round_trip(tmp_path):
    o = make(tmp_path)
    try:
        keys = o.chunk_keys(list(range(256 * 3 + 10)))
        assert len(keys) == 3  # full chunks only
        assert o.lookup(keys) == 0
        o.save(keys[:2])
        assert o.lookup(keys) == 2  # contiguous prefix only
        dt, nbytes, found = o.load(keys[:2])
        assert found == 2 and nbytes == 2 * 256 * 1024 and dt > 0
        assert o.chunks_loaded == 2 and o.measured_fetch() is not None
    finally:
        o.close()


def test_gate_recomputes_on_slow_measurements_and_probes_again_later(tmp_path):
    o = make(tmp_path)
    try:
        assert o.gate(10_000, prefill_tps=1e6)  # nothing measured: fetch, to measure
        o._bw_ewma = 1e6  # as if loads had run at 1 MB/s: 10k tokens x 1 KiB take 10 s, prefill 10 ms
        o.last_load_at = __import__("time").monotonic()
        assert not o.gate(10_000, prefill_tps=1e6)
        assert o.gate(10_000, prefill_tps=1.0)  # prefill slower still: fetch
        o.last_load_at -= Offload.PROBE_S + 1  # no load for a while: probe the tier again
        assert o.gate(10_000, prefill_tps=1e6)
    finally:
        o.close()
