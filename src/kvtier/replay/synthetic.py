"""Synthetic sessions for controlled sweeps (``kvtier replay --synthetic``): ISL/OSL scans beside the
recorded traces, as the serving methodology does.

``--users`` sessions of ``--turns`` turns. Turn k (from 1) sends, as chat messages: a system prompt of
``--shared-prefix`` tokens (the same text for every user: a shared prefix an offload tier can serve
across users), then the session so far — k user messages of ``--isl`` new tokens each and the k − 1
replies of ``--osl`` tokens before them — and asks for ``--osl`` tokens. The text is words that are one
token each under the replay's tokenizer (picked from a fixed list by encoding each; for the chars/4
tokenizer, the words of exactly four characters with their leading space), drawn from a seeded
generator, different per user and turn; so a message of n tokens is n words, and the prompt of turn k
is P + k·ISL + (k − 1)·OSL tokens plus the chat template's own. Gaps between turns are 0 (closed loop).
"""

from __future__ import annotations

import numpy as np

from kvtier.errors import ConfigError
from kvtier.replay.datasets import LoadedDataset, Session, Turn
from kvtier.tokenizer import Tokenizer

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there one all we their been has when who will more no if out so said what up its about "
    "into than them can only other new some time could these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three"
).split()


def one_token_words(tok: Tokenizer) -> list[str]:
    """The words (with their leading space) that this tokenizer encodes as exactly one token."""
    words = [w for w in (" " + x for x in WORDS) if len(tok.encode(w)) == 1]
    if tok.kind == "chars":  # characters make the tokens there: words of one token's width only
        words = [w for w in words if len(w) == len(" the")]
    if len(words) < 16:
        raise ConfigError(f"--synthetic: the tokenizer {tok.name} has too few one-token words ({len(words)})")
    return words


def synthetic_dataset(
    users: int, turns: int, isl: int, osl: int, shared_prefix: int, tok: Tokenizer, seed: int = 0
) -> LoadedDataset:
    words = one_token_words(tok)
    vocab = np.array(words)

    def text(rng: np.random.Generator, n: int) -> str:
        return "".join(vocab[rng.integers(0, len(vocab), n)].tolist()) if n else ""

    prefix = text(np.random.default_rng([seed, 0]), shared_prefix)
    sessions = []
    for u in range(users):
        rng = np.random.default_rng([seed, 1, u])
        history: list[dict[str, str]] = [{"role": "system", "content": prefix}] if shared_prefix else []
        ts = []
        for _ in range(turns):
            history = history + [{"role": "user", "content": text(rng, isl)}]
            ts.append(Turn(tuple(history), osl, 0.0))
            history = history + [{"role": "assistant", "content": text(rng, osl)}]
        sessions.append(Session(f"synthetic-{u}", tuple(ts), "synthetic"))
    note = (
        f"synthetic: {users} users x {turns} turns, ISL {isl}, OSL {osl}, shared prefix {shared_prefix} tokens; "
        f"{len(words)} one-token words of {tok.name}, seed {seed}"
    )
    return LoadedDataset(sessions, "synthetic", [], [note])


__all__ = ["synthetic_dataset", "one_token_words"]
