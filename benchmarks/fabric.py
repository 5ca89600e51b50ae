"""When does a shared store pay? The fetch-vs-recompute crossover measured across a real, shaped link, beside the
one ``kvtier plan breakeven`` predicts.

The testbed (benchmarks/_fabric.py, root): ``kvtier cache-server`` (CPU tier, TCP with its shared token) on host s,
two real vLLM replicas (the CPU build, ``kvtier model make``'s model: 1,024 KV bytes a token) on hosts a and b,
each with its own veth link to s; b's link is shaped with ``tc tbf`` to each rate and reaches the store through a
relay that adds each round trip. For each context, RTT and rate:

* **fetch**: a fresh prompt is computed on a (which stores it over its own, unshaped link); when the server has
  it, b is asked the same prompt and loads every whole block over the shaped link. Its TTFT (the request's time,
  one token) counts only where vLLM says every whole block came from the connector (``cached_tokens``);
* **recompute**: a fresh prompt of the same length on b: no block anywhere, the whole prefill (its lookup misses
  in one round trip).

Both engines run on every core but the last, the store and the relay on the last; an engine keeps its cores busy
for about half a second after a request (measured: b's load was submitted 280-390 ms late when it was asked at
once, 1-2 ms late after 0.5 s), so b's measured request waits ``--quiet`` seconds after any other work. TTFT is
the streamed time to the first token (a non-streamed request's time would include the engine's stores after it).

The measured crossover per (context, RTT) is the rate where the fetch's median TTFT meets the recompute's at the
smallest RTT swept (0: the store's round trips cost microseconds, so that is the engine with no store) —
interpolated linearly in 1/rate between the two rates around it (a fetch is a fixed part plus bytes / rate).
A miss with the store across the RTT is slower than that by its own round trips (the lookup, and a store plan per
prefill chunk); each line prints it as "a miss with the store at this rtt".
The prediction is ``kvtier plan breakeven``'s exact break-even (``links[0].breakeven_exact_bytes_per_s``) fed
only by: the model's KV bytes per token (``--hf-config``, the model folder), the prefill the cache saves, from
``kvtier ladder``'s fitted prefill curve on b (``compute_s(prompt) - compute_s(new, cached)``, as
``--prefill-tps``), the link's configured rate and the configured RTT times the round trips a fetch makes on
its path (``--round-trips``, kvtier's client: the lookup, the pin, the pipelined loads; the unpin is posted).

Printed: one line per point, then per (context, RTT) the two crossovers; last:
``fabric crossover_measured_mbps=… crossover_predicted_mbps=… worst_ratio=… points=…`` (each a list in the order
of the (context, RTT) pairs, ``none`` where the fetch never beat the recompute in the swept range, or no rate makes
it pay; worst_ratio the largest of measured/predicted and predicted/measured over the pairs with both; one_sided
the pairs with a crossover on one side only: a disagreement worst_ratio does not show). ``--plot`` draws TTFT
against rate per context (docs/plan.md). ``--report DIR`` prints the report again from a run's folder.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fabric import Fabric, World, prepare, start_world, stop_world

REPO = Path(__file__).resolve().parents[1]
BLOCK = 128  # vLLM's block on the CPU build: what the connector moves


@dataclass
class Point:
    context: int
    rtt_ms: float
    rate_mbit: float | None  # None: recompute (the link's rate does not enter)
    source: str  # fetch | recompute
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    verified: bool


def ask(url: str, prompt: str) -> tuple[dict, float]:
    """(usage, TTFT): streamed, the time to the first token's chunk; the usage from the last chunk. (A non-streamed
    request's time would include what the engine does after its first token: its stores to the server.)"""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()  # fmt: skip
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, usage = None, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError(f"{url}: a stream without a token or without usage")
    return usage, ttft


def server_counts(w: World) -> tuple[float, float]:
    from kvtier.replay.scrape import parse_snapshot

    with urllib.request.urlopen(w.urls["s"] + "/metrics", timeout=10) as r:
        m = parse_snapshot(r.read().decode())
    return m.get("kvtier_block_server_stored_blocks_total") or 0.0, m.get("kvtier_block_server_pending_blocks") or 0.0


