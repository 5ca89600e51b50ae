"""The simulator's prefix cache against a real vLLM's, on the same trace: is the sim's hit rate vLLM's?

One held-in trace (an LMCache mini-SWE-agent trace from ../shared/data by default) is replayed against a real
vLLM 0.32.0 (the CPU build, ``scripts/install-engines.sh cpu``, serving a ``kvtier model make`` folder with
dummy weights) and against ``kvtier sim`` given the same KV capacity in tokens, block size (128: the CPU
build's), model length and tokenizer (``--tokenizer hf:DIR``: the folder's tokenizer and chat template, so
the sim's prompt ids are the server's). One replica, no gaps (``--gap-scale 0``), ``--max-tokens-cap``
(decode on 2 cores would take the run's time, and the replay sends the recorded history, not the replies),
``--skip-too-long`` (this small tokenizer counts the longest prompts past 16,384 tokens: a user stops before
its first such turn), concurrency 1 then 4. Each server is started fresh per run (every concurrency and trial;
in ``--ttft`` mode the ladder has an engine of its own), so no run meets another's cache: before each replay the
server's prefix-cache queries counter must read 0 (``_common.prior_queries``), or the run stops.

With ``--offload-gb G`` both servers offload: the vLLM runs kvtier's CPU tier of G GB inside it (kvtier/vllm), the
sim an in-process CPU tier holding as many tokens (G x its model's KV bytes per token over the dummy model's) with
vLLM's 128-token block as its entry (``--offload-chunk-tokens``) and, as vLLM's tier, no fetch gate
(``--no-fetch-gate``); each prints its prompt tokens by source (vLLM's
``prompt_tokens_by_source``: the GPU cache's hits, the offload tier's, recompute) and the last line is
``sim_vs_vllm_offload gpu_vllm=… gpu_sim=… offload_vllm=… offload_sim=… worst_source_abs_diff=…`` (the largest
difference of one source's share at one concurrency).

With ``--ttft [--dataset DIR]`` it compares time, not only hits: it measures the real vLLM's ladder (``kvtier
ladder``: cold and GPU TTFT by context, TPOT by running sequences; never fitted to the replayed trace), starts the sim
with ``--calibration`` from it, replays the trace against both and prints per turn the TTFT p50 and p95 of each, and
last ``sim_vs_vllm_ttft p50_err=… p95_err=… hit_diff=…`` (the worst turn's relative error of the sim's p50 and p95
against vLLM's, the largest hit-rate difference, over the concurrencies). The per-turn table is written beside
the ladder as ``ladder.twin-check.json`` (results/ladder.py ``TwinCheck``): every twin calibrated from that ladder
then carries it in the error it reports (``twin_error``).

With ``--all-families`` it does that on every trace family in ../shared/data (benchmarks/_families.py: the three
LMCache agent-trace folders, tau2-bench, ShareGPT, a Mooncake slice given text by its block hashes), at each
``--concurrency`` (1,4,8 by default there), with no offload tier and with kvtier's CPU tier of
``--families-offload-gb`` inside vLLM (the sim calibrated from the same ladder, with the same tier and the served
folder's own KV geometry, ``--hf-config``): one ladder for all (never fitted to a trace), a fresh server of each kind
per run, and a table of the worst turn's TTFT p50 and p95 error and the prompt tokens' shares by source (GPU hit,
offload tier, recompute) on each side per family, regime and concurrency; last
``sim_vs_vllm_families rows=… worst_p50_err=… worst_p95_err=… worst_source_diff=… rows_met=…`` (rows within
#56's aims: p50 15 %, p95 25 %, each source's share 0.03). A ladder whose fit is unreliable is measured again
(``--ladder-attempts``) and never used. ``--offload-ladder`` calibrates the offload runs' twin from a second ladder,
of vLLM with the tier inside it (as served). ``--vllm-repeats 2`` replays every run on a second fresh vLLM too and
judges vLLM against itself by the same measures: the table gains that column, and the last line
``rows_within_floor=… floor_p50=… floor_p95=… floor_source=…`` (a row is within its floor when each of the twin's
errors is within the aim or within vLLM's own difference, whichever is wider).

Printed per concurrency: each server's overall prefix hit rate from its own counters (the replay's scrape:
hits / queries over the run, no warm-up) and the hit rate per turn of a virtual user (Σ cached / Σ prompt
tokens from usage.prompt_tokens_details), then the prompt tokens each counted (a template mismatch would
show here). Last line: ``sim_vs_vllm hit_rate_vllm=… hit_rate_sim=… abs_diff=…`` over both concurrencies and all
``--trials`` (Σ hits / Σ queries of each server), with the worst single concurrency's difference (of the
trials' means) beside it. At concurrency 4 the arrival order of the users' turns decides which prefixes
survive, and it varies from run to run on both servers: ``--trials 3`` prints each one's spread.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, prior_queries, start_peer

sys.path.insert(0, str(REPO / "src"))
from kvtier.child import Child
from kvtier.config.launch import CPU_BLOCK_TOKENS
from kvtier.launch import cpu_engine
from kvtier.launch.devices import cpu_inventory
from kvtier.launch.procs import free_ports, http_ok
from kvtier.modelmaker import Geometry, make_model
from kvtier.modelspec import build_catalog, resolve_model
from kvtier.results.ladder import TwinCheck, TwinCheckRow, twin_check_path

SHARED = REPO.parent / "shared" / "data"
CPU_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM 0.32's prefill chunk on its CPU build (the sim is given the same)
SIM_MODEL = "tiny-1b"
SIM_KV_PER_VLLM_KV = resolve_model(SIM_MODEL, build_catalog()).kv_bytes_per_token / Geometry().kv_bytes_per_token
"""The sim's KV bytes per token (its catalog model) over the served dummy model's: an offload tier of G GB on vLLM
holds as many tokens as one of G x this on the sim (24: tiny-1b's 24 KiB against the dummy model's 1 KiB)."""


def replay(url: str, out: Path, a: argparse.Namespace, model_dir: Path, concurrency: int) -> dict:
    cmd = [sys.executable, "-m", "kvtier", "replay", "--base-url", url + "/v1", "--model", "tiny",
           "--dataset", str(a.trace), "--tokenizer", f"hf:{model_dir}", "--num-rounds", str(a.num_rounds),
           "--min-chunk-rounds", str(a.num_rounds),
           "--concurrency", str(concurrency), "--gap-scale", "0", "--warmup", "0", "--skip-too-long",
           "--ignore-eos",  # the tiny random model stops early at random; the twin never does: like for like
           "--max-tokens-cap", str(a.max_tokens_cap), "--metrics-url", url, "--scrape-interval", "2",
           "--progress", "none", "--output", str(out)]  # fmt: skip
    if a.max_requests:
        cmd += ["--max-requests", str(a.max_requests)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"replay against {url} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    recs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    per_turn: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for r in recs:
        if r["status"] == "ok":
            per_turn[r["turn"]][0] += r["cached_tokens"] or 0
            per_turn[r["turn"]][1] += r["prompt_tokens"] or 0
    hits = sum(v[0] for v in per_turn.values())
    prompt = sum(v[1] for v in per_turn.values())
    (m,) = s["server_metrics"]
    return {"status": s["status"], "hit_rate": m["prefix_cache_hit_rate_overall"], "per_turn": dict(per_turn),
            "cached": hits, "prompt": prompt, "requests": len(recs),
            "by_source": m.get("prompt_tokens_by_source") or {}}  # fmt: skip


def start_sim(a: argparse.Namespace, model_dir: Path, port: int, work: Path, calibration: Path | None = None) -> Child:
    """A fresh sim; calibrated (``calibration``) it takes the served folder's own KV geometry (--hf-config), so its
    offload tier holds and moves as many bytes per token as kvtier's tier inside vLLM; else the catalog's tiny-1b
    with the offload tier scaled to hold as many tokens."""
    geometry = ["--hf-config", str(model_dir)] if calibration is not None else ["--model", SIM_MODEL]
    per = 1.0 if calibration is not None else SIM_KV_PER_VLLM_KV
    cmd = [sys.executable, "-m", "kvtier", "sim", *geometry, "--served-model-name", "tiny",
           "--gpu-kv-tokens", str(a.kv_tokens), "--block-tokens", str(a.block_tokens),
           "--max-model-len", str(a.max_model_len), "--tokenizer", f"hf:{model_dir}",
           "--max-num-batched-tokens", str(a.vllm_max_num_batched_tokens or CPU_MAX_NUM_BATCHED_TOKENS),
           "--port", str(port)]  # fmt: skip
    if a.offload_gb:  # the twin of kvtier's CPU tier inside vLLM: as many tokens, vLLM's block as the entry
        gb = a.offload_gb * per
        cmd += ["--offload", "cpu", "--cpu-offload-gb", str(gb), "--offload-chunk-tokens", str(a.block_tokens),
                "--no-fetch-gate"]  # kvtier's CPU tier in vLLM loads every hit: no gate on that side  # fmt: skip
    else:
        cmd += ["--offload", "none"]
    if calibration is None:
        cmd += ["--prefill-tps", str(a.sim_prefill_tps), "--tpot-ms", str(a.sim_tpot_ms)]
    else:
        cmd += ["--calibration", str(calibration)]
    return start_peer(cmd, "kvtier sim", log=work / f"sim-{port}.log")


def wait_http(url: str, proc: Child, timeout: float = 60) -> None:
    import time

    t0 = time.monotonic()
    while not http_ok(url + "/health"):
        if proc.poll() is not None:
            raise SystemExit(f"kvtier sim exited {proc.poll()}")
        if time.monotonic() - t0 > timeout:
            raise SystemExit("kvtier sim did not start")
        time.sleep(0.3)


def fresh_replay(url: str, out: Path, a: argparse.Namespace, model_dir: Path, concurrency: int) -> dict:
    """``replay`` on a server whose prefix cache has seen nothing (checked, not assumed), with the per-turn TTFTs."""
    seen = prior_queries(url)
    if seen:
        raise SystemExit(f"{url}: {seen:.0f} prompt tokens already looked up before the replay: not a fresh server")
    got = replay(url, out, a, model_dir, concurrency)
    got["ttft"] = turn_ttfts(out)
    return got


def turn_ttfts(folder: Path) -> dict[int, list[float]]:
    """The ok requests' TTFT by turn of a virtual user, from a replay's requests.jsonl."""
    out: dict[int, list[float]] = defaultdict(list)
    for line in (folder / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["status"] == "ok" and r["ttft_s"] is not None:
            out[r["turn"]].append(r["ttft_s"])
    return out


def measure_ladder(a: argparse.Namespace, work: Path, model_dir: Path, cores: list[str]) -> Path:
    """The real vLLM's ladder on an engine of its own (its cache never meets a replay), measured again while its fit
    is unreliable (--ladder-attempts): never fitted to a replayed trace. With ``a.offload_gb`` the engine has
    kvtier's CPU tier inside it, as the runs it calibrates (its stores share the engine's cores)."""
    name = f"ladder-cpu{a.offload_gb:g}" if a.offload_gb else "ladder"
    ladder = work / f"{name}.json"
    srv = start_vllm(a, model_dir, work, cores, f"vllm-{name}")
    try:
        srv.wait_healthy()
        cmd = [sys.executable, "-m", "kvtier", "ladder", "--base-url", srv.url + "/v1", "--model", "tiny",
               "--tokenizer", f"hf:{model_dir}", "--new-tokens", a.ladder_new_tokens,
               "--repeats", str(a.ladder_repeats),
               "--tpot-concurrency", "1,2,4", "--tpot-tokens", "32", "--output", str(ladder), "--plot",
               str(work / f"{name}.png"), "--quiet"]  # fmt: skip
        for attempt in range(1, a.ladder_attempts + 1):  # an unreliable fit is measured again, never used
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            print(p.stdout, flush=True)
            if p.returncode not in (0, 1) or not ladder.exists():
                raise SystemExit(f"kvtier ladder against vLLM failed ({p.returncode}):\n{p.stderr[-3000:]}")
            why = (json.loads(ladder.read_text()).get("fit") or {}).get("unreliable") or []
            if not why:
                return ladder
            print(f"ladder attempt {attempt} of {a.ladder_attempts}: unreliable ({'; '.join(why)})", flush=True)
        raise SystemExit(f"every ladder of {a.ladder_attempts} was unreliable: the twin is not calibrated")
    finally:
        srv.stop()


def start_vllm(a: argparse.Namespace, model_dir: Path, work: Path, cores: list[str], name: str) -> cpu_engine.CpuVllm:
    """A fresh vLLM for one run; with --offload-gb, kvtier's CPU tier of that size inside it (kvtier/vllm)."""
    (port,) = free_ports(1)
    extra = ["--max-num-batched-tokens", str(a.vllm_max_num_batched_tokens)] if a.vllm_max_num_batched_tokens else []
    env = None
    if a.offload_gb:  # kvtier's CPU tier inside vLLM (kvtier/vllm), what the sim's offload tier twins
        from kvtier.vllm import engine_pythonpath, kv_transfer_arg

        extra += ["--kv-transfer-config", kv_transfer_arg({"offload": "cpu", "cpu_offload_gb": a.offload_gb})]
        env = {"PYTHONPATH": engine_pythonpath(str(work / "pylib"))}
    kv_bytes = a.kv_tokens * Geometry().kv_bytes_per_token
    return cpu_engine.start(a.engine_python, str(model_dir), port, work, kv_bytes, a.max_model_len, cores,
                            name=name, extra=extra, env=env)  # fmt: skip


