"""Datasets of recorded sessions -> turns -> virtual users.

Formats (``--dataset-format``, auto-detected from the first record):
* ``agent-trace`` — LMCache agent traces: JSONL, one LLM call per line
  ``{timestamp, input (full prompt text), output, session_id}``; calls are sorted by timestamp
  inside a session. A turn sends the recorded ``input`` as one user message. Variants, detected per
  file and said in the summary's ``dataset.notes``: timestamps in integer µs / ms / s or float seconds;
  ``session_id`` a string, an integer, empty (one session per file), or new on every call (sessions
  rebuilt from the prompt prefix chain); one file holding several sessions.
* ``tau2`` — tau2-bench results JSON: each assistant message that carries ``usage`` is one agent
  LLM call; its history is the policy (system) plus every earlier message (user, assistant, tool);
  tool calls made by the user simulator are dropped.
* ``sharegpt`` — ``[{conversations: [{from, value}, ...]}]``: each gpt reply is a turn.
* ``agentic-traces`` — rows ``{session_id, model, input: [OpenAI messages, the full history],
  output_length, pre_gap}`` (JSONL, or Parquet when pyarrow is installed); rows of a session keep
  their file order; each row is a turn.
* ``jsonl`` — generic: one session per line, ``{"session_id", "turns": [{"messages": [...],
  "max_tokens": N, "pre_gap": seconds}]}`` where each turn's messages are its full history.
A folder holds one session file each (agent-trace) or several files of one format; an empty
session file is skipped with a warning; an empty dataset or a malformed record is a DatasetError
naming file and line.

Virtual users: each session, in order, is cut into consecutive chunks of ``num_rounds`` turns;
every full chunk is one virtual user (a shorter remainder, or a shorter session, gives none).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import DatasetError
from kvtier.results.envelope import ResultWarning, WarningCode, warning
from kvtier.workload.formats import classify, elsewhere
from kvtier.workload.sharegpt import read_sharegpt_records, sharegpt_id, sharegpt_messages

FORMATS = ("auto", "agent-trace", "tau2", "sharegpt", "agentic-traces", "jsonl")


@dataclass(frozen=True)
class Turn:
    messages: tuple[dict[str, Any], ...]
    max_tokens: int
    gap_s: float  # recorded time from the previous call's start to this one's (0 for the first)


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]
    source: str


@dataclass(frozen=True)
class VirtualUser:
    user_id: str
    session_id: str
    first_turn: int  # index in the session of this chunk's first turn
    turns: tuple[Turn, ...]


Counter = Callable[[str], int]
"""Counts recorded output text into max_tokens (kvtier.tokenizer: ``Tokenizer.count``)."""


def _max_tokens(count: Counter, text: str) -> int:
    """max_tokens for a recorded output: at least 1 (an empty recorded reply still asks for one
    token; servers reject max_tokens 0)."""
    return max(1, count(text))


MAX_GAP_S = 86_400.0
"""Longest recorded gap before a turn: a day. Larger (or non-finite) values are errors, not sleeps."""


def _read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = p.read_bytes()[: e.start].count(b"\n") + 1
        raise DatasetError(f"{p}:{line}: not UTF-8 text") from None
    except OSError as e:
        raise DatasetError(f"{p}: cannot read: {e.strerror}") from None


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}:{e.lineno}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise DatasetError(f"{where}: JSON nested too deeply") from None


def _gap(value: Any, where: str) -> float:
    """A recorded gap in seconds: a finite number in [0, MAX_GAP_S] (None: 0)."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_GAP_S:
        raise DatasetError(f"{where}: pre_gap must be seconds in [0, {MAX_GAP_S:g}], got {value!r}")
    return float(value)


def _load_json(p: Path) -> Any:
    return _parse_json(_read_text(p), str(p))


