"""The storage latency stack with bpftrace (``--enable-latency-tracing``, ``kvtier trace attach``).

Block layer, on the traced devices (block tracepoints): for each request, per direction, queue time (Q2D:
inserted into the scheduler -> issued to the driver), device time (D2C: issued -> completed) and total (Q2C;
a request that skipped the scheduler has no insert and counts only in D2C); the request sizes in KiB (the
bssplit); the requests in flight on the device when one is issued (queue depth); where on the device they land
(LBA heatmap, GiB from the start). System calls of the traced process (syscall tracepoints, filtered by its
pid or command name): read and write time and size (pread64/preadv/read and pwrite64/pwritev/writev/write: the
VFS entry points, which kprobes would reach deeper where the kernel allows them — on this kernel it does not),
fsync/fdatasync time, the gap from a file's last write to its fsync, and from an fadvise to the next read of
that file. ``UNAVAILABLE`` names what the spec's list has that no tracepoint gives, with the reason. bpftrace
runs as a child process while the load lasts and prints its histograms at SIGINT; where the syscall probes
cannot attach, the block-layer program runs alone and ``degraded`` says why.

Nothing here may fail a run: without bpftrace, without root (or password-less sudo), or when its probes
cannot attach (a container, a kernel without BTF/tracepoints), ``start`` returns a tracer whose
``reason`` says why, and the run goes on with its diskstats figures.
"""

from __future__ import annotations

import math
import os
import re
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from kvtier.child import run, start
from kvtier.errors import LaunchError

BLOCK_HISTOGRAMS = (
    "q2d_read_us",
    "q2d_write_us",
    "d2c_read_us",
    "d2c_write_us",
    "q2c_read_us",
    "q2c_write_us",
    "size_read_kb",
    "size_write_kb",
    "queue_depth",
    "lba_gib",
)
SYSCALL_HISTOGRAMS = (
    "syscall_read_us",
    "syscall_write_us",
    "syscall_read_kb",
    "syscall_write_kb",
    "fsync_us",
    "write_to_fsync_us",
    "fadvise_to_read_us",
)
HISTOGRAMS = BLOCK_HISTOGRAMS + SYSCALL_HISTOGRAMS
UNAVAILABLE = {
    "vfs_internal": "VFS functions (vfs_read, vfs_write, iomap) need kprobes, which this kernel does not offer (no "
    "kprobe_events): the read/write system calls stand in for them",
    "page_cache": "page-cache hits and misses need kprobes or the filemap tracepoints' inode mapping; not traced",
}
READS = ("pread64", "preadv", "preadv2", "readv", "read")  # glibc's preadv() is the preadv2 system call
WRITES = ("pwrite64", "pwritev", "pwritev2", "writev", "write")


ATTACHED = "kvtier: probes attached"
"""What the program's BEGIN probe prints: bpftrace runs BEGIN once every probe is attached."""


def syscall_program(who: str) -> str:
    """The system-call part for the processes ``who`` selects (a bpftrace predicate: ``pid == 123``)."""
    lines = []
    for kind, calls in (("read", READS), ("write", WRITES)):
        for c in calls:
            enter = f"tracepoint:syscalls:sys_enter_{c} /{who}/ {{ @s_{kind}[tid] = nsecs; @s_fd[tid] = args->fd; "
            if kind == "read":  # the gap from an fadvise of the file to its next read
                enter += "$a = @fadv[pid, args->fd]; if ($a) { @fadvise_to_read_us = hist((nsecs - $a) / 1000); "
                enter += "delete(@fadv[pid, args->fd]); } "
            lines.append(enter + "}")
            lines.append(
                f"tracepoint:syscalls:sys_exit_{c} /@s_{kind}[tid]/ {{ "
                f"@syscall_{kind}_us = hist((nsecs - @s_{kind}[tid]) / 1000); "
                f"if (args->ret > 0) {{ @syscall_{kind}_kb = hist((uint64)args->ret / 1024); }} "
                + ("@lastw[pid, @s_fd[tid]] = nsecs; " if kind == "write" else "")
                + f"delete(@s_{kind}[tid]); delete(@s_fd[tid]); }}"
            )
    for c in ("fsync", "fdatasync"):
        lines.append(
            f"tracepoint:syscalls:sys_enter_{c} /{who}/ {{ @s_sync[tid] = nsecs; $w = @lastw[pid, args->fd]; "
            "if ($w) { @write_to_fsync_us = hist((nsecs - $w) / 1000); delete(@lastw[pid, args->fd]); } }"
        )
        lines.append(
            f"tracepoint:syscalls:sys_exit_{c} /@s_sync[tid]/ {{ @fsync_us = hist((nsecs - @s_sync[tid]) / 1000); "
            "delete(@s_sync[tid]); }"
        )
    lines.append(f"tracepoint:syscalls:sys_enter_fadvise64 /{who}/ {{ @fadv[pid, args->fd] = nsecs; }}")
    return "\n".join(lines) + "\n"


