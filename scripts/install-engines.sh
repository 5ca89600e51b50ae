#!/usr/bin/env bash
# Install the serving engines `kvtier launch --engine vllm` runs, as a pinned, known-good pair, into a
# Python environment of their own (default .engines/; vLLM brings its own torch), then check them.
#
#   bash scripts/install-engines.sh [--venv DIR] [--dry-run]          NVIDIA (CUDA wheels from PyPI)
#   bash scripts/install-engines.sh --rocm                            AMD: prints the source build
#
# Why pinned: LMCache's compiled module (lmcache.c_ops) is built against one torch release. A fresh
# `pip install vllm lmcache` pairs vLLM 0.33.0 (torch 2.14) with LMCache 0.5.6 (built for torch
# 2.13): the module does not import, LMCache falls back to plain torch copies, and a benchmark would
# measure the fallback. vLLM 0.32.0 + LMCache 0.5.6 is the newest pair that matches. The same pins
# are kvtier's `engines` extra (pyproject.toml) and kvtier.launch.engines.KNOWN_GOOD.
#
# Afterwards put DIR/bin first on PATH (so `vllm` and `lmcache` are these) and run
#   kvtier launch --tier cpu --engine vllm --check
set -euo pipefail
VLLM_VERSION=0.32.0
LMCACHE_VERSION=0.5.6
cd "$(dirname "$0")/.."
venv=.engines
dry=""
rocm=""
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --rocm) rocm=1; shift ;;
    *) echo "install-engines.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

if [ -n "$rocm" ]; then
  cat <<ROCM
AMD (ROCm): no LMCache wheel is built for ROCm; build it from source against the torch of your
ROCm vLLM (AMD's vLLM container, or vLLM built for ROCm), in that environment:

  git clone https://github.com/LMCache/LMCache && cd LMCache && git checkout v${LMCACHE_VERSION}
  BUILD_WITH_HIP=1 pip install -e . --no-build-isolation
  kvtier launch --tier cpu --engine vllm --build amd --check

--no-build-isolation makes the build use the installed (ROCm) torch, so lmcache.c_ops matches it.
ROCM
  exit 0
fi

run() { echo "+ $*"; [ -n "$dry" ] || "$@"; }
py=python3
command -v "$py" >/dev/null || { echo "install-engines.sh: python3 is required" >&2; exit 1; }
[ -x "$venv/bin/python" ] || run "$py" -m venv "$venv"
run "$venv/bin/python" -m pip install -q --upgrade pip
run "$venv/bin/python" -m pip install "vllm==${VLLM_VERSION}" "lmcache==${LMCACHE_VERSION}"
[ -n "$dry" ] && exit 0
echo "installed into $venv; checking the pair (PATH=$venv/bin:\$PATH):"
PATH="$PWD/$venv/bin:$PATH" .venv/bin/python -m kvtier launch --tier cpu --engine vllm --check
