"""requests.jsonl read back: the one reader of a replay's per-request records, for plan, report and views alike.

``read_records`` returns every line as a validated ``RequestRecord`` (the model of the ``ReplayRecord`` the client
writes; every key checked, a key an older file lacks read as null), with its line number for messages naming
file:line. ``ReplayRecords.read`` is the report's columns (turn, ok, TTFT, TPOT, start): its fast path finds the
six fields it needs in a line without parsing the inter-token gaps (most of a line), and validates any line it does
not read that way as ``read_records`` does."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier.errors import DatasetError
from kvtier.results.replay import decomposition_problem, tpot_s

MAX_TURN = 1 << 31
"""The largest turn number a requests.jsonl line may carry (a session of two billion turns)."""
MAX_RECORD_BYTES = 16 * 1024 * 1024
"""The longest line of a requests.jsonl a tool reads (a record of 100k generated tokens is ~2 MB)."""


class EngineFacts(BaseModel):
    """What the engine's own record adds to a request it was joined to (kvtier/replay/engine_join.py)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    id: str  # the engine's request id
    load_wall_s: float | None = Field(None, ge=0)  # the workers' first load submitted to the last done
    load_io_s: dict[str, float] = Field(default_factory=dict)  # the tiers' own read time, by tier
    load_bytes: dict[str, int] = Field(default_factory=dict)
    failed_tokens: int = Field(0, ge=0)  # tokens whose load failed (recomputed)
    stored_bytes: dict[str, int] = Field(default_factory=dict)  # stores started for the request, by tier
    preemptions: int = Field(0, ge=0)


