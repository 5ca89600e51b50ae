"""S3 tier: entries as objects on any S3-compatible server (the ``s3`` extra: boto3).

An entry is one object ``<prefix>/<run>/<digest>``. Entries up to ``part_bytes`` go up in one
PUT; larger ones as a multipart upload of ``part_bytes`` parts (S3's minimum part is 5 MiB),
aborted when any part fails so no upload is left open. Reads are ranged GETs of the caller's
buffer size, each copied into the aligned buffer, so export yields chunks the next tier can write
with O_DIRECT and a read can be cancelled between ranges.

The client is one thread-safe boto3 client whose connection pool is sized to the I/O slots; every
worker thread runs its own requests on it. Request checksums are computed only where S3 requires
them (botocore's default CRC32 of every body would cost CPU the device never sees). Credentials
come from the standard AWS chain (environment, ~/.aws config, instance roles) — never argv.

Timing: device_ns is the time inside the HTTP calls (send, server work, receive); host_ns the
rest (joining chunks into a part, copying a range into the buffer).

Cleanup: only objects under this run's own prefix are ever deleted; the bucket is created when
missing and is never removed.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvtier.engine.backend import (
    MAX_TTL_S,
    OwnKeys,
    check_cancel,
    expected_size_problem,
    read_through_export,
    round_up,
    shared_digest,
)
from kvtier.errors import EntryNotFound, ForeignEntry, StorageError, TierFullError, TierUnavailable, UnsupportedError
from kvtier.telemetry.clock import IOTiming

MIN_PART_BYTES = 5 * 1024 * 1024

DEFAULT_PART_BYTES = 16 * 1024 * 1024


def _boto() -> tuple[Any, Any, Any]:
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError as e:
        raise UnsupportedError("the S3 tier needs boto3: pip install 'kvtier[s3]' (or pip install boto3)") from e
    return boto3, botocore.config, botocore.exceptions


class S3Tier:
    """KV entries as objects in one bucket, under a prefix of this run's own."""

    def __init__(
        self,
        endpoint: str | None,
        bucket: str,
        capacity_bytes: int,
        prefix: str = "kvtier",
        connections: int = 16,
        part_bytes: int = DEFAULT_PART_BYTES,
        name: str = "s3",
        timeout_s: float = 60.0,
        region: str | None = None,
        namespace: str | None = None,
        ttl_s: float = 3600.0,
        scope: str = "",
    ) -> None:
        """``namespace``: None for this run's own prefix (emptied by close()), or NAME of a shared one under
        PREFIX/shared/NAME/: objects carry their writer and expiry time as metadata, an object past its expiry
        reads as a miss (S3 has no per-object TTL; a bucket lifecycle rule or ``kvtier clean --remote`` removes
        it), other writers' objects are read (``read_shared``), and close() leaves the namespace. ``scope``: in a
        shared namespace, what besides the key names an entry's bytes (``KeyScope.tag()``), hashed into its name."""
        boto3, config, exc = _boto()
        self._exc = exc
        self.name = name
        self.bucket = bucket
        self.capacity_bytes = capacity_bytes
        self.part_bytes = round_up(max(part_bytes, MIN_PART_BYTES))
        run = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.writer = f"{socket.gethostname()}-{run}"
        self.namespace = namespace
        self.scope = scope if namespace else ""
        self.ttl_s = ttl_s
        self.prefix = f"{prefix.strip('/')}/{f'shared/{namespace}' if namespace else run}".lstrip("/")
        cfg = config.Config(
            max_pool_connections=max(1, connections),
            connect_timeout=min(timeout_s, 10.0),
            read_timeout=timeout_s,
            retries={"max_attempts": 2, "mode": "standard"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"} if endpoint else {},
        )
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        session = boto3.session.Session()
        if session.get_credentials() is None:
            raise StorageError(
                f"{self.name} tier: no AWS credentials found (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE or ~/.aws/credentials)"
            )
        self._client = session.client("s3", endpoint_url=endpoint or None, region_name=region, config=cfg)
        self._index: dict[str, int] = {}  # key -> object size
        self._lock = threading.Lock()
        self.cleanup_problems: list[str] = []
        self._own = OwnKeys(self.prefix + "/")  # listings filtered to what is really ours
        created = False
        try:
            try:
                self._client.head_bucket(Bucket=bucket)
            except exc.ClientError as e:
                if _code(e) not in ("404", "NoSuchBucket", "NotFound"):
                    raise
                try:
                    self._client.create_bucket(Bucket=bucket)
                    created = True
                except exc.ClientError as e2:  # another writer (a replica starting beside this one) made it first
                    if _code(e2) != "BucketAlreadyOwnedByYou":
                        raise
        except Exception as e:
            raise self._fail(f"bucket {bucket!r} at {endpoint or 'AWS'}", e) from e
        self.server = {
            "endpoint": endpoint or "aws",
            "bucket": bucket,
            "bucket_created": created,
            "key_prefix": self.prefix,
            "part_bytes": self.part_bytes,
            "connections": max(1, connections),
            "region": region,
            "namespace": f"shared:{namespace}" if namespace else "run",
            "ttl_s": ttl_s if namespace else None,
            "scope": self.scope or None,
            "writer": self.writer,
        }

    def _object(self, key: str) -> str:
        return f"{self.prefix}/{shared_digest(self.scope, key)}"

    def _fail(self, what: str, e: BaseException) -> StorageError:
        exc = self._exc
        if isinstance(e, StorageError):
            return e
        unreachable = (
            exc.EndpointConnectionError,
            exc.ConnectionClosedError,
            exc.ReadTimeoutError,
            exc.ConnectTimeoutError,
            ConnectionError,
        )
        if isinstance(e, unreachable):
            return TierUnavailable(f"{self.name} tier: {what}: server unreachable ({e})")
        if isinstance(e, exc.ClientError):
            code = _code(e)
            if code in ("NoSuchKey", "404"):
                return EntryNotFound(f"{self.name} tier: {what}: no such object")
            if code in ("EntityTooLarge", "QuotaExceeded", "InsufficientStorage", "507"):
                return TierFullError(f"{self.name} tier: {what}: {e}")
        return StorageError(f"{self.name} tier: {what}: {e}")

    def stored_size(self, nbytes: int) -> int:
        return round_up(nbytes)

    # -- Backend ---------------------------------------------------------------------------
    def _parts(self, chunks: Iterable[memoryview]) -> Iterator[bytearray]:
        """The entry as bodies of at most part_bytes, copied out of the chunks as they come (a chunk
        may be a view of a reused buffer, overwritten by the next one)."""
        part = bytearray()
        for c in chunks:
            pos = 0
            while pos < len(c):
                take = min(len(c) - pos, self.part_bytes - len(part))
                part += c[pos : pos + take]
                pos += take
                if len(part) == self.part_bytes:
                    yield part
                    part = bytearray()
        if part:
            yield part

    def write(self, key: str, chunks: Iterable[memoryview], nbytes: int) -> IOTiming:
        t0 = time.perf_counter_ns()
        obj = self._object(key)
        device = total = 0
        upload: str | None = None
        try:
            parts = self._parts(chunks)
            first = next(parts, bytearray())
            second = next(parts, None)
            meta = self._metadata()
            if second is None:  # one part: a plain PUT
                t = time.perf_counter_ns()
                self._client.put_object(Bucket=self.bucket, Key=obj, Body=first, **meta)
                device += time.perf_counter_ns() - t
                total = len(first)
            else:
                t = time.perf_counter_ns()
                upload = self._client.create_multipart_upload(Bucket=self.bucket, Key=obj, **meta)["UploadId"]
                device += time.perf_counter_ns() - t
                done: list[dict[str, Any]] = []
                for number, body in enumerate(itertools.chain((first, second), parts), 1):
                    t = time.perf_counter_ns()
                    r = self._client.upload_part(
                        Bucket=self.bucket, Key=obj, UploadId=upload, PartNumber=number, Body=body
                    )
                    device += time.perf_counter_ns() - t
                    done.append({"ETag": r["ETag"], "PartNumber": number})
                    total += len(body)
                t = time.perf_counter_ns()
                self._client.complete_multipart_upload(
                    Bucket=self.bucket, Key=obj, UploadId=upload, MultipartUpload={"Parts": done}
                )
                device += time.perf_counter_ns() - t
                upload = None
        except BaseException as e:
            if upload is not None:
                try:
                    self._client.abort_multipart_upload(Bucket=self.bucket, Key=obj, UploadId=upload)
                except Exception:  # noqa: BLE001 - close() aborts every open upload under the prefix again
                    pass
            if isinstance(e, StorageError) or not isinstance(e, Exception):
                raise
            raise self._fail(f"write of {key!r}", e) from e
        with self._lock:
            self._index[key] = total
        return IOTiming(host_ns=time.perf_counter_ns() - t0 - device, device_ns=device)

    def _metadata(self) -> dict[str, Any]:
        """put_object's Metadata in a shared namespace: who wrote it and when it expires (Unix seconds)."""
        if not self.namespace:
            return {}
        return {"Metadata": {"kvtier-writer": self.writer, "kvtier-expires": f"{time.time() + self.ttl_s:.3f}"}}

    def present(self, keys: Sequence[str]) -> list[bool | None]:
        """In a shared namespace, whether each entry is there and not past its expiry (a HEAD each, in order,
        stopping at the first absent one: a prefix is used up to its first miss); the hint a scheduler asks
        before it plans a load (the load checks the object itself, ``read_shared``). Outside a shared namespace:
        all False. StorageError when the server fails."""
        out: list[bool | None] = [False] * len(keys)
        if not self.namespace:
            return out
        for i, key in enumerate(keys):
            try:
                head = self._client.head_object(Bucket=self.bucket, Key=self._object(key))
            except self._exc.ClientError as e:
                if _code(e) in ("404", "NoSuchKey", "NotFound"):
                    break
                raise self._fail(f"lookup of {key!r}", e) from e
            except Exception as e:
                raise self._fail(f"lookup of {key!r}", e) from e
            expires = _number((head.get("Metadata") or {}).get("kvtier-expires"))
            if expires is None or expires < time.time():
                break
            out[i] = True
        return out

    def read_shared(
        self, key: str, buf: memoryview, expect: int, cancel: threading.Event | None = None
    ) -> tuple[int, IOTiming, bool] | None:
        """In a shared namespace, an object this run does not hold but some writer put there: read it through
        ``buf``; (bytes, timing, whether another writer wrote it), or None when there is none or it expired.

        The writer is believed in nothing before its HEAD is checked: the object's size must be the
        ``expect``-byte entry's and its expiry a finite time within MAX_TTL_S from now; otherwise ForeignEntry
        (a miss by cause, never a hit) and no byte of it is read."""
        if not self.namespace:
            return None
        t0 = time.perf_counter_ns()
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self._object(key))
        except self._exc.ClientError as e:
            if _code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._fail(f"lookup of {key!r}", e) from e
        except Exception as e:
            raise self._fail(f"lookup of {key!r}", e) from e
        meta = head.get("Metadata") or {}
        now = time.time()
        expires = _number(meta.get("kvtier-expires"))
        if expires is None or not expires <= now + MAX_TTL_S:  # nan, inf, 1e308, text, or none at all
            raise ForeignEntry(
                f"{self.name} tier: {key!r}: expiry {str(meta.get('kvtier-expires'))[:40]!r} is not a time within "
                f"{MAX_TTL_S:.0f} s"
            )
        if expires < now:
            return None  # past its TTL: a miss (the object stays until a lifecycle rule or kvtier clean --remote)
        length = _number(head.get("ContentLength"))
        size_b = int(length) if length is not None else -1
        problem = expected_size_problem(size_b, 1, expect)
        if problem is not None:
            raise ForeignEntry(f"{self.name} tier: {key!r}: {problem}")
        timing = IOTiming(device_ns=time.perf_counter_ns() - t0)
        for _ in self._export_object(key, size_b, buf, timing, cancel):
            pass
        timing.host_ns = time.perf_counter_ns() - t0 - timing.device_ns
        return size_b, timing, meta.get("kvtier-writer") != self.writer

    def export(
        self, key: str, buf: memoryview, timing: IOTiming, cancel: threading.Event | None = None
    ) -> Iterator[memoryview]:
        with self._lock:
            size = self._index.get(key)
        if size is None:
            raise EntryNotFound(f"{self.name} tier: {key!r} not stored")
        return self._export_object(key, size, buf, timing, cancel)

    def _export_object(
        self, key: str, size: int, buf: memoryview, timing: IOTiming, cancel: threading.Event | None
    ) -> Iterator[memoryview]:
        obj = self._object(key)
        step = len(buf)
        off = 0
        while off < size:
            check_cancel(cancel, f"{self.name} read", off)
            t0 = time.perf_counter_ns()
            n = min(step, size - off)
            try:
                args: dict[str, Any] = {"Bucket": self.bucket, "Key": obj}
                if n < size:
                    args["Range"] = f"bytes={off}-{off + n - 1}"
                body = self._client.get_object(**args)["Body"]
                got = _read_into(body, buf[:n])
            except StorageError:
                raise
            except Exception as e:
                raise self._fail(f"read of {key!r}", e) from e
            timing.device_ns += time.perf_counter_ns() - t0
            if got != n:
                raise StorageError(f"{self.name} tier: {key!r}: got {got} bytes at {off}, expected {n}")
            off += n
            yield buf[:n]

    def read(self, key: str, buf: memoryview, cancel: threading.Event | None = None) -> IOTiming:
        return read_through_export(self.export, key, buf, cancel)

    def delete(self, key: str) -> None:
        """This run no longer holds the object: removed in its own prefix; in a shared namespace left to its
        expiry (another writer may have written it since, or another reader want it)."""
        with self._lock:
            had = self._index.pop(key, None)
        if had is None or self.namespace:
            return
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._object(key))
        except Exception:  # noqa: BLE001 - the object stays until close() sweeps the prefix (which says
            pass  # what it could not remove): noting each failure here would grow without bound

    def listing(self) -> dict[str, int]:
        """Every object under this run's prefix and its size. The server's answer is not trusted: an object
        outside the prefix (an endpoint that ignores Prefix) is left out and counted (engine.backend.OwnKeys)."""
        out: dict[str, int] = {}
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + "/")
        for page in pages:
            objs = {o["Key"]: int(o["Size"]) for o in page.get("Contents", []) if isinstance(o.get("Key"), str)}
            out.update({k: objs[k] for k in self._own.keep(objs)})
        return out

    def stored_bytes(self) -> int:
        """The sizes of our objects summed from a bucket listing under the run's prefix."""
        try:
            return sum(self.listing().values())
        except Exception as e:
            raise self._fail("listing", e) from e

    def close(self) -> None:
        """Delete every object (and abort every open multipart upload) under this run's prefix; a shared
        namespace is left as it is (a failed write already aborted its own upload; other writers' uploads are
        theirs). A server that cannot be reached is noted in ``cleanup_problems``. Nothing raises."""
        with self._lock:
            self._index.clear()
        if not self.namespace:
            self.purge()

    def purge_preview(self) -> list[str]:
        """What ``purge`` would delete (``kvtier clean --remote --dry-run``)."""
        return list(self.listing())

    def purge(self) -> int:
        """Delete every object under this tier's prefix (the run's own, or a whole shared namespace: ``kvtier
        clean --remote``) and abort its open multipart uploads, ours only whatever the server lists; the
        objects deleted. Problems go to ``cleanup_problems``; nothing raises."""
        keys: list[str] = []
        try:
            keys = list(self.listing())
            for i in range(0, len(keys), 1000):
                self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
                )
            uploads = self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix + "/")
            for u in uploads.get("Uploads", []):
                if str(u.get("Key", "")).startswith(self.prefix + "/"):  # ours only, whatever the server listed
                    self._client.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
        except Exception as e:  # noqa: BLE001 - noted
            self.cleanup_problems.append(f"s3://{self.bucket}/{self.prefix}/: objects not removed ({e})")
            keys = []
        problem = self._own.problem(f"s3://{self.bucket}/", "a listing with Prefix", "Prefix")
        if problem:
            self.cleanup_problems.append(problem)
        return len(keys)


def _read_into(body: Any, view: memoryview) -> int:
    """Receive a response body straight into ``view`` (urllib3's readinto under botocore's streaming
    body: no bytes object, no copy); the bytes received. Falls back to read() and one copy where
    the stream has no readinto."""
    raw = getattr(body, "_raw_stream", None)
    if raw is None or not hasattr(raw, "readinto"):
        data = body.read()
        if len(data) > len(view):
            raise StorageError(f"a body of {len(data)} bytes for a {len(view)}-byte range")
        view[: len(data)] = data
        return len(data)
    got = 0
    while got < len(view):
        r = raw.readinto(view[got:])
        if not r:
            break
        got += r
    return got  # a short body is the caller's error; urllib3 enforces Content-Length


def _number(v: object) -> float | None:
    """A finite number from a server's header or metadata, or None (text, nan, inf, none)."""
    try:
        x = float(str(v)[:64]) if v is not None else math.nan
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def _code(e: Any) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


__all__ = ["S3Tier", "MIN_PART_BYTES"]