def compare_ttft(a: argparse.Namespace, work: Path, model_dir: Path, cores: list[str], ladder: Path,
                 tag: str = "") -> dict:  # fmt: skip
    """The trace replayed against a fresh vLLM and a fresh sim calibrated from ``ladder`` at each concurrency: per turn
    the TTFT p50 and p95 of each (printed), the worst turn's errors, the hit rates and the prompt tokens by source
    (GPU, offload tier, recompute) as shares of each side's, and the rows of the twin check. With
    ``--vllm-repeats 2`` a second fresh vLLM replays the same run: the first against it, by the same measures, is
    the floor no twin can be judged below (what vLLM differs from itself by on this host)."""
    got: dict[str, dict] = {"vllm": {}, "sim": {}, "again": {}}
    for conc in a.concurrency:  # a fresh server of each kind per run: both sides start from an empty cache
        for k in range(a.vllm_repeats):
            name = f"vllm{tag}-{conc}" + (f".{k}" if k else "")
            srv = start_vllm(a, model_dir, work, cores, name)
            try:
                srv.wait_healthy()
                got["again" if k else "vllm"][conc] = fresh_replay(srv.url, work / name, a, model_dir, conc)
            finally:
                srv.stop()
        (port,) = free_ports(1)
        sim = start_sim(a, model_dir, port, work, calibration=ladder)
        try:
            wait_http(f"http://127.0.0.1:{port}", sim)
            got["sim"][conc] = fresh_replay(f"http://127.0.0.1:{port}", work / f"sim{tag}-{conc}", a, model_dir, conc)
        finally:
            sim.stop(grace_s=30)
    out: dict[str, list] = {"check": [], "rows": []}
    offload = f"cpu {a.offload_gb:g} GB" if a.offload_gb else "none"
    for conc in a.concurrency:
        v, s_ = got["vllm"][conc], got["sim"][conc]
        worst = turn_errors(v, s_, f"concurrency {conc}", "sim")
        out["check"] += [TwinCheckRow(trace=f"{a.trace.name} turn {t}", concurrency=conc, offload=offload,
                                      quantile=q, real_s=pv, twin_s=ps)
                         for t, q, pv, ps in worst.pop("quantiles")]  # fmt: skip
        hv, hs = v["cached"] / max(1, v["prompt"]), s_["cached"] / max(1, s_["prompt"])
        sv, ss = _share(v["by_source"]), _share(s_["by_source"])
        print(f"concurrency {conc}: hit rate vllm {hv:.4f} sim {hs:.4f}; by source vllm {_shares(v['by_source'])}; "
              f"sim {_shares(s_['by_source'])}; status vllm {v['status']} sim {s_['status']}", flush=True)  # fmt: skip
        row = {"concurrency": conc, "offload": offload, "p50_err": worst["p50"], "p95_err": worst["p95"],
               "p50_bias": worst["bias"],
               "hit_diff": abs(hv - hs), "source_diff": _source_diff(sv, ss), "vllm": sv, "sim": ss,
               "requests": (v["requests"], s_["requests"]), "status": (v["status"], s_["status"])}  # fmt: skip
        if conc in got["again"]:  # vLLM against itself: the same measures, a second fresh engine
            w = got["again"][conc]
            floor = turn_errors(v, w, f"concurrency {conc}", "vllm again")
            floor.pop("quantiles")
            row["floor"] = {"p50": floor["p50"], "p95": floor["p95"], "bias": floor["bias"],
                            "source": _source_diff(sv, _share(w["by_source"]))}  # fmt: skip
        out["rows"].append(row)
    return out


