"""``kvtier launch --arms``: the same replay against several offload engines, a fresh stack each, side by side.

Each arm is ``ENGINE[:TIER]`` — ``none`` (the GPU tier: vLLM's own prefix cache alone), ``kvtier``,
``vllm-native`` or ``lmcache`` on ``--tier`` or the tier it names. Every round runs every arm once, as an ordinary
launch into OUTDIR/arms/ARM-rROUND (its launch.json and replay/ as always), in the given order on even rounds and
reversed on odd ones. A launch that fails to start is recorded and the next arm runs; Ctrl+C stops the rounds and
what ran is still reduced. The reduction and the verdict are results/arms.py's; arms.json is written whatever
happens.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.config.launch import LaunchConfig, parse_arms
from kvtier.errors import KvtierError
from kvtier.results.arms import ArmOffload, ArmRun, ArmsResult, ArmStats, Spread, Verdict
from kvtier.results.envelope import Status, StopCode, StopReason, collect_host, iso, utc_now
from kvtier.results.io import write_json
from kvtier.results.records import RequestRecord, read_records
from kvtier.results.replay import ScrapeSummary, server_metrics_of

BOOTSTRAP = 2000
SEED = 20261202


def later(r: RequestRecord) -> bool:
    """A request whose prompt extends an earlier one of its session (a later turn, or an agent run's later step)."""
    return bool(r.turn or r.session_turn)


def turn_of(r: RequestRecord) -> int:
    return r.turn or r.session_turn


def records(folder: Path) -> list[RequestRecord]:
    """A launch folder's replay records, read by results/records.py (none when its replay never ran)."""
    rj = folder / "replay" / "requests.jsonl"
    return [r for _, r in read_records(rj)] if rj.is_file() else []


def server_metrics(folder: Path) -> list[ScrapeSummary]:
    """The servers' counters in a launch folder's replay summary, read by results/replay.py (none without one)."""
    sj = folder / "replay" / "summary.json"
    return server_metrics_of(sj) if sj.is_file() else []


def spread(xs: list[float], rng: np.random.Generator) -> Spread:
    """p50 and p95 with 95 % percentile-bootstrap intervals."""
    if not xs:
        return Spread(n=0, p50_s=None, p50_lo_s=None, p50_hi_s=None, p95_s=None, p95_lo_s=None, p95_hi_s=None)
    a = np.asarray(xs, dtype=float)
    idx = rng.integers(0, len(a), size=(BOOTSTRAP, len(a)))
    boot = a[idx]
    p50s, p95s = np.percentile(boot, 50, axis=1), np.percentile(boot, 95, axis=1)

    def r(x: float) -> float:
        return round(float(x), 6)

    return Spread(
        n=len(a),
        p50_s=r(np.percentile(a, 50)),
        p50_lo_s=r(np.percentile(p50s, 2.5)),
        p50_hi_s=r(np.percentile(p50s, 97.5)),
        p95_s=r(np.percentile(a, 95)),
        p95_lo_s=r(np.percentile(p95s, 2.5)),
        p95_hi_s=r(np.percentile(p95s, 97.5)),
    )


OFFLOAD_COUNTERS = (
    "kv_offload_load_bytes",
    "kv_offload_load_time_s",
    "kv_offload_store_bytes",
    "kv_offload_store_time_s",
    "kvtier_offload_failed_loads",
    "kvtier_shared_cross_replica_loads",
)


def _add(total: dict[str, float], part: dict[str, float] | None) -> None:
    for k, v in (part or {}).items():
        total[k] = total.get(k, 0.0) + float(v)


def reduce_arm(
    arm: str,
    engine: str,
    tier: str,
    profile: str | None,
    runs: list[ArmRun],
    folders: list[Path],
    rng: np.random.Generator,
) -> ArmStats:
    """Pool an arm's runs: their requests.jsonl and the servers' counters in summary.json."""
    recs: list[RequestRecord] = []
    by_source: dict[str, float] = {}
    cached: dict[str, float] = {}
    off: dict[str, float] = {}
    failed: dict[str, int] = {}
    for folder in folders:
        recs += records(folder)
        for m in server_metrics(folder):
            _add(by_source, m.prompt_tokens_by_source)
            _add(cached, m.prompt_tokens_cached_by_source)
            for k in OFFLOAD_COUNTERS:
                v = getattr(m, k)
                if v is not None:
                    off[k] = off.get(k, 0.0) + float(v)
    ok = [(r, r.ttft_s) for r in recs if r.ok and r.ttft_s is not None]
    for r in recs:
        if r.status not in ("ok", "cut") and r.cause:
            failed[r.cause] = failed.get(r.cause, 0) + 1
    later_ttft = [t for r, t in ok if later(r)]
    by_turn: dict[str, list[float]] = {}
    for r, ttft in ok:
        if later(r):
            t = turn_of(r)
            by_turn.setdefault(str(t) if t < 8 else "8+", []).append(ttft)
    prompt = sum(r.prompt_tokens or 0 for r, _ in ok)
    source_total = sum(by_source.values())
    load_b, load_s = off.get("kv_offload_load_bytes"), off.get("kv_offload_load_time_s")
    return ArmStats(
        arm=arm,
        offload_engine=engine,
        tier=tier,
        profile=profile,
        runs=runs,
        later_ttft=spread(later_ttft, rng),
        all_ttft=spread([t for _, t in ok], rng),
        later_ttft_p50_by_turn_s={k: round(float(np.percentile(v, 50)), 6) for k, v in sorted(by_turn.items())},
        prompt_tokens=prompt,
        tokens_by_source={k: round(v) for k, v in sorted(by_source.items())},
        hit_rate_by_source={k: round(v / source_total, 6) for k, v in sorted(by_source.items()) if source_total},
        cached_by_source={k: round(v) for k, v in sorted(cached.items()) if v},
        offload=ArmOffload(
            load_bytes=load_b,
            load_s=load_s,
            store_bytes=off.get("kv_offload_store_bytes"),
            store_s=off.get("kv_offload_store_time_s"),
            load_gb_per_s=round(load_b / load_s / 1e9, 4) if load_b and load_s else None,
            kvtier_failed_loads=off.get("kvtier_offload_failed_loads"),
            cross_replica_loads=off.get("kvtier_shared_cross_replica_loads"),
        ),
        failed=failed,
    )


def verdict(arm: ArmStats, base: ArmStats) -> Verdict:
    a, b = arm.later_ttft, base.later_ttft
    by_turn = {
        t: round(v / base.later_ttft_p50_by_turn_s[t], 4)
        for t, v in arm.later_ttft_p50_by_turn_s.items()
        if base.later_ttft_p50_by_turn_s.get(t)
    }
    if a.p50_s is None or b.p50_s is None or not b.p50_s:
        return Verdict(
            arm=arm.arm,
            later_ttft_p50_ratio=None,
            pays=None,
            by_turn_ratio=by_turn,
            why="no later-turn request completed in one of the two arms",
        )
    ratio = round(a.p50_s / b.p50_s, 4)
    assert a.p50_hi_s is not None and a.p50_lo_s is not None and b.p50_lo_s is not None and b.p50_hi_s is not None
    mine = f"later-turn TTFT p50 {a.p50_s:.3f} s [{a.p50_lo_s:.3f}, {a.p50_hi_s:.3f}]"
    theirs = f"none's {b.p50_s:.3f} s [{b.p50_lo_s:.3f}, {b.p50_hi_s:.3f}]"
    if a.p50_hi_s < b.p50_lo_s:
        pays, why = True, f"{mine} is below {theirs}: it pays"
    elif a.p50_lo_s > b.p50_hi_s:
        pays, why = False, f"{mine} is above {theirs}: it costs"
    else:
        pays, why = (
            None,
            f"later-turn TTFT p50 {a.p50_s:.3f} s vs none's {b.p50_s:.3f} s (x{ratio}): the 95 % "
            "intervals overlap, this run cannot tell (more --rounds or --max-requests)",
        )
    return Verdict(arm=arm.arm, later_ttft_p50_ratio=ratio, pays=pays, why=why, by_turn_ratio=by_turn)


def run_arms(cfg: LaunchConfig) -> ArmsResult:
    """Every round, every arm: a launch each; then the reduction and verdicts, written to OUTDIR/arms.json."""
    from kvtier.launch import run

    out = Path(str(cfg.output))
    arms = parse_arms(cfg.arms, cfg.tier)
    started = utc_now()
    order: list[list[str]] = []
    runs: dict[str, list[tuple[ArmRun, Path]]] = {a: [] for a, _, _ in arms}
    profiles: dict[str, str | None] = {a: None for a, _, _ in arms}
    stop = StopReason(code=StopCode.dataset_finished, message=f"{cfg.rounds} round(s) of {len(arms)} arms ran")
    try:
        for k in range(cfg.rounds):
            this = arms if k % 2 == 0 else list(reversed(arms))
            order.append([a for a, _, _ in this])
            for name, engine, tier in this:
                folder = out / "arms" / f"{name.replace(':', '-')}-r{k}"
                arm_cfg = LaunchConfig.model_validate(
                    {
                        **cfg.model_dump(exclude={"arms", "rounds", "replay"}),
                        "tier": tier,
                        "arms": [],
                        "rounds": 1,
                        "offload_engine": engine if tier != "gpu" else "auto",
                        "output": str(folder),
                        "replay": cfg.replay,
                    }
                )
                print(f"kvtier launch --arms: round {k}, arm {name} ({tier} tier) -> {folder}", file=sys.stderr)
                runs[name].append((_one(run, arm_cfg, k, folder, profiles, name), folder))
    except KeyboardInterrupt:
        stop = StopReason(code=StopCode.interrupted, message="interrupted: the arms that ran are reduced")
    rng = np.random.default_rng(SEED)
    stats = [
        reduce_arm(a, e, t, profiles[a], [r for r, _ in runs[a]], [f for _, f in runs[a]], rng) for a, e, t in arms
    ]
    base = next(s for s in stats if s.arm == "none")
    verdicts = [verdict(s, base) for s in stats if s.arm != "none"]
    usable = [s for s in stats if s.later_ttft.n > 0]
    every_run = [r for s in stats for r in s.runs]
    if len(usable) < len(stats):
        status = Status.failed
    elif stop.code != StopCode.dataset_finished or any(r.status != "complete" for r in every_run):
        status = Status.partial
    else:
        status = Status.complete
    result = ArmsResult(
        status=status,
        stop_reason=stop,
        started_at=iso(started),
        finished_at=iso(utc_now()),
        host=collect_host(),
        rounds=cfg.rounds,
        order=order,
        arms=stats,
        verdicts=verdicts,
        config=cfg,
    )
    write_json(result, out / "arms.json")
    return result


def _one(run: Any, cfg: LaunchConfig, k: int, folder: Path, profiles: dict[str, str | None], name: str) -> ArmRun:
    """One arm's launch, as an ArmRun (a launch that raised is a failed run with its message)."""
    try:
        res = run(cfg)
        profiles[name] = res.profile
        status, stop, error = res.status.value, res.stop_reason.code.value, res.error
    except KvtierError as e:
        status, stop, error = "failed", "startup-failed", str(e)[:500]
    recs = records(folder)
    failed: dict[str, int] = {}
    for r in recs:
        if r.status not in ("ok", "cut"):
            failed[r.cause or "unknown"] = failed.get(r.cause or "unknown", 0) + 1
    return ArmRun(
        round=k,
        folder=str(folder),
        status=status,
        stop=stop,
        requests=len(recs),
        ok=sum(r.ok for r in recs),
        failed=failed,
        cut=sum(r.status == "cut" for r in recs),
        error=error,
    )


def lines(result: ArmsResult) -> list[str]:
    """The arms side by side, for the terminal."""
    out = []
    for s in result.arms:
        t = s.later_ttft
        p50 = "—" if t.p50_s is None else f"{t.p50_s:.3f} s [{t.p50_lo_s:.3f}, {t.p50_hi_s:.3f}]"
        p95 = "—" if t.p95_s is None else f"{t.p95_s:.3f} s"
        ext = s.hit_rate_by_source.get("external_kv_transfer")
        gpu = s.hit_rate_by_source.get("local_cache_hit")
        cross = s.offload.cross_replica_loads
        shared = "" if cross is None else f" ({cross:.0f} blocks another replica stored)"
        out.append(
            f"arm {s.arm:16s} later-turn TTFT p50 {p50} p95 {p95} (n={t.n}); hit rate GPU "
            f"{_pct(gpu)} offload {_pct(ext)}{shared}; failed {s.failed or 'none'}"
        )
    for v in result.verdicts:
        out.append(f"verdict {v.arm}: {v.why}")
    return out


def _pct(x: float | None) -> str:
    return "—" if x is None or math.isnan(x) else f"{100 * x:.1f} %"


__all__ = ["run_arms", "reduce_arm", "verdict", "spread", "later", "lines"]
