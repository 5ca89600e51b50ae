"""The placement model against the published Llama-3.1-70B figures, and its boundaries."""

import math

import pytest

from kvtier import costs
from kvtier.modelspec import build_catalog
from kvtier.units import parse_bandwidth, parse_duration

M70 = build_catalog()["llama3.1-70b-instruct"]
KVPT = M70.kv_bytes_per_token
CTX, TPS = 8192, 5000.0
HBM = 3.35e12
G100, G1, G5 = parse_bandwidth("100Gbit/s"), parse_bandwidth("1Gbit/s"), parse_bandwidth("5Gbit/s")


def test_published_figures():
    assert KVPT == 320 * 1024
    assert costs.decode_local_s(CTX, KVPT, HBM, stages=4, rtt_s=0.020) == pytest.approx(0.0808, abs=5e-5)
    assert costs.stream_remote_s(CTX, KVPT, G100, 0.001) == pytest.approx(0.216, abs=5e-4)
    assert costs.stream_remote_s(CTX, KVPT, G1, 0.020) == pytest.approx(21.5, abs=0.05)
    assert costs.query_shipping_s(M70.num_layers, 0.020) == pytest.approx(1.6)
    assert costs.breakeven_bandwidth(KVPT, TPS) * 8 / 1e9 == pytest.approx(13.1, abs=0.05)
    assert costs.breakeven_bandwidth(KVPT, TPS, 3.5) * 8 / 1e9 == pytest.approx(3.7, abs=0.05)


@pytest.mark.parametrize(
    "bw,rtt,comp,fetch,verdict",
    [
        (G100, 0.001, 1.0, 0.2157, "fetch"),
        (G1, 0.020, 1.0, 21.4948, "recompute"),
        (G5, 0.020, 1.0, 4.3150, "recompute"),
        (G5, 0.020, 3.5, 1.2471, "fetch"),
    ],
)
def test_gate_table(bw, rtt, comp, fetch, verdict):
    d = costs.should_fetch(CTX, KVPT, bw, rtt, TPS, comp)
    assert round(d.fetch_s, 4) == fetch
    assert round(d.recompute_s, 4) == 1.6384
    assert d.verdict == verdict


def test_gate_flips_exactly_at_the_exact_breakeven():
    rtt = 0.02
    be = costs.breakeven_bandwidth_exact(CTX, KVPT, TPS, rtt)
    assert costs.should_fetch(CTX, KVPT, be * 1.001, rtt, TPS).fetch
    assert not costs.should_fetch(CTX, KVPT, be * 0.999, rtt, TPS).fetch
    assert costs.fetch_s(CTX, KVPT, be, rtt) == pytest.approx(costs.recompute_s(CTX, TPS), rel=1e-12)


def test_exact_breakeven_fails_closed_when_recompute_beats_a_round_trip():
    # 50 tokens at 5000 tok/s = 10 ms of recompute < a 20 ms round trip
    with pytest.raises(costs.NoBreakEven, match="no bandwidth makes fetching pay"):
        costs.breakeven_bandwidth_exact(50, KVPT, TPS, 0.020)
    with pytest.raises(costs.NoBreakEven):
        costs.breakeven_bandwidth_numeric(50, KVPT, TPS, 0.020)
    d = costs.should_fetch(50, KVPT, 1e15, 0.020, TPS)  # even an absurd link cannot help
    assert not d.fetch
    assert costs.should_fetch(100, KVPT, 1e15, 0.020, TPS).verdict == "recompute"  # equal: not strictly faster


def test_numeric_crossover_matches_exact_and_converges_to_closed_form():
    for ctx in (256, 8192, 1 << 20):
        exact = costs.breakeven_bandwidth_exact(ctx, KVPT, TPS, 0.001, 3.5)
        num = costs.breakeven_bandwidth_numeric(ctx, KVPT, TPS, 0.001, 3.5)
        assert num == pytest.approx(exact, rel=1e-9)
    closed = costs.breakeven_bandwidth(KVPT, TPS, 3.5)
    gaps = [costs.breakeven_bandwidth_exact(c, KVPT, TPS, 0.001, 3.5) / closed - 1 for c in (1e4, 1e5, 1e6, 1e8)]
    assert all(g > 0 for g in gaps) and gaps == sorted(gaps, reverse=True) and gaps[-1] < 1e-6


def test_min_context_for_fetch():
    c0 = costs.min_context_for_fetch(KVPT, G100, 0.001, TPS)
    assert c0 is not None
    assert costs.should_fetch(math.ceil(c0) + 1, KVPT, G100, 0.001, TPS).fetch
    assert not costs.should_fetch(math.floor(c0) - 1, KVPT, G100, 0.001, TPS).fetch
    assert costs.min_context_for_fetch(KVPT, G1, 0.001, TPS) is None  # below the closed-form break-even


@pytest.mark.parametrize(
    "bad", [dict(bw=0), dict(bw=-1), dict(bw=math.nan), dict(tps=0), dict(comp=0), dict(rtt=-0.001), dict(ctx=-5)]
)
def test_gate_fails_closed_on_bad_input(bad):
    args = dict(ctx=CTX, kvpt=KVPT, bw=G100, rtt=0.001, tps=TPS, comp=1.0) | bad
    d = costs.should_fetch(args["ctx"], args["kvpt"], args["bw"], args["rtt"], args["tps"], args["comp"])
    assert not d.fetch and "invalid input" in d.reason


@pytest.mark.parametrize(
    "text,value",
    [
        ("100Gbit/s", 12.5e9),
        ("1Gbit/s", 1.25e8),
        ("25Gbps", 3.125e9),
        ("3.35TB/s", 3.35e12),
        ("12.5GB/s", 12.5e9),
        ("1GiB/s", 2**30),
        ("800Mb/s", 1e8),
        ("1000", 1000.0),
    ],
)
def test_bandwidth_units(text, value):
    assert parse_bandwidth(text) == pytest.approx(value)


@pytest.mark.parametrize("text,value", [("1ms", 1e-3), ("20 ms", 0.02), ("5us", 5e-6), ("0.5s", 0.5), ("0", 0.0)])
def test_time_units(text, value):
    assert parse_duration(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["fast", "10 parsecs", "Gbit/s", "-1GB/s", "0GB/s"])
def test_bad_units_are_errors(text):
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError):
        parse_bandwidth(text)


def test_a_negative_time_keeps_its_unit_and_sign():
    """`plan value` printed a tier's loss per hit as -1.298e+04 µs."""
    from kvtier.units import fmt_seconds

    assert fmt_seconds(-0.01298) == "-12.98 ms" and fmt_seconds(-2.5) == "-2.5 s" and fmt_seconds(0.01298) == "12.98 ms"