def turn_errors(v: dict, other: dict, label: str, who: str) -> dict:
    """Per turn of a virtual user, ``other``'s TTFT p50 and p95 against vLLM's ``v`` (printed), and the worst turn's
    relative error of each; ``bias``: the mean over turns of the signed p50 error (a model gap leans one way, noise
    both); ``quantiles``: (turn, quantile, vLLM's, other's) where both are positive."""
    import numpy as np

    worst: dict = {"p50": 0.0, "p95": 0.0, "quantiles": []}
    signed = []
    for t in sorted(set(v["ttft"]) & set(other["ttft"])):
        row = []
        for q, name in ((50, "p50"), (95, "p95")):
            pv, ps = float(np.percentile(v["ttft"][t], q)), float(np.percentile(other["ttft"][t], q))
            worst[name] = max(worst[name], abs(ps - pv) / pv)
            signed += [(ps - pv) / pv] if name == "p50" else []
            row.append(f"{name} vllm {pv:.4f} {who} {ps:.4f} ({(ps - pv) / pv:+.1%})")
            if pv > 0 and ps > 0:
                worst["quantiles"].append((t, name, pv, ps))
        print(f"{label} turn {t} (n={len(v['ttft'][t])}/{len(other['ttft'][t])}): " + ", ".join(row))
    worst["bias"] = float(np.mean(signed)) if signed else 0.0
    return worst


