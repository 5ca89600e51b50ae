#!/usr/bin/env bash
# Install the system tools kvtier's benchmarks use, when missing (Debian/Ubuntu, needs root or sudo).
#   scripts/install-tools.sh fio [more packages]
set -euo pipefail
need=()
for pkg in "${@:-fio}"; do
  command -v "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq "${need[@]}" >/dev/null
