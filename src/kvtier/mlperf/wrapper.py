"""kvtier's ``mlperf_wrapper.py``: what mlpstorage 3.0's ``kvcache run`` starts on every MPI rank.

mlpstorage (``mlpstorage_py/benchmarks/kvcache.py``) never calls ``kv-cache.py`` itself. For each option and
trial it runs, through ``mpirun`` (with ``--mca orte_abort_on_non_zero_status 0``, so one rank's failure does not
stop the others)::

    PYTHON DIR/mlperf_wrapper.py --rank-output-base RESULTS/option_<o>/trial_<t> --rank-cache-base CACHE
        --seed-base 42 --config DIR/config.yaml --model M --num-users U --duration D --gpu-mem-gb 0
        --cpu-mem-gb C --max-concurrent-allocs A --generation-mode none

and then, on the controller, reads ``RESULTS/option_<o>/trial_<t>/rank_<r>/kvcache_results_*.json`` for every
rank: ``summary.cache_stats`` (storage read/write bandwidth, storage device read/write p95, storage entries) and
``summary`` (average and storage throughput). It ignores the exit status of the ranks.

This module takes the same arguments. Each rank is one independent ``kvtier bench`` (as each reference rank is one
independent ``kv-cache.py``): its seed is the base plus the rank, its cache folder ``CACHE/rank_<r>``, its result
``rank_<r>/kvtier_result_<YYYYmmdd_HHMMSS>.json`` as the bench writes it (the file its closing ``result:`` and
``next:`` lines name, and ``kvtier report`` reads) and, for a complete run, mlpstorage's copy beside it as
``kvcache_results_<stamp>.json`` (see ``for_mlpstorage``); every other argument goes to ``kvtier bench`` as given, with
the per-rank three last. The launcher's rank variables are taken away from the bench's environment, so it does not
join the launch as an MPI rank of its own.

Where it differs from the reference's wrapper, on purpose: a rank whose run is not ``complete`` (it failed, was
interrupted, lost requests or stores to errors) keeps only its own ``kvtier_result_<stamp>.json``, a name
mlpstorage's aggregation does not read, and exits non-zero. mlpstorage then lists the rank under
``missing_files`` and marks the option ``partial_failure``, instead of adding zeros or a cut-short run into the
published figures. The 90 s pauses before and after the run are the reference's defaults (``--start-delay``,
``--end-delay``); ``KVTIER_MLPERF_DELAY_S`` changes that default for runs that are not submissions (the command
line mlpstorage builds stays as it is).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from kvtier.child import start
from kvtier.results.io import write_text_atomic

BASE_SEED = 42
DELAY_S = 90  # the reference wrapper's pause before and after each run (its TEST_DELAY)
DELAY_ENV = "KVTIER_MLPERF_DELAY_S"
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "HYDRA_", "MPI_LOCAL")
RESULT_GLOB = "kvcache_results_*.json"  # what mlpstorage's aggregation reads, per rank folder
PERCENTILE_KEY = re.compile(r"^(gpu|cpu|storage|nvme)_(read|write)(_device|_host)?_p\d+_ms$")


class WrapperError(Exception):
    """A launch this wrapper cannot run: named, exit status 2."""


def rank_from(environ: Mapping[str, str]) -> int:
    """This process's rank from the launcher's environment (Open MPI, PMIx, MPICH); 0 outside a launch."""
    for name in RANK_VARS:
        value = environ.get(name, "").strip()
        if not value:
            continue
        if not value.isdigit():
            raise WrapperError(f"{name}={value!r} is not a rank number")
        return int(value)
    return 0


def bench_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment without its rank variables: ``kvtier bench`` runs as one instance, not as a
    rank of this launch (kvtier's own MPI mode would wait for the other ranks' benches to join it)."""
    return {k: v for k, v in environ.items() if not k.startswith(LAUNCHER_PREFIXES)}


def default_delay(environ: Mapping[str, str]) -> int:
    raw = environ.get(DELAY_ENV)
    if raw is None or raw == "":
        return DELAY_S
    try:
        value = int(raw)
    except ValueError:
        raise WrapperError(f"{DELAY_ENV}={raw!r}: expected whole seconds") from None
    if value < 0:
        raise WrapperError(f"{DELAY_ENV}={raw!r}: expected whole seconds, 0 or more")
    return value


def parser(delay_s: int) -> argparse.ArgumentParser:
    # allow_abbrev=False: a forwarded --seed must not be taken for --seed-base.
    p = argparse.ArgumentParser(
        prog="mlperf_wrapper.py",
        description="kvtier's rank launcher for mlpstorage's kvcache benchmark: one kvtier bench per MPI rank, "
        "its result where mlpstorage's aggregation reads it; every argument it does not know goes to kvtier bench",
        allow_abbrev=False,
    )
    p.add_argument("--rank-output-base", required=True, help="results go to BASE/rank_<r>/kvcache_results_*.json")
    p.add_argument("--rank-cache-base", required=True, help="each rank's file tier is BASE/rank_<r>")
    p.add_argument("--seed-base", type=int, default=BASE_SEED, help="a rank's seed is this plus the rank (42)")
    p.add_argument("--start-delay", type=int, default=delay_s, help=f"seconds to wait before the run ({delay_s})")
    p.add_argument("--end-delay", type=int, default=delay_s, help=f"seconds to wait after the run ({delay_s})")
    return p