def _source_diff(a: dict[str, float], b: dict[str, float]) -> float:
    """The largest difference of one source's share of the prompt tokens (GPU hit, offload tier, recompute)."""
    return max([0.0, *(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))])


def write_check(ladder: Path, rows: list[TwinCheckRow]) -> None:
    """The latest sim-vs-real table of this ladder: every twin calibrated from it carries it (#56 item 5)."""
    if not rows:
        return
    digest = hashlib.sha256(ladder.read_bytes()).hexdigest()
    written = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    twin_check_path(ladder).write_text(TwinCheck(ladder_sha256=digest, written=written, rows=rows).model_dump_json())
    print(f"twin check: {twin_check_path(ladder)} ({len(rows)} rows)")


def ttft_main(a: argparse.Namespace, work: Path, model_dir: Path, cores: list[str]) -> None:
    """--ttft: the real vLLM's ladder (measured here, never fitted to the replayed trace), the sim calibrated from
    it, and the same trace replayed against both at each concurrency: per-turn TTFT p50 and p95, hit rates."""
    ladder = measure_ladder(a, work, model_dir, cores)
    got = compare_ttft(a, work, model_dir, cores, ladder)
    write_check(ladder, got["check"])
    print(f"ladder: {ladder}, plot: {work / 'ladder.png'}")
    rows = got["rows"]
    last = (f"sim_vs_vllm_ttft p50_err={max(r['p50_err'] for r in rows):.3f} "
            f"p95_err={max(r['p95_err'] for r in rows):.3f} "
            f"hit_diff={max(r['hit_diff'] for r in rows):.4f}")  # fmt: skip
    if all("floor" in r for r in rows):  # vLLM against itself, by the same measures
        last += (f" floor_p50={max(r['floor']['p50'] for r in rows):.3f} "
                 f"floor_p95={max(r['floor']['p95'] for r in rows):.3f}")  # fmt: skip
    print(last)


