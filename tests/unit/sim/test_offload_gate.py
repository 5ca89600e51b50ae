"""The sim's real offload tier: chunk round trip and a fetch gate that keeps measuring."""

from __future__ import annotations

from kvtier.config.sim import OffloadTierConfig
from kvtier.keys import KeyScope
from kvtier.sim.model import Offload, OffloadConfig


def make(tmp_path) -> Offload:
    return Offload(
        OffloadConfig("cpu", tier=OffloadTierConfig(cpu_offload_gb=0.05)),
        KeyScope("tiny"),
        kv_bytes_per_token=1024,
        seed=1,
    )


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


def test_without_the_gate_every_hit_is_loaded_however_slow_the_tier(tmp_path):
    """--no-fetch-gate: the twin of an engine that loads whatever its tier holds (kvtier's CPU tier in vLLM)."""
    from kvtier.config.sim import SimConfig

    o = make(tmp_path)
    try:
        o._bw_ewma, o.last_load_at = 1e6, __import__("time").monotonic()
        assert not o.gate(10_000, prefill_tps=1e6)
        o.gated = False
        assert o.gate(10_000, prefill_tps=1e6)
    finally:
        o.close()
    assert SimConfig(offload="cpu", no_fetch_gate=True).no_fetch_gate
    with __import__("pytest").raises(ValueError, match="--no-fetch-gate"):
        SimConfig(no_fetch_gate=True)  # no tier: nothing to gate


def test_the_breaker_opens_after_three_failures_probes_once_and_closes_on_success(tmp_path, monkeypatch):
    import time

    o = make(tmp_path)
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    try:
        for _ in range(2):
            o._note_error("timed out")
        assert o.admit("load") and not o.breaker_open  # two in a row: still asked
        o._note_error("timed out")
        assert o.breaker_open and not o.admit("load") and not o.admit("store")
        assert (o.bypassed_loads, o.bypassed_stores, o.errors) == (1, 1, 3)
        now[0] += o.BYPASS_S
        assert o.admit("load")  # the probe
        assert not o.admit("load")  # only one
        o._note_error("timed out")  # the probe failed: open for another BYPASS_S
        now[0] += o.BYPASS_S / 2
        assert not o.admit("store")
        now[0] += o.BYPASS_S
        assert o.admit("load")
        o._note_ok()  # the probe succeeded: closed
        assert not o.breaker_open and o.admit("load") and o.admit("store")
    finally:
        o.close()
