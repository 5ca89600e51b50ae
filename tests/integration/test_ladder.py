"""kvtier ladder against servers whose truth we know: the sim with real offload tiers (a CPU staging tier in front
of NVMe files) finds every tier, verifies every point by the sim's counters, and recovers the sim's own timing; the
gate from the ladder agrees with what was measured; a sim calibrated from the ladder times as the ladder measured.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from kvtier.results import load
from kvtier.results.ladder import LadderResult
from tests.conftest import kvtier_cmd
from tests.integration.test_sim import Sim, chat, start_sim, stop_sim

pytestmark = pytest.mark.serial  # it times the tiers against each other: run alone (scripts/test.sh)

PREFILL_TPS, OVERHEAD_MS, TPOT_MS, SLOWDOWN = 8000.0, 2.0, 4.0, 0.05
# tiny-1b (24,576 B/token): a 2,048-token GPU, a 0.15 GB staging tier (6,553 tokens) in front of 0.5 GB of files
SIM_ARGS = ["--model", "tiny-1b", "--gpu-kv-tokens", "2064", "--prefill-tps", str(PREFILL_TPS),
            "--prefill-overhead-ms", str(OVERHEAD_MS), "--tpot-ms", str(TPOT_MS),
            "--batch-slowdown", str(SLOWDOWN)]  # fmt: skip


def ladder(sim: Sim, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        kvtier_cmd() + ["ladder", "--base-url", sim.base + "/v1", "--model", "tiny-1b", "--output", str(out),
                        "--quiet", *extra],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[LadderResult, Path]:
    d = tmp_path_factory.mktemp("ladder")
    (d / "nvme").mkdir()
    sim = start_sim(d, *SIM_ARGS, "--offload", "nvme", "--nvme-dir", str(d / "nvme"), "--staging-gb", "0.15",
                    "--nvme-offload-gb", "0.5")  # fmt: skip
    try:
        p = ladder(sim, d / "ladder.json", "--contexts", "256,768,1536", "--new-tokens", "16,256", "--repeats", "2",
                   "--tpot-concurrency", "1,2,4", "--tpot-tokens", "24", "--plot", str(d / "ladder.png"))  # fmt: skip
    finally:
        stop_sim(sim)
    assert p.returncode == 0, p.stdout + p.stderr
    r = load(d / "ladder.json")
    assert isinstance(r, LadderResult)
    assert "fit: prefill_s =" in p.stdout and "ladder (complete, grid-finished)" in p.stdout
    return r, d


def test_the_ladder_finds_every_tier_and_verifies_every_point(measured: tuple[LadderResult, Path]) -> None:
    r, d = measured
    assert r.status.value == "complete" and r.server.kind == "kvtier-sim"
    assert [t.name for t in r.server.tiers] == ["cpu", "storage"]
    assert r.server.gpu_kv_tokens == 2048 and r.server.kv_bytes_per_token == 24576
    sources = {p.source for p in r.points}
    assert sources == {"cold", "gpu", "cpu", "storage"}
    assert all(p.verified for p in r.points), [(p.source, p.why) for p in r.points if not p.verified]
    for p in r.points:  # what verified each point: the counters named the intended source
        if p.source == "storage":
            assert p.shown.tiers["storage"] >= 0.5 * p.context_tokens and p.shown.tiers["cpu"] == 0
            assert p.flood_tokens > 6553  # past the staging tier
        if p.source == "cpu":
            assert p.shown.tiers["cpu"] >= 0.5 * p.context_tokens and (p.shown.gpu_hit_tokens or 0) < 64
        if p.source == "cold":
            assert (p.cached_tokens or 0) < 16
    # the grid, and the groups of a cell whose repeats spread past 20 % measured again (4 sources each)
    assert len(r.points) == 3 * 2 * 2 * 4 + 4 * sum(r.remeasured.values())
    assert (d / "ladder.png").stat().st_size > 10_000
    assert r.host_load is not None and r.host_load.cpus >= 1 and r.fit is not None and r.fit.unreliable == []
    # the random order: the cells were not measured context by context
    firsts = [p.context_tokens for p in sorted(r.points, key=lambda p: p.seq) if p.source == "cold"]
    assert firsts != sorted(firsts)


def test_the_ladder_recovers_the_sims_own_timing(measured: tuple[LadderResult, Path]) -> None:
    r, _ = measured
    assert r.fit is not None
    t = r.fit.timing
    assert t.source == "measured"
    assert 1 / t.prefill.s_per_token == pytest.approx(PREFILL_TPS, rel=0.10)
    assert t.decode.tpot_s == pytest.approx(TPOT_MS / 1e3, rel=0.10)
    assert {f.tier for f in t.fetch} == {"cpu", "storage"}
    storage, cpu = t.fetch_for("storage"), t.fetch_for("cpu")
    assert storage is not None and cpu is not None
    at = 1536  # the files cost more to read back than the staging tier's RAM
    assert storage.seconds(at) > cpu.seconds(at)
    assert r.fit.prefill_fit_median_abs_rel_err is not None and r.fit.prefill_fit_median_abs_rel_err < 0.10
    # the interference sweep: a preset's decode steps cost a prefill nothing (it starts beside them at once)
    assert t.step is not None and t.step.points >= 15 and t.step.share <= 0.5
    assert sum(p.valid for p in r.loaded) >= 15


def test_a_twin_calibrated_with_interference_reproduces_it(measured: tuple[LadderResult, Path]) -> None:
    """#56 item 3: a ladder whose steps add (share 1, a 20 ms decode step) calibrates a sim; the same ladder run
    against that sim measures the interference back: the twin's prefill pays for the batch beside it."""
    r, d = measured
    assert r.fit is not None
    doc = json.loads((d / "ladder.json").read_text())
    doc["fit"]["timing"]["decode"] = {"tpot_s": 0.02, "s_per_extra_seq": 0.0}
    doc["fit"]["timing"]["step"] = {"share": 1.0, "points": 27, "median_abs_rel_err": 0.05}
    (d / "steps.json").write_text(json.dumps(doc))
    sim = start_sim(d, "--model", "tiny-1b", "--gpu-kv-tokens", "2064", "--calibration", str(d / "steps.json"))
    try:
        p = ladder(sim, d / "steps-again.json", "--contexts", "256,768", "--new-tokens", "16", "--repeats", "2",
                   "--tpot-concurrency", "1,2", "--tpot-tokens", "12", "--handling-contexts", "")  # fmt: skip
    finally:
        stop_sim(sim)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    again = load(d / "steps-again.json")
    assert isinstance(again, LadderResult) and again.fit is not None and again.fit.timing.step is not None
    assert again.fit.timing.decode.tpot_s == pytest.approx(0.02, rel=0.15)
    assert again.fit.timing.step.share == pytest.approx(1.0, abs=0.35)


