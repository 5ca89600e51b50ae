"""kvtier ladder's pure parts: the fit, the verification rules, the flood sizes, the config and the gate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.config.ladder import LadderConfig
from kvtier.errors import ConfigError
from kvtier.ladder.fit import (
    ONE_CHUNK,
    fit_ladder,
    fit_step,
    nonneg_relative_lstsq,
    split_handling,
    tpot_implausible,
    unreliable,
)
from kvtier.ladder.measure import default_contexts, flood_sizes, verify
from kvtier.ladder.server import Reading, Server, describe
from kvtier.replay.scrape import parse_snapshot
from kvtier.results.ladder import (
    DecodeModel,
    HandlingPoint,
    LadderPoint,
    LoadedPoint,
    PrefillModel,
    Shown,
    TierFacts,
    Timing,
    TpotPoint,
    loaded_ttft,
)

TRUE = PrefillModel(overhead_s=0.004, s_per_token=5e-5, s_per_token_pair=2e-9, s_per_prompt_token=1e-6)


def _point(source: str, ctx: int, new: int, ttft: float, cached: int, tiers: dict[str, int] | None = None,
           held: bool = False) -> LadderPoint:  # fmt: skip
    return LadderPoint(seq=0, group=0, source=source, context_tokens=ctx, new_tokens=new, repeat=0,
                       prompt_tokens=ctx + new, cached_tokens=cached, ttft_s=ttft, server_ttft_s=None, verified=True,
                       shown=Shown(gpu_hit_tokens=0, external_hit_tokens=0, tiers=tiers or {}, usage_cached_tokens=None,
                                   basis="counters"), held_back=held, start_unix_s=0.0, status="ok")  # fmt: skip


def _synthetic(noise: float, seed: int = 1) -> list[LadderPoint]:
    rng = np.random.default_rng(seed)
    pts = []
    for ctx in (256, 1024, 4096, 16384):
        for new in (16, 256, 2048):
            held = ctx == 4096 and new == 256
            for _ in range(3):
                e = 1 + noise * rng.standard_normal()
                pts.append(_point("cold", ctx, new, TRUE.seconds(ctx + new) * e, 0, held=held))
                pts.append(_point("gpu", ctx, new, TRUE.seconds(new, ctx) * e, ctx, held=held))
                fetch = 0.002 + 2e-6 * ctx
                pts.append(_point("cpu", ctx, new, (TRUE.seconds(new, ctx) + fetch) * e, ctx, {"cpu": ctx}))
    return pts


def test_the_fit_recovers_a_superlinear_prefill_fetch_and_tpot() -> None:
    tpot = [TpotPoint(running=m, tpot_s=0.01 + 0.001 * (m - 1), requests=m, failed=0) for m in (1, 2, 4, 8)]
    f = fit_ladder(_synthetic(0.0), tpot, ["cpu"], 1000, "x.json")
    assert f is not None
    p = f.timing.prefill
    assert p.s_per_token == pytest.approx(TRUE.s_per_token, rel=1e-3)
    assert p.s_per_token_pair == pytest.approx(TRUE.s_per_token_pair, rel=1e-3)
    assert p.overhead_s == pytest.approx(TRUE.overhead_s, rel=1e-3)
    assert f.superlinear and f.prefill_holdout_points == 6
    assert f.prefill_holdout_median_abs_rel_err is not None and f.prefill_holdout_median_abs_rel_err < 1e-6
    (cpu,) = f.timing.fetch
    assert cpu.overhead_s == pytest.approx(0.002, rel=1e-3) and cpu.s_per_token == pytest.approx(2e-6, rel=1e-3)
    assert cpu.bytes_per_s == pytest.approx(1000 / 2e-6, rel=1e-3)
    assert f.timing.decode.tpot_s == pytest.approx(0.01) and f.timing.decode.s_per_extra_seq == pytest.approx(0.001)
    assert f.timing.range is not None and f.timing.range.max_prompt_tokens == 16384 + 2048


def test_the_fit_under_noise_stays_close_and_unverified_points_are_left_out() -> None:
    pts = _synthetic(0.03)
    bogus = _point("cold", 1024, 16, 99.0, 0)
    bogus.verified = False  # a point whose counters showed a hit: never fitted
    f = fit_ladder([*pts, bogus], [], ["cpu"], None, "x.json")
    assert f is not None
    assert f.prefill_fit_median_abs_rel_err is not None and f.prefill_fit_median_abs_rel_err < 0.05
    assert f.timing.prefill.s_per_token == pytest.approx(TRUE.s_per_token, rel=0.15)
    assert all(r.measured_s != 99.0 for r in f.residuals)
    assert f.timing.decode.tpot_s == 0.0 and "no TPOT sweep" in f.timing.figures["decode"]
    bursts = [TpotPoint(running=m, tpot_s=None, requests=3 * m, failed=0, bursty=3 * m) for m in (1, 2)]
    f = fit_ladder(pts, bursts, ["cpu"], None, "x.json")
    assert f is not None and f.timing.decode.tpot_s == 0.0
    assert "every stream of the TPOT sweep (9) came in bursts" in f.timing.figures["decode"]


def test_too_few_points_give_no_fit_and_coefficients_stay_non_negative() -> None:
    assert fit_ladder(_synthetic(0.0)[:2], [], [], None, "x") is None
    x = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    beta = nonneg_relative_lstsq(x, np.array([3.0, 2.0, 1.0]))  # a falling line: the slope would be negative
    assert (beta >= 0).all() and beta[1] == 0.0


def test_chunks_add_up_to_the_whole_prompt() -> None:
    whole = TRUE.compute_s(3000, 500)
    parts = TRUE.compute_s(1000, 500) + TRUE.compute_s(2000, 1500)
    assert parts == pytest.approx(whole)


SIM_METRICS = """
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="m"} 100.0
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{model_name="m"} 0.0
# TYPE kvtier_sim:offload_tier_capacity_tokens gauge
kvtier_sim:offload_tier_capacity_tokens{model_name="m",tier="cpu"} 20000.0
kvtier_sim:offload_tier_capacity_tokens{model_name="m",tier="storage"} 300000.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",kv_bytes_per_token="1024",model_name="m",num_gpu_blocks="1000"} 1.0
"""


def test_describe_finds_the_sims_tiers_geometry_and_counters() -> None:
    s = describe(16000, parse_snapshot(SIM_METRICS))
    assert s.kind == "kvtier-sim" and s.gpu_kv_tokens == 16000 and s.block_tokens == 16 and s.kv_bytes_per_token == 1024
    assert [(t.name, t.capacity_tokens) for t in s.tiers] == [("cpu", 20000), ("storage", 300000)]
    hit = 'kvtier_sim:prompt_tokens_by_tier_total{model_name="m",tier="storage"} 4096.0\n'
    later = parse_snapshot(SIM_METRICS.replace(" 100.0", " 612.0") + hit)
    r = s.reading(parse_snapshot(SIM_METRICS), later)
    assert r is not None and r.gpu == 512 and r.external == 0 and r.tiers == {"cpu": 0, "storage": 4096}


def test_a_vllm_without_metrics_or_offload_is_described_honestly() -> None:
    s = describe(None, None)
    assert s.kind == "unknown" and not s.tiers and any("no /metrics" in n for n in s.notes)
    v = describe(100,
                 parse_snapshot('# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total 1.0\n'
                                '# TYPE vllm:external_prefix_cache_hits_total counter\n'
                                'vllm:external_prefix_cache_hits_total 0.0\n'))  # fmt: skip
    assert v.kind == "vllm" and not v.tiers and any("cold and GPU points only" in n for n in v.notes)


def _server(tiers: list[TierFacts] | None = None) -> Server:
    return Server("kvtier-sim", 32000, 16, 16000, 1024, tiers or [], [], [])


def test_verify_accepts_only_the_intended_source() -> None:
    s = _server([TierFacts(name="cpu", capacity_tokens=20000, counter="x")])
    assert verify("cold", 4096, 4200, Reading(0, 0, {"cpu": 0}), 0, s)[0]
    ok, why, _, _ = verify("cold", 4096, 4200, Reading(4096, 0, {"cpu": 0}), 4096, s)
    assert not ok and why is not None and "4096 of 4200 tokens were cached" in why
    assert verify("gpu", 4096, 4200, Reading(4096, 0, {"cpu": 0}), 4096, s)[0]
    assert not verify("gpu", 4096, 4200, Reading(0, 4096, {"cpu": 4096}), 4096, s)[0]  # served by offload
    assert verify("cpu", 4096, 4200, Reading(0, 3840, {"cpu": 3840}), 3840, s)[0]
    ok, why, _, _ = verify("cpu", 4096, 4200, Reading(4096, 0, {"cpu": 0}), 4096, s)  # still in the GPU
    assert not ok and why is not None and "from cpu" in why
    ok, why, _, _ = verify("gpu", 4096, 4200, None, 4096, s)  # usage alone cannot tell the GPU from a tier
    assert not ok and why is not None and "cannot tell" in why
    assert verify("gpu", 4096, 4200, None, 4096, _server())[0]  # ... but can on a server without tiers
    ok, why, _, _ = verify("disk", 4096, 4200, Reading(0, 4096, {}), 4096, s)
    assert not ok and why is not None and "no counter" in why


def test_flood_sizes_push_past_the_tiers_above_or_say_why_they_cannot() -> None:
    tiers = [TierFacts(name="cpu", capacity_tokens=40000, counter="x"),
             TierFacts(name="storage", capacity_tokens=400000, counter="x")]  # fmt: skip
    f = flood_sizes(_server(tiers), ["cpu", "storage"], {})
    assert f["cpu"] == (20000, 40000, None)  # 1.25 x the GPU's 16,000
    assert f["storage"][0] == 50000 and f["storage"][2] is None  # 1.25 x the cpu tier's 40,000
    small = [TierFacts(name="cpu", capacity_tokens=10000, counter="x")]
    n, _, why = flood_sizes(_server(small), ["cpu"], {})["cpu"]
    assert n is None and why is not None and "would also push the prefix out of cpu" in why
    assert "--gpu-kv-gb" in why and "--num-gpu-blocks-override" in why  # #58 item 18: the flags that change it
    assert "--flood-tokens" not in why  # the tier (10,000) holds less than the GPU (16,000): no flood fits between
    roomy = [TierFacts(name="cpu", capacity_tokens=18000, counter="x")]
    n, holds, why = flood_sizes(_server(roomy), ["cpu"], {})["cpu"]
    assert n is None and why is not None and "--flood-tokens cpu=N with 16,000 < N < 18,000" in why
    unknown = [TierFacts(name="l1", capacity_tokens=None, counter="x")]
    assert flood_sizes(_server(unknown), ["l1"], {"l1": 5000})["l1"][0] == 5000


def test_default_contexts_are_log_spaced_and_fit() -> None:
    c = default_contexts(16384, 256, 10)
    assert c[0] == 256 and c[-1] <= 16384 - 256 - 10 and len(c) == 6 and c == sorted(c)


def test_config_takes_comma_lists_and_names_bad_values() -> None:
    c = LadderConfig(base_url="http://x/v1", model="m", contexts=["256,1024", "4096"], new_tokens="16",
                     flood_tokens=["cpu=100"])  # fmt: skip
    assert c.contexts == [256, 1024, 4096] and c.new_tokens == [16] and c.flood_overrides() == {"cpu": 100}
    assert c.metrics_root() == "http://x"
    with pytest.raises(Exception, match="contexts"):
        LadderConfig(base_url="http://x/v1", model="m", contexts="256,abc")
    with pytest.raises(Exception, match="flood_tokens"):
        LadderConfig(base_url="http://x/v1", model="m", flood_tokens=["cpu"])
    _ = ConfigError


def test_a_tier_no_counter_names_is_verified_by_the_requests_own_engine_record() -> None:
    """A vLLM on a shared cache server exposes no per-tier counter the ladder knows, but its per-request record
    (kvtier's spec, --engine-log) names the source of each token: that record verifies the point."""
    s = _server()  # no tier discovered from the counters
    record = Reading(0, 2048, {"host": 2048})
    assert verify("host", 2048, 2073, record, 2048, s, engine=True)[0]
    ok, why, _, _ = verify("host", 2048, 2073, record, 2048, s)  # the same numbers as a counter delta: no
    assert not ok and why is not None and "no counter" in why
    ok, why, _, _ = verify("disk", 2048, 2073, record, 2048, s, engine=True)  # a source the record does not name
    assert not ok and why is not None and "no counter" in why


def _ladder_file(fit, path: Path) -> str:  # type: ignore[no-untyped-def]
    """A ladder result holding ``fit`` (no points), written to ``path``."""
    from kvtier.results.envelope import Status, StopCode, StopReason, collect_host
    from kvtier.results.io import write_json
    from kvtier.results.ladder import LadderResult, ServerFacts

    facts = ServerFacts(base_url="http://127.0.0.1:1/v1", model="m", kind="vllm", max_model_len=None,
                        block_tokens=None, gpu_kv_tokens=None, kv_bytes_per_token=None, tiers=[], counters=[],
                        prompt_overhead_tokens=0, tokens_per_word=1.0)  # fmt: skip
    result = LadderResult(status=Status.complete, stop_reason=StopReason(code=StopCode.grid_finished, message=""),
                          started_at="", finished_at="", host=collect_host(),
                          config=LadderConfig(base_url="http://127.0.0.1:1/v1", model="m"), server=facts,
                          points=[], cells=[], tpot=[], fit=fit, failures={}, requests_sent=0,
                          wall_s=1.0)  # fmt: skip
    write_json(result, str(path))
    return str(path)


def test_a_twins_error_is_the_spread_of_its_ladders_points_widened_by_its_own_check(tmp_path: Path) -> None:
    """#56 item 5: the error a calibrated twin carries is measured: the central 90 % of real / predicted over the
    ladder's points (always holding 1), widened by a sim-vs-real check written beside the ladder for that ladder's
    bytes; a check of another ladder, or a file that is not one, is said and not used."""
    import hashlib
    import json

    import numpy as np

    from kvtier.results.ladder import TwinCheck, TwinCheckRow, twin_check_path, twin_error

    fit = fit_ladder(_synthetic(0.05, seed=2), [], ["cpu"], None, "x.json")
    assert fit is not None
    path = _ladder_file(fit, tmp_path / "ladder.json")
    ratios = [r.measured_s / r.predicted_s for r in fit.residuals]
    err = twin_error(fit, path)
    assert err.points == len(ratios) and err.checked_rows == 0
    assert err.ratio_low == pytest.approx(min(1.0, float(np.percentile(ratios, 5))), abs=1e-4)
    assert err.ratio_high == pytest.approx(max(1.0, float(np.percentile(ratios, 95))), abs=1e-4)
    assert err.ratio_low < 1 < err.ratio_high and err.band(2.0) == (
        round(2 * err.ratio_low, 6),
        round(2 * err.ratio_high, 6),
    )
    check = twin_check_path(path)
    assert check.name == "ladder.twin-check.json"
    rows = [TwinCheckRow(trace="t", concurrency=4, offload="none", quantile="p95", real_s=0.2, twin_s=0.1)]
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    check.write_text(TwinCheck(ladder_sha256=digest, written="2026-12-07", rows=rows).model_dump_json())
    wide = twin_error(fit, path)  # the twin read half of the real p95: real / predicted 2.0
    assert wide.ratio_high == 2.0 and wide.ratio_low == err.ratio_low and wide.checked_rows == 1
    assert check.name in wide.basis
    check.write_text(TwinCheck(ladder_sha256="0" * 64, written="x", rows=rows).model_dump_json())
    other = twin_error(fit, path)
    assert other.ratio_high == err.ratio_high and "checked another ladder" in other.basis
    check.write_text("{not json")
    assert "is not a twin check" in twin_error(fit, path).basis
    bad = TwinCheck(ladder_sha256=digest, written="x", rows=rows).model_dump()
    bad["rows"][0]["twin_s"] = float("inf")  # a broken row is refused with the file, never a crash or a 0 ratio
    check.write_text(json.dumps(bad))
    assert "is not a twin check" in twin_error(fit, path).basis
    tiny = TwinCheckRow(trace="t", concurrency=1, offload="none", quantile="p50", real_s=1e-5, twin_s=100.0)
    check.write_text(TwinCheck(ladder_sha256=digest, written="x", rows=[tiny]).model_dump_json())
    held = twin_error(fit, path)  # a ratio of 1e-7 is held at the bound and said
    assert held.ratio_low == 1e-3 and "held within" in held.basis


def test_a_fit_past_its_error_bounds_is_unreliable_and_the_sim_refuses_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """#56 item 4: a quiet ladder's fit is reliable; one measured on a busy machine (a third of noise) is marked
    unreliable with each reason, and kvtier sim --calibration refuses it unless told --accept-unreliable."""
    from kvtier.results.ladder import LadderFit, load_fitted
    from kvtier.sim.servers import calibration_values

    quiet = fit_ladder(_synthetic(0.01), [], ["cpu"], None, "x.json")
    assert quiet is not None and quiet.unreliable == []
    busy = fit_ladder(_synthetic(0.6, seed=3), [], ["cpu"], None, "x.json")
    assert busy is not None and busy.unreliable
    assert any(r.startswith("the prefill fit's median error on its own points is ") for r in busy.unreliable)

    def ladder_file(fit: LadderFit, name: str) -> str:
        return _ladder_file(fit, tmp_path / name)

    with pytest.raises(ConfigError, match="--calibration .*: the ladder's fit is unreliable — the prefill fit's"):
        calibration_values(ladder_file(busy, "busy.json"))
    assert calibration_values(ladder_file(busy, "busy2.json"), accept_unreliable=True)[0]["prefill_tps"] > 0
    assert load_fitted(ladder_file(busy, "busy3.json"), "--ladder")[1].unreliable  # plan answers read it, said
    assert calibration_values(ladder_file(quiet, "quiet.json"))[0]["prefill_tps"] > 0


def test_a_gate_on_a_ladder_that_could_not_reach_the_servers_tier_says_why_not_blames_the_server() -> None:
    """#58 item 18: `plan gate --from` on a ladder whose flood could not reach the sim's CPU tier said "measure
    one against a server with offloading", though the server had one."""
    from types import SimpleNamespace

    from kvtier.errors import DatasetError
    from kvtier.plan.ladder_gate import ladder_gate_report
    from kvtier.results.envelope import WarningCode, warning
    from kvtier.results.ladder import TierFacts

    fit = fit_ladder(_synthetic(0.01), [], [], None, "x.json")  # cold and GPU only: no fetch curve
    assert fit is not None and not fit.timing.fetch
    why = warning(WarningCode.ladder_tier_unreachable, "cpu: not measured: a flood of 20,000 tokens would also ...")
    r = SimpleNamespace(server=SimpleNamespace(tiers=[TierFacts(name="cpu", capacity_tokens=10000, counter="x")]),
                        warnings=[why], cells=[])  # fmt: skip
    with pytest.raises(DatasetError, match="the server has cpu, which the ladder could not reach: cpu: not measured"):
        ladder_gate_report(r, fit, "l.json")  # type: ignore[arg-type]
    r.server.tiers = []
    with pytest.raises(DatasetError, match="measure one against a server with offloading"):
        ladder_gate_report(r, fit, "l.json")  # type: ignore[arg-type]


def _timing(tpot_s: float = 0.01) -> Timing:
    return Timing(source="measured", origin="t", prefill=TRUE, decode=DecodeModel(tpot_s=tpot_s, s_per_extra_seq=0.001))


def test_the_step_share_is_recovered_from_prompts_timed_beside_decoding_sequences():
    """Probes made by the step model with share 0.6 (and 3 % noise) give back 0.6; no valid probe, or no measured
    decode, gives no step model (the sim then adds nothing)."""
    t, rng = _timing(), np.random.default_rng(3)
    probes = [
        LoadedPoint(
            running=m,
            prompt_tokens=n,
            valid=True,
            ttft_s=loaded_ttft(t, n, m, ONE_CHUNK, 0.6) * (1 + 0.03 * rng.standard_normal()),
        )  # fmt: skip
        for m in (1, 2, 4)
        for n in (64, 512, 1024)
        for _ in range(3)
    ]
    step = fit_step(t, probes)
    assert step is not None and abs(step.share - 0.6) <= 0.05 and step.points == 27
    assert fit_step(t, [p.model_copy(update={"valid": False}) for p in probes]) is None
    assert fit_step(_timing(0.0), probes) is None


def test_how_much_slower_handling_runs_among_decoding_sequences_is_recovered_from_cached_prompts():
    """Long cached prompts timed alone and beside decoding sequences, made with handling 1.8x as long among them
    (and 3 % noise), give back a load of 0.8 beside the share; the cold probes alone fit the share as before."""
    t, rng = _timing(), np.random.default_rng(5)
    cold = [LoadedPoint(running=m, prompt_tokens=n, valid=True, ttft_s=loaded_ttft(t, n, m, ONE_CHUNK, 0.6))
            for m in (1, 2, 4) for n in (64, 512, 1024)]  # fmt: skip
    n, new = 8192, 3
    alone = TRUE.seconds(new, n - new)
    cached = [
        LoadedPoint(
            running=m,
            prompt_tokens=n,
            cached_tokens=n - new,
            valid=True,
            alone_s=alone,
            ttft_s=(alone + loaded_ttft(t, new, m, ONE_CHUNK, 0.6) - TRUE.seconds(new) + 0.8 * TRUE.handling_s(n))
            * (1 + 0.03 * rng.standard_normal()),
        )  # fmt: skip
        for m in (1, 2, 4)
        for _ in range(3)
    ]
    step = fit_step(t, cold + cached)
    assert step is not None and abs(step.share - 0.6) <= 0.01 and step.points == 9  # the cold probes only
    assert abs(step.handling_load - 0.8) <= 0.15 and step.handling_points == 9
    none = fit_step(t, cold)
    assert none is not None and (none.handling_load, none.handling_points) == (0.0, 0)  # not measured: 0


def test_a_tpot_sweep_that_falls_with_more_sequences_or_comes_in_bursts_is_implausible():
    def pt(m: int, s: float | None, bursty: int = 0) -> TpotPoint:
        return TpotPoint(running=m, tpot_s=s, requests=8, failed=0, bursty=bursty)

    assert tpot_implausible([pt(1, 0.005), pt(2, 0.0052), pt(4, 0.006)]) is None
    assert tpot_implausible([pt(1, 0.005), pt(2, 0.0049), pt(4, 0.0048)]) is None  # flat within the bound
    assert "falls from 5.36 ms" in (tpot_implausible([pt(1, 0.00536), pt(2, 0.0078), pt(4, 0.0036)]) or "")
    assert "came in bursts" in (tpot_implausible([pt(1, 0.005), pt(2, None, bursty=5)]) or "")


def test_handling_is_split_into_tokens_and_characters_by_two_kinds_of_text():
    """Cached prompts of words (5 characters a token) and of dense letters (1.6): the main fit's handling per token of
    word text (h) is split into its part per token and per character, and a prompt whose characters are given is
    timed by them; with one kind of text only, nothing is split."""
    true_tok, true_char, rho = 4e-7, 1.2e-7, 5.0
    main = TRUE.model_copy(update={"s_per_prompt_token": true_tok + rho * true_char})

    def hp(style: str, tokens: int, chars: int) -> HandlingPoint:
        cached = tokens - 12
        t = TRUE.overhead_s + TRUE.compute_s(12, cached) + true_tok * tokens + true_char * chars
        return HandlingPoint(style=style, prompt_tokens=tokens, cached_tokens=cached, chars=chars, ttft_s=t, valid=True)

    pts = [hp("words", n, int(n * rho)) for n in (2048, 8192)] + [hp("dense", n, int(n * 1.6)) for n in (2048, 8192)]
    split, err = split_handling(main, pts)
    assert abs(split.s_per_prompt_char - true_char) / true_char < 0.02
    assert abs(split.s_per_prompt_token - true_tok) / true_tok < 0.05
    assert split.prompt_chars_per_token == pytest.approx(rho, rel=0.01) and err is not None and err < 0.01
    assert split.handling_s(1000) == pytest.approx(main.s_per_prompt_token * 1000, rel=0.02)  # the ladder's own text
    words_only, none = split_handling(main, pts[:2])
    assert words_only == main and none is None


def test_a_step_model_that_misses_its_probes_makes_the_fit_unreliable():
    assert unreliable(0.05, 0.05, 0.05, 0.30) == [
        "the step model's median error on TTFTs with sequences decoding is 30.0% (bound 25%)"
    ]
    assert unreliable(0.05, 0.05, 0.05, 0.10) == []
