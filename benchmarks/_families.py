"""Every trace family in ../shared/data, cut to a slice a side-by-side run on two cores can replay (sim_vs_vllm.py
--all-families): the three LMCache agent-trace folders, tau2-bench, ShareGPT and the Mooncake conversation trace.

Each slice is written into the run's work folder in a format kvtier replay reads, with its source named; the
Mooncake trace has no text (its prompts are 512-token block hashes), so each block becomes a fixed run of words
seeded by its hash: requests that share a block share its text, and a conversation's next turn, which repeats the
blocks of the one before, repeats their text (the trace's prefix reuse, kept).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Family:
    name: str
    source: Path  # the file or folder in ../shared/data
    num_rounds: int  # turns per virtual user
    sessions: int  # sessions (files, simulations, conversations) taken


def families(shared: Path) -> list[Family]:
    agent = shared / "lmcache_agent_trace"
    return [
        Family("miniswe", agent / "miniswe", 5, 3),
        Family("magagent", agent / "magagent", 5, 3),
        Family("taubench", agent / "taubench", 5, 3),
        Family("tau2-bench", shared / "tau2_bench" / "gpt-4.1_airline_default_gpt-4.1_1trials.json", 5, 3),
        Family("sharegpt", shared / "sharegpt" / "sharegpt_zh_1K_records_0000-0499.json", 3, 12),
        Family("mooncake", shared / "mooncake_fast25" / "conversation_trace.jsonl", 3, 8),
    ]


def prepare(f: Family, work: Path) -> Path:
    """The family's slice as a dataset kvtier replay reads (a folder or a file under ``work``); ShareGPT's
    conversations of more than four virtual users' turns are left out (one would be most of the slice)."""
    out = work / f"trace-{f.name}"
    if f.source.is_dir():  # agent traces: the first files by name, one session each
        out.mkdir(parents=True, exist_ok=True)
        for p in sorted(f.source.glob("*.jsonl"))[: f.sessions]:
            (out / p.name).unlink(missing_ok=True)
            (out / p.name).symlink_to(p.resolve())
        return out
    if f.name == "tau2-bench":
        doc = json.loads(f.source.read_text())
        doc["simulations"] = doc["simulations"][: f.sessions]
        path = out.with_suffix(".json")
        path.write_text(json.dumps(doc))
        return path
    if f.name == "sharegpt":  # the first conversations with a whole virtual user's turns
        convs = json.loads(f.source.read_text())
        turns = [sum(m.get("from") == "gpt" for m in c["conversations"]) for c in convs]
        keep = [c for c, n in zip(convs, turns) if f.num_rounds <= n <= 4 * f.num_rounds]
        path = out.with_suffix(".json")
        path.write_text(json.dumps(keep[: f.sessions], ensure_ascii=False))
        return path
    return _mooncake(f, out.with_suffix(".jsonl"))


def _mooncake(f: Family, path: Path) -> Path:
    """The first conversations of at least ``num_rounds`` turns, as kvtier's session JSONL: a request joins the
    conversation whose first block after the shared system block (hash 0) it starts with; each turn sends its
    blocks' text as one user message, with the recorded output length as max_tokens."""
    convs: dict[int, list[dict]] = {}
    order: list[int] = []
    with open(f.source) as fh:
        for line in fh:
            r = json.loads(line)
            h = r["hash_ids"]
            key = h[1] if len(h) > 1 else -1 - len(order)
            if key not in convs:
                convs[key] = []
                order.append(key)
            convs[key].append(r)
            done = [k for k in order if len(convs[k]) >= f.num_rounds]
            if len(done) >= f.sessions:
                break
    words_per_block = MOONCAKE_BLOCK_TOKENS  # the kvtier model make tokenizer: about one token a filler word
    from kvtier.modelmaker import WORDS

    def block(h: int) -> str:
        return " ".join(np.random.default_rng(h).choice(WORDS, size=words_per_block).tolist())

    lines = []
    for k in [k for k in order if len(convs[k]) >= f.num_rounds][: f.sessions]:
        turns = []
        for r in convs[k][: f.num_rounds]:
            text = " ".join(block(h) for h in r["hash_ids"])
            turns.append({"messages": [{"role": "user", "content": text}], "max_tokens": int(r["output_length"])})
        lines.append(json.dumps({"session_id": f"mooncake-{k}", "turns": turns}))
    path.write_text("\n".join(lines) + "\n")
    return path