def _read_json_lines(p: Path) -> list[tuple[int, Any]]:
    out = []
    for n, line in enumerate(_read_text(p).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise DatasetError(f"{p}:{n}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise DatasetError(f"{p}:{n}: JSON nested too deeply") from None
    return out


def _time_unit(values: list[float | int]) -> tuple[float, str]:
    """Seconds per unit of one file's timestamps, and the words that say how that was decided: float
    values are seconds; integers that look like a Unix epoch are µs, ms or s by their size; other
    integers (relative times) by their median gap (>= 1e5: µs, >= 50: ms, else s)."""
    if any(isinstance(v, float) for v in values):
        return 1.0, "float seconds"
    first = abs(int(values[0]))
    for scale, unit, floor in ((1e-6, "microseconds", 1e14), (1e-3, "milliseconds", 1e11), (1.0, "seconds", 1e8)):
        if first >= floor:
            return scale, f"integer {unit} (Unix epoch)"
    ordered = sorted(int(v) for v in values)
    gaps = sorted(b - a for a, b in zip(ordered, ordered[1:]) if b > a)
    med = gaps[len(gaps) // 2] if gaps else 0
    scale, unit = (
        (1e-6, "microseconds") if med >= 100_000 else (1e-3, "milliseconds") if med >= 50 else (1.0, "seconds")
    )
    return scale, f"integer {unit} (relative times; median gap {med})"


def _chain_sessions(calls: list[_Call]) -> list[list[_Call]]:
    """Sessions rebuilt from the prompt prefix chain: a call continues the open session whose latest
    prompt its own prompt starts with (the longest such), else it starts a new one."""
    chains: list[list[_Call]] = []
    for c in calls:
        best, best_len = None, -1
        for chain in chains:
            last = chain[-1].input
            if len(last) > best_len and c.input.startswith(last):
                best, best_len = chain, len(last)
        if best is None:
            chains.append([c])
        else:
            best.append(c)
    return chains


@dataclass
class _Call:
    t: float  # seconds
    input: str
    output: str
    sid: str | None
    line: int


def load_agent_trace(p: Path, count: Counter, notes: list[str] | None = None) -> list[Session]:
    """One file of LMCache agent-trace calls -> its sessions. Variants read (and said in ``notes``):
    timestamps as integer µs / ms / s or float seconds (or ISO strings); ``session_id`` as a string, an
    integer, empty or missing (then one session per file), or different on every call (then sessions
    are rebuilt from the prompt prefix chain; where that chain links no call to another, as in an aider
    fork whose every call has its own chat-completion id, the file is one session in recorded order);
    several sessions in one file (grouped by session_id)."""
    rows = _read_json_lines(p)
    raw: list[tuple[Any, str, str, Any, int]] = []
    for n, r in rows:
        ts = r.get("timestamp") if isinstance(r, dict) else None
        if isinstance(ts, str):
            ts = _ts(ts)
        if (
            not isinstance(r, dict)
            or not isinstance(r.get("input"), str)
            or isinstance(ts, bool)
            or not isinstance(ts, (int, float))
        ):
            raise DatasetError(f"{p}:{n}: expected {{timestamp: number, input: str, output: str, session_id}}")
        sid = r.get("session_id")
        if sid is not None and not isinstance(sid, (str, int)) or isinstance(sid, bool):
            raise DatasetError(f"{p}:{n}: session_id must be a string or an integer, got {sid!r}")
        raw.append((ts, r["input"], str(r.get("output") or ""), sid, n))
    if not raw:
        return []
    scale, unit = _time_unit([x[0] for x in raw])
    calls = sorted(
        (_Call(ts * scale, i, o, None if s in (None, "") else str(s), n) for ts, i, o, s, n in raw), key=lambda c: c.t
    )
    named = [c.sid for c in calls if c.sid is not None]
    groups: list[tuple[str, list[_Call]]]
    if not named:
        groups, how = [(p.stem, calls)], "no session_id: one session per file"
    elif len(set(named)) == len(calls) > 1:
        chains = _chain_sessions(calls)
        if len(chains) == len(calls):  # per-call ids (a chat-completion id each), and no prompt extends another
            groups = [(p.stem, calls)]
            how = (
                f"session_id differs on every call and no prompt extends another: the file is one session "
                f"(one task) of {len(calls)} calls in recorded order"
            )
        else:
            groups = [(p.stem if len(chains) == 1 else f"{p.stem}#{k}", g) for k, g in enumerate(chains)]
            how = f"session_id differs on every call: {len(groups)} sessions rebuilt from the prompt prefix chain"
    else:
        by: dict[str, list[_Call]] = {}
        for c in calls:  # a call without an id joins the file's own session
            by.setdefault(c.sid or p.stem, []).append(c)
        groups = list(by.items())
        how = f"sessions by session_id ({len(groups)})"
    if notes is not None:
        notes.append(f"{p.name}: timestamps {unit}; {how}")
    sessions = []
    for sid, g in groups:
        turns, prev = [], None
        for c in g:
            gap = 0.0 if prev is None else _gap(c.t - prev, f"{p}:{c.line}: the timestamp gap (s)")
            turns.append(Turn(({"role": "user", "content": c.input},), _max_tokens(count, c.output), gap))
            prev = c.t
        sessions.append(Session(sid, tuple(turns), str(p)))
    return sessions


def _ts(s: Any) -> float | None:
    import datetime as dt

    try:
        return dt.datetime.fromisoformat(str(s)).timestamp()
    except ValueError:
        return None


def load_tau2(p: Path, count: Counter) -> list[Session]:
    d = _load_json(p)
    if not isinstance(d, dict) or not isinstance(d.get("simulations"), list):
        raise DatasetError(f"{p}: not a tau2-bench results file (no 'simulations' list)")
    policy = str(d.get("info", {}).get("environment_info", {}).get("policy") or "")
    sessions = []
    for si, sim in enumerate(d["simulations"]):
        msgs = sim.get("messages") if isinstance(sim, dict) else None
        if not isinstance(msgs, list):
            raise DatasetError(f"{p}: simulations[{si}] has no messages list")
        history: list[dict[str, Any]] = [{"role": "system", "content": policy}] if policy else []
        turns, prev_ts = [], None
        for mi, m in enumerate(msgs):
            where = f"{p}: simulations[{si}].messages[{mi}]"
            if not isinstance(m, dict):
                raise DatasetError(f"{where}: expected an object")
            role = m.get("role")
            if role == "assistant" and m.get("usage"):
                usage = m["usage"]
                out = usage.get("completion_tokens") if isinstance(usage, dict) else None
                if out is not None and (isinstance(out, bool) or not isinstance(out, int) or out < 0):
                    raise DatasetError(f"{where}: usage.completion_tokens must be a non-negative integer, got {out!r}")
                ts = _ts(m.get("timestamp"))
                gap = 0.0 if prev_ts is None or ts is None else _gap(max(0.0, ts - prev_ts), where)
                prev_ts = ts if ts is not None else prev_ts
                turns.append(Turn(tuple(history), max(1, out or 1), gap))
            entry: dict[str, Any] = {"role": role, "content": m.get("content") or ""}
            raw_calls = m.get("tool_calls") or []
            if not isinstance(raw_calls, list) or not all(isinstance(c, dict) for c in raw_calls):
                raise DatasetError(f"{where}: tool_calls must be a list of objects")
            calls = [c for c in raw_calls if c.get("requestor", "assistant") == "assistant"]
            if role == "user" and m.get("tool_calls"):
                calls = []  # user-side tool calls are the simulator's, not the agent's
            if calls and role == "assistant":
                entry["tool_calls"] = [
                    {
                        "id": c.get("id", ""),
                        "type": "function",
                        "function": {"name": c.get("name", ""), "arguments": json.dumps(c.get("arguments", {}))},
                    }
                    for c in calls
                ]
            if role == "tool":
                entry["tool_call_id"] = m.get("id", "")
                if m.get("requestor") == "user":
                    continue
            if role in ("user", "assistant", "tool"):
                history.append(entry)
        if turns:
            sessions.append(Session(str(sim.get("id", si)), tuple(turns), f"{p}#simulations[{si}]"))
    return sessions


def load_sharegpt_sessions(p: Path, count: Counter, notes: list[str] | None = None) -> list[Session]:
    """Each record with a usable exchange is a session; each reply is a turn whose history is every
    message before it (workload/sharegpt.py reads the records, for bench and replay alike). Records without one
    are left out and said in ``notes`` (how many, and the first's index)."""
    sessions = []
    dropped: list[int] = []
    records = read_sharegpt_records(p)
    for i, rec in enumerate(records):
        msgs = sharegpt_messages(rec)
        turns = [
            Turn(tuple(msgs[:k]), _max_tokens(count, m["content"]), 0.0)
            for k, m in enumerate(msgs)
            if m["role"] == "assistant"
        ]
        if turns:
            sessions.append(Session(sharegpt_id(rec, i), tuple(turns), f"{p}[{i}]"))
        else:
            dropped.append(i)
    if dropped and notes is not None:
        notes.append(
            f"{p.name}: {len(dropped)} of {len(records)} records left out: no usable exchange (no reply, or only "
            f"empty texts); the first is record [{dropped[0]}]"
        )
    return sessions


def load_agentic_traces(p: Path, count: Counter) -> list[Session]:
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{p}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        rows = list(enumerate(pq.read_table(p).to_pylist(), start=1))
    else:
        rows = _read_json_lines(p)
    by_session: dict[str, list[Turn]] = {}
    for n, r in rows:
        msgs = r.get("input") if isinstance(r, dict) else None
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise DatasetError(f"{p}:{n}: 'input' must be a non-empty list of OpenAI messages")
        out = r.get("output_length")
        if not isinstance(out, int) or out < 1:
            raise DatasetError(f"{p}:{n}: 'output_length' must be a positive integer")
        by_session.setdefault(str(r.get("session_id", p.stem)), []).append(
            Turn(tuple(msgs), out, _gap(r.get("pre_gap"), f"{p}:{n}"))
        )
    return [Session(sid, tuple(turns), str(p)) for sid, turns in by_session.items()]


def load_jsonl_sessions(p: Path, count: Counter) -> list[Session]:
    sessions = []
    for n, r in _read_json_lines(p):
        if not isinstance(r, dict) or not isinstance(r.get("turns"), list):
            raise DatasetError(f"{p}:{n}: expected {{session_id, turns: [{{messages, max_tokens, pre_gap}}]}}")
        turns = []
        for k, t in enumerate(r["turns"]):
            msgs = t.get("messages") if isinstance(t, dict) else None
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
                raise DatasetError(f"{p}:{n}: turns[{k}].messages must be a non-empty list of {{role, content}}")
            mt = t.get("max_tokens", 128)
            if not isinstance(mt, int) or mt < 1:
                raise DatasetError(f"{p}:{n}: turns[{k}].max_tokens must be a positive integer")
            turns.append(Turn(tuple(msgs), mt, _gap(t.get("pre_gap"), f"{p}:{n}: turns[{k}]")))
        sessions.append(Session(str(r.get("session_id", f"{p.stem}:{n}")), tuple(turns), f"{p}:{n}"))
    return sessions


LOADERS: dict[str, Callable[[Path, Counter], list[Session]]] = {
    "agent-trace": load_agent_trace,
    "tau2": load_tau2,
    "sharegpt": load_sharegpt_sessions,
    "agentic-traces": load_agentic_traces,
    "jsonl": load_jsonl_sessions,
}


def tool_schemas(sessions: list[Session]) -> list[dict[str, Any]]:
    """An OpenAI tools list naming every function the recorded assistant messages call (gpt-oss mode)."""
    names: set[str] = set()
    for s in sessions:
        for t in s.turns:
            for m in t.messages:
                for c in m.get("tool_calls") or []:
                    name = (c.get("function") or {}).get("name") if isinstance(c, dict) else None
                    if name:
                        names.add(str(name))
    return [
        {
            "type": "function",
            "function": {
                "name": n,
                "description": f"recorded tool {n}",
                "parameters": {"type": "object", "additionalProperties": True},
            },
        }
        for n in sorted(names)
    ]


def detect(p: Path) -> str:
    text = _read_text(p)
    if not text.strip():
        return "empty"
    if p.suffix == ".jsonl":
        f = classify(text.lstrip().splitlines()[0])
        kind = JSONL_KINDS.get(f.name) if f is not None else None
        if kind is None:
            raise DatasetError(f"{p}:1: cannot tell the dataset format" + _not_ours(p))
        return kind
    try:
        d = _load_json(p)
    except DatasetError as e:
        raise DatasetError(str(e) + elsewhere(p, REPLAY_FORMATS)) from None
    if isinstance(d, list):
        return "sharegpt"
    if isinstance(d, dict) and "simulations" in d:
        return "tau2"
    raise DatasetError(f"{p}: cannot tell the dataset format" + _not_ours(p))


JSONL_KINDS = {"sessions": "jsonl", "agentic-traces": "agentic-traces", "agent-trace": "agent-trace"}
"""kvtier/workload/formats.py's JSONL formats this module reads, by its --dataset-format name."""
REPLAY_FORMATS = ("sharegpt", "tau2", *JSONL_KINDS)
"""The formats of kvtier/workload/formats.py that this module reads."""


def _not_ours(p: Path) -> str:
    """Who reads the file instead (a trace for kvtier bench, ...), else how to name a format of ours."""
    return (
        elsewhere(p, REPLAY_FORMATS) or "; give --dataset-format (jsonl, sharegpt, tau2, agent-trace, agentic-traces)"
    )


@dataclass
class LoadedDataset:
    sessions: list[Session]
    format: str  # the format read (the last file's, for a folder)
    warnings: list[ResultWarning]
    notes: list[str] = field(default_factory=list)  # how each file's variant was read; ShareGPT records left out
    hit_plan: Any = None  # --target-hit-rate: the documents the requests share (replay/hitrate.py HitPlan)


def load_sessions(path: str | Path, fmt: str, count: Counter) -> LoadedDataset:
    """Every session of PATH (a file, or a folder of session files), validated; ``count`` turns
    recorded reply text into max_tokens where the format has no counts."""
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"--dataset: {p} does not exist")
    files = (
        sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".json", ".jsonl", ".parquet"))
        if p.is_dir()
        else [p]
    )
    warnings: list[ResultWarning] = []
    notes: list[str] = []
    sessions: list[Session] = []
    used = fmt
    for f in files:
        try:
            kind = fmt if fmt != "auto" else ("agentic-traces" if f.suffix == ".parquet" else detect(f))
        except UnicodeDecodeError:
            raise DatasetError(f"{f}: not UTF-8 text") from None
        if kind == "empty":
            warnings.append(warning(WarningCode.dataset_file_skipped, f"{f}: empty session file skipped", file=str(f)))
            continue
        used = kind
        got = (
            load_agent_trace(f, count, notes)
            if kind == "agent-trace"
            else load_sharegpt_sessions(f, count, notes)
            if kind == "sharegpt"
            else LOADERS[kind](f, count)
        )
        if not got:
            warnings.append(
                warning(WarningCode.dataset_file_skipped, f"{f}: no session with a usable turn, skipped", file=str(f))
            )
        sessions += got
    if not sessions:
        raise DatasetError(f"{p}: the dataset holds no session")
    return LoadedDataset(sessions, used, warnings, notes)


