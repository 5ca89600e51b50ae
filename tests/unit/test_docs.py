"""The docs stay true to the code: every warning and stop code the source can write is in docs/metrics.md, every
module docs/architecture.md names exists, and every link between the docs and the README resolves."""

from __future__ import annotations

import re
from pathlib import Path

from kvtier.results.envelope import StopCode, WarningCode

REPO = Path(__file__).resolve().parents[2]
METRICS = (REPO / "docs" / "metrics.md").read_text()


def test_every_warning_and_stop_code_is_documented():
    missing = [c.value for c in (*WarningCode, *StopCode) if f"`{c.value}`" not in METRICS]
    assert not missing, f"docs/metrics.md does not name: {missing}"


def test_every_module_the_architecture_names_exists():
    text = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([a-z_]+(?:/[a-z_]+)*\.py)`", text))
    assert len(named) > 20  # the pattern still finds the table's modules
    missing = sorted(p for p in named if not ((REPO / "src" / "kvtier" / p).exists() or (REPO / p).exists()))
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_links_between_the_docs_resolve():
    broken = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_the_readme_stays_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 300