SYSCALL_MAPS = " clear(@s_read); clear(@s_write); clear(@s_fd); clear(@s_sync); clear(@lastw); clear(@fadv);"
"""The system-call program's scratch maps, cleared at END only where it runs: bpftrace refuses a program that names
a map it never sets (0.17: "Undefined map: @s_read" stopped the block-layer-only fallback from loading)."""


def program(devs: list[int], who: str | None = None, watch: int | None = None, max_s: int | None = None) -> str:
    """The bpftrace program for these kernel dev_t numbers ((major << 20) | minor), and with ``who`` (a
    predicate on pid or comm) the system calls of those processes.

    It ends itself, whatever happens to whoever started it: once the thread ``watch`` (kvtier's main thread) exits,
    killed or not, and after ``max_s`` seconds. bpftrace started through sudo outlives a killed kvtier otherwise: the
    kernel clears the parent-death signal when it executes a set-uid program."""
    cond = " || ".join(f"args->dev == {d}" for d in devs) or "1"
    ends = ""
    if watch is not None and not _in_pid_namespace():  # bpftrace's tid is the host's: a namespace's pid is not
        ends += f"tracepoint:sched:sched_process_exit /tid == {int(watch)}/ {{ exit(); }}\n"
    if max_s is not None:
        ends += f"interval:s:{max(1, int(max_s))} {{ exit(); }}\n"
    # rwbs is a string ("R", "RA", "WS", "FWS", "FWFS"...): the direction is its first letter after a flush 'F'
    rd = '(strncmp(args->rwbs, "R", 1) == 0 || strncmp(args->rwbs, "FR", 2) == 0)'
    wr = '(strncmp(args->rwbs, "W", 1) == 0 || strncmp(args->rwbs, "FW", 2) == 0)'
    return f"""
BEGIN {{ printf("{ATTACHED}\\n"); }}
tracepoint:block:block_rq_insert /{cond}/ {{ @ins[args->dev, args->sector] = nsecs; }}
tracepoint:block:block_rq_issue /{cond}/ {{
  @iss[args->dev, args->sector] = nsecs;
  @queue_depth = hist(@inflight[args->dev]);
  @inflight[args->dev] = @inflight[args->dev] + 1;
  @lba_gib = hist(args->sector >> 21);
  $t = @ins[args->dev, args->sector];
  if ({rd}) {{
    @size_read_kb = hist(args->bytes / 1024);
    if ($t) {{ @q2d_read_us = hist((nsecs - $t) / 1000); }}
  }}
  if ({wr}) {{
    @size_write_kb = hist(args->bytes / 1024);
    if ($t) {{ @q2d_write_us = hist((nsecs - $t) / 1000); }}
  }}
}}
tracepoint:block:block_rq_complete /{cond}/ {{
  $i = @iss[args->dev, args->sector];
  $q = @ins[args->dev, args->sector];
  if ($i && @inflight[args->dev] > 0) {{ @inflight[args->dev] = @inflight[args->dev] - 1; }}
  if ($i) {{
    if ({rd}) {{ @d2c_read_us = hist((nsecs - $i) / 1000); if ($q) {{ @q2c_read_us = hist((nsecs - $q) / 1000); }} }}
    if ({wr}) {{ @d2c_write_us = hist((nsecs - $i) / 1000); if ($q) {{ @q2c_write_us = hist((nsecs - $q) / 1000); }} }}
  }}
  delete(@iss[args->dev, args->sector]);
  delete(@ins[args->dev, args->sector]);
}}
END {{ clear(@ins); clear(@iss); clear(@inflight);{SYSCALL_MAPS if who else ""} }}
{ends}""" + (syscall_program(who) if who else "")


