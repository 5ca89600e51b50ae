"""Quantities with units (ground floor: no I/O): bandwidths in bytes/s and durations in seconds, SI (decimal) prefixes.

Bandwidth: ``B/s``, ``kB/s``, ``MB/s``, ``GB/s``, ``TB/s`` (bytes); ``bit/s``, ``kbit/s``, ``Mbit/s``,
``Gbit/s``, ``Tbit/s`` or ``b/s``, ``Gb/s``, ``Gbps`` (bits); ``KiB/s``, ``MiB/s``, ``GiB/s``, ``TiB/s``.
Time: ``s``, ``ms``, ``us`` (or ``µs``), ``ns``. A bare number is bytes/s or seconds.
"""

from __future__ import annotations

import re

from kvtier.errors import ConfigError

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
"""The binary sizes, defined once."""

_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BIN = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_BW = re.compile(_NUM + r"\s*([kKMGTP]i?)?(B|bit|b)?(?:/s|ps)?")
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str, what: str = "bandwidth") -> float:
    """Bytes per second from e.g. ``100Gbit/s``, ``3.35TB/s``, ``12.5GB/s``, ``25Gbps``."""
    s = str(text).strip()
    m = _BW.fullmatch(s)
    if not m or (m.group(3) is None and m.group(2) is not None):
        raise ConfigError(f"{what}: cannot read {text!r} as a bandwidth (e.g. 100Gbit/s, 12.5GB/s, 3.35TB/s)")
    value, prefix, unit = float(m.group(1)), m.group(2) or "", m.group(3) or "B"
    scale = _BIN[prefix] if prefix in _BIN else _SI.get(prefix)
    if scale is None:
        raise ConfigError(f"{what}: unknown prefix {prefix!r} in {text!r}")
    bytes_per_s = value * scale / (8.0 if unit in ("bit", "b") else 1.0)
    if bytes_per_s <= 0:
        raise ConfigError(f"{what}: must be > 0, got {text!r}")
    return bytes_per_s


def parse_duration(text: str, what: str = "time") -> float:
    """Seconds from e.g. ``20ms``, ``1 us``, ``0.5s``, ``0``."""
    s = str(text).strip()
    m = re.fullmatch(_NUM + r"\s*(s|ms|us|µs|ns)?", s)
    if not m:
        raise ConfigError(f"{what}: cannot read {text!r} as a duration (e.g. 1ms, 20ms, 5us, 0.2s)")
    return float(m.group(1)) * _TIME[m.group(2) or "s"]


def fmt_bandwidth(bytes_per_s: float) -> str:
    """Network-style: Gbit/s (decimal)."""
    return f"{bytes_per_s * 8 / 1e9:.3g} Gbit/s"


def fmt_seconds(s: float) -> str:
    if s < 0:  # a loss (a fetch slower than the recompute it replaced): the magnitude's unit, signed
        return "-" + fmt_seconds(-s)
    if s >= 1:
        return f"{s:.4g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.4g} ms"
    return f"{s * 1e6:.4g} µs"
