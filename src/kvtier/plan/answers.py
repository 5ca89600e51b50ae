"""``kvtier plan`` as library calls: each subcommand's config in, its typed answer out (results/plan.py).

    from kvtier.config.plan import GateConfig
    from kvtier.plan.answers import answer, plan_result

    cfg = GateConfig(model="llama3.1-70b-instruct", context="8192", prefill_tps=5000, case=["5Gbit/s,20ms"])
    a = answer(cfg)                 # GateReport: a.cases[0].verdict == "recompute"
    plan_result(cfg, a, started)    # the same answer in the envelope (what --output writes)

The CLI (cli/plan.py) is a table of (config, this call, a printer); nothing here prints.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvtier.config.plan import (
    BreakevenConfig,
    BytesConfig,
    CapacityConfig,
    FetchConfig,
    GateConfig,
    ModelFlags,
    PlanConfig,
    RecommendConfig,
    RetentionConfig,
    SweepConfig,
    ValueConfig,
    ViewsConfig,
    gate_case,
    named_numbers,
    number_list,
)
from kvtier.errors import ConfigError
from kvtier.modelspec import ModelSpec, build_catalog, resolve_model, spec_from_hf_config, spec_from_reference
from kvtier.plan import reports
from kvtier.results.envelope import Section
from kvtier.results.plan import PLAN_RESULTS, PlanResult
from kvtier.results.sweep import SweepGrid
from kvtier.units import parse_bandwidth


def model_spec(cfg: ModelFlags) -> ModelSpec:
    """The model the flags name: a catalog entry, a Hugging Face config.json, or a geometry of one's own."""
    cfg.require_model()
    if cfg.hf_config:
        m = spec_from_hf_config(cfg.hf_config)
    elif cfg.model:
        m = resolve_model(cfg.model, build_catalog())
    else:
        raw: dict[str, Any] = {
            "num_layers": cfg.layers,
            "kv_heads": cfg.kv_heads or 0,
            "head_dim": cfg.head_dim or 0,
            "attention_type": cfg.attention or ("mla" if cfg.kv_lora_rank else "gqa"),
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
        }
        m = spec_from_reference("custom", raw)
    return replace(m, dtype=cfg.dtype) if cfg.dtype else m


def bytes_answer(cfg: BytesConfig) -> reports.BytesReport | reports.CatalogReport:
    if cfg.list_ or not cfg.model_given:
        return reports.catalog_report(build_catalog())
    return reports.bytes_report(model_spec(cfg), cfg.tp)


def breakeven_answer(cfg: BreakevenConfig) -> reports.BreakevenReport:
    links = [reports.Link(*link) for link in cfg.links()]
    hbm = parse_bandwidth(cfg.hbm_bw, "--hbm-bw")
    return reports.breakeven_report(
        model_spec(cfg), cfg.context, cfg.prefill_tps, hbm, cfg.stages, links, cfg.compression, cfg.tp
    )


def gate_answer(cfg: GateConfig) -> reports.GateReport | Any:
    if cfg.from_:
        from kvtier.plan.ladder_gate import ladder_gate_report
        from kvtier.results.ladder import load_fitted

        r, fit = load_fitted(cfg.from_, "--from")
        return ladder_gate_report(r, fit, cfg.from_, cfg.contexts(), cfg.new_token_counts())
    cases = [reports.GateCase(c, *gate_case(c)) for c in cfg.case]
    return reports.gate_report(model_spec(cfg), cfg.context_tokens(), float(cfg.prefill_tps or 0), cases, cfg.tp)


def capacity_answer(cfg: CapacityConfig) -> reports.CapacityReport:
    return reports.capacity_report(
        model_spec(cfg), cfg.tokens, cfg.headroom, cfg.tier_bytes(), cfg.tokens_per_user, cfg.target_usage, cfg.tp
    )


def fetch_answer(cfg: FetchConfig) -> reports.FetchReport:
    from kvtier.plan.measured import load_read_costs

    tier_costs, result = load_read_costs(cfg.from_)
    source = reports.FetchSource(model=result.model.key, status=result.status.value, file=str(cfg.from_))
    m = model_spec(cfg) if cfg.model_given else resolve_model(result.model.key, build_catalog())
    return reports.fetch_report(tier_costs, source, m, cfg.prefill_tps, cfg.contexts(), cfg.tp)


def value_answer(cfg: ValueConfig) -> Any:
    from kvtier.plan.value import engine_measured, ladder_check, ladder_value_report, value_report

    store_gb = named_numbers(cfg.store_gb, "--store-gb")
    if cfg.ladder and engine_measured(cfg.from_):  # measured per request: the ladder's curves beside, as a check
        measured = value_report(cfg.from_, None, cfg.gpu_cost, cfg.store_cost, store_gb)
        return measured.model_copy(update={"ladder": cfg.ladder, "ladder_check": ladder_check(cfg.from_, cfg.ladder)})
    if cfg.ladder:
        return ladder_value_report(cfg.from_, cfg.ladder, cfg.gpu_cost, cfg.store_cost, store_gb)
    fetch_bw: dict[str, float] = {}
    kvpt = None
    if cfg.fetch_from:
        from kvtier.plan.measured import load_read_costs

        tier_costs, bench = load_read_costs(cfg.fetch_from)
        fetch_bw = {c.tier: c.bw_mean for c in tier_costs}
        kvpt = bench.model.kv_bytes_per_token_per_rank
    return value_report(cfg.from_, cfg.prefill_tps, cfg.gpu_cost, cfg.store_cost, store_gb, fetch_bw, kvpt)


