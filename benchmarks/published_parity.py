"""kvtier's MLPerf aggregation over the submitters' own rank files: does it reproduce their published summaries?

For every published MLPerf Storage v3.0 KV cache run folder it is given (default: every one kvtier carries, under
tests/fixtures/mlperf_published/closed/ — each rank file's summary, copied from mlcommons/storage_results_v3.0 at
068d91f, its source path inside), it reads the rank files as mlpstorage does
(``option_<o>/trial_<t>/rank_<r>/kvcache_results_*.json``), aggregates them with kvtier's ``option_figures`` (the
same function ``kvtier mlperf run`` writes its table with), and sets each figure beside the one in the run's
``summary.json``. A whole published run folder (the full rank files, per-request lists and all) can be given too.

Last line: ``published_parity runs=<folders> figures=<figures compared> exact=<equal to the last bit>
order_only=<not, but equal to the last bit when a trial's ranks are summed in another order: the submitter's
mlpstorage read them in another order> worst_rel_err=<largest relative difference>``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtier.results.ranks import parity, read_run_folder

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "mlperf_published"


def run_folders(root: Path) -> list[Path]:
    return sorted({p.parent for p in root.rglob("option_1")})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="*", type=Path, help="run folders (default: the published ones kvtier carries)")
    args = ap.parse_args(argv)
    folders = args.folders or run_folders(FIXTURES)
    if not folders:
        print(f"no run folder under {FIXTURES}", file=sys.stderr)
        return 2
    n = exact = order = 0
    worst = 0.0
    for folder in folders:
        run = read_run_folder(folder)
        rows = parity(run)
        name = folder.relative_to(FIXTURES) if folder.is_relative_to(FIXTURES) else folder
        trials = {o: len(run.trials(o)) for o in run.options()}
        print(f"{name}: {len(run.ranks)} rank files, options {trials} (trials each), {len(run.missing)} missing")
        for r in rows:
            n += 1
            exact += r.exact
            order += r.order_only
            err = r.rel_err if r.rel_err is not None else float("inf")
            worst = max(worst, err)
            print(
                f"  option {r.option} {r.key}: published {r.published!r}, kvtier {r.recomputed!r}"
                f" ({'exact' if r.exact else f'rel err {err:.3g}'}"
                f"{'; exact when a trial sums its ranks in another order' if r.order_only else ''})"
            )
    print(
        f"published_parity runs={len(folders)} figures={n} exact={exact} order_only={order} worst_rel_err={worst:.3g}"
    )
    return 0 if n and exact + order == n else 1


if __name__ == "__main__":
    sys.exit(main())
