"""The engine's request log read back (kvtier/vllm/reqlog.py writes it inside vLLM): the one reader of that file
kind, for ``kvtier replay --engine-log`` and ``kvtier launch``, which join it to the replay's requests
(kvtier/replay/engine_join.py).

A file holds one segment per engine start: a header, the request lines, and a footer when the engine shut down
cleanly (its counts of records written and dropped by cause). Every line is validated; a line that is not the
schema's is an error naming file:line, except a last line without its newline (the engine is still writing it),
which is left for the next read. Lines are read bounded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier.errors import DatasetError

MAX_LINE_BYTES = 1024 * 1024
"""The longest line of an engine request log a reader takes (a record is ~1 KB)."""

ENGINE_ID = re.compile(r"chatcmpl-(?P<chat>.+)-[0-9a-f]{8}|cmpl-(?P<cmpl>.+)-\d+-[0-9a-f]{8}|(?P<other>.+)-[0-9a-f]{8}")
"""vLLM's OpenAI server makes a request's engine id from the X-Request-Id it was sent: the API's prefix, the id (and,
for /v1/completions, the prompt's index), then 8 random hex digits (vLLM 0.32 ``InputProcessor.assign_request_id``)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class EngineLoad(_Strict):
    jobs: int = Field(ge=0)  # load jobs the scheduler made for the request
    blocks: dict[str, int]  # block shards loaded, by tier (summed over the engine's workers)
    bytes: dict[str, int]
    io_s: dict[str, float]  # the tiers' own read time, summed over the blocks
    failed_blocks: int = Field(ge=0)


class EngineStores(_Strict):
    blocks: dict[str, int]  # blocks whose store the request started, by the tier the index placed them in
    bytes: dict[str, int]


class EngineStamps(_Strict):
    """time.monotonic() seconds in the engine (the host's CLOCK_MONOTONIC); null where the request never got there."""

    arrived: float
    lookup: float | None
    admitted: float | None
    loaded: float | None
    prefill: float | None
    first_token: float | None
    load_submitted: float | None
    load_done: float | None


class EngineRequest(_Strict):
    """One request as vLLM's scheduler saw it, with kvtier's offload tiers (docs/metrics.md "engine request log")."""

    kind: Literal["request"]
    id: str = Field(max_length=512)
    status: str
    prompt_tokens: int = Field(ge=0)
    tokens: dict[str, int]  # gpu, each tier, recomputed: sums to prompt_tokens
    external_tokens: int = Field(ge=0)  # what vLLM's external_prefix_cache_hits counted for it
    failed_tokens: int = Field(ge=0)  # of those, tokens whose blocks failed to load (recomputed)
    preemptions: int = Field(ge=0)
    preempted_before_first_token: bool
    load: EngineLoad
    stores: EngineStores
    mono_s: EngineStamps
    arrival_unix_s: float | None  # vLLM's own arrival stamp (its API server, wall clock)
    wall_minus_mono_s: float

    @property
    def external_id(self) -> str | None:
        """The X-Request-Id the client sent, from the engine's id (None: not one of that form)."""
        m = ENGINE_ID.fullmatch(self.id)
        return (m.group("chat") or m.group("cmpl") or m.group("other")) if m else None

    @property
    def tier_tokens(self) -> dict[str, int]:
        """The prompt tokens each offload tier served (failed loads already moved to recomputed)."""
        return {k: v for k, v in self.tokens.items() if k not in ("gpu", "recomputed")}


class EngineTier(_Strict):
    name: str
    source: str


class EngineHeader(_Strict):
    kind: Literal["header"]
    schema_: str = Field(alias="schema")
    engine: str
    block_tokens: int
    block_bytes: int
    world_size: int
    tiers: list[EngineTier]
    cache_server: str | None
    cap_bytes: int
    pid: int
    wall_minus_mono_s: float


class EngineFooter(_Strict):
    kind: Literal["footer"]
    records: int
    dropped: dict[str, int]
    in_flight_at_close: int