class RequestRecord(BaseModel):
    """One line of requests.jsonl (docs/metrics.md "requests.jsonl"), read back."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    status: Literal["ok", "error", "timeout", "cut"]
    user: str = ""
    session: str = ""
    turn: int = Field(0, ge=0, le=MAX_TURN)
    session_turn: int = 0
    max_tokens: int = 0
    cause: str | None = None
    error: str | None = None
    http_status: int | None = None
    replica: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = Field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int | None = Field(None, ge=0)
    completion_tokens: int | None = Field(None, ge=0)
    cached_tokens: int | None = Field(None, ge=0)
    start_unix_s: float | None = None
    prompt_sources: dict[str, int] | None = None
    server_ttft_parts: dict[str, float] | None = None
    server_ttft_s: float | None = None
    first_event_s: float | None = None
    transit_s: dict[str, float] | None = None
    decomposition_dropped: str | None = None
    sim_timing: str | None = None
    rank: int | None = None
    request_id: str | None = None
    start_mono_s: float | None = None
    decomposition: Literal["measured-in-engine"] | None = None
    engine: EngineFacts | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _record(path: Path, n: int, raw: dict[str, Any]) -> RequestRecord:
    """A parsed line validated: the TTFT decomposition by its one schema first (results/replay.py), then the types."""
    parts = (raw.get("prompt_sources"), raw.get("server_ttft_parts"), raw.get("server_ttft_s"))
    if any(p is not None for p in parts) and (problem := decomposition_problem(*parts)) is not None:
        raise DatasetError(
            f"{path}:{n}: the TTFT decomposition (prompt_sources, server_ttft_parts, server_ttft_s): {problem}"
        )
    try:
        return RequestRecord.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        if where == "turn":
            turn = str(raw.get("turn"))[:40]
            raise DatasetError(f"{path}:{n}: turn {turn} is not a turn number (0..{MAX_TURN})") from None
        raise DatasetError(f"{path}:{n}: {where}: {msg}") from None


def _parse(path: Path, n: int, text: str | bytes) -> dict[str, Any]:
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}:{n}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(raw, dict):
        raise DatasetError(f"{path}:{n}: not a JSON object")
    return raw


def read_records(path: Path) -> list[tuple[int, RequestRecord]]:
    """Every record of a requests.jsonl with its line number, validated; a line that is not a record is a
    DatasetError naming file:line. Lines are read bounded (MAX_RECORD_BYTES)."""
    out = []
    try:
        with path.open("rb") as f:
            for n, raw in enumerate(iter(lambda: f.readline(MAX_RECORD_BYTES + 1), b""), start=1):
                if len(raw) > MAX_RECORD_BYTES:
                    raise DatasetError(f"{path}:{n}: a record longer than {MAX_RECORD_BYTES} bytes")
                if raw.strip():
                    out.append((n, _record(path, n, _parse(path, n, raw))))
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror}") from e
    return out


_FIELDS = ('"turn": ', '"status": "', '"ttft_s": ', '"e2e_s": ', '"completion_tokens": ', '"start_unix_s": ')
"""The fields the report reads from a requests.jsonl line (results/replay.py ``ReplayRecord``): each key as
it is written, ending in what precedes its value (a string's value starts after its opening quote)."""


def _fast_fields(text: str) -> tuple[str, ...] | None:
    """The six fields, each found with ``str.find`` wherever it is in the line (linear in the line, whatever
    it holds: a lazy regular expression backtracked for minutes on a crafted line; and any key order, so an
    MPI rank's lines, which carry ``rank`` too, take this path). A key cannot appear inside a value: JSON
    escapes a quote inside a string, and ``"turn": `` is not a part of ``"session_turn": ``. A string value
    ends at its closing quote, a number at the next comma or closing brace. None when a field is missing or
    a string holds an escaped quote (the line is then parsed as JSON)."""
    out = []
    for key in _FIELDS:
        i = text.find(key)
        if i < 0:
            return None
        start = i + len(key)
        if key.endswith('"'):
            j = text.find('"', start)
            if j < 0 or text[j - 1] == "\\":
                return None
        else:
            ends = [k for k in (text.find(",", start), text.find("}", start)) if k >= 0]
            if not ends:
                return None
            j = min(ends)
        out.append(text[start:j].strip())
    return tuple(out)


@dataclass
class ReplayRecords:
    """requests.jsonl in columns (only the fields the report uses)."""

    turn: np.ndarray
    ok: np.ndarray
    ttft_s: np.ndarray  # nan where none
    tpot_s: np.ndarray  # nan where fewer than two tokens
    start_s: np.ndarray  # since the first request's start

    @classmethod
    def read(cls, path: Path) -> ReplayRecords | None:
        """The columns of requests.jsonl. Fast path: the six fields used found by ``_fast_fields`` (the
        inter-token gaps, most of a line, are skipped); a line it does not read is validated as read_records does."""
        if not path.is_file():
            return None
        turn: list[int] = []
        ok: list[bool] = []
        ttft: list[float] = []
        tpot: list[float] = []
        start: list[float] = []
        nan = float("nan")

        def num(v: Any) -> float:
            return nan if v in (None, "null") else float(v)

        with path.open(encoding="utf-8") as f:
            for line, text in enumerate(f, start=1):
                fields: tuple[Any, ...] | None = _fast_fields(text)
                try:
                    if fields is None or not fields[0].isdigit():
                        raise ValueError
                    t, status, tt, e2e, n, st = fields
                    ttft_v, e2e_v, n_v, start_v = num(tt), num(e2e), num(n), num(st)
                except ValueError:  # not as the client writes it: the line validated as read_records does
                    r = _record(path, line, _parse(path, line, text))
                    t, status, n_v = r.turn, r.status, num(r.completion_tokens)
                    ttft_v, e2e_v, start_v = num(r.ttft_s), num(r.e2e_s), num(r.start_unix_s)
                if not 0 <= int(t) <= MAX_TURN:  # 1e308 or 400 digits: no turn number, and no int64 either
                    raise DatasetError(f"{path}:{line}: turn {str(t)[:40]} is not a turn number (0..{MAX_TURN})")
                good = status == "ok" and ttft_v == ttft_v
                turn.append(int(t))
                ok.append(good)
                ttft.append(ttft_v)
                v = tpot_s(e2e_v, ttft_v, n_v) if good else None
                tpot.append(nan if v is None else v)
                start.append(start_v)
        s = np.asarray(start, dtype=np.float64)
        base = np.nanmin(s) if np.isfinite(s).any() else 0.0
        return cls(
            np.asarray(turn, dtype=np.int64),
            np.asarray(ok, dtype=bool),
            np.asarray(ttft, dtype=np.float64),
            np.asarray(tpot, dtype=np.float64),
            s - base,
        )

    def ttft_ok(self, later: bool | None = None) -> np.ndarray:
        m = self.ok & np.isfinite(self.ttft_s)
        if later is True:
            m &= self.turn > 0
        elif later is False:
            m &= self.turn == 0
        out: np.ndarray = self.ttft_s[m]
        return out
