"""``kvtier model make DIR``: a model folder a real vLLM can serve with ``--load-format dummy``.

vLLM's dummy load format fills the weights with random values, so a folder needs no weights: only a
``config.json`` (the architecture and its geometry) and the tokenizer files. This writes a Llama
architecture (``LlamaForCausalLM``: every vLLM build serves it, the CPU one included) whose KV
geometry — layers, KV heads, head_dim, dtype — is either given by flags or taken from a catalog model
(``--like``), at tiny widths elsewhere (hidden size, query heads, MLP, vocabulary) so that it runs at
useful speed on a CPU. The KV cache a server holds per token depends only on the KV geometry, so
kvtier's bytes per token for the folder (``spec_from_hf_config``) is what vLLM allocates per token.

The tokenizer is a byte-level BPE trained here, offline and deterministically, with the ``tokenizers``
library on generated text (seeded word salad over a fixed English word list, digits, code and JSON
punctuation): byte-level, so every input text encodes, and the same on every machine. Its chat
template is ChatML-like and accepts string or text-part message contents. ``kvtier replay --tokenizer
hf:DIR`` counts with this very file, so the replay and the server agree on every prompt's length.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.errors import ConfigError, UnsupportedError
from kvtier.modelspec import ModelSpec
from kvtier.results.io import write_text_atomic

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}" + IM_START + "{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    + IM_END
    + "\n{% endfor %}{% if add_generation_prompt %}"
    + IM_START
    + "assistant\n{% endif %}"
)
MARKER = "kvtier-model.json"
"""Written beside the config: what made the folder and the geometry it was asked for."""

HF_DTYPE = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}

_WORDS = (
    "the of and to in is that it for on with as was be by this are or at from have an not but can "
    "which you all they we one there their has been if more when will would who so no out up what "
    "about into than them only other time new some could these two may first then do any like my "
    "now over such our man me even most made after also did many before must through back years "
    "where much your way well down should because each just those people how too little state good "
    "very make world still own see men work long get here between both life being under never day "
    "same another know while last might us great old year off come since against go came right used "
    "take three user assistant tool function call result error file data model cache token request "
    "server storage memory read write latency turn session prompt reply json value key list string "
    "number true false null return def class import self print for while if else elif try except"
).split()
WORDS: tuple[str, ...] = tuple(_WORDS)
"""The English words the folder's tokenizer was trained on (each about one token): filler text that any
tokenizer counts at close to a token a word (kvtier ladder's prompts)."""
_PUNCT = [".", ",", ":", ";", "!", "?", "(", ")", "[", "]", "{", "}", '"', "'", "-", "_", "/", "=", "+", "*"]


@dataclass(frozen=True)
class Geometry:
    """What ``config.json`` says: the KV geometry (layers, KV heads, head_dim, dtype) that decides the KV
    bytes per token, and the widths that only decide the compute."""

    num_layers: int = 2
    num_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    hidden_size: int = 256
    intermediate_size: int = 512
    vocab_size: int = 4096
    max_position: int = 32768
    dtype: str = "bfloat16"

    def check(self) -> None:
        for field in ("num_layers", "num_heads", "kv_heads", "head_dim", "hidden_size", "intermediate_size"):
            if getattr(self, field) < 1:
                raise ConfigError(f"--{field.replace('_', '-')}: must be >= 1, got {getattr(self, field)}")
        if self.num_heads % self.kv_heads:
            raise ConfigError(
                f"--heads {self.num_heads}: must be a multiple of --kv-heads {self.kv_heads} (GQA groups)"
            )
        if self.vocab_size < 512:
            raise ConfigError(f"--vocab {self.vocab_size}: must be >= 512 (the 256 bytes, the specials, some merges)")
        if self.max_position < 16:
            raise ConfigError(f"--max-model-len {self.max_position}: must be >= 16")
        if self.dtype not in HF_DTYPE:
            raise ConfigError(f"--dtype {self.dtype!r}: one of {', '.join(HF_DTYPE)}")

    @property
    def kv_bytes_per_token(self) -> int:
        """kvtier's one rule (ModelSpec) for this geometry."""
        spec = ModelSpec("made", "made", self.num_layers, self.kv_heads, self.head_dim, dtype=self.dtype)
        return spec.kv_bytes_per_token


def geometry_like(spec: ModelSpec, **widths: int) -> Geometry:
    """A catalog model's KV geometry at tiny widths: its layers, KV heads and head_dim (so its KV bytes per
    token), one query head per KV head, a 256-wide residual stream and a 512-wide MLP."""
    if spec.attention == "mla":
        raise UnsupportedError(
            f"--like {spec.key}: MLA (a joint KV latent) has no Llama form; give the geometry by flags instead"
        )
    dtype = spec.dtype if spec.dtype in HF_DTYPE else None
    if dtype is None:
        raise UnsupportedError(
            f"--like {spec.key}: its KV dtype {spec.dtype} is not one vLLM allocates for dummy weights"
        )
    base = Geometry(
        num_layers=spec.num_layers, num_heads=spec.kv_heads, kv_heads=spec.kv_heads, head_dim=spec.head_dim, dtype=dtype
    )
    return Geometry(**{**asdict(base), **{k: v for k, v in widths.items() if v is not None}})


def _corpus(seed: int, n_lines: int = 20_000) -> list[str]:
    """Seeded text for training the tokenizer: word salad, numbers, code- and JSON-like lines."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = np.array(_WORDS)
    out = []
    for i in range(n_lines):
        k = int(rng.integers(4, 24))
        ws = list(words[rng.integers(0, len(words), size=k)])
        if i % 5 == 0:
            ws[0] = ws[0].capitalize()
        if i % 7 == 0:
            ws.insert(int(rng.integers(0, k)), str(int(rng.integers(0, 100_000))))
        if i % 11 == 0:
            ws = ['{"' + ws[0] + '":', '"' + " ".join(ws[1:]) + '"}']
        line = " ".join(ws) + _PUNCT[int(rng.integers(0, len(_PUNCT)))]
        out.append(line)
    return out


def train_tokenizer(vocab_size: int, seed: int = 0) -> object:
    """A byte-level BPE over generated text; every text encodes (byte fallback by construction)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise UnsupportedError("kvtier model make needs the tokenizers library: pip install 'kvtier[hf]'") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return tok


def make_model(out: str | os.PathLike[str], geometry: Geometry, like: str | None = None, force: bool = False) -> Path:
    """Write config.json, generation_config.json, tokenizer.json, tokenizer_config.json and the marker into
    ``out`` (created; an existing folder is refused unless it is empty, a folder this made, or ``force``)."""
    geometry.check()
    d = Path(out)
    if d.is_symlink() and not d.exists():
        raise ConfigError(f"{d}: a symbolic link to {os.readlink(d)}, which does not exist: give a folder")
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{d}: exists and is not a folder")
    if d.is_dir() and any(d.iterdir()) and not (d / MARKER).exists() and not force:
        raise ConfigError(f"{d}: not empty and not a folder kvtier model make wrote (--force to write into it)")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{d}: cannot make the folder: {e.strerror}") from None
    tok = train_tokenizer(geometry.vocab_size)
    vocab = tok.get_vocab_size()  # type: ignore[attr-defined]
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)  # type: ignore[attr-defined]
    im_end = tok.token_to_id(IM_END)  # type: ignore[attr-defined]
    write_text_atomic(d / "tokenizer.json", tok.to_str(), "kvtier model make")  # type: ignore[attr-defined]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": geometry.hidden_size,
        "intermediate_size": geometry.intermediate_size,
        "num_hidden_layers": geometry.num_layers,
        "num_attention_heads": geometry.num_heads,
        "num_key_value_heads": geometry.kv_heads,
        "head_dim": geometry.head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": geometry.max_position,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": HF_DTYPE[geometry.dtype],
        "bos_token_id": bos,
        "eos_token_id": [eos, im_end],
    }
    files = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": bos, "eos_token_id": [eos, im_end]},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "model_max_length": geometry.max_position,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": False,
            "chat_template": CHAT_TEMPLATE,
        },
        "special_tokens_map.json": {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS},
        MARKER: {
            "made_by": "kvtier model make",
            "like": like,
            "geometry": asdict(geometry),
            "kv_bytes_per_token": geometry.kv_bytes_per_token,
        },
    }
    for name, doc in files.items():
        write_text_atomic(d / name, json.dumps(doc, indent=2) + "\n", "kvtier model make")
    return d


__all__ = ["Geometry", "geometry_like", "make_model", "train_tokenizer", "CHAT_TEMPLATE", "MARKER"]
