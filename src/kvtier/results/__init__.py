"""Results: the shared envelope, each command's typed result, the writers, and ``load``.

``load(path)`` reads any file kvtier writes — a bench result JSON, an MPI bench aggregate, a replay
``summary.json`` (or its folder), a ``launch.json`` (or its folder), a ``kvtier plan`` answer written with
``--output`` — back into its typed model, validating every key; an error names the file and the key path. It also
reads mlpstorage's own KV cache run summary (a published run folder's ``summary.json``, or the
``kvcache_run_summary_<time>.json`` of a run mlpstorage drove), which has no ``benchmark`` key: known by its shape.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from pydantic import ValidationError

from kvtier.errors import DatasetError

if TYPE_CHECKING:
    from kvtier.results.aggregate import BenchAggregate
    from kvtier.results.arms import ArmsResult
    from kvtier.results.bench import BenchResult
    from kvtier.results.ladder import LadderResult
    from kvtier.results.launch import LaunchResult
    from kvtier.results.mlperf import MlperfRunSummary, MlpstorageRunSummary
    from kvtier.results.plan import PlanResult
    from kvtier.results.replay import ReplayResult
    from kvtier.results.sweep import SweepResult

    AnyResult: TypeAlias = (
        BenchResult
        | ReplayResult
        | LaunchResult
        | BenchAggregate
        | MlperfRunSummary
        | MlpstorageRunSummary
        | SweepResult
        | LadderResult
        | ArmsResult
        | PlanResult
    )


MODELS = {
    "kvtier bench": "bench:BenchResult",
    "kvtier bench mpi": "aggregate:BenchAggregate",
    "kvtier replay": "replay:ReplayResult",
    "kvtier launch": "launch:LaunchResult",
    "kvtier launch arms": "arms:ArmsResult",
    "kvtier ladder": "ladder:LadderResult",
    "kvtier plan sweep": "sweep:SweepResult",
    "kvtier mlperf run": "mlperf:MlperfRunSummary",  # the MLPerf wrapper's own layout, not an envelope
    "mlpstorage kvcache run": "mlperf:MlpstorageRunSummary",  # mlpstorage's own summary: no envelope, no benchmark
}
MLPSTORAGE_KEYS = ("schema_version", "run_datetime", "total_ranks", "trials_per_option", "options")
"""What mlpstorage's run summary has (and no ``benchmark``): ``load`` reads such a file as ``MlpstorageRunSummary``."""
"""The result union, discriminated by ``benchmark``: its model's module under results/ (imported when read); the
plan answers (``kvtier plan NAME``) are results/plan.py's ``PLAN_RESULTS``."""


def _model_for(benchmark: Any) -> Any:
    if not isinstance(benchmark, str):
        return None
    if benchmark.startswith("kvtier plan ") and benchmark not in MODELS:
        from kvtier.results.plan import PLAN_RESULTS

        return PLAN_RESULTS.get(benchmark)
    if benchmark not in MODELS:
        return None
    module, name = MODELS[benchmark].split(":")
    return getattr(importlib.import_module(f"kvtier.results.{module}"), name)


def _file(path: Path) -> Path:
    if path.is_dir():
        for name in (
            "summary.json",
            "arms.json",
            "launch.json",
            "sweep.json",
            "ladder.json",
            "kvcache_run_summary.json",
        ):
            if (path / name).is_file():
                return path / name
        theirs = sorted(path.glob("kvcache_run_summary_*.json"))  # mlpstorage's, in a run folder it wrote
        if theirs:
            return theirs[-1]
        raise DatasetError(f"{path}: a folder without summary.json, launch.json or kvcache_run_summary.json")
    return path


def load(path: str | Path) -> AnyResult:
    """The typed result in ``path`` (a result file, or a replay/launch result folder)."""
    from kvtier.results.envelope import SCHEMA_VERSION

    p = _file(Path(path))
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise DatasetError(f"{p}: cannot read: {e.strerror}") from e
    except UnicodeDecodeError:
        raise DatasetError(f"{p}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{p}:{e.lineno}: not valid JSON ({e.msg}): expected a result file kvtier wrote") from None
    except RecursionError:
        raise DatasetError(f"{p}: JSON nested too deep to be a kvtier result") from None
    if not isinstance(raw, dict):
        raise DatasetError(f"{p}: not a kvtier result (expected a JSON object)")
    if "benchmark" not in raw and all(k in raw for k in MLPSTORAGE_KEYS):
        raw = {**raw, "benchmark": "mlpstorage kvcache run"}
    model = _model_for(raw.get("benchmark"))
    if model is None:
        raise DatasetError(
            f"{p}: benchmark: not a kvtier result ({raw.get('benchmark')!r}); expected a result kvtier wrote (a bench "
            "result JSON, an MPI aggregate, a replay or launch folder or its summary.json/launch.json, a ladder, "
            "sweep or arms file, a plan answer written with --output, kvtier's or mlpstorage's kvcache run summary)"
        )
    version = raw.get("result_schema_version")
    if raw["benchmark"] not in ("kvtier mlperf run", "mlpstorage kvcache run") and version != SCHEMA_VERSION:
        raise DatasetError(
            f"{p}: result_schema_version: {version!r}; this kvtier reads version {SCHEMA_VERSION} "
            "(re-run with this kvtier to get a file it can read)"
        )
    try:
        return model.model_validate(raw)  # type: ignore[no-any-return]
    except ValidationError as e:
        raise DatasetError(_errors(p, e)) from None


def _errors(p: Path, e: ValidationError) -> str:
    lines = []
    for err in e.errors()[:20]:
        where = ".".join(str(x) for x in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"{p}: {where}: {msg}")
    more = len(e.errors()) - 20
    return "\n".join(lines + ([f"{p}: ... and {more} more"] if more > 0 else []))


__all__ = ["load"]
