"""The figures people compare, per result kind, with which way is better; and the words for a difference.

One table of named figures per loaded result (``figures``), shared by ``kvtier report`` (its tables and
its sentences) and ``kvtier compare`` (its ratios). A replay's later-turn TTFT needs its per-request
records (``requests.jsonl`` beside ``summary.json``); they are read once into ``ReplayRecords``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvtier.results.bench import BenchResult
from kvtier.results.launch import LaunchResult
from kvtier.results.records import ReplayRecords
from kvtier.results.replay import ReplayResult
from kvtier.stats import percentile

if TYPE_CHECKING:
    from kvtier.results import AnyResult
    from kvtier.results.plan import PlanResult

R = TypeVar("R")

LOWER, HIGHER = "lower", "higher"
FEW_SAMPLES = 30
"""A percentile or mean from fewer samples than this is flagged in the report: its tail is one or two
requests, not a distribution."""


@dataclass
class Figure:
    name: str
    value: float | None
    unit: str
    better: str  # LOWER | HIGHER | "" (informative)
    samples: int | None = None  # how many samples a percentile or mean comes from (None: not a sample figure)

    @property
    def few_samples(self) -> bool:
        return self.samples is not None and self.value is not None and self.samples < FEW_SAMPLES


@dataclass
class Loaded:
    """One result as the report sees it: its label, kind, typed model and, for a replay, its records."""

    path: str
    label: str
    kind: str  # bench | replay | bench-mpi | mlperf | launch | sweep | ladder | arms | plan-<subcommand>
    result: AnyResult
    records: ReplayRecords | None = None
    figures: list[Figure] = field(default_factory=list)

    def figure(self, name: str) -> Figure | None:
        return next((f for f in self.figures if f.name == name), None)

    def _as(self, cls: type[R]) -> R:
        if not isinstance(self.result, cls):
            raise TypeError(f"{self.path}: a {type(self.result).__name__}, not a {cls.__name__} ({self.kind})")
        return self.result

    # the result as its kind's model: the report groups by kind, and each part reads the one model it draws
    @property
    def bench(self) -> BenchResult:
        return self._as(BenchResult)

    @property
    def replay(self) -> ReplayResult:
        return self._as(ReplayResult)

    @property
    def launch(self) -> LaunchResult:
        return self._as(LaunchResult)

    @property
    def plan(self) -> PlanResult:
        if not self.kind.startswith("plan-"):
            raise TypeError(f"{self.path}: a {type(self.result).__name__}, not a kvtier plan answer ({self.kind})")
        return self.result  # type: ignore[return-value]  # every plan-* kind is one of PlanResult's models


def _p(values: np.ndarray, q: float) -> float | None:
    return percentile(values, q)


def bench_figures(r: Any) -> list[Figure]:
    s = r.summary
    cs = s.cache_stats
    e2e, sio = s.end_to_end_latency_ms, s.storage_io_latency_ms
    out = [
        Figure("requests completed", float(r.requests_completed), "", HIGHER),
        Figure("requests failed", float(r.requests_failed), "", LOWER),
        Figure("throughput tokens/s", s.avg_throughput_tokens_per_sec, "tok/s", HIGHER),
        Figure("storage throughput tokens/s (MLPerf)", s.storage_throughput_tokens_per_sec, "tok/s", HIGHER),
        Figure("KV tokens moved/s", s.storage_kv_tokens_per_sec, "tok/s", HIGHER),
        Figure("requests/s", s.requests_per_second, "req/s", HIGHER),
        Figure("end-to-end p50 ms", e2e.p50, "ms", LOWER, e2e.count),
        Figure("end-to-end p95 ms", e2e.p95, "ms", LOWER, e2e.count),
        Figure("storage I/O p95 ms", sio.p95, "ms", LOWER, sio.count),
        Figure("cache hit rate (MLPerf)", cs.cache_hit_rate, "", HIGHER),
        Figure("reuse hit rate", cs.reuse_hit_rate, "", HIGHER),  # reads of entries other requests wrote
    ]
    for tier, t in r.tiers.items():
        for op in ("read", "write"):
            o = getattr(t, op)
            if o.ops:
                out.append(Figure(f"{tier} {op} device p95 ms", o.device_latency_ms.p95, "ms", LOWER, o.ops))
                out.append(
                    Figure(f"{tier} {op} GB/s (device time)", _gbps(o.device_bandwidth_bytes_per_sec), "GB/s", HIGHER)
                )
    amp = s.kv_layout_stats.read_amplification
    out.append(Figure("read amplification", amp, "x", LOWER))
    return out


def _gbps(v: float | None) -> float | None:
    return None if v is None else v / 1e9


def replay_figures(r: Any, rec: ReplayRecords | None) -> list[Figure]:
    s = r.summary
    n = s.ttft_s.count
    out = [
        Figure("requests ok", float(s.requests_ok), "", HIGHER),
        Figure("TTFT p50 s", s.ttft_s.p50, "s", LOWER, n),
        Figure("TTFT p95 s", s.ttft_s.p95, "s", LOWER, n),
    ]
    if s.twin is not None and "p95" in s.twin.ttft_s:  # a calibrated sim's: what its measured error allows
        lo, hi = s.twin.ttft_s["p95"]
        out += [Figure("TTFT p95 s within the twin's error, low", lo, "s", ""),
                Figure("TTFT p95 s within the twin's error, high", hi, "s", "")]  # fmt: skip
    if rec is not None:
        later = rec.ttft_ok(later=True)
        out += [
            Figure("later-turn TTFT p50 s", _p(later, 50), "s", LOWER, int(later.size)),
            Figure("later-turn TTFT p95 s", _p(later, 95), "s", LOWER, int(later.size)),
        ]
    out += [
        Figure("TTFT degradation median %", s.ttft_degradation.median_pct, "%", LOWER),
        Figure("TPOT mean s", s.tpot_s_mean, "s", LOWER),
        Figure("end-to-end p50 s", s.e2e_s.p50, "s", LOWER, s.e2e_s.count),
        Figure("requests/s", s.requests_per_s, "req/s", HIGHER),
        Figure("output tokens/s", s.output_tokens_per_s, "tok/s", HIGHER),
        Figure("sessions complete", float(s.sessions.complete), "", HIGHER),
        Figure("requests failed", float(s.requests_failed), "", LOWER),
    ]
    ro = r.reuse_opportunity
    if ro is not None:  # the dataset's, the same for runs of one dataset: informative
        out += [
            Figure("dataset history reuse fraction", ro.history_reuse_fraction, "", ""),
            Figure("dataset cross-session reuse fraction", ro.cross_session_reuse_fraction, "", ""),
            Figure("dataset new fraction", ro.new_fraction, "", ""),
        ]
    for m in r.server_metrics[:1]:  # the front server (or the one replica scraped)
        out += [
            Figure("GPU prefix hit rate", m.prefix_cache_hit_rate_overall, "", HIGHER),
            Figure("external (offload) hit rate", m.external_prefix_cache_hit_rate_overall, "", HIGHER),
        ]
    return out


def aggregate_figures(r: Any) -> list[Figure]:
    t, lat = r.totals, r.latency
    return [
        Figure("ranks reported", float(r.ranks_reported), "", HIGHER),
        Figure("throughput tokens/s", t.avg_throughput_tokens_per_sec, "tok/s", HIGHER),
        Figure("KV tokens moved/s", t.storage_kv_tokens_per_sec, "tok/s", HIGHER),
        Figure("read GB/s (all tiers)", t.storage_read_bytes_per_sec / 1e9, "GB/s", HIGHER),
        Figure("write GB/s (all tiers)", t.storage_write_bytes_per_sec / 1e9, "GB/s", HIGHER),
        Figure("end-to-end p50 ms", lat.end_to_end_latency_ms.get("p50"), "ms", LOWER),
        Figure("end-to-end p95 ms", lat.end_to_end_latency_ms.get("p95"), "ms", LOWER),
        Figure("storage I/O p95 ms", lat.storage_io_latency_ms.get("p95"), "ms", LOWER),
        Figure(
            "storage throughput tokens/s (MLPerf sum)", r.mlperf.storage_throughput_tokens_per_sec_sum, "tok/s", HIGHER
        ),
    ]


def mlperf_figures(r: Any) -> list[Figure]:
    out = []
    for o, s in (r.options or {}).items():
        for name, sp in s.kvtier.spread.items():
            cv = sp.cv
            out.append(
                Figure(f"option {o} {name} spread across trials (CV %)", None if cv is None else cv * 100, "%", LOWER)
            )
        out += [
            Figure(f"option {o} read GiB/s", s.aggregated_read_bandwidth_gbps, "GiB/s", HIGHER),
            Figure(f"option {o} write GiB/s", s.aggregated_write_bandwidth_gbps, "GiB/s", HIGHER),
            Figure(f"option {o} storage tokens/s", s.aggregated_storage_throughput_tokens_per_sec, "tok/s", HIGHER),
        ]
    return out


def figures_of(item: Loaded) -> list[Figure]:
    if item.kind == "bench":
        return bench_figures(item.result)
    if item.kind == "replay":
        return replay_figures(item.result, item.records)
    if item.kind == "bench-mpi":
        return aggregate_figures(item.result)
    if item.kind == "mlperf":
        return mlperf_figures(item.result)
    return []


def ttft_sentence(summary: Any) -> str | None:
    """Where a replay's TTFT went, in words, from the server's decomposition: turn 0 against the later turns
    (the prompt's share by source; the mean milliseconds by part). None without the decomposition."""
    d = getattr(summary, "ttft_decomposition", None)
    if d is None or not d.requests:
        return None

    def say(turns: list[Any], what: str) -> str | None:
        n = sum(t.requests for t in turns)
        if not n:
            return None
        tokens: dict[str, float] = {}
        secs: dict[str, float] = {}
        for t in turns:
            for k, v in t.token_share.items():
                tokens[k] = tokens.get(k, 0.0) + v * t.requests / n
            for k, v in t.seconds_mean.items():
                secs[k] = secs.get(k, 0.0) + v * t.requests / n
        ttft = sum(t.ttft_s_mean * t.requests for t in turns) / n
        share = ", ".join(f"{v:.0%} {k}" for k, v in sorted(tokens.items(), key=lambda kv: -kv[1]) if v >= 0.005)
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(secs.items(), key=lambda kv: -kv[1]) if v > 0)
        return f"{what} ({n} requests): prompt tokens {share}; TTFT {ttft * 1e3:.1f} ms, of it (ms) {parts}"

    first = [t for t in d.by_turn if t.turn == 0]
    later = [t for t in d.by_turn if t.turn > 0]
    said = [x for x in (say(first, "turn 0"), say(later, "later turns")) if x]
    return "; ".join(said) + (
        f". The parts account for the TTFT within 5 % in {d.closure_within_5pct:.0%} of requests."
        if d.closure_within_5pct is not None
        else "."
    )