def families_main(a: argparse.Namespace, work: Path, model_dir: Path, cores: list[str]) -> None:
    """--all-families: one ladder of the real vLLM, then every trace family in ../shared/data (benchmarks/_families.py)
    at each concurrency, with no offload tier and with kvtier's CPU tier inside vLLM (the sim with the same tier, by
    the same KV geometry): a row per family, regime and concurrency."""
    from _families import families, prepare

    a.offload_gb = 0.0
    ladder = measure_ladder(a, work, model_dir, cores)
    ladders = {0.0: ladder}
    if a.offload_ladder:  # the tier's runs calibrated from the engine with the tier, as served
        a.offload_gb = a.families_offload_gb
        ladders[a.offload_gb] = measure_ladder(a, work, model_dir, cores)
    wanted = set(a.families.split(",")) if a.families else None
    rows, check = [], []
    for fam in families(SHARED):
        if wanted is not None and fam.name not in wanted:
            continue
        a.trace, a.num_rounds = prepare(fam, work), fam.num_rounds
        for gb in (0.0, a.families_offload_gb):
            a.offload_gb = gb
            regime = f"cpu {gb:g} GB" if gb else "none"
            print(f"== {fam.name} ({fam.source.name}), offload {regime}", flush=True)
            got = compare_ttft(a, work, model_dir, cores, ladders.get(gb, ladder), tag=f"-{fam.name}-{gb:g}")
            check += got["check"]
            rows += [{"family": fam.name, **r} for r in got["rows"]]
    for gb, lad in ladders.items():  # each ladder's twin check holds the runs it calibrated
        write_check(lad, [c for c in check if (c.offload != "none") == bool(gb) or len(ladders) == 1])
    print(f"ladder: {', '.join(str(x) for x in ladders.values())}")
    print("\n".join(families_table(rows, a.concurrency)))


