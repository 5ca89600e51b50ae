"""kvtier replay against a real kvtier sim on 127.0.0.1: summary, scraped metrics, a dying server."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import SHARED_DATA, kvtier_cmd, replay_summary
from tests.integration.test_sim import start_sim, stop_sim, wait_until

MINISWE = SHARED_DATA / "lmcache_agent_trace" / "miniswe"
pytestmark = [pytest.mark.skipif(not MINISWE.exists(), reason="../shared/data not present"), pytest.mark.slow]


def replay(sim, out: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        kvtier_cmd()
        + [
            "replay",
            "--base-url",
            f"{sim.base}/v1",
            "--model",
            "tiny-1b",
            "--dataset",
            str(MINISWE),
            "--num-rounds",
            "5",
            "--concurrency",
            "4",
            "--output",
            str(out),
            "--gap-scale",
            "0",
            "--scrape-interval",
            "0.5",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_value(pv: subprocess.CompletedProcess[str], ok: list[dict], served: int) -> None:
    """kvtier plan value on the replay: each tier's tokens and value from its records, inputs measured or given."""
    assert pv.returncode == 0, pv.stderr
    v = json.loads(pv.stdout)
    assert v["requests"] == len(ok) and v["prompt_tokens"] == sum(r["prompt_tokens"] for r in ok)
    assert {i["name"]: i["source"] for i in v["inputs"]}["prefill rate"] == "measured"
    assert [t["tokens_served"] for t in v["tiers"]] == [served]
    for t in v["tiers"]:
        assert t["hit_rate"] == pytest.approx(served / v["prompt_tokens"], abs=1e-6)
        assert t["cost_usd_per_hour"] == pytest.approx(0.5 * 2 / 730, rel=1e-3)
        # valued net of the fetch (#41): GPU cost x (prefill avoided - fetch)
        assert t["gpu_s_saved_per_hour"] == pytest.approx(
            t["prefill_s_avoided_per_hour"] - t["fetch_s_per_hour"], abs=2e-3
        )
        assert t["value_usd_per_hour"] == pytest.approx(2 * t["gpu_s_saved_per_hour"] / 3600, abs=2e-6)
        if t["value_usd_per_hour"] > 0:
            assert t["breakeven_hit_rate"] == pytest.approx(
                t["hit_rate"] * t["cost_usd_per_hour"] / t["value_usd_per_hour"], rel=1e-3, abs=2e-6
            )  # the report rounds to 6 decimals
        else:
            assert t["pays"] is False and t["breakeven_hit_rate"] is None