def access_stream(cfg: RetentionConfig) -> Any:
    """The prefix-block accesses retention walks: a Mooncake trace, a replay as sent, or a dataset as a closed loop
    of ``--concurrency`` users."""
    from kvtier.plan import retention

    if cfg.trace:
        return retention.stream_from_trace(cfg.trace)
    if cfg.from_:
        return retention.stream_from_replay(cfg.from_)
    from kvtier.config.replay import ReplayConfig
    from kvtier.replay.driver import load_users

    rc = ReplayConfig(
        dataset=cfg.dataset,
        dataset_format=cfg.dataset_format,
        tokenizer=cfg.tokenizer,
        num_rounds=cfg.num_rounds,
        min_chunk_rounds=cfg.min_chunk_rounds,
        reuse_block_tokens=cfg.block_tokens,
    )
    rc, _, users, tokenizer, _ = load_users(rc)
    order = retention.closed_loop_order([len(u.turns) for u in users], cfg.concurrency)
    return retention.stream_from_users(
        users,
        tokenizer.encode,
        cfg.block_tokens,
        order,
        source=str(cfg.dataset),
        order_text=f"a closed loop of {cfg.concurrency} virtual users at equal service times (one step a request)",
    )


def retention_answer(cfg: RetentionConfig) -> Any:
    from kvtier.plan.retention import retention_report

    m = model_spec(cfg)
    return retention_report(access_stream(cfg), m.key, int(m.kv_bytes_per_token_per_rank(cfg.tp)), cfg.tier_gb())


def recommend_answer(cfg: RecommendConfig) -> Any:
    from kvtier.plan.recommend import recommend

    return recommend(cfg.from_, cfg.slo_ttft_p95, named_numbers(cfg.store_cost, "--store-cost"), cfg.concurrency)


def views_answer(cfg: ViewsConfig) -> Any:
    from kvtier.plan.views import views_report

    return views_report(
        cfg.from_,
        cfg.fetch_from,
        cfg.preset,
        prefill_tps=cfg.prefill_tps,
        prefill_overhead_ms=cfg.prefill_overhead_ms,
        model=cfg.model,
        storage=cfg.storage,
        storage_dir=cfg.storage_dir,
        work=cfg.work,
        ladder=cfg.ladder,
    )


ANSWERS: dict[type[Any], Callable[[Any], Section]] = {
    BytesConfig: bytes_answer,
    BreakevenConfig: breakeven_answer,
    GateConfig: gate_answer,
    CapacityConfig: capacity_answer,
    FetchConfig: fetch_answer,
    ValueConfig: value_answer,
    RetentionConfig: retention_answer,
    RecommendConfig: recommend_answer,
    ViewsConfig: views_answer,
}
"""Each answering subcommand's library call, by its config model."""

BENCHMARKS: dict[type[Any], str] = {
    BytesConfig: "kvtier plan bytes",
    BreakevenConfig: "kvtier plan breakeven",
    GateConfig: "kvtier plan gate",
    CapacityConfig: "kvtier plan capacity",
    FetchConfig: "kvtier plan fetch",
    ValueConfig: "kvtier plan value",
    RetentionConfig: "kvtier plan retention",
    RecommendConfig: "kvtier plan recommend",
    ViewsConfig: "kvtier plan views",
}


def answer(cfg: PlanConfig) -> Section:
    """The subcommand's answer to ``cfg`` (its library call, by the config's type)."""
    return ANSWERS[type(cfg)](cfg)


def plan_result(cfg: PlanConfig, ans: Section, started: dt.datetime) -> PlanResult:
    """``ans`` in the envelope: the config asked, the host, ``complete``/``answered`` (what ``--output`` writes)."""
    from kvtier.results.envelope import Status, StopCode, StopReason, collect_host, iso, utc_now

    model = PLAN_RESULTS[BENCHMARKS[type(cfg)]]
    return model(
        status=Status.complete,
        stop_reason=StopReason(code=StopCode.answered, message="the planner answered"),
        started_at=iso(started),
        finished_at=iso(utc_now()),
        host=collect_host(),
        config=cfg,
        answer=ans,
    )


def sweep_grid(cfg: SweepConfig) -> SweepGrid:
    """The grid a sweep runs (its folder's sweep.json keeps it), paths made absolute."""
    import shlex
    from pathlib import Path

    if not Path(cfg.dataset).exists():
        raise ConfigError(f"--dataset {cfg.dataset}: no such file or folder")
    resolve_model(cfg.sim_model, build_catalog())  # an unknown model fails now, not in the first trial
    if cfg.calibration:  # a ladder without a fit, or an unreliable one not accepted, fails now too
        from kvtier.results.ladder import load_fitted

        load_fitted(cfg.calibration, "--calibration", None if cfg.accept_unreliable else "--accept-unreliable")
    out = Path(cfg.output)
    return SweepGrid(
        dataset=str(Path(cfg.dataset).resolve()),
        dataset_format=cfg.dataset_format,
        cpu_gb=number_list(cfg.cpu_gb, "--cpu-gb"),
        nvme_gb=number_list(cfg.nvme_gb, "--nvme-gb"),
        concurrency=[int(x) for x in number_list(cfg.concurrency, "--concurrency", integer=True)],
        trials=cfg.trials,
        budget_s=cfg.budget,
        preset=cfg.preset,
        sim_model=cfg.sim_model,
        gpu_kv_gb=cfg.gpu_kv_gb,
        num_rounds=cfg.num_rounds,
        max_tokens_cap=cfg.max_tokens_cap,
        duration_s=cfg.duration,
        nvme_dir=str(Path(cfg.nvme_dir or out / "nvme").resolve()),
        replay_args=shlex.split(cfg.replay_args or ""),
        calibration=str(Path(cfg.calibration).resolve()) if cfg.calibration else None,
        accept_unreliable=cfg.accept_unreliable,
    )


__all__ = ["ANSWERS", "answer", "model_spec", "plan_result", "sweep_grid"]
