"""Which public trace or dataset format a file is, from its first line, and which kvtier command reads it.

A reader that cannot read a file says what the file looks like and who reads that ("… looks like a ShareGPT
dataset, which kvtier replay --dataset and kvtier bench --dataset-path read"), instead of suggesting a flag of
its own that would not help (or that its command does not have). ``classify`` is the one rule set the readers use
to recognise their own formats too. Never raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Format:
    name: str
    what: str  # in words
    readers: str  # the commands (and flags) that read it, as a clause


FORMATS = {
    "mooncake": Format(
        "mooncake",
        "a Mooncake trace (arrival times and prefix-block hash_ids)",
        "kvtier bench --trace-path and kvtier plan retention --trace read it",
    ),
    "azure": Format(
        "azure", "an Azure LLM inference trace (CSV with ContextTokens)", "kvtier bench --trace-path reads it"
    ),
    "burstgpt": Format(
        "burstgpt",
        "a BurstGPT trace (CSV with Request tokens)",
        "kvtier bench --trace-path (or --use-burst-trace) reads it",
    ),
    "sharegpt": Format(
        "sharegpt",
        "a ShareGPT dataset (a JSON list of conversations)",
        "kvtier replay --dataset and kvtier bench --dataset-path read it",
    ),
    "tau2": Format("tau2", "a tau2-bench results file (simulations)", "kvtier replay --dataset reads it"),
    "sessions": Format("sessions", "kvtier's own session JSONL (turns)", "kvtier replay --dataset reads it"),
    "agentic-traces": Format(
        "agentic-traces",
        "an agentic traces file (JSONL of input and output_length)",
        "kvtier replay --dataset reads it",
    ),
    "agent-trace": Format(
        "agent-trace", "an LMCache agent trace (JSONL of input and timestamp)", "kvtier replay --dataset reads it"
    ),
}

FIRST_LINE_BYTES = 16 * 1024 * 1024
"""The most of a file's first line read to tell its format (an agent trace's first record can be megabytes)."""


def classify(first: str, rest: str = "") -> Format | None:
    """The format a file's first line shows (``rest``: what follows it, for a JSON document's keys), or None. The one
    rule set: the trace loader and replay's dataset reader recognise their own formats with it."""
    first = first.strip()
    cols = [c.strip().strip('"') for c in first.split(",")]
    if "ContextTokens" in cols:
        return FORMATS["azure"]
    if "Request tokens" in cols:
        return FORMATS["burstgpt"]
    if first.startswith("{"):
        if "hash_ids" in first:
            return FORMATS["mooncake"]
        if '"turns"' in first:
            return FORMATS["sessions"]
        if '"output_length"' in first and '"input"' in first:
            return FORMATS["agentic-traces"]
        if '"input"' in first and '"timestamp"' in first:
            return FORMATS["agent-trace"]
        if '"simulations"' in first + rest:
            return FORMATS["tau2"]
    if first.startswith("[") and '"conversations"' in first + rest:
        return FORMATS["sharegpt"]
    return None


def sniff(path: Path) -> Format | None:
    """The format of the file at ``path`` (its first line, and a little after it), or None."""
    try:
        with path.open("rb") as f:
            first = f.readline(FIRST_LINE_BYTES).decode("utf-8", errors="replace")
            while first and not first.strip():  # leading blank lines
                first = f.readline(FIRST_LINE_BYTES).decode("utf-8", errors="replace")
            rest = f.read(65536).decode("utf-8", errors="replace")
    except OSError:
        return None
    return classify(first, rest)


def elsewhere(path: Path, here: tuple[str, ...] = ()) -> str:
    """A clause for an error about ``path``: what it looks like and which command reads it; empty when it is not
    a format we know, or is one of ``here`` (the formats the failing reader itself reads: its own error says why)."""
    f = sniff(path)
    if f is None or f.name in here:
        return ""
    return f"; {path.name} looks like {f.what}: {f.readers}"


__all__ = ["FORMATS", "Format", "classify", "sniff", "elsewhere"]
