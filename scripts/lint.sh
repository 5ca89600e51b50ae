#!/usr/bin/env bash
# Lint, format check and type check (ruff and mypy from the test extras: run scripts/setup.sh test first).
# Rules and strictness live in pyproject.toml ([tool.ruff], [tool.mypy]).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
