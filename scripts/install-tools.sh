#!/usr/bin/env bash
# Install the system tools kvtier's tests and benchmarks use, when missing (Debian/Ubuntu, needs root or sudo).
#   scripts/install-tools.sh fio [more tools]      (a tool is a command; ss comes from the iproute2 package,
#                                                  mpirun from openmpi-bin)
set -euo pipefail
need=()
for tool in "${@:-fio}"; do
  command -v "$tool" >/dev/null 2>&1 && continue
  case "$tool" in
    ss) need+=(iproute2) ;;
    mpirun) need+=(openmpi-bin) ;;
    *) need+=("$tool") ;;
  esac
done
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq "${need[@]}" >/dev/null
