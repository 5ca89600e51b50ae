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


def _with_health(result, devices: list[str]):  # type: ignore[no-untyped-def]
    from kvtier.results.bench import Criterion, StorageHealth
    from kvtier.results.bench_facts import DeviceStats

    r = result.model_copy(deep=True)
    crit = [
        Criterion(name="Storage Tier Write Device P95 < 500ms", target=500, actual=6401.52, unit="ms", passed=False),
        Criterion(name="Storage Tier Read Device P95 < 200ms", target=200, actual=1839.39, unit="ms", passed=False),
        Criterion(name="Cache Hit Rate > 30%", target=0.3, actual=0.86, unit="ratio", passed=True),
    ]
    r.summary.cache_stats.storage_health = StorageHealth(profile="latency", overall_status="FAIL", criteria=crit,
                                                         passed_count=1, total_count=3)  # fmt: skip
    r.device = DeviceStats(path="/var/tmp", resolution="", devices=devices, totals=None, timeline=[], ours=None,
                           other_traffic_fraction=None)  # fmt: skip
    return r


def test_a_failed_health_names_each_criterion_and_why_a_virtual_disk_fails_it(tiny_bench_result, capsys):  # type: ignore[no-untyped-def]
    """The demo's first screen once said only 'FAIL (1/4 criteria passed)': now each criterion, its measure, why a
    virtual disk fails the latency ones, and what to run next."""
    print_summary(_with_health(tiny_bench_result[0], ["vda"]), Path("results/demo.json"))
    out = capsys.readouterr().out
    assert "storage health (latency profile): FAIL, 1 of 3 criteria met" in out
    assert "FAIL  Storage Tier Read Device P95 < 200ms: measured 1,839.39 ms" in out
    assert "pass  Cache Hit Rate > 30%: measured 0.86" in out
    assert "on vda, a virtual disk" in " ".join(out.split())
    assert "next: kvtier report results/demo.json --html report.html" in " ".join(out.split())
    print_summary(_with_health(tiny_bench_result[0], ["nvme0n1"]), Path("r.json"))
    assert "virtual disk" not in capsys.readouterr().out  # a real drive's failure is the drive's
