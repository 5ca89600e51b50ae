"""kvtier launch with kvtier's offloading backend inside a real vLLM (the CPU build): every vLLM launch profile passes
the installed vLLM's own argument parser and config classes, and ``kvtier launch --build cpu --tier cpu --arms
none,kvtier`` runs the backend under a replay beside a plain vLLM. The backend's own server tests are in
test_vllm_offload.py. Everything skips, with the reason, where the engine is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import REPO, kvtier_cmd, replay_summary
from tests.integration.test_launch import assert_no_orphans
from tests.integration.test_real_vllm import ENGINE_PYTHON, PROBLEM, STARTUP_S, _trace
from tests.integration.test_vllm_offload import BLOCK

pytest.importorskip("tokenizers")
pytestmark = [pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or ""), pytest.mark.slow, pytest.mark.engine]


def test_every_vllm_launch_profile_passes_the_installed_vllms_own_validation(tmp_path):
    """Each profile's replica command, resolved as kvtier launch resolves it, parsed by vLLM's server parser, its
    engine arguments and KV-transfer config built, its connector, spec and secondary tiers resolved — and a broken
    flag, connector setting or kvtier size is a problem, not a pass."""
    from kvtier.config.launch import LaunchConfig
    from kvtier.config.replay import ReplayConfig
    from kvtier.launch.orchestrate import plan
    from kvtier.launch.profiles import load_profiles
    from kvtier.modelmaker import Geometry, make_model
    from kvtier.vllm import engine_pythonpath

    model = make_model(tmp_path / "tiny", Geometry())
    cmds = []
    profiles, _ = load_profiles()
    for name, p in profiles.items():
        if p.engine != "vllm":
            continue
        cfg = LaunchConfig(tier=p.tier, engine="vllm", build=p.build, gpus=None if p.build == "cpu" else "0",
                           offload_engine=p.offload if p.tier != "gpu" else "auto", l1_gb=1, l2_gb=2,
                           nvme_dir=str(tmp_path / "nvme"), engine_python=str(ENGINE_PYTHON), model_dir=str(model),
                           dry_run=True, output=str(tmp_path / "out"),
                           replay=ReplayConfig(model="tiny" if p.build == "cpu" else str(model),
                                               dataset="d"))  # fmt: skip
        lp = plan(cfg)
        assert lp.profile_name == name
        cmds.append({"name": name, "argv": lp.replicas[0].argv})
    good = cmds[-1]["argv"]
    ktc_at = next(i for i, c in enumerate(cmds) if c["name"] == "vllm-cpu-nvme")
    bad_ktc = list(cmds[ktc_at]["argv"])
    i = bad_ktc.index("--kv-transfer-config") + 1
    bad_ktc[i] = bad_ktc[i].replace('"nvme_offload_gb"', '"nvme_offload_gbb"')
    cmds += [{"name": "bad-flag", "argv": [*good, "--kv-offloading-sise", "4"]},
             {"name": "bad-kvtier-setting", "argv": bad_ktc}]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": engine_pythonpath(str(tmp_path / "pylib"))}
    p = subprocess.run([str(ENGINE_PYTHON), "-m", "kvtier.vllm.validate"], input=json.dumps(cmds), text=True,
                       capture_output=True, env=env, timeout=600)  # fmt: skip
    out = {o["name"]: o for o in json.loads(p.stdout.strip().splitlines()[-1])}
    assert p.returncode == 1  # the two broken ones
    for name, o in out.items():
        if name.startswith("bad-"):
            assert not o["ok"], o
        else:
            assert o["ok"], o
    assert "nvme_offload_gbb: not a kvtier offload setting" in out["bad-kvtier-setting"]["problems"][0]
    assert any("secondary tier fs: FileSystemTierManager" in c for c in out["vllm-nvidia-nvme-native"]["checks"])
    assert any("KvtierOffloadingSpec" in c for c in out["vllm-amd-cpu-kvtier"]["checks"])


def test_launch_arms_none_and_kvtier_side_by_side_on_the_cpu_build(tmp_path):
    """kvtier launch --build cpu --arms none,kvtier: two agent runs side by side (their first four steps, 3.3-6k
    tokens each, each extending its run's last one) outgrow vLLM's 6,272-token cache, so each run's prefix is pushed
    out by the other's. The none arm recomputes it; the kvtier arm (a fresh vLLM with kvtier's CPU tier inside)
    loads it back, as the replay's scrape of vLLM's and kvtier's own counters says; arms.json sets them side by
    side."""
    first = _trace()
    data = tmp_path / "two-runs"
    data.mkdir()
    for f in sorted(first.parent.glob("*.jsonl"))[:2]:
        (data / f.name).symlink_to(f)
    out = tmp_path / "run"
    p = subprocess.run(
        [*kvtier_cmd(), "launch", "--engine", "vllm", "--build", "cpu", "--tier", "cpu", "--arms", "none,kvtier",
         "--l1-gb", "0.5", "--kv-cache-tokens", "6272", "--max-model-len", "6144",
         "--engine-python", str(ENGINE_PYTHON), "--output", str(out), "--health-interval", "5",
         "--", "--model", "tiny", "--dataset", str(data), "--num-rounds", "1", "--concurrency", "2",
         "--max-requests", "8", "--max-tokens-cap", "16", "--gap-scale", "0", "--progress", "none"],
        capture_output=True, text=True, timeout=2 * STARTUP_S + 900, cwd=REPO,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    r = json.loads((out / "arms.json").read_text())
    assert r["status"] == "complete" and r["order"] == [["none", "kvtier"]]
    by = {s["arm"]: s for s in r["arms"]}
    assert by["none"]["tier"] == "gpu" and by["kvtier"]["profile"] == "vllm-cpu-cpu"
    # none has nothing to load from; kvtier loaded what vLLM's cache had lost, by vLLM's own counters
    assert by["none"]["tokens_by_source"].get("external_kv_transfer", 0) == 0
    external = by["kvtier"]["tokens_by_source"]["external_kv_transfer"]
    assert external > 0 and by["kvtier"]["cached_by_source"]["host"] >= external
    assert by["kvtier"]["offload"]["store_bytes"] > 0 and not by["kvtier"]["offload"]["kvtier_failed_loads"]
    for s in by.values():
        assert s["later_ttft"]["n"] > 0 and s["failed"] == {}
        assert s["later_ttft"]["p50_lo_s"] <= s["later_ttft"]["p50_s"] <= s["later_ttft"]["p50_hi_s"]
    (v,) = r["verdicts"]
    assert v["arm"] == "kvtier" and v["later_ttft_p50_ratio"] > 0 and v["why"]
    arm = out / "arms" / "kvtier-r0"
    m = replay_summary(arm / "replay" / "summary.json")["server_metrics"][0]
    assert m["kvtier_offload_loaded_blocks"]["cpu"] * BLOCK == m["prompt_tokens_by_source"]["external_kv_transfer"]
    assert "Loading out-of-tree offloading spec 'KvtierOffloadingSpec'" in (arm / "logs" / "replica0.log").read_text()
    assert_no_orphans(arm)
    assert_no_orphans(out / "arms" / "none-r0")
    page = subprocess.run([*kvtier_cmd(), "report", str(out / "arms.json"), "--html", str(tmp_path / "page.html")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert page.returncode == 0, page.stderr
    text = (tmp_path / "page.html").read_text()
    assert "Offload engines side by side" in text and "verdict kvtier against none" in text