def bench_command(forwarded: Sequence[str], seed: int, output: Path, cache: Path) -> list[str]:
    """``kvtier bench`` with the forwarded arguments and this rank's seed, output and cache folder last (the last of
    a repeated flag wins)."""
    return [
        sys.executable,
        "-m",
        "kvtier",
        "bench",
        *forwarded,
        "--seed",
        str(seed),
        "--output",
        str(output),
        "--cache-dir",
        str(cache),
    ]


def read_result(path: Path) -> dict[str, Any] | None:
    """The run's result (None: no result file, or not a JSON object)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def for_mlpstorage(result: dict[str, Any]) -> dict[str, Any]:
    """The result as mlpstorage's aggregation can read it. Where a tier had no operation of a kind, kvtier writes
    its percentiles as null; the reference leaves those keys out, and mlpstorage reads them with ``.get(key, 0.0)``
    and takes the max over ranks, so a null stops its whole run (``'>' not supported between 'NoneType' and
    'NoneType'``, seen with mlpstorage 3.0.26 when the CPU tier held every entry). The null percentiles leave
    ``summary.cache_stats`` as the reference's do, and ``mlperf_wrapper`` names what was left out."""
    cache = result.get("summary", {}).get("cache_stats")
    dropped: list[str] = []
    if isinstance(cache, dict):
        dropped = sorted(k for k, v in cache.items() if v is None and PERCENTILE_KEY.match(k))
        for k in dropped:
            del cache[k]
    result["mlperf_wrapper"] = {
        "by": "kvtier mlperf_wrapper.py",
        "left_out_null_percentiles": dropped,
        "why": "the reference writes no percentile without samples; mlpstorage reads a missing one as 0.0",
    }
    return result


def settle(own: Path, folder: Path, stamp: str, rc: int) -> tuple[Path | None, int]:
    """After the bench: a complete run's result is copied, as mlpstorage reads it, under the name mlpstorage reads
    (``kvcache_results_<stamp>.json``) beside kvtier's own (``own``, as the bench wrote it); any other run keeps only
    its own. The file the rank leaves for the user (None: no result) and the wrapper's exit status (non-zero unless
    complete)."""
    result = read_result(own)  # read once: its status decides, its copy is what mlpstorage reads
    status = result.get("status") if result is not None else None
    if result is None or not isinstance(status, str):
        return None, rc or 1
    if status == "complete" and rc == 0:
        write_text_atomic(folder / f"kvcache_results_{stamp}.json", json.dumps(for_mlpstorage(result), indent=2))
        return own, 0
    return own, rc or 1


def sleep(seconds: int, what: str, rank: int) -> None:
    if seconds > 0:
        print(f"kvtier mlperf_wrapper rank {rank}: {what} delay {seconds} s", flush=True)
        time.sleep(seconds)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    try:
        args, forwarded = parser(default_delay(env)).parse_known_args(argv)
        rank = rank_from(env)
    except WrapperError as e:
        print(f"mlperf_wrapper.py: error: {e}", file=sys.stderr)
        return 2
    if args.start_delay < 0 or args.end_delay < 0:
        print("mlperf_wrapper.py: error: --start-delay and --end-delay are seconds, 0 or more", file=sys.stderr)
        return 2
    folder = Path(args.rank_output_base) / f"rank_{rank}"
    cache = Path(args.rank_cache_base) / f"rank_{rank}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"mlperf_wrapper.py: error: cannot make {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    stamp = datetime.now().strftime("%Y%m%d_%H%M%S")
    own = folder / f"kvtier_result_{stamp}.json"  # the bench's own result: its closing lines name this file
    cmd = bench_command(forwarded, args.seed_base + rank, own, cache)

    stopping: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        sleep(args.start_delay, "start", rank)
        if stopping:
            print(f"kvtier mlperf_wrapper rank {rank}: stopped before the run", file=sys.stderr)
            return 128 + stopping[0]
        print(f"kvtier mlperf_wrapper rank {rank}: seed {args.seed_base + rank}, cache {cache}", flush=True)
        child = start(cmd, name="kvtier bench", stdout=None, env=bench_environment(env), group=False)
        with child.forwarding(stopping):  # pass the launcher's stop on: the bench writes its partial result
            for s in list(stopping):  # one that came between the start delay and the start
                child.send(s)
            rc = child.popen.wait()
        final, code = settle(own, folder, stamp, rc)
        if final is None:
            print(f"kvtier mlperf_wrapper rank {rank}: kvtier bench exited {rc} without a result", file=sys.stderr)
        elif code:
            print(
                f"kvtier mlperf_wrapper rank {rank}: the run is not complete (exit {rc}); its result is {final}, "
                f"which mlpstorage does not read (it counts the rank as missing)",
                file=sys.stderr,
            )
        else:
            print(
                f"kvtier mlperf_wrapper rank {rank}: result {final}; mlpstorage reads its copy, "
                f"{folder / f'kvcache_results_{stamp}.json'}",
                flush=True,
            )
        if not stopping:
            sleep(args.end_delay, "end", rank)
        return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
