"""The bench's terminal summary prints outside text as it is: rich markup in a warning, a path or a model
name is never interpreted (``pip install 'kvtier[gpu]'`` once printed as ``'kvtier'``)."""

from __future__ import annotations

from pathlib import Path

from kvtier.cli.bench import print_summary
from kvtier.results.envelope import ResultWarning


def test_markup_in_a_warning_is_printed_as_it_is(tiny_bench_result, capsys):  # type: ignore[no-untyped-def]
    result = tiny_bench_result[0].model_copy(deep=True)
    result.warnings.append(
        ResultWarning(code="gpu-tier-off", message="torch is not installed (pip install 'kvtier[gpu]')")
    )
    print_summary(result, Path("/tmp/[bold]r.json"))
    out = " ".join(capsys.readouterr().out.split())
    assert "pip install 'kvtier[gpu]'" in out and "/tmp/[bold]r.json" in out