def virtual_users(
    sessions: list[Session], num_rounds: int, min_chunk_rounds: int = 0, order: str = "interleave"
) -> list[VirtualUser]:
    """Cut each session into chunks of num_rounds turns; each full chunk is a virtual user. A session of
    fewer than ``min_chunk_rounds`` turns gives none (the methodology's 5 by default in ``kvtier replay``).

    Dispatch order: ``interleave`` (default) takes every session's first chunk, then every
    session's second chunk, and so on, so the users in flight together come from different
    conversations where the data allows and a conversation's later rounds start after its earlier
    ones were dispatched (they can find that history in a cache); ``session`` keeps each session's
    chunks together (file order)."""
    if num_rounds < 1:
        raise ValueError("num_rounds must be >= 1")
    if order not in ("interleave", "session"):
        raise ValueError(f"order must be interleave or session, got {order!r}")
    per_session: list[list[VirtualUser]] = []
    for s in sessions:
        mine: list[VirtualUser] = []
        if len(s.turns) < min_chunk_rounds:  # too short a conversation to say anything of later turns
            per_session.append(mine)
            continue
        for start in range(0, len(s.turns) - num_rounds + 1, num_rounds):
            chunk = s.turns[start : start + num_rounds]
            if len(chunk) == num_rounds:
                mine.append(VirtualUser(f"{s.session_id}#{start // num_rounds}", s.session_id, start, chunk))
        per_session.append(mine)
    if order == "session":
        return [u for mine in per_session for u in mine]
    deepest = max((len(m) for m in per_session), default=0)
    return [mine[i] for i in range(deepest) for mine in per_session if i < len(mine)]
