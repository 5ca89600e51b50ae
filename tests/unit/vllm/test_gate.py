"""The live fetch gate (kvtier/vllm/gate.py): what it decides from what the engine measured, and how it learns,
closes on a slow link and reopens through its probes. The gate on a real engine over a shaped link is
benchmarks/fabric.py --gate."""

from __future__ import annotations

from kvtier.vllm.gate import PROBE_EVERY, LiveGate, chain, following

BLOCK_TOKENS, BLOCK_BYTES = 128, 128 * 1024  # 1 KiB of KV a token, as kvtier model make's model


def gate_at(rate_bytes_s: float, prefill_tps: float = 20_000.0, rtt_s: float = 0.001) -> LiveGate:
    g = LiveGate(BLOCK_TOKENS, BLOCK_BYTES, round_trips=3, probe_s=5.0)
    g.rtt(rtt_s)
    g.prefilled(4096, 4096 / prefill_tps)
    g.loaded(int(rate_bytes_s), 1.0 + rtt_s)  # one second of transfer after its round trip
    return g


def test_it_learns_first_then_fetches_only_what_is_faster_than_recomputing():
    g = LiveGate(BLOCK_TOKENS, BLOCK_BYTES)
    assert g.allow(64, now=0.0) and g.take() == {"learning": 64}  # nothing measured yet: let it through
    # 64 blocks = 8 MiB; recompute of 8,192 tokens at 20,000 tok/s = 0.41 s
    assert gate_at(100e6).allow(64, now=0.0)  # 0.084 s + 3 ms: fetch
    slow = gate_at(10e6)
    assert not slow.allow(64, now=100.0) and slow.counts["gated"] == 64  # 0.84 s > 0.41 s: recompute
    assert slow.last is not None and not slow.last.fetch and "recompute" in slow.last.reason


def test_a_link_that_slows_down_closes_the_gate_at_once_and_a_probe_reopens_it():
    g = gate_at(100e6)
    assert g.allow(64, now=0.0)
    g.loaded(int(4e6), 1.0)  # a job at 4 MB/s: the very next lookup sees it
    for i in range(PROBE_EVERY):  # gated: recomputed, until enough gated runs and seconds have passed
        assert not g.allow(64, now=1.0 + i * 0.1)
    assert not g.allow(64, now=2.0)  # enough runs, but not yet PROBE_S since the start
    assert g.allow(64, now=5.5)  # a probe: its load is measured
    g.loaded(int(200e6), 1.0)  # the probe's job: the link is back
    assert g.allow(64, now=5.6)
    assert g.take() == {"fetched": 128, "gated": 64 * (PROBE_EVERY + 1), "probe": 64} and g.take() == {}


def test_a_short_prompt_or_a_slow_round_trip_is_recomputed_and_steps_too_small_to_time_are_ignored():
    g = gate_at(1e9, rtt_s=0.05)  # 3 x 50 ms of round trips against 1 block = 6.4 ms of prefill
    assert not g.allow(1, now=100.0)  # recompute
    h = LiveGate(BLOCK_TOKENS, BLOCK_BYTES)
    h.prefilled(16, 0.001)  # a decode step: not a prefill rate
    h.rtt(0.001)
    h.loaded(1 << 20, 0.01)
    assert h.figures() is None


def test_following_is_this_key_and_the_requests_next_keys_in_prompt_order():
    class Ctx:
        _offload_key_positions = {"c": 384, "a": 128, "b": 256, "z": 512}

    assert following(Ctx(), "b") == ["b", "c", "z"]
    assert following(Ctx(), "nope") == ["nope"] and following(object(), "k") == ["k"]
    assert chain(Ctx()) == ["a", "b", "c", "z"] and chain(object()) == []  # the whole request, for eviction fanout
