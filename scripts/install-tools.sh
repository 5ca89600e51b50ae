#!/usr/bin/env bash
# Install the system tools kvtier's tests and benchmarks use, when missing (Debian/Ubuntu, needs root or sudo).
#   scripts/install-tools.sh fio [more tools]      (a tool is a command; ss comes from the iproute2 package,
#                                                  mpirun from openmpi-bin)
# bpftrace (--enable-latency-tracing, kvtier trace attach) also needs tracefs: as root, it is mounted at
# /sys/kernel/tracing when it is not there yet.
set -euo pipefail
mount_tracefs() {
  [ -e /sys/kernel/tracing/events ] && return 0
  [ "$(id -u)" -eq 0 ] || { echo "install-tools.sh: tracefs is not mounted (as root: mount -t tracefs nodev /sys/kernel/tracing)" >&2; return 0; }
  mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null ||
    echo "install-tools.sh: could not mount tracefs; bpftrace's probes will not attach" >&2
}
need=()
for tool in "${@:-fio}"; do
  [ "$tool" = bpftrace ] && mount_tracefs
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