def test_a_twin_whose_handling_slows_among_running_sequences_is_measured_back(
    measured: tuple[LadderResult, Path],
) -> None:
    """A calibration whose handling is 20 us a prompt token and twice as long while sequences run (handling_load 1)
    makes a twin; the ladder's cached probes, timed alone and among its decoding streams, give the load back."""
    r, d = measured
    assert r.fit is not None
    doc = json.loads((d / "ladder.json").read_text())
    doc["fit"]["timing"]["prefill"].update(s_per_prompt_token=2e-5, s_per_prompt_char=0.0)
    doc["fit"]["timing"]["decode"] = {"tpot_s": 0.01, "s_per_extra_seq": 0.0}
    doc["fit"]["timing"]["step"] = {"share": 0.0, "points": 27, "handling_load": 1.0, "handling_points": 9}
    (d / "handling.json").write_text(json.dumps(doc))
    sim = start_sim(d, "--model", "tiny-1b", "--gpu-kv-tokens", "2064", "--calibration", str(d / "handling.json"))
    try:
        p = ladder(sim, d / "handling-again.json", "--contexts", "256,768", "--new-tokens", "16", "--repeats", "3",
                   "--tpot-concurrency", "1,2", "--tpot-tokens", "12", "--loaded-prompts", "64",
                   "--handling-contexts", "1024")  # fmt: skip
    finally:
        stop_sim(sim)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    again = load(d / "handling-again.json")
    assert isinstance(again, LadderResult) and again.fit is not None and again.fit.timing.step is not None
    cached = [x for x in again.loaded if x.cached_tokens is not None]
    assert len(cached) == 6 and all(x.valid for x in cached), [x.why for x in cached]
    assert sum(bool(x.ttft_s and x.alone_s and x.ttft_s > x.alone_s) for x in cached) >= 5  # slower among them
    assert again.fit.timing.step.handling_points == 6
    assert again.fit.timing.step.handling_load == pytest.approx(1.0, abs=0.4)


