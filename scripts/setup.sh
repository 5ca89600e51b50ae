#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install kvtier into it. Usage: scripts/setup.sh [extras]
#   scripts/setup.sh          -> kvtier and its runtime dependencies
#   scripts/setup.sh test     -> plus pytest, hypothesis, openpyxl, matplotlib
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "kvtier needs Python >= 3.11 (found $("$PY" --version 2>&1))" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e "$spec"
