"""GPUDirect Storage for the file tier, through kvikio (the ``gds`` extra), when a CUDA device and
cuFile exist.

``GdsFileTier`` keeps the file tier's layout (one header block, then the aligned payload) and its
header checks; only the payload moves through ``kvikio.CuFile`` (cuFile's DMA path between the
NVMe device and the buffer, without the kernel's page cache or a bounce through the POSIX path).
``--gds auto`` uses it where ``probe_gds`` finds kvikio, a CUDA device and cuFile out of
compatibility mode, else the O_DIRECT path; ``on`` refuses to run without it; ``off`` never uses
it. The choice and its reason are recorded in the result (``storage.gds``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from kvtier.engine.file import FileTier
from kvtier.engine.gpu import gpu_available

GdsMode = Literal["auto", "on", "off"]


def _kvikio() -> Any:
    import kvikio

    return kvikio


def probe_gds() -> tuple[bool, str]:
    """(True, what) when the file tier can move its payload through cuFile, else (False, why)."""
    try:
        kvikio = _kvikio()
    except ImportError:
        return False, "kvikio is not installed (pip install 'kvtier[gds]')"
    ok, why = gpu_available()
    if not ok:
        return False, why
    defaults = kvikio.defaults
    if hasattr(defaults, "is_compat_mode_preferred"):  # kvikio >= 25: AUTO resolved against cuFile's presence
        compat = bool(defaults.is_compat_mode_preferred())
    elif hasattr(defaults, "compat_mode"):  # older kvikio: a bool
        compat = bool(defaults.compat_mode())
    else:
        compat = str(defaults.get("compat_mode")).upper().endswith("ON")
    if compat:
        return False, "kvikio runs in compatibility mode (no cuFile/GDS driver): POSIX I/O only"
    return True, f"kvikio {getattr(kvikio, '__version__', '?')} with cuFile on {why}"


def gds_choice(mode: GdsMode) -> dict[str, Any]:
    """What ``--gds`` resolves to here: {requested, used, reason}."""
    if mode == "off":
        return {"requested": mode, "used": False, "reason": "--gds off"}
    ok, why = probe_gds()
    return {"requested": mode, "used": ok, "reason": why}


class GdsFileTier(FileTier):
    """The file tier with its payload written and read by cuFile (kvikio.CuFile)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kv = _kvikio()

    def _put(self, fd: int, path: Path, views: list[memoryview], offset: int) -> None:
        if offset == 0:  # the header block goes by POSIX; the payload after it by cuFile
            os.pwrite(fd, views[0], 0)
            views, offset = views[1:], len(views[0])
        if not views:
            return
        with self._kv.CuFile(path, "r+") as f:
            futures = []
            for v in views:
                futures.append(f.pwrite(v, file_offset=offset))
                offset += len(v)
            for fut in futures:
                fut.get()

    def _get(self, fd: int, path: Path, views: list[memoryview], offset: int) -> int:
        got = 0
        if offset == 0:
            got = os.preadv(fd, views[:1], 0)
            views, offset = views[1:], len(views[0])
        if not views:
            return got
        with self._kv.CuFile(path, "r") as f:
            for v in views:
                got += int(f.pread(v, file_offset=offset).get())
                offset += len(v)
        return got


__all__ = ["GdsFileTier", "probe_gds", "gds_choice", "GdsMode"]
