"""GPUDirect Storage for the file tier, through kvikio (the ``gds`` extra), when a CUDA device and
cuFile exist.

GPUDirect moves bytes between *device* memory and the drive. kvikio given a host buffer takes its POSIX
path, so handing it the file tier's host buffers would be ordinary I/O reported as GDS. Here the payload
goes through a per-thread CUDA staging buffer instead: a write copies each chunk host -> device and
``kvikio.CuFile.pwrite`` writes it from device memory; a read has cuFile fill the device buffer and copies
it back into the caller's host buffer. The staging copies are the price of kvtier's payload being made on
the host (in an inference server the KV already lives on the device); they are timed apart and counted as
host time, so ``device_ns`` stays the cuFile calls. The file layout (one header block, then the aligned
payload) and the header checks are the file tier's; the 4 KiB header moves by POSIX.

Whether cuFile really carried the bytes is kvikio's to say, not ours: ``GdsFileTier.outcome()`` reads
kvikio's I/O statistics (``kvikio.SummaryMonitor``, kvikio >= 26.04: bytes per backend, ``Gds`` or
``Posix``) and says ``used: true`` only when the Gds backend moved the payload. A kvikio without statistics
is asked for its compatibility mode instead, and the result says which evidence it rests on.

``--gds auto`` uses this tier where ``probe_gds`` finds kvikio, a CUDA device and cuFile out of
compatibility mode, else the O_DIRECT path; ``on`` refuses to run without it; ``off`` never uses it. The
choice, the evidence and the bytes per path are recorded in the result (``storage.gds``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal, Protocol

from kvtier.engine.file import FileTier
from kvtier.engine.gpu import gpu_available
from kvtier.telemetry.clock import IOTiming

GdsMode = Literal["auto", "on", "off"]


def _kvikio() -> Any:
    import kvikio

    return kvikio


def _compat_mode(kvikio: Any) -> bool:
    """kvikio's own answer to "will you use POSIX instead of cuFile?" (its API moved between versions)."""
    defaults = kvikio.defaults
    if hasattr(defaults, "is_compat_mode_preferred"):  # kvikio >= 25: AUTO resolved against cuFile's presence
        return bool(defaults.is_compat_mode_preferred())
    if hasattr(defaults, "compat_mode"):  # older kvikio: a bool
        return bool(defaults.compat_mode())
    return str(defaults.get("compat_mode")).upper().endswith("ON")


def probe_gds() -> tuple[bool, str]:
    """(True, what) when the file tier can move its payload through cuFile, else (False, why)."""
    try:
        kvikio = _kvikio()
    except ImportError:
        return False, "kvikio is not installed (pip install 'kvtier[gds]')"
    ok, why = gpu_available()
    if not ok:
        return False, why
    if _compat_mode(kvikio):
        return False, "kvikio runs in compatibility mode (no cuFile/GDS driver): POSIX I/O only"
    return True, f"kvikio {getattr(kvikio, '__version__', '?')} with cuFile on {why}"


def gds_choice(mode: GdsMode) -> dict[str, Any]:
    """What ``--gds`` resolves to here: {requested, used, reason} (``used`` as the probe sees it; the run's
    own evidence replaces it at the end, ``GdsFileTier.outcome``)."""
    if mode == "off":
        return {"requested": mode, "used": False, "reason": "--gds off"}
    ok, why = probe_gds()
    return {"requested": mode, "used": ok, "reason": why}


class Staging(Protocol):
    """Device memory for one thread's transfers: ``buffer(n)`` gives a device buffer of at least n bytes
    (kept and reused), ``slice(buf, n)`` its first n bytes; the copies are synchronous."""

    def buffer(self, nbytes: int) -> Any: ...

    def slice(self, buf: Any, nbytes: int) -> Any: ...

    def to_device(self, dst: Any, src: memoryview) -> None: ...

    def to_host(self, dst: memoryview, src: Any) -> None: ...


class TorchStaging:
    """Staging buffers as torch CUDA tensors (uint8); kvikio reads them through ``__cuda_array_interface__``."""

    def __init__(self, device: int = 0) -> None:
        import torch

        self._torch = torch
        self._device = torch.device("cuda", device)

    def buffer(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self._device)

    def slice(self, buf: Any, nbytes: int) -> Any:
        return buf[:nbytes]

    def to_device(self, dst: Any, src: memoryview) -> None:
        dst.copy_(self._torch.frombuffer(src, dtype=self._torch.uint8))
        self._torch.cuda.synchronize(self._device)

    def to_host(self, dst: memoryview, src: Any) -> None:
        self._torch.frombuffer(dst, dtype=self._torch.uint8).copy_(src)
        self._torch.cuda.synchronize(self._device)


def new_staging() -> Staging:
    """The staging the tier uses (a test puts a stand-in here where no device exists)."""
    return TorchStaging()


class _Thread(threading.local):
    def __init__(self) -> None:
        self.buf: Any = None
        self.size = 0
        self.staging_ns = 0  # staging copies of the operation in progress: moved from device to host time
        self.file: Any = None  # the CuFile of the entry in progress (opened once per entry, not per chunk)
        self.path: str | None = None
        self.mode = ""
        self.registered = False


class GdsFileTier(FileTier):
    """The file tier with its payload moved between a per-thread device buffer and the file by cuFile."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kv = _kvikio()
        self._staging = new_staging()
        self._tls = _Thread()
        self._open_lock = threading.Lock()
        self._open: list[_Thread] = []  # every thread's state, so close() can close their files
        self._monitor = self._kv.SummaryMonitor() if hasattr(self._kv, "SummaryMonitor") else None
        self._moved = {"gds_bytes": 0, "posix_bytes": 0, "staged_bytes": 0}
        self._count_lock = threading.Lock()

    # -- per-thread state ---------------------------------------------------------------------
    def _state(self) -> _Thread:
        st = self._tls
        if not st.registered:
            with self._open_lock:
                self._open.append(st)
            st.registered = True
        return st

    def _device(self, nbytes: int) -> Any:
        st = self._state()
        if st.buf is None or st.size < nbytes:
            st.buf = self._staging.buffer(nbytes)
            st.size = nbytes
        return self._staging.slice(st.buf, nbytes)

    def _cufile(self, name: str, mode: str) -> Any:
        path = self.pinned_path(name)  # through the run folder's descriptor, as every other open of the tier
        st = self._state()
        if st.path != path or st.mode != mode:
            self._drop_file(st)
            st.file, st.path, st.mode = self._kv.CuFile(path, mode), path, mode
        return st.file

    @staticmethod
    def _drop_file(st: _Thread) -> None:
        if st.file is not None:
            st.file.close()
        st.file, st.path, st.mode = None, None, ""

    def _staged(self, fn: Any, *args: Any) -> None:
        t = time.perf_counter_ns()
        fn(*args)
        self._tls.staging_ns += time.perf_counter_ns() - t

    # -- the two calls that move bytes ---------------------------------------------------------
    def _put(self, fd: int, name: str, views: list[memoryview], offset: int) -> None:
        if offset == 0:  # the header block goes by POSIX; the payload after it by cuFile
            os.pwrite(fd, views[0], 0)
            views, offset = views[1:], len(views[0])
            self._drop_file(self._state())  # a new file under this path: never a handle to the old one
        if not views:
            return
        f = self._cufile(name, "r+")
        staged = 0
        for v in views:
            dev = self._device(len(v))
            self._staged(self._staging.to_device, dev, v)
            f.pwrite(dev, len(v), offset).get()
            offset += len(v)
            staged += len(v)
        with self._count_lock:
            self._moved["staged_bytes"] += staged

    def _get(self, fd: int, name: str, views: list[memoryview], offset: int) -> int:
        got = 0
        if offset == 0:
            got = os.preadv(fd, views[:1], 0)
            views, offset = views[1:], len(views[0])
            self._drop_file(self._state())
        if not views:
            return got
        f = self._cufile(name, "r")
        header = got
        for v in views:
            dev = self._device(len(v))
            n = int(f.pread(dev, len(v), offset).get())
            self._staged(self._staging.to_host, v[:n], self._staging.slice(dev, n))
            got += n
            offset += n
            if n < len(v):
                break
        with self._count_lock:
            self._moved["staged_bytes"] += got - header
        return got

    # -- timing: the staging copies are host time, not the device's ----------------------------
    def _restate(self, timing: IOTiming) -> None:
        st = self._tls
        timing.device_ns -= st.staging_ns
        timing.host_ns += st.staging_ns
        st.staging_ns = 0

    def write(self, key: str, chunks: Any, nbytes: int) -> IOTiming:
        self._tls.staging_ns = 0
        timing = super().write(key, chunks, nbytes)
        self._restate(timing)
        return timing

    def export(
        self, key: str, buf: memoryview, timing: IOTiming, cancel: threading.Event | None = None
    ) -> Iterator[memoryview]:
        self._tls.staging_ns = 0
        try:
            for chunk in super().export(key, buf, timing, cancel):
                self._restate(timing)
                yield chunk
        finally:
            self._restate(timing)

    # -- what happened -------------------------------------------------------------------------
    def outcome(self) -> dict[str, Any]:
        """{used, evidence, reason, gds_bytes, posix_bytes, staged_bytes}: whether cuFile moved the payload,
        by kvikio's account. ``gds_bytes``/``posix_bytes`` are kvikio's per-backend totals (null without its
        statistics); ``staged_bytes`` the payload this tier moved through its device buffers (writes and reads)."""
        out: dict[str, Any] = {"staged_bytes": self._moved["staged_bytes"], "gds_bytes": None, "posix_bytes": None}
        if self._monitor is not None:
            by = self._monitor.get().by_backend
            gds = sum(int(v["bytes_transferred"]) for k, v in by.items() if k.lower() in ("gds", "cufile"))
            posix = sum(int(v["bytes_transferred"]) for k, v in by.items() if k.lower() == "posix")
            out.update(evidence="kvikio statistics", gds_bytes=gds, posix_bytes=posix)
            if gds and not posix:
                out.update(used=True, reason=f"kvikio: its cuFile (Gds) backend moved all {gds} payload bytes")
            elif gds:
                out.update(used=False, reason=f"kvikio: cuFile moved {gds} bytes but POSIX moved {posix}")
            elif posix:
                out.update(used=False, reason=f"kvikio: its POSIX backend moved all {posix} bytes (compatibility mode)")
            else:
                out.update(used=False, reason="no payload moved through kvikio")
            return out
        compat = _compat_mode(self._kv)
        out["evidence"] = "kvikio compatibility mode (this kvikio keeps no per-operation statistics)"
        if compat:
            out.update(used=False, reason="kvikio runs in compatibility mode: POSIX I/O through a bounce buffer")
        elif not self._moved["staged_bytes"]:
            out.update(used=False, reason="no payload moved through kvikio")
        else:
            out.update(used=True, reason="device buffers through kvikio with its compatibility mode off")
        return out

    def close(self) -> None:
        with self._open_lock:
            states, self._open = self._open, []
        for st in states:
            self._drop_file(st)
            st.buf = None
        super().close()


__all__ = ["GdsFileTier", "probe_gds", "gds_choice", "GdsMode", "Staging", "TorchStaging", "new_staging"]