def settle(w: World, at_least: float, timeout_s: float = 300.0) -> None:
    """Until the server has placed ``at_least`` blocks in all and none is pending (stores off the request's path)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stored, pending = server_counts(w)
        if stored >= at_least and pending == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the store did not settle within {timeout_s} s")


class Prompts:
    """Fresh prompts of about ``tokens`` tokens (words of a few tokens each; the exact count is the engine's)."""

    def __init__(self, seed: int, tokens_per_word: float) -> None:
        self.rnd = random.Random(seed)
        self.tpw = tokens_per_word

    def make(self, tokens: int) -> str:
        return " ".join(f"q{self.rnd.randrange(10**6)}" for _ in range(int(tokens / self.tpw)))


def crossover(rates: list[float], fetch: dict[float, float], recompute: float) -> float | None:
    """The rate where fetch meets recompute, linear in 1/rate between the neighbours; None outside the sweep."""
    pts = sorted((r, fetch[r] - recompute) for r in rates if r in fetch)
    for (r1, d1), (r2, d2) in zip(pts, pts[1:], strict=False):
        if d1 > 0 >= d2:
            x1, x2 = 1 / r1, 1 / r2
            x = x1 + (x2 - x1) * d1 / (d1 - d2)
            return 1 / x
    return None


def predicted(model_dir: str, cached: int, saved_s: float, rtt_s: float) -> float | None:
    """kvtier plan breakeven's exact break-even for this point, Mbit/s (None: no rate makes the fetch pay)."""
    if saved_s <= 0:
        return None
    out = subprocess.run([sys.executable, "-m", "kvtier", "plan", "breakeven", "--hf-config", model_dir,
                          "--context", str(cached), "--prefill-tps", f"{cached / saved_s:.6g}",
                          "--net-bw", "1Gbit/s", "--rtt", f"{rtt_s * 1e3:.6g}ms", "--json"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    link = json.loads(out.stdout)["links"][0]
    bw = link.get("breakeven_exact_bytes_per_s")
    return None if bw is None else bw * 8 / 1e6


def run_ladder(w: World, model_dir: str, contexts: list[int], repeats: int, out: Path, flood: int) -> Path:
    """kvtier ladder on b, its link unshaped and no RTT added: cold and GPU points (the prefill curve) and points
    served from the store (``host``: vLLM's label of the server's CPU tier, reached after a flood of ``flood``
    tokens pushed the prefix out of b's own cache; verified by b's own per-request record), whose fixed part is
    the fetch's cost beyond bytes."""
    path = out / "ladder.json"
    cmd = [sys.executable, "-m", "kvtier", "ladder", "--base-url", w.urls["b"] + "/v1", "--model", "tiny",
           "--tokenizer", f"hf:{model_dir}", "--contexts", ",".join(map(str, contexts)), "--sources", "cold,gpu,host",
           "--flood-tokens", f"host={flood}", "--engine-log", str(w.work / "b.requests.jsonl"),
           "--repeats", str(repeats), "--quiet", "--output", str(path)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="2048,8192,16384", help="prompt tokens, comma separated")
    ap.add_argument("--rates", default="10,20,50,100,200,500,1000", help="link rates, Mbit/s, comma separated")
    ap.add_argument("--rtts", default="0,5,20", help="added round trips, ms, comma separated")
    ap.add_argument("--repeats", type=int, default=3, help="requests per point (the median is used)")
    ap.add_argument("--ladder-repeats", type=int, default=3)
    ap.add_argument("--round-trips", type=int, default=3,
                    help="round trips on a fetch's path (lookup, pin, pipelined loads): the RTT's multiple in the "
                         "prediction")  # fmt: skip
    ap.add_argument("--quiet", type=float, default=1.5,
                    help="seconds between a's last work and b's measured request: an engine keeps its cores busy "
                         "for about half a second after a request, and both engines share them")  # fmt: skip
    ap.add_argument("--engine-python", default=str(REPO / ".engines-cpu" / "bin" / "python"))
    ap.add_argument("--output", type=Path, help="folder for the points, the ladder and the logs")
    ap.add_argument("--plot", type=Path, help="PNG: TTFT against link rate per context, the predicted boundary")
    ap.add_argument("--report", type=Path, help="report again from an earlier run's --output folder, run nothing")
    a = ap.parse_args()
    if a.report is not None:
        points = [Point(**json.loads(x)) for x in (a.report / "points.jsonl").read_text().splitlines() if x.strip()]
        return report(points, sorted({p.rate_mbit for p in points if p.rate_mbit is not None}),
                      sorted({p.context for p in points}), sorted({p.rtt_ms for p in points}),
                      a.report / "ladder.json", str(a.report / "tiny"), a.round_trips, a.plot)  # fmt: skip
    ready = prepare("fabric", a.output, a.engine_python)
    if ready is None:
        return 2
    work, model = ready
    contexts = [int(x) for x in a.contexts.split(",")]
    rates = sorted(float(x) for x in a.rates.split(","))
    rtts = [float(x) for x in a.rtts.split(",")]
    max_len = max(contexts) + 1024
    points: list[Point] = []
    with Fabric(["s", "a", "b"]) as fab:
        kv_tokens = 2 * max_len  # b's own KV cache: one prompt at a time, and a flood to push it out stays short
        w = start_world(fab, work, a.engine_python, model, kv_tokens, max_len, 1.0)
        try:
            ladder = run_ladder(w, model, contexts, a.ladder_repeats, work, 2 * kv_tokens)
            usage, _ = ask(w.urls["b"], Prompts(0, 1.0).make(1000))
            prompts = Prompts(1, usage["prompt_tokens"] / 1000)
            settle(w, 0)
            for rtt in rtts:
                w.set_rtt(rtt)
                for ctx in contexts:
                    w.shape(None)
                    for _ in range(a.repeats):
                        stored, _ = server_counts(w)
                        time.sleep(a.quiet)
                        u, dt = ask(w.urls["b"], prompts.make(ctx))
                        p = Point(ctx, rtt, None, "recompute", u["prompt_tokens"],
                                  u["prompt_tokens_details"]["cached_tokens"], dt,
                                  u["prompt_tokens_details"]["cached_tokens"] == 0)  # fmt: skip
                        points.append(p)
                        print(json.dumps(asdict(p)), flush=True)
                        settle(w, stored + p.prompt_tokens // BLOCK)
                    for rate in rates:
                        for _ in range(a.repeats):
                            text = prompts.make(ctx)
                            stored, _ = server_counts(w)
                            ua, _ = ask(w.urls["a"], text)
                            settle(w, stored + ua["prompt_tokens"] // BLOCK)
                            time.sleep(a.quiet)
                            w.shape(rate)
                            u, dt = ask(w.urls["b"], text)
                            w.shape(None)
                            whole = u["prompt_tokens"] // BLOCK * BLOCK
                            cached = u["prompt_tokens_details"]["cached_tokens"]
                            p = Point(ctx, rtt, rate, "fetch", u["prompt_tokens"], cached, dt, cached == whole)
                            points.append(p)
                            print(json.dumps(asdict(p)), flush=True)
        finally:
            stop_world(w)
    (work / "points.jsonl").write_text("".join(json.dumps(asdict(p)) + "\n" for p in points))
    return report(points, rates, contexts, rtts, ladder, model, a.round_trips, a.plot)


def report(points: list[Point], rates: list[float], contexts: list[int], rtts: list[float], ladder: Path,
           model: str, trips: int, plot: Path | None) -> int:  # fmt: skip
    from kvtier.results.ladder import load_fitted

    _, fit = load_fitted(str(ladder), "ladder")
    pre = fit.timing.prefill
    print(f"ladder prefill fit: median error {fit.prefill_fit_median_abs_rel_err}, held back "
          f"{fit.prefill_holdout_median_abs_rel_err}; {pre}")  # fmt: skip
    measured, predicted_, ratios, rows = [], [], [], []
    with_fixed: list[str] = []
    ratios_fixed: list[float] = []
    disagree = 0  # pairs with a crossover on one side only (measured outside the sweep, or predicted none)
    host = next((f for f in fit.timing.fetch if f.tier == "host"), None)
    fixed = host.overhead_s if host is not None else None
    print(f"ladder fetch from the store (host), link unshaped: {host}")
    base_rtt = min(rtts)
    for ctx in contexts:
        ok_ctx = [p for p in points if p.context == ctx and p.verified]
        rec0 = [p.ttft_s for p in ok_ctx if p.source == "recompute" and p.rtt_ms == base_rtt]
        for rtt in rtts:
            ok = [p for p in ok_ctx if p.rtt_ms == rtt]
            rec = [p.ttft_s for p in ok if p.source == "recompute"]
            fet = {r: statistics.median(x) for r in rates
                   if (x := [p.ttft_s for p in ok if p.source == "fetch" and p.rate_mbit == r])}  # fmt: skip
            if not rec0 or not fet:
                continue
            prompt = int(statistics.median(p.prompt_tokens for p in ok))
            cached = prompt // BLOCK * BLOCK
            saved = pre.compute_s(prompt, 0) - pre.compute_s(prompt - cached, cached)
            base = statistics.median(rec0)
            m = crossover(rates, fet, base)
            pr = predicted(model, cached, saved, trips * rtt / 1e3)
            pr_fixed = predicted(model, cached, saved, trips * rtt / 1e3 + fixed) if fixed is not None else None
            rows.append((ctx, rtt, base, fet, m, pr))
            measured.append("none" if m is None else f"{m:.1f}")
            predicted_.append("none" if pr is None else f"{pr:.1f}")
            with_fixed.append("none" if pr_fixed is None else f"{pr_fixed:.1f}")
            if m is not None and pr is not None:
                ratios.append(max(m / pr, pr / m))
            elif (m is None) != (pr is None):
                disagree += 1
            if m is not None and pr_fixed is not None:
                ratios_fixed.append(max(m / pr_fixed, pr_fixed / m))
            tax = f"{(statistics.median(rec) - base) * 1e3:+.0f} ms" if rec else "n/a"
            curve = " ".join(f"{r:g}:{v * 1e3:.0f}" for r, v in sorted(fet.items()))
            print(f"context {ctx} (prompt {prompt}) rtt {rtt:g} ms: recompute {base * 1e3:.0f} ms (a miss with the "
                  f"store at this rtt: {tax}); fetch {curve} ms; crossover measured {measured[-1]} Mbit/s, "
                  f"predicted {predicted_[-1]} Mbit/s ({with_fixed[-1]} with the ladder's fixed fetch cost)"
                  )  # fmt: skip
    if plot is not None:
        draw(rows, plot)
    unverified = sum(1 for p in points if not p.verified)
    if ratios_fixed:
        print(f"with the ladder's fixed fetch cost ({fixed * 1e3:.1f} ms) beside the round trips: predicted "
              f"{','.join(with_fixed)} Mbit/s, worst ratio {max(ratios_fixed):.3f}")  # fmt: skip
    worst = f"{max(ratios):.3f}" if ratios else "nan"
    print(f"fabric crossover_measured_mbps={','.join(measured)} crossover_predicted_mbps={','.join(predicted_)} "
          f"worst_ratio={worst} one_sided={disagree} points={len(points) - unverified} unverified={unverified}"
          )  # fmt: skip
    return 0 if ratios and not math.isnan(max(ratios)) else 1


def draw(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (ctx, rtt, rec, fet, _m, pr) in enumerate(rows):
        color = f"C{i}"
        xs = sorted(fet)
        ax.plot(xs, [fet[x] * 1e3 for x in xs], "o-", color=color, label=f"{ctx} tok, +{rtt:g} ms: fetch")
        ax.axhline(rec * 1e3, color=color, ls="--", lw=1)
        if pr is not None:
            ax.axvline(pr, color=color, ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate, Mbit/s (tc tbf)")
    ax.set_ylabel("TTFT, ms")
    ax.set_title("fetch over the link (lines) vs recompute (dashed); predicted crossover (dotted)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