def change_pct(base: float | None, other: float | None) -> float | None:
    if base is None or other is None or base == 0:
        return None
    return (other - base) / abs(base) * 100.0


def sentences(base: Loaded, other: Loaded, threshold_pct: float = 5.0, most: int = 4) -> list[str]:
    """The differences that matter, in words: the largest relative changes of the figures that have a
    direction, beyond ``threshold_pct``; e.g. "cpu: later-turn TTFT p95 -64 % vs none (better)"."""
    found = []
    for f in other.figures:
        b = base.figure(f.name)
        if b is None or not f.better:
            continue
        if f.unit == "%":  # a change of a percentage is said in points: a relative change of one is no figure
            if b.value is None or f.value is None or abs(f.value - b.value) < threshold_pct:
                continue
            c = f.value - b.value
            said = f"{c:+.1f} points"
        else:
            ch = change_pct(b.value, f.value)
            if ch is None or abs(ch) < threshold_pct:
                continue
            c, said = ch, f"{ch:+.0f} %"
        good = (c < 0) == (f.better == LOWER)
        found.append((abs(c), f"{other.label}: {f.name} {said} vs {base.label} ({'better' if good else 'worse'})"))
    found.sort(key=lambda x: -x[0])
    return [s for _, s in found[:most]]


__all__ = ["Figure", "Loaded", "ReplayRecords", "figures_of", "sentences", "change_pct", "LOWER", "HIGHER"]
