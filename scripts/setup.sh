#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install kvtier into it. Usage: scripts/setup.sh [extras]
#   scripts/setup.sh          -> kvtier and its runtime dependencies
#   scripts/setup.sh test     -> plus pytest, hypothesis, openpyxl, matplotlib, and a CPU torch
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
if [ "$extras" = test ]; then
  # torch for the tests of --gpu-native's logic (engine/device.py on torch CPU tensors standing in for device
  # memory): the CPU build, pinned as scripts/install-engines.sh pins it (pip takes the local 2.13.0+cpu wheel on
  # this kind of machine; elsewhere set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu, or pip fetches a
  # CUDA build). Not in the test extra, so `pip install .[test]` never pulls gigabytes; the tests skip without it.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" ||
    echo "scripts/setup.sh: could not install torch (CPU); the --gpu-native tests will skip" >&2
fi