def _in_pid_namespace() -> bool:
    """Whether this process's pid is a PID namespace's, not the host's (``NSpid`` lists more than one)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return len(line.split()) > 2
    except OSError:
        pass
    return False


_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_NAME = re.compile(r"^@(\w+):\s*$")
_RANGE = re.compile(r"^\[(\d+)([KMGT]?),\s*(\d+)([KMGT]?)\)\s+(\d+)\s*\|")
_SINGLE = re.compile(r"^\[(\d+)([KMGT]?)\]\s+(\d+)\s*\|")
_OPEN = re.compile(r"^\[(\d+)([KMGT]?),\s*\.\.\.\)\s+(\d+)\s*\|")


def parse_histograms(text: str) -> dict[str, list[dict[str, int | None]]]:
    """bpftrace's printed ``hist()`` maps: name -> buckets [{low, high, count}] (high None: open end)."""
    out: dict[str, list[dict[str, int | None]]] = {}
    current: list[dict[str, int | None]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        m = _NAME.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        if current is None or not line:
            continue
        r = _RANGE.match(line)
        if r:
            lo, hi = int(r.group(1)) * _UNITS[r.group(2)], int(r.group(3)) * _UNITS[r.group(4)]
            current.append({"low": lo, "high": hi, "count": int(r.group(5))})
            continue
        s = _SINGLE.match(line)
        if s:
            v = int(s.group(1)) * _UNITS[s.group(2)]
            current.append({"low": v, "high": v + 1, "count": int(s.group(3))})
            continue
        o = _OPEN.match(line)
        if o:
            current.append({"low": int(o.group(1)) * _UNITS[o.group(2)], "high": None, "count": int(o.group(3))})
    return out


def hist_percentile(buckets: list[dict[str, int | None]], q: float) -> dict[str, int | None] | None:
    """The bucket holding the q-th percentile (a histogram knows a range, not a value)."""
    total = sum(int(b["count"] or 0) for b in buckets)
    if not total:
        return None
    target, seen = total * q / 100.0, 0
    for b in buckets:
        seen += int(b["count"] or 0)
        if seen >= target:
            return {"low": b["low"], "high": b["high"]}
    return {"low": buckets[-1]["low"], "high": buckets[-1]["high"]}


def summarize(hists: dict[str, list[dict[str, int | None]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in HISTOGRAMS:
        b = hists.get(name)
        if not b:
            continue
        out[name] = {
            "count": sum(int(x["count"] or 0) for x in b),
            "p50_bucket": hist_percentile(b, 50),
            "p95_bucket": hist_percentile(b, 95),
            "p99_bucket": hist_percentile(b, 99),
            "buckets": b,
        }
    return out


def whole_disks(sysfs: Path = Path("/sys")) -> list[str]:
    """The host's whole disks (/sys/block, less loop, ram and zram devices)."""
    try:
        names = sorted(p.name for p in (sysfs / "block").iterdir())
    except OSError:
        return []
    return [n for n in names if not n.startswith(("loop", "ram", "zram"))]


def dev_numbers(devices: list[str], sysfs: Path = Path("/sys")) -> list[int]:
    """Kernel dev_t ((major << 20) | minor) of each device name, from /sys/block/<name>/dev."""
    out = []
    for d in devices:
        try:
            major, minor = (int(x) for x in (sysfs / "block" / d / "dev").read_text().strip().split(":"))
        except (OSError, ValueError):
            continue
        out.append((major << 20) | minor)
    return out


def _attach(cmd: list[str], attach_s: float) -> tuple[subprocess.Popen[str] | None, list[str], str | None]:
    """Start bpftrace and wait until its BEGIN probe printed ATTACHED (bpftrace runs BEGIN once every probe is
    attached): (the running process, the command, None), or (None, the command, why not). Judging by "still
    running after a few seconds" missed the first writes of a run once: under load the probes attached later."""
    cmd = [*cmd[:-2], "-B", "line", *cmd[-2:]]  # its output line by line: the marker arrives when printed
    try:
        proc = start(cmd, name="bpftrace", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True).popen
    except LaunchError as e:
        return None, cmd, f"bpftrace could not start: {e}"
    assert proc.stdout is not None
    deadline = time.monotonic() + attach_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.strip() == ATTACHED:
                return proc, cmd, None
            if line:
                continue
        if proc.poll() is not None:
            _, err = proc.communicate()
            lines = [ln.strip() for ln in err.splitlines() if ln.strip() and "RLIMIT_MEMLOCK" not in ln]
            first = next((ln for ln in lines if "ERROR" in ln), lines[0] if lines else f"exit {proc.returncode}")
            return None, cmd, f"bpftrace could not attach its probes: {first[:300]}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return None, cmd, f"bpftrace did not attach its probes within {attach_s:g} s"


class BlockTracer:
    """One bpftrace child. ``reason`` is None while it traces; otherwise why it does not."""

    def __init__(
        self,
        devices: list[str],
        reason: str | None,
        proc: subprocess.Popen[str] | None = None,
        command: list[str] | None = None,
        who: str | None = None,
        degraded: str | None = None,
    ) -> None:
        self.devices = devices
        self.reason = reason
        self.proc = proc
        self.command = command or []
        self.raw_tail = ""
        self.who = who  # the processes whose system calls are traced (a bpftrace predicate), None: none
        self.degraded = degraded  # why the system-call probes are not part of the trace, when they are not
        self.started = time.monotonic()
        self.duration_s: float | None = None

    @classmethod
    def start(
        cls,
        devices: list[str],
        attach_s: float = 60.0,
        bpftrace: str | None = None,
        who: str | None = None,
        max_s: float | None = None,
    ) -> BlockTracer:
        """bpftrace on ``devices`` (and, with ``who``, the system calls of those processes). Where the system-call
        probes cannot attach, the block-layer program alone, with ``degraded`` saying why. bpftrace ends itself when
        this process exits and, with ``max_s``, after that many seconds (``program``)."""
        exe = bpftrace or shutil.which("bpftrace")
        if exe is None:
            return cls(devices, "bpftrace is not installed (apt-get install bpftrace; scripts/install-tools.sh)")
        if not devices and who is None:
            return cls(devices, "no block device under the storage tier to trace")
        prefix = [exe]
        if os.geteuid() != 0:
            sudo = shutil.which("sudo")
            asked = run([sudo, "-n", "true"], timeout_s=10) if sudo is not None else None
            if sudo is None or asked is None or asked.returncode:
                return cls(devices, "bpftrace needs root (run as root, or with password-less sudo)")
            prefix = [sudo, "-n", exe]
        devs = dev_numbers(devices)
        watch, bound = os.getpid(), None if max_s is None else math.ceil(max_s)
        proc, cmd, problem = _attach([*prefix, "-e", program(devs, who, watch, bound)], attach_s)
        if proc is not None:
            return cls(devices, None, proc, cmd, who)
        if who is None:
            return cls(devices, problem, command=cmd)
        degraded = f"the system-call probes did not attach ({problem}): block layer only"
        proc, cmd, problem = _attach([*prefix, "-e", program(devs, None, watch, bound)], attach_s)
        if proc is not None:
            return cls(devices, None, proc, cmd, None, degraded)
        return cls(devices, problem, command=cmd, degraded=degraded)

    def stop(self) -> dict[str, Any]:
        """SIGINT (bpftrace prints its maps and exits), then the parsed histograms."""
        if self.proc is None:
            return {}
        self.duration_s = round(time.monotonic() - self.started, 3)
        ended_itself = self.proc.poll() is not None
        if ended_itself:  # it ended itself (its max_s bound) or was killed: a partial trace
            ended = f"bpftrace ended before it was stopped (exit {self.proc.returncode}): the trace covers part of it"
            self.degraded = f"{self.degraded}; {ended}" if self.degraded else ended
        try:
            if not ended_itself:  # reaped already: its group id may be another's now
                os.killpg(self.proc.pid, signal.SIGINT)
            out, err = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, err = self.proc.communicate()
        except ProcessLookupError:
            out, err = self.proc.communicate()
        hists = parse_histograms(out + "\n" + err)
        if not hists:
            self.raw_tail = (out + err)[-500:]
            self.reason = "bpftrace printed no histograms (no block I/O on the traced devices?)"
        return summarize(hists)

    def section(self, hists: dict[str, Any]) -> dict[str, Any]:
        """What a result records of the trace: what was traced, what was not and why, the histograms."""
        names = BLOCK_HISTOGRAMS + (SYSCALL_HISTOGRAMS if self.who else ())
        return {
            "devices": self.devices,
            "traced": self.reason is None,
            "reason": self.reason,
            "processes": self.who,
            "degraded": self.degraded,
            "duration_s": self.duration_s,
            "empty": [n for n in names if n not in hists] if self.reason is None else [],
            "unavailable": dict(UNAVAILABLE),
            "histograms": hists,
        }


__all__ = ["BlockTracer", "parse_histograms", "summarize", "program", "syscall_program", "dev_numbers", "HISTOGRAMS"]