def test_plan_gate_from_the_ladder_agrees_with_its_points(measured: tuple[LadderResult, Path]) -> None:
    _, d = measured
    p = subprocess.run(kvtier_cmd() + ["plan", "gate", "--from", str(d / "ladder.json"), "--json"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(p.stdout)
    assert rep["checked"] == 2 * 3 * 2 and rep["agreed"] == rep["checked"]
    assert {x["tier"] for x in rep["rows"]} == {"cpu", "storage"}
    refused = subprocess.run(kvtier_cmd() + ["plan", "gate", "--from", str(d / "ladder.json"), "--prefill-tps", "9"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode != 0 and "--prefill-tps" in refused.stderr


def test_a_sim_calibrated_from_the_ladder_times_as_it_measured(measured: tuple[LadderResult, Path]) -> None:
    r, d = measured
    assert r.fit is not None
    sim = start_sim(d, "--model", "tiny-1b", "--gpu-kv-tokens", "2064", "--calibration", str(d / "ladder.json"))
    try:
        text = urllib.request.urlopen(sim.base + "/metrics", timeout=10).read().decode()
        assert 'source="measured"' in text and "kvtier_sim:timing_info" in text
        status, body, _ = sim.post("/v1/chat/completions", chat("a short prompt " * 20, max_tokens=2))
        assert status == 200 and body["kvtier"]["timing"] == "measured"
        # #56 item 5: the twin says how far its times may stray, measured on the ladder's own points
        (item,) = json.loads(urllib.request.urlopen(sim.base + "/v1/models", timeout=10).read())["data"]
        err = item["kvtier_timing"]["error"]
        assert item["kvtier_timing"]["origin"] == str(d / "ladder.json")
        assert 0 < err["ratio_low"] <= 1 <= err["ratio_high"] and err["points"] == len(r.fit.residuals)
        p = ladder(sim, d / "again.json", "--contexts", "256,768,1536", "--new-tokens", "16,256", "--repeats", "2",
                   "--tpot-concurrency", "")  # fmt: skip
        assert p.returncode == 0, p.stdout + p.stderr
        out = d / "replay"
        rp = subprocess.run(kvtier_cmd() + ["replay", "--base-url", sim.base + "/v1", "--model", "tiny-1b",
                                            "--synthetic", "--users", "2", "--turns", "3", "--isl", "300", "--osl", "4",
                                            "--min-chunk-rounds", "0", "--num-rounds", "3", "--concurrency", "2",
                                            "--progress", "none", "--output", str(out)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
        assert rp.returncode == 0, rp.stderr
    finally:
        stop_sim(sim)
    recs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and {r["sim_timing"] for r in recs} == {"measured"}
    summary = json.loads((out / "summary.json").read_text())
    codes = {w["code"] for w in summary["warnings"]}
    assert "sim-timing-assumed" not in codes and "sim-timing-extrapolated" not in codes
    twin, ttft = summary["summary"]["twin"], summary["summary"]["ttft_s"]  # the TTFT it measured, as the error allows
    assert twin["error"] == err and twin["ttft_s"]["p95"] == [round(ttft["p95"] * err["ratio_low"], 6),
                                                               round(ttft["p95"] * err["ratio_high"], 6)]  # fmt: skip
    # what the replay's cache hits saved, priced by the ladder's curve (any server: usage.cached_tokens only)
    v = subprocess.run(kvtier_cmd() + ["plan", "value", "--from", str(out), "--ladder", str(d / "ladder.json"),
                                       "--gpu-cost", "2", "--json"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert v.returncode == 0, v.stderr
    rep = json.loads(v.stdout)
    (row,) = rep["tiers"]
    assert row["tier"] == "cache" and row["requests_hit"] >= 2 and row["prefill_s_avoided_per_hour"] > 0
    assert {i["source"] for i in rep["inputs"] if i["name"] == "prefill"} == {"derived"}
    lo, hi = row["gpu_s_saved_per_hour_band"]  # the saving carries the ladder's error
    assert rep["twin_error"] == err and lo <= row["gpu_s_saved_per_hour"] <= hi and lo < hi
    # plan views from the ladder, on the same replay as a real vLLM would have recorded it (no kvtier extension)
    plain = d / "as-vllm"
    shutil.copytree(out, plain)
    lines = [json.loads(x) for x in (plain / "requests.jsonl").read_text().splitlines()]
    for rec in lines:
        rec.update(prompt_sources=None, server_ttft_parts=None, server_ttft_s=None)
    (plain / "requests.jsonl").write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    refused = subprocess.run(kvtier_cmd() + ["plan", "views", "--from", str(plain), "--fetch-from", "x.json"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode != 0  # without a ladder, a replay with no decomposition cannot be viewed
    vw = subprocess.run(kvtier_cmd() + ["plan", "views", "--from", str(plain), "--ladder", str(d / "ladder.json"),
                                        "--json"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert vw.returncode == 0, vw.stderr
    views = json.loads(vw.stdout)
    assert views["requests"] == 6 and len(views["turns"]) == 3
    assert all(t["predicted_ttft_s"] and t["measured_fetch_s"] is None for t in views["turns"])
    for t in views["turns"]:  # each prediction with the interval the ladder's error allows, and whether it held
        lo, hi = t["predicted_ttft_s_band"]
        assert lo <= t["predicted_ttft_s"] <= hi and t["within_band"] == (lo <= t["measured_ttft_s"] <= hi)
    assert views["twin_error"] == err and "turns' measured TTFT lies within the ladder's error" in views["findings"][0]
    # a sweep whose sims are calibrated from the ladder: recommend decides the SLO on the twin's error too
    from tests.integration.test_plan_sweep import sessions

    sweep = d / "sweep"
    sw = subprocess.run(kvtier_cmd() + ["plan", "sweep", "--dataset", str(sessions(d / "data", users=2, turns=5)),
                                        "--cpu-gb", "0", "--trials", "1", "--concurrency", "2", "--gpu-kv-gb", "0.3",
                                        "--calibration", str(d / "ladder.json"), "--output", str(sweep)],
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert sw.returncode == 0, sw.stderr
    rc = subprocess.run(kvtier_cmd() + ["plan", "recommend", "--from", str(sweep), "--slo-ttft-p95", "60", "--json"],
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert rc.returncode == 0, rc.stderr
    (point,) = json.loads(rc.stdout)["points"]
    wide, p95 = point["ttft_p95_s_with_twin"], point["ttft_p95_s"]["mean"]
    assert point["twin_error"] == err and wide["low"] <= p95 <= wide["high"] and point["meets_slo"] is True
    # the calibrated sim runs the ladder's model: the prediction from that model lands near what it measured
    assert views["median_abs_ttft_error"] is not None and views["median_abs_ttft_error"] < 0.5
    again = load(d / "again.json")
    assert isinstance(again, LadderResult) and again.fit is not None
    # the calibrated twin's prefill per token is the measured server's (its own HTTP cost is added to the fixed part)
    assert again.fit.timing.prefill.s_per_token == pytest.approx(r.fit.timing.prefill.s_per_token, rel=0.15)
    flags = subprocess.run(kvtier_cmd() + ["sim", "--calibration", str(d / "ladder.json"), "--prefill-tps", "5"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert flags.returncode != 0 and "--prefill-tps" in flags.stderr


def test_a_flood_too_small_leaves_the_tier_unverified_and_the_run_partial(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, *SIM_ARGS, "--offload", "cpu", "--cpu-offload-gb", "0.2")
    try:
        p = ladder(sim, tmp_path / "l.json", "--contexts", "256,1024", "--new-tokens", "16", "--repeats", "2",
                   "--flood-tokens", "cpu=300", "--tpot-concurrency", "")  # fmt: skip
    finally:
        stop_sim(sim)
    r = load(tmp_path / "l.json")
    assert isinstance(r, LadderResult)
    cpu = [p for p in r.points if p.source == "cpu"]
    assert cpu and not any(p.verified for p in cpu)
    assert all(p.why and "from cpu" in p.why for p in cpu)  # the GPU still held the prefix: the counters said so
    assert r.status.value == "partial" and p.returncode == 1
    codes = {w.code for w in r.warnings}
    assert {"ladder-unverified", "ladder-source-unverified"} <= codes
    assert r.fit is not None and not r.fit.timing.fetch  # unverified points are never fitted


def test_a_bounded_ladder_keeps_what_it_measured(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, *SIM_ARGS)
    try:
        p = ladder(sim, tmp_path / "l.json", "--contexts", "256,512,1024", "--max-requests", "9")
    finally:
        stop_sim(sim)
    r = load(tmp_path / "l.json")
    assert isinstance(r, LadderResult)
    assert r.status.value == "partial" and r.stop_reason.code.value == "max-requests" and p.returncode == 1
    assert r.requests_sent == 9 and 0 < len(r.points) <= 7  # two probes, then the points
