#!/usr/bin/env bash
# Set up, then run a short default benchmark on a temporary directory:
# llama3.1-8b, 10 users, 15 s, CPU RAM tier 1 GB in front of a 10 GiB file tier (it writes at most that, in a
# temporary folder it removes), no simulated GPU time.
# Prints a summary table and writes results/demo.json (and results/demo.xlsx).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh examples  # the core, and what the README's examples use (plots, tokenizers, .zst)
dir="$(mktemp -d "${TMPDIR:-/var/tmp}/kvtier-demo-XXXXXX")"
trap 'rm -rf "$dir"' EXIT
mkdir -p results
.venv/bin/kvtier bench --model llama3.1-8b --num-users 10 --duration 15 --gpu-mem-gb 0 --cpu-mem-gb 1 \
  --storage-capacity-gb 10 --max-concurrent-allocs 4 --generation-mode none --seed 42 --cache-dir "$dir" \
  --output results/demo.json --xlsx-output results/demo.xlsx "$@"
