"""docs/metrics.md names every warning code and stop code a result can carry, and docs/architecture.md names
only modules that exist: a code added without its meaning, or a module renamed, fails here."""

from __future__ import annotations

import re
from pathlib import Path

from kvtier.report.envelope import StopCode, WarningCode

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_warning_and_stop_code_is_documented():
    text = (DOCS / "metrics.md").read_text()
    assert [w.value for w in WarningCode if f"`{w.value}`" not in text] == []
    assert [s.value for s in StopCode if f"`{s.value}`" not in text] == []


def test_every_module_named_in_the_architecture_exists():
    src = Path(__file__).resolve().parents[2] / "src" / "kvtier"
    text = (DOCS / "architecture.md").read_text()
    named = set(re.findall(r"`([a-z_]+(?:/[a-z_]+)*\.py)`", text))
    repo = src.parents[1]
    assert named and [m for m in sorted(named) if not (src / m).exists() and not (repo / m).exists()] == []