def families_table(rows: list[dict], concurrency: list[int]) -> list[str]:
    """--all-families' table (a row per family, regime and concurrency), the twin's p50 bias at each concurrency,
    and last the figure line."""
    out: list[str] = []
    floors = all("floor" in r for r in rows)
    head = (
        "| family | offload | concurrency | requests vLLM/sim | TTFT p50 err (worst turn) | p95 err | p50 bias | "
        "GPU hit share vLLM/sim | offload share vLLM/sim | recompute share vLLM/sim | worst source diff |"
    )
    out.append("\n" + head + (" vLLM vs itself p50/p95/bias/source |" if floors else ""))
    out.append("|---" * (12 if floors else 11) + "|")
    gpu, off, rec = "local_cache_hit", "external_kv_transfer", "local_compute"
    for r in rows:
        v, s_ = r["vllm"], r["sim"]
        f = r.get("floor")
        out.append(
            f"| {r['family']} | {r['offload']} | {r['concurrency']} | {r['requests'][0]}/{r['requests'][1]} | "
            f"{r['p50_err']:.1%} | {r['p95_err']:.1%} | {r['p50_bias']:+.1%} | "
            f"{v.get(gpu, 0):.3f}/{s_.get(gpu, 0):.3f} | {v.get(off, 0):.3f}/{s_.get(off, 0):.3f} | "
            f"{v.get(rec, 0):.3f}/{s_.get(rec, 0):.3f} | {r['source_diff']:.3f} |"
            + (f" {f['p50']:.1%}/{f['p95']:.1%}/{f['bias']:+.1%}/{f['source']:.3f} |" if f else "")
        )
    for conc in concurrency:  # a model gap leans one way at a load; noise leans both ways
        at = [r for r in rows if r["concurrency"] == conc]
        line = f"concurrency {conc}: the twin's p50 bias, median over {len(at)} rows {median_of(at, 'p50_bias'):+.1%}"
        if floors:
            line += f"; vLLM against itself {median_of([r['floor'] for r in at], 'bias'):+.1%}"
        out.append(line)
    last = (
        f"sim_vs_vllm_families rows={len(rows)} worst_p50_err={max(r['p50_err'] for r in rows):.3f} "
        f"worst_p95_err={max(r['p95_err'] for r in rows):.3f} "
        f"worst_source_diff={max(r['source_diff'] for r in rows):.3f} rows_met={sum(map(meets, rows))}"
    )
    if floors:  # judged against vLLM's own spread too: a row cannot be held nearer than vLLM is to itself
        last += (f" rows_within_floor={sum(meets(r, r['floor']) for r in rows)} "
                 f"floor_p50={max(r['floor']['p50'] for r in rows):.3f} "
                 f"floor_p95={max(r['floor']['p95'] for r in rows):.3f} "
                 f"floor_source={max(r['floor']['source'] for r in rows):.3f}")  # fmt: skip
    out.append(last)
    return out


def median_of(rows: list[dict], key: str) -> float:
    import numpy as np

    return float(np.median([r[key] for r in rows])) if rows else 0.0


AIMS = {"p50": 0.15, "p95": 0.25, "source": 0.03}
"""#56's aims for a row: the worst turn's TTFT p50 and p95 error, and the largest difference of one source's share."""


def meets(row: dict, floor: dict | None = None) -> bool:
    """The row's twin within #56's aims, or within vLLM's own spread (``floor``) where that is wider."""
    got = {"p50": row["p50_err"], "p95": row["p95_err"], "source": row["source_diff"]}
    return all(got[k] <= max(aim, (floor or {}).get(k, 0.0)) for k, aim in AIMS.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-python", default=str(REPO / cpu_engine.DEFAULT_PYTHON))
    ap.add_argument("--trace", type=Path, default=SHARED / "lmcache_agent_trace" / "miniswe",
                    help="a trace file, or a folder of them (the first --sessions files, by name)")  # fmt: skip
    ap.add_argument("--sessions", type=int, default=3, help="files taken from a --trace folder")
    ap.add_argument("--kv-tokens", type=int, default=16512,
                    help="KV cache per server, tokens (129 blocks, one the null block: sessions compete)")  # fmt: skip
    ap.add_argument("--block-tokens", type=int, default=CPU_BLOCK_TOKENS, help="vLLM's block size on its CPU build")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--num-rounds", type=int, default=5)
    ap.add_argument("--max-tokens-cap", type=int, default=16)
    ap.add_argument("--max-requests", type=int, default=0, help="0: the whole trace")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--vllm-max-num-batched-tokens", type=int, default=0,
                    help="vLLM's prefill chunk (0: its CPU default, 2048; >= --max-model-len: unchunked)")  # fmt: skip
    ap.add_argument("--sim-prefill-tps", type=float, default=8000.0, help="near the CPU build's, measured here")
    ap.add_argument("--sim-tpot-ms", type=float, default=40.0)
    ap.add_argument("--trials", type=int, default=1,
                    help="runs of each concurrency on each server (fresh ones): means and spreads")  # fmt: skip
    ap.add_argument("--vllm-results", type=Path, default=None,
                    help="a JSON file of vLLM's side: read when it exists (same flags), written when not")  # fmt: skip
    ap.add_argument("--offload-gb", type=float, default=0.0,
                    help="offload too: vLLM with kvtier's CPU tier of this size inside it (kvtier/vllm), the sim with "
                         "the same in-process tier and vLLM's block as its entry; compares the prompt tokens by "
                         "source (GPU hit, offload hit, recompute); last line sim_vs_vllm_offload ...")  # fmt: skip
    ap.add_argument("--ttft", action="store_true",
                    help="TTFT, not only hit rate: measure the vLLM's ladder, calibrate the sim from it "
                         "(kvtier sim --calibration), replay the trace against both; last line "
                         "sim_vs_vllm_ttft ...")  # fmt: skip
    ap.add_argument("--dataset", type=Path, default=None, help="--ttft: any agent-trace folder (same as --trace)")
    ap.add_argument("--ladder-new-tokens", default="16,256", help="--ttft: the ladder's new-token counts")
    ap.add_argument("--ladder-repeats", type=int, default=3, help="--ttft: the ladder's repeats per point")
    ap.add_argument("--ladder-attempts", type=int, default=3,
                    help="--ttft: ladders measured until one's fit is reliable (each bad one says why)")  # fmt: skip
    ap.add_argument("--all-families", action="store_true",
                    help="--ttft on every trace family in ../shared/data, with and without kvtier's CPU tier in "
                         "vLLM (benchmarks/_families.py); last line sim_vs_vllm_families ...")  # fmt: skip
    ap.add_argument("--families", default="", help="--all-families: only these, comma separated")
    ap.add_argument("--vllm-repeats", type=int, default=1, choices=(1, 2),
                    help="--ttft: 2 replays each run on a second fresh vLLM too, and compares vLLM with itself "
                         "by the same measures (the floor no twin can be judged below)")  # fmt: skip
    ap.add_argument("--offload-ladder", action="store_true",
                    help="--all-families: the offload runs' twin from a ladder of vLLM with its tier")  # fmt: skip
    ap.add_argument("--families-offload-gb", type=float, default=0.5, help="--all-families: the CPU tier's size")
    a = ap.parse_args()
    if a.dataset is not None:
        a.trace = a.dataset
    if a.trace is None or not a.trace.exists():
        raise SystemExit("--trace: no trace (../shared/data/lmcache_agent_trace/miniswe is the default)")
    if not Path(a.engine_python).exists():
        raise SystemExit(f"{a.engine_python}: missing (bash scripts/install-engines.sh cpu)")
    work = Path(tempfile.mkdtemp(prefix="kvtier-sim-vs-vllm-"))
    if a.trace.is_dir():  # the first --sessions files, as one dataset folder
        files = sorted(a.trace.glob("*.jsonl"))[: a.sessions]
        (work / "trace").mkdir()
        for f in files:
            (work / "trace" / f.name).symlink_to(f.resolve())
        a.trace = work / "trace"
    model_dir = make_model(work / "tiny", Geometry())
    cores = cpu_inventory(None).devices
    if a.all_families:
        if a.concurrency == [1, 4]:  # the default: the three levels here
            a.concurrency = [1, 4, 8]
        families_main(a, work, model_dir, cores)
        return
    if a.ttft:
        ttft_main(a, work, model_dir, cores)
        return
    totals = {"vllm": [0.0, 0.0], "sim": [0.0, 0.0]}
    worst = 0.0
    saved = json.loads(a.vllm_results.read_text()) if a.vllm_results and a.vllm_results.exists() else {}
    rates: dict[tuple[int, str], list[float]] = defaultdict(list)
    sources: dict[str, dict[str, float]] = {"vllm": {}, "sim": {}}
    sources_by_conc: dict[tuple[int, str], dict[str, float]] = defaultdict(dict)
    for conc, trial in [(c, t) for c in a.concurrency for t in range(a.trials)]:
        got = {}
        tag = str(conc) if trial == 0 else f"{conc}.{trial}"
        if tag in saved:
            got["vllm"] = saved[tag]
            got["vllm"]["per_turn"] = {int(k): v for k, v in got["vllm"]["per_turn"].items()}
        else:
            srv = start_vllm(a, model_dir, work, cores, f"vllm-{conc}")
            try:
                srv.wait_healthy()
                got["vllm"] = fresh_replay(srv.url, work / f"vllm-{conc}", a, model_dir, conc)
            finally:
                srv.stop()
            saved[tag] = got["vllm"]
            if a.vllm_results:
                a.vllm_results.write_text(json.dumps(saved))
        (port,) = free_ports(1)
        sim = start_sim(a, model_dir, port, work)
        try:
            wait_http(f"http://127.0.0.1:{port}", sim)
            got["sim"] = fresh_replay(f"http://127.0.0.1:{port}", work / f"sim-{conc}", a, model_dir, conc)
        finally:
            sim.stop(grace_s=30)
        for who, r in got.items():
            turns = " ".join(f"t{t}={c / p:.3f}" for t, (c, p) in sorted(r["per_turn"].items()) if p)
            print(f"concurrency {conc} {who:5s} {r['status']:8s} requests {r['requests']:3d} hit_rate "
                  f"{r['hit_rate']:.4f} (usage: {r['cached']:,} of {r['prompt']:,} prompt tokens) per turn: {turns}",
                  flush=True)  # fmt: skip
            # pooled over the concurrencies from the usage counts (the counters' deltas agree with them)
            totals[who][0] += r["cached"]
            totals[who][1] += r["prompt"]
            rates[(conc, who)].append(r["hit_rate"])
            for src, n in r.get("by_source", {}).items():
                sources[who][src] = sources[who].get(src, 0.0) + n
                sources_by_conc[(conc, who)][src] = sources_by_conc[(conc, who)].get(src, 0.0) + n
            if a.offload_gb:
                print(f"concurrency {conc} {who:5s} prompt tokens by source: {_shares(r.get('by_source', {}))}")
    for conc in a.concurrency:  # each concurrency over its trials: the mean, and each server's own spread
        mv, ms = (sum(rates[(conc, w)]) / len(rates[(conc, w)]) for w in ("vllm", "sim"))
        worst = max(worst, abs(mv - ms))
        if a.trials > 1:
            spread = {w: max(rates[(conc, w)]) - min(rates[(conc, w)]) for w in ("vllm", "sim")}
            print(f"concurrency {conc} over {a.trials} trials: vllm {mv:.4f} (spread {spread['vllm']:.4f}), "
                  f"sim {ms:.4f} (spread {spread['sim']:.4f})")  # fmt: skip
    hv, hs = (totals[w][0] / totals[w][1] for w in ("vllm", "sim"))
    if a.offload_gb:  # by source: the GPU's own hits, the offload tier's, recompute (vLLM's counter on both)
        worst_src = 0.0
        for conc in a.concurrency:
            v, sm = (_share(sources_by_conc[(conc, w)]) for w in ("vllm", "sim"))
            worst_src = max([worst_src, *(abs(v.get(k, 0.0) - sm.get(k, 0.0)) for k in set(v) | set(sm))])
        v, sm = _share(sources["vllm"]), _share(sources["sim"])
        gpu, off = "local_cache_hit", "external_kv_transfer"
        print(f"sim_vs_vllm_offload gpu_vllm={v.get(gpu, 0):.4f} gpu_sim={sm.get(gpu, 0):.4f} "
              f"offload_vllm={v.get(off, 0):.4f} offload_sim={sm.get(off, 0):.4f} "
              f"worst_source_abs_diff={worst_src:.4f}")  # fmt: skip
        return
    print(
        f"sim_vs_vllm hit_rate_vllm={hv:.4f} hit_rate_sim={hs:.4f} abs_diff={abs(hv - hs):.4f} "
        f"worst_concurrency_abs_diff={worst:.4f}"
    )


def _share(by_source: dict[str, float]) -> dict[str, float]:
    total = sum(by_source.values())
    return {k: v / total for k, v in by_source.items()} if total else {}


def _shares(by_source: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in sorted(_share(by_source).items())) or "not counted"


if __name__ == "__main__":
    main()