def test_replay_against_sim_summary_and_metrics_agree(tmp_path):
    sim = start_sim(tmp_path, "--offload", "cpu", "--cpu-offload-gb", "2", "--gpu-kv-gb", "0.5")
    try:
        p = replay(sim, tmp_path / "out")
        server = sim.metrics()
    finally:
        stop_sim(sim)
    assert p.returncode == 0, p.stderr
    assert "virtual users of 5 turns" in p.stderr
    s = replay_summary(tmp_path / "out" / "summary.json")
    reqs = [json.loads(x) for x in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    summ = s["summary"]
    assert summ["sessions"]["total"] == s["concurrency"]["virtual_users"] > 0
    assert (
        summ["sessions"]["complete"] + summ["sessions"]["incomplete"] + summ["sessions"]["error"]
        == summ["sessions"]["total"]
    )
    assert summ["ttft_degradation"]["median_pct"] is not None and summ["ttft_s"]["p50"] > 0
    assert all(r["replica"] == f"127.0.0.1:{sim.port}" for r in reqs)
    assert {"user", "turn", "status", "replica", "ttft_s"} <= set(reqs[0])
    # the sim's TTFT decomposition (its response extension), in every ok record and by turn in the summary
    ok = [r for r in reqs if r["status"] == "ok"]
    for r in ok:
        src, parts = r["prompt_sources"], r["server_ttft_parts"]
        assert sum(src.values()) == r["prompt_tokens"] and set(src) <= {"gpu", "cpu", "recomputed"}, r
        assert set(parts) == {"receive", "queue", "lookup", "fetch", "recompute", "first_decode", "send"}
        assert sum(parts.values()) == pytest.approx(r["server_ttft_s"], abs=1e-5)
        assert r["server_ttft_s"] <= r["ttft_s"]  # measured inside the client's own interval
        assert (src["gpu"] + src.get("cpu", 0) > 0) == (r["cached_tokens"] > 0)
    dec = summ["ttft_decomposition"]
    assert dec["requests"] == len(ok) and [t["turn"] for t in dec["by_turn"]] == [0, 1, 2, 3, 4]
    assert sum(t["requests"] for t in dec["by_turn"]) == len(ok) and 0 <= dec["closure_within_5pct"] <= 1
    assert dec["by_turn"][-1]["token_share"].get("gpu", 0) > dec["by_turn"][0]["token_share"].get("gpu", 0)
    # kvtier plan value: each tier's tokens and value from these records, inputs marked measured or given
    pv = subprocess.run(
        kvtier_cmd() + ["plan", "value", "--from", str(tmp_path / "out"), "--json", "--gpu-cost", "2",
                        "--store-cost", "0.5", "--store-gb", "cpu=2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    served = sum(r["prompt_sources"].get("cpu", 0) for r in ok)
    if not served:  # nothing to value is an error that says why (#44 item 2), never an empty table
        assert pv.returncode == 3 and "no offload tier served any" in pv.stderr, pv.stderr
    else:
        check_value(pv, ok, served)
    # kvtier plan retention --from: the replay's own dataset in the order its ok requests were sent, in seconds
    pr = subprocess.run(
        kvtier_cmd() + ["plan", "retention", "--from", str(tmp_path / "out"), "--model", "llama3.1-8b",
                        "--tier", "cpu=0.2", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert pr.returncode == 0, pr.stderr
    ret = json.loads(pr.stdout)
    assert ret["requests"] == len(ok) and ret["unit"] == "s" and ret["block_tokens"] == 256
    assert ret["accessed_tokens"] <= sum(r["prompt_tokens"] for r in ok)  # full blocks of the sent prompts
    starts = [r["start_unix_s"] for r in ok]
    assert ret["span"] == pytest.approx(max(starts) - min(starts), abs=1e-6)  # the records' own times, in order
    assert ret["tiers"][0]["hit_fraction"] <= ret["reused_tokens"] / ret["accessed_tokens"] + 1e-6
    # kvtier plan views (c): these requests' KV I/O run through kvtier trace replay, its reads predicting the fetch
    pv = subprocess.run(
        kvtier_cmd() + ["plan", "views", "--from", str(tmp_path / "out"), "--storage", "--preset", "cpu-test",
                        "--work", str(tmp_path / "views"), "--json"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert pv.returncode == 0, pv.stderr
    views = json.loads(pv.stdout)
    assert [t["turn"] for t in views["turns"]] == [0, 1, 2, 3, 4] and views["requests"] == len(ok)
    assert sum(t["requests"] for t in views["turns"]) == len(ok)
    bench = json.loads(Path(views["storage_result"]).read_text())
    assert bench["benchmark"] == "kvtier bench" and bench["tiers"]["cpu"]["read"]["ops"] > 0
    assert all(t["storage_ttft_s"] is not None and t["predicted_ttft_s"] is None for t in views["turns"])
    assert views["median_abs_storage_ttft_error"] is not None
    m = s["server_metrics"][0]
    # the scraper's overall rate equals the server's own counters (warm-up included in both)
    expect = server["vllm:prefix_cache_hits_total"] / server["vllm:prefix_cache_queries_total"]
    assert m["prefix_cache_hit_rate_overall"] == pytest.approx(expect, rel=0.05)
    assert m["kv_cache_usage_perc_mean"] is not None
    assert_envelope_and_compare(tmp_path, tmp_path / "out" / "summary.json")


def assert_envelope_and_compare(tmp_path: Path, summary: Path) -> None:
    """The summary loads back as a typed ReplayResult; compare accepts it against itself and refuses a
    run with another concurrency."""
    from kvtier.results import load
    from kvtier.results.replay import ReplayResult

    r = load(summary)
    assert isinstance(r, ReplayResult) and r.status == "complete" and r.stop_reason.code == "dataset-finished"
    assert r.config.dataset_format == "agent-trace" and r.config.event_loop in ("uvloop", "asyncio")
    assert r.host.directories["output"].path == str((tmp_path / "out").resolve())
    p = subprocess.run(
        kvtier_cmd() + ["replay", "compare", str(summary), str(summary.parent)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 0 and "TTFT p50" in p.stdout, p.stderr
    other = json.loads(summary.read_text())
    other["config"]["concurrency"] = 8
    (tmp_path / "b.json").write_text(json.dumps(other))
    p = subprocess.run(
        kvtier_cmd() + ["replay", "compare", str(summary), str(tmp_path / "b.json")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2 and "NOT COMPARABLE: b: concurrency: 4 vs 8" in p.stderr


def test_killing_the_server_mid_run_still_writes_a_result(tmp_path):
    sim = start_sim(tmp_path, "--offload", "none", "--tpot-ms", "20")
    proc = subprocess.Popen(
        kvtier_cmd()
        + [
            "replay",
            "--base-url",
            f"{sim.base}/v1",
            "--model",
            "tiny-1b",
            "--dataset",
            str(MINISWE),
            "--num-rounds",
            "5",
            "--concurrency",
            "4",
            "--output",
            str(tmp_path / "out"),
            "--gap-scale",
            "0",
            "--scrape-interval",
            "0.5",
            "--request-timeout",
            "30",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # kill the server mid-run: once some requests finished (and before the replay could end)
    wait_until(lambda: sim.metrics().get("vllm:request_success_total", 0) >= 8, "requests to finish", 60)
    sim.proc.send_signal(signal.SIGKILL)
    sim.proc.wait()
    out, err = proc.communicate(timeout=120)
    r = replay_summary(tmp_path / "out" / "summary.json")
    s = r["summary"]
    assert s["requests_failed"] >= 1 and s["sessions"]["error"] >= 1
    # every user after the kill fails to connect: far above --max-failure-rate, so failed, exit 1
    assert proc.returncode == 1, err
    assert r["status"] == "failed" and r["stop_reason"]["code"] == "too-many-failures"
    assert s["failures"]["connection"]["count"] >= 4  # at least the 4 in flight when it died
    assert sum(f["count"] for f in s["failures"].values()) == s["requests_failed"]
    assert f"{s['requests_failed']} of {s['requests_failed'] + s['requests_ok']} requests failed: " in out


def test_synthetic_sessions_against_sim_grow_by_isl_and_osl_each_turn(tmp_path):
    """--synthetic: the server counts each turn's prompt as the last one plus one reply and one new user
    message: a constant step of ISL + OSL (+ the template's tokens for two messages) on every turn."""
    sim = start_sim(tmp_path, "--offload", "cpu", "--cpu-offload-gb", "0.5", "--gpu-kv-gb", "0.2")
    try:
        p = subprocess.run(
            kvtier_cmd()
            + ["replay", "--base-url", f"{sim.base}/v1", "--model", "tiny-1b", "--synthetic", "--users", "3",
               "--turns", "4", "--isl", "300", "--osl", "20", "--shared-prefix", "512", "--concurrency", "3",
               "--output", str(tmp_path / "out"), "--scrape-interval", "0.5", "--progress", "none"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        stop_sim(sim)
    assert p.returncode == 0, p.stderr
    assert "3 sessions in synthetic (synthetic) give 3 virtual users of 4 turns" in p.stderr
    reqs = [json.loads(x) for x in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    by: dict[str, dict[int, int]] = {}
    for r in reqs:
        by.setdefault(r["user"], {})[r["turn"]] = r["prompt_tokens"]
    steps = {b[k + 1] - b[k] for b in by.values() for k in range(3)}
    assert len(steps) == 1 and 320 <= steps.pop() <= 340  # 300 + 20 + a few template tokens
    assert all(r["completion_tokens"] <= 20 for r in reqs)
    s = replay_summary(tmp_path / "out" / "summary.json")
    assert s["dataset"]["format"] == "synthetic" and s["config"]["num_rounds"] == 4
    assert s["reuse_opportunity"]["cross_session_reuse_tokens"] > 0  # the shared 512-token system prompt


def test_an_offload_tier_the_gpu_cache_left_unused_is_named_and_plan_value_says_why(tmp_path):
    """#44 item 2, the README's serving path as it was: a sim whose modelled GPU holds every prefix (there, the
    preset's KV cache; here 4 GB of it) never serves a token from its CPU tier. The replay says so with a coded
    warning naming the flag, and `plan value` refuses to print an empty table (exit 3, the reason and the flag)."""
    sim = start_sim(tmp_path, "--offload", "cpu", "--cpu-offload-gb", "2", "--gpu-kv-gb", "4")
    try:
        p = replay(sim, tmp_path / "out", "--num-rounds", "2")
    finally:
        stop_sim(sim)
    assert p.returncode == 0, p.stderr
    s = replay_summary(tmp_path / "out" / "summary.json")
    m = s["server_metrics"][0]
    assert m["external_prefix_cache_hits"] == 0 and m["prompt_tokens_by_source"]["local_cache_hit"] > 0
    (w,) = [w for w in s["warnings"] if w["code"] == "offload-never-used"]
    assert "--gpu-kv-gb" in w["message"] and w["gpu_cache_hit_tokens"] > 0
    # #58 item 16: the console shows it (the README says "the replay warns"), and the tail beside the median
    assert f"warning [offload-never-used]: {w['message']}" in p.stdout, p.stdout
    line = next(x for x in p.stdout.splitlines() if x.startswith("replay ("))
    t = s["summary"]["ttft_s"]
    assert all(f"{q} {t[q]:.3g} s" in line for q in ("p50", "p95", "p99")), line
    assert "of TTFT queued (the server's TTFT decomposition)" in line and "//" not in line
    pv = subprocess.run(kvtier_cmd() + ["plan", "value", "--from", str(tmp_path / "out")],
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert pv.returncode == 3 and "no offload tier served any" in pv.stderr and "--gpu-kv-gb" in pv.stderr
