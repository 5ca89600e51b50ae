"""Block-layer latency histograms of the storage tier's devices with bpftrace (``--enable-latency-tracing``).

For each request the block layer handles on those devices, three times in microseconds, per
direction: queue (Q2D: inserted into the scheduler -> issued to the driver), device (D2C: issued ->
completed) and total (Q2C: inserted -> completed; a request that skipped the scheduler has no insert
and counts only in D2C); and the request sizes in KiB. bpftrace runs as a child process while the load
lasts and prints its histograms at SIGINT.

Nothing here may fail a run: without bpftrace, without root (or password-less sudo), or when its probes
cannot attach (a container, a kernel without BTF/tracepoints), ``start`` returns a tracer whose
``reason`` says why, and the run goes on with its diskstats figures.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

HISTOGRAMS = (
    "q2d_read_us",
    "q2d_write_us",
    "d2c_read_us",
    "d2c_write_us",
    "q2c_read_us",
    "q2c_write_us",
    "size_read_kb",
    "size_write_kb",
)

_R, _W = 82, 87  # 'R', 'W' in rwbs ("R", "WS", "FWS", "RA"...): the direction is in its first two letters


def program(devs: list[int]) -> str:
    """The bpftrace program for these kernel dev_t numbers ((major << 20) | minor)."""
    cond = " || ".join(f"args->dev == {d}" for d in devs) or "1"
    rd = f"(args->rwbs[0] == {_R} || args->rwbs[1] == {_R})"
    wr = f"(args->rwbs[0] == {_W} || args->rwbs[1] == {_W})"
    return f"""
tracepoint:block:block_rq_insert /{cond}/ {{ @ins[args->dev, args->sector] = nsecs; }}
tracepoint:block:block_rq_issue /{cond}/ {{
  @iss[args->dev, args->sector] = nsecs;
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
  if ($i) {{
    if ({rd}) {{ @d2c_read_us = hist((nsecs - $i) / 1000); if ($q) {{ @q2c_read_us = hist((nsecs - $q) / 1000); }} }}
    if ({wr}) {{ @d2c_write_us = hist((nsecs - $i) / 1000); if ($q) {{ @q2c_write_us = hist((nsecs - $q) / 1000); }} }}
  }}
  delete(@iss[args->dev, args->sector]);
  delete(@ins[args->dev, args->sector]);
}}
END {{ clear(@ins); clear(@iss); }}
"""


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


class BlockTracer:
    """One bpftrace child. ``reason`` is None while it traces; otherwise why it does not."""

    def __init__(
        self,
        devices: list[str],
        reason: str | None,
        proc: subprocess.Popen[str] | None = None,
        command: list[str] | None = None,
    ) -> None:
        self.devices = devices
        self.reason = reason
        self.proc = proc
        self.command = command or []
        self.raw_tail = ""

    @classmethod
    def start(cls, devices: list[str], attach_s: float = 3.0, bpftrace: str | None = None) -> BlockTracer:
        exe = bpftrace or shutil.which("bpftrace")
        if exe is None:
            return cls(devices, "bpftrace is not installed (apt-get install bpftrace)")
        if not devices:
            return cls(devices, "no block device under the storage tier to trace")
        cmd = [exe, "-e", program(dev_numbers(devices))]
        if os.geteuid() != 0:
            sudo = shutil.which("sudo")
            if sudo is None or subprocess.run([sudo, "-n", "true"], capture_output=True, check=False).returncode:
                return cls(devices, "bpftrace needs root (run as root, or with password-less sudo)")
            cmd = [sudo, "-n", *cmd]
        try:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
            )
        except OSError as e:
            return cls(devices, f"bpftrace could not start: {e.strerror or e}")
        deadline = time.monotonic() + attach_s
        while time.monotonic() < deadline:  # probes attach within a second or two, or bpftrace exits
            if proc.poll() is not None:
                _, err = proc.communicate()
                first = next((ln for ln in err.splitlines() if ln.strip()), f"exit status {proc.returncode}")
                return cls(devices, f"bpftrace could not attach its probes: {first.strip()[:300]}", command=cmd)
            time.sleep(0.1)
        return cls(devices, None, proc, cmd)

    def stop(self) -> dict[str, Any]:
        """SIGINT (bpftrace prints its maps and exits), then the parsed histograms."""
        if self.proc is None:
            return {}
        try:
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


__all__ = ["BlockTracer", "parse_histograms", "summarize", "program", "dev_numbers", "HISTOGRAMS"]