@dataclass
class EngineLog:
    """Every segment of one or more log files: the headers, the requests, and the footers of the clean shutdowns."""

    paths: list[str] = field(default_factory=list)
    headers: list[EngineHeader] = field(default_factory=list)
    requests: list[EngineRequest] = field(default_factory=list)
    footers: list[EngineFooter] = field(default_factory=list)
    partial_lines: int = 0  # a last line still being written

    @property
    def dropped(self) -> dict[str, int]:
        """Records the engines dropped, by cause, as their footers say."""
        out: dict[str, int] = {}
        for f in self.footers:
            for k, n in f.dropped.items():
                out[k] = out.get(k, 0) + n
        return out


class EngineLogTail:
    """Engine request logs read as they grow: each ``poll`` adds the complete lines written since the last to ``log``
    (validated; file:line in every error), the requests by the id the client sent to ``by_id``, and each tier's
    by-source label to ``sources``. A last line without its newline is the engine's still being written: read next
    time. The one reader of the file kind: ``read_engine_log`` is a single poll."""

    def __init__(self, paths: list[str] | list[Path]) -> None:
        self.paths = [Path(p) for p in paths]
        self.log = EngineLog(paths=[str(p) for p in paths])
        self.by_id: dict[str, EngineRequest] = {}
        self.sources: dict[str, str] = {}  # a tier's name -> the by-source label vLLM's counters give its hits
        self._at = [0] * len(self.paths)
        self._lines = [0] * len(self.paths)

    def poll(self) -> EngineLog:
        log = self.log
        log.partial_lines = 0
        before = (len(log.headers), len(log.requests))
        for i, path in enumerate(self.paths):
            try:
                with path.open("rb") as f:
                    f.seek(self._at[i])
                    while raw := f.readline(MAX_LINE_BYTES + 1):
                        n = self._lines[i] + 1
                        if len(raw) > MAX_LINE_BYTES:
                            raise DatasetError(f"{path}:{n}: a line longer than {MAX_LINE_BYTES} bytes")
                        if not raw.endswith(b"\n"):
                            log.partial_lines += 1
                            break
                        self._at[i] += len(raw)
                        self._lines[i] = n
                        if raw.strip():
                            _add(log, path, n, raw)
            except OSError as e:
                raise DatasetError(f"{path}: cannot read the engine request log: {e.strerror}") from e
        for h in log.headers[before[0] :]:
            self.sources.update((t.name, t.source) for t in h.tiers)
        for r in log.requests[before[1] :]:
            if (ext := r.external_id) is not None:
                self.by_id[ext] = r
        return log


_KINDS: dict[str, type[BaseModel]] = {"header": EngineHeader, "request": EngineRequest, "footer": EngineFooter}


def read_engine_log(paths: list[str] | list[Path]) -> EngineLog:
    """The records of the engine request logs ``paths``, validated (module docstring)."""
    return EngineLogTail(paths).poll()


def check_engine_logs(paths: list[str]) -> None:
    """``--engine-log`` before a run: the engine writes its log from its start, so one missing now is a wrong path."""
    from kvtier.errors import ConfigError

    for path in paths:
        if not Path(path).is_file():
            raise ConfigError(f"--engine-log: {path}: not a file (an engine started with request_log writes it)")


def _add(out: EngineLog, path: Path, n: int, raw: bytes) -> None:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DatasetError(f"{path}:{n}: not valid JSON") from None
    kind = obj.get("kind") if isinstance(obj, dict) else None
    model = _KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise DatasetError(f"{path}:{n}: not an engine request log line (kind header, request or footer)")
    try:
        rec = model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise DatasetError(f"{path}:{n}: {where}: {err['msg']}") from None
    if isinstance(rec, EngineHeader):
        out.headers.append(rec)
    elif isinstance(rec, EngineRequest):
        if sum(rec.tokens.values()) != rec.prompt_tokens or any(v < 0 for v in rec.tokens.values()):
            raise DatasetError(f"{path}:{n}: tokens {rec.tokens} do not sum to prompt_tokens {rec.prompt_tokens}")
        out.requests.append(rec)
    else:
        assert isinstance(rec, EngineFooter)
        out.footers.append(rec)


__all__ = [
    "EngineLogTail",
    "EngineLog",
    "EngineRequest",
    "EngineHeader",
    "EngineFooter",
    "read_engine_log",
    "check_engine_logs",
    "ENGINE_ID",
]
