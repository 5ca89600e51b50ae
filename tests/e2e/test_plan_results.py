"""#43: ``kvtier plan`` inside the house: every flag from a config model, every answer a result file
(``--output``: the envelope) that ``results.load`` reads back typed, ``kvtier report`` renders and ``kvtier
compare`` sets side by side."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvtier.results import load
from kvtier.results.envelope import Status, StopCode
from tests.conftest import kvtier_cmd

MODEL = ["--model", "llama3.1-70b-instruct"]
QUESTIONS = {
    "bytes": ["plan", "bytes", *MODEL],
    "breakeven": ["plan", "breakeven", *MODEL, "--context", "8192", "--prefill-tps", "5000", "--net-bw", "100Gbit/s",
                  "--net-bw", "1Gbit/s", "--rtt", "1ms", "--rtt", "20ms", "--compression", "3.5"],
    "gate": ["plan", "gate", *MODEL, "--context", "8192", "--prefill-tps", "5000", "--case", "100Gbit/s,1ms",
             "--case", "5Gbit/s,20ms,3.5"],
    "capacity": ["plan", "capacity", *MODEL, "--tokens", "1000000", "--tier", "cpu=512", "--tier", "nvme=7680"],
}  # fmt: skip


def run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(kvtier_cmd() + args, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("sub", sorted(QUESTIONS))
def test_an_answer_written_with_output_reads_back_typed_and_equals_the_json(tmp_path, sub):
    out = tmp_path / f"{sub}.json"
    p = run(QUESTIONS[sub] + ["--output", str(out)])
    assert p.returncode == 0, p.stderr
    assert f"result: {out}" in p.stdout  # the table is still printed, and says where the file is
    r = load(out)
    assert r.benchmark == f"kvtier plan {sub}"
    assert r.status == Status.complete and r.stop_reason.code == StopCode.answered
    assert r.config.model == "llama3.1-70b-instruct" and r.host.python
    j = run(QUESTIONS[sub] + ["--json"])
    assert json.loads(j.stdout) == r.answer.model_dump(mode="json", exclude_unset=True)


def test_report_renders_plan_answers_and_compare_sets_two_side_by_side(tmp_path):
    a, b = tmp_path / "fast.json", tmp_path / "slow.json"
    base = QUESTIONS["breakeven"]
    assert run(base + ["--output", str(a)]).returncode == 0
    slow = [x if x != "5000" else "2500" for x in base]  # half the prefill rate: twice the recompute time
    assert run(slow + ["--output", str(b)]).returncode == 0
    c = run(["compare", str(a), str(b)])
    assert c.returncode == 0, c.stderr
    row = next(line for line in c.stdout.splitlines() if line.startswith("recompute s"))
    assert "(2.00x)" in row
    assert "configs differ in: prefill_tps" in c.stdout
    html = tmp_path / "r.html"
    gate = tmp_path / "gate.json"
    assert run(QUESTIONS["gate"] + ["--output", str(gate)]).returncode == 0
    p = run(["report", str(a), str(b), str(gate), "--html", str(html)])
    assert p.returncode == 0, p.stderr
    text = html.read_text()
    assert "Fetch vs recompute break-even (kvtier plan breakeven)" in text and "Fetch gate (kvtier plan gate)" in text
    assert "--prefill-tps 2500" in text  # the question asked, as flags
    assert "5Gbit/s,20ms,3.5: fetch" in text  # the gate's verdicts
    assert "data:image/png;base64," in text  # the break-even plot, the same drawing as --plot
    mixed = run(["compare", str(a), str(gate)])
    assert mixed.returncode == 3 and "one kind at a time" in mixed.stderr


def test_an_output_into_a_missing_folder_fails_before_answering(tmp_path):
    out = tmp_path / "no" / "such" / "a.json"
    p = run(QUESTIONS["gate"] + ["--output", str(out)])
    assert p.returncode == 2 and "--output" in p.stderr and not p.stdout and not out.exists()


def test_every_plan_flag_is_a_field_of_its_subcommands_config():
    """No hand-written option: each subcommand's parser has exactly the flags its model's fields make."""
    import argparse

    from kvtier.cli.main import build_parser
    from kvtier.cli.plan import SUBCOMMANDS
    from kvtier.config.base import flag_name
    from kvtier.config.plan import SweepConfig

    plan = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["plan"]
    subs = next(a for a in plan._actions if isinstance(a, argparse._SubParsersAction)).choices
    models = {s.name: s.config for s in SUBCOMMANDS} | {"sweep": SweepConfig}
    assert set(subs) == set(models)
    for name, model in models.items():
        given = {o for a in subs[name]._actions for o in a.option_strings} - {"-h", "--help"}
        assert given == {flag_name(f) for f in model.model_fields}, name


@pytest.mark.parametrize(
    "args,needle",
    [
        (["plan", "gate", "--from", "x.json", "--case", "1GB/s,1ms"], "--from: the ladder measured the server; --case"),
        (["plan", "capacity", *MODEL, "--tier", "cpu"], "--tier 'cpu': expected NAME=NUMBER"),
        (["plan", "bytes", "--hf-config", "x", "--model", "llama3.1-8b"], "--hf-config: give it alone"),
        (["plan", "fetch", "--from", "x.json", "--prefill-tps", "1", "--context", "0,8"], "every context must be > 0"),
        (["plan", "sweep", "--dataset", "d", "--output", "o", "--concurrency", "0,2"], "--concurrency: must be >= 1"),
    ],
)
def test_bad_combinations_are_refused_by_the_config_naming_the_flags(args, needle):
    p = run(args, timeout=60)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr
