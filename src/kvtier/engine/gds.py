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
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kvtier.engine.backend import ALIGN, aligned_buffer, check_cancel, round_up
from kvtier.engine.device import gpu_available, is_device, to_host
from kvtier.engine.file import SAMPLE_BYTES, FileTier, sample_crc
from kvtier.errors import StorageError
from kvtier.telemetry.clock import IOTiming

if TYPE_CHECKING:
    from kvtier.engine.device import DeviceMemory

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


def new_staging() -> Staging:
    """The staging the tier uses without ``--gpu-native``: device memory on CUDA device 0 (engine/device.py; a
    test puts a stand-in here where no device exists)."""
    from kvtier.engine.device import DeviceMemory

    return DeviceMemory("cuda:0")


class _Thread(threading.local):
    def __init__(self) -> None:
        self.buf: Any = None
        self.size = 0
        self.staging_ns = 0  # staging copies of the operation in progress: moved from device to host time
        self.file: Any = None  # the CuFile of the entry in progress (opened once per entry, not per chunk)
        self.path: str | None = None
        self.mode = ""
        self.registered = False
        self.sample: memoryview | None = None  # the payload's first bytes of a device chunk, for the header's crc


class GdsFileTier(FileTier):
    """The file tier with its payload moved between a per-thread device buffer and the file by cuFile."""

    takes_device = True  # TieredStore: a --gpu-native device chunk goes to cuFile as it is (no staging copy)

    def __init__(self, *args: Any, memory: DeviceMemory | None = None, native: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kv = _kvikio()
        self._staging: Staging = memory if memory is not None else new_staging()
        self.native = native  # --gpu-native: reads yield the device buffer cuFile filled (no copy to the host)
        self._tls = _Thread()
        self._open_lock = threading.Lock()
        self._open: list[_Thread] = []  # every thread's state, so close() can close their files
        self._monitor = self._kv.SummaryMonitor() if hasattr(self._kv, "SummaryMonitor") else None
        self._moved = {"staged_bytes": 0, "device_bytes": 0}
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
        staged = direct = 0
        for v in views:
            if is_device(v):  # --gpu-native: the KV is in device memory already
                f.pwrite(v, len(v), offset).get()
                direct += len(v)
            else:
                dev = self._device(len(v))
                self._staged(self._staging.to_device, dev, v)
                f.pwrite(dev, len(v), offset).get()
                staged += len(v)
            offset += len(v)
        with self._count_lock:
            self._moved["staged_bytes"] += staged
            self._moved["device_bytes"] += direct

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

    def _crc(self, first: Any, nbytes: int) -> int:
        if first is None or not is_device(first):
            return super()._crc(first, nbytes)
        head = self._header_sample()
        n = min(SAMPLE_BYTES, nbytes, len(first))
        to_host(head[:n], first[:n])
        return sample_crc(head[:n], nbytes)

    def _header_sample(self) -> memoryview:
        st = self._state()
        if st.sample is None:
            st.sample = aligned_buffer(SAMPLE_BYTES)
        return st.sample

    def export(
        self, key: str, buf: memoryview, timing: IOTiming, cancel: threading.Event | None = None
    ) -> Iterator[Any]:
        self._tls.staging_ns = 0
        try:
            chunks = (
                self._export_device(key, buf, timing, cancel)
                if self.native
                else super().export(key, buf, timing, cancel)
            )
            for chunk in chunks:
                self._restate(timing)
                yield chunk
        finally:
            self._restate(timing)

    def _export_device(
        self, key: str, buf: memoryview, timing: IOTiming, cancel: threading.Event | None
    ) -> Iterator[Any]:
        """--gpu-native: the header and the payload's first block (its checksum) by the usual path, then the
        payload by cuFile into this thread's device buffer, yielded as it is (the reader lands it on the device)."""
        t0 = time.perf_counter_ns()
        dev0 = timing.device_ns
        try:
            fd, nbytes, got = self._open_checked(key, timing, buf[:SAMPLE_BYTES])
        except OSError as e:
            raise StorageError(f"{self.name} tier: read of {key!r} failed: {e.strerror}") from e
        try:
            padded, step = round_up(nbytes), len(buf) - len(buf) % ALIGN
            name = self.name_for(key)
            yield buf[:got]
            off = got
            while off < padded:
                check_cancel(cancel, f"{self.name} read", off)
                n = min(step, padded - off)
                dev = self._device(n)
                f = self._cufile(name, "r")
                t = time.perf_counter_ns()
                r = int(f.pread(dev, n, ALIGN + off).get())
                timing.device_ns += time.perf_counter_ns() - t
                if r <= 0:
                    raise StorageError(f"{self.name} tier: short read of {key!r} at {off}")
                with self._count_lock:
                    self._moved["device_bytes"] += r
                off += r
                yield self._staging.slice(dev, r)
        except OSError as e:
            raise StorageError(f"{self.name} tier: read of {key!r} failed: {e.strerror}") from e
        finally:
            os.close(fd)
            timing.host_ns += time.perf_counter_ns() - t0 - (timing.device_ns - dev0)

    # -- what happened -------------------------------------------------------------------------
    def outcome(self) -> dict[str, Any]:
        """{used, evidence, reason, gds_bytes, posix_bytes, staged_bytes, device_bytes}: whether cuFile moved the
        payload, by kvikio's account. ``gds_bytes``/``posix_bytes`` are kvikio's per-backend totals (null without
        its statistics); ``staged_bytes`` the payload this tier copied through its staging buffers (host <->
        device, writes and reads), ``device_bytes`` what it moved between the file and device memory with no
        copy (--gpu-native: the writer's device chunks, and reads yielded as the device buffer cuFile filled)."""
        out: dict[str, Any] = {
            "staged_bytes": self._moved["staged_bytes"],
            "device_bytes": self._moved["device_bytes"],
            "gds_bytes": None,
            "posix_bytes": None,
        }
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
        elif not self._moved["staged_bytes"] and not self._moved["device_bytes"]:
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


__all__ = ["GdsFileTier", "probe_gds", "gds_choice", "GdsMode", "Staging", "new_staging"]
