"""``kvtier model make DIR``: a dummy-weight model folder for a real vLLM (kvtier.modelmaker)."""

from __future__ import annotations

import argparse


def add_model_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse's private generic
    p = sub.add_parser("model", help="model folders for real servers (a dummy-weight model vLLM can serve)")
    msub = p.add_subparsers(dest="model_command", required=True)
    m = msub.add_parser(
        "make",
        help="write config.json + tokenizer files of a Llama geometry, for vllm --load-format dummy (offline)",
    )
    m.add_argument("directory", help="the model folder to write (created)")
    m.add_argument("--like", default=None, help="take layers, KV heads, head_dim and dtype from this catalog model")
    for flag, dest, hint in (
        ("--layers", "num_layers", "decoder layers (default 2, or --like's)"),
        ("--heads", "num_heads", "query heads (default 4, or --like's KV heads)"),
        ("--kv-heads", "kv_heads", "KV heads (default 2, or --like's)"),
        ("--head-dim", "head_dim", "head dimension (default 64, or --like's)"),
        ("--hidden", "hidden_size", "residual width (default 256)"),
        ("--intermediate", "intermediate_size", "MLP width (default 512)"),
        ("--vocab", "vocab_size", "tokenizer vocabulary (default 4096)"),
        ("--max-model-len", "max_position", "max_position_embeddings (default 32768)"),
    ):
        m.add_argument(flag, dest=dest, type=int, default=None, help=hint)
    m.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="default bfloat16")
    m.add_argument("--force", action="store_true", help="write into a non-empty folder kvtier did not make")
    m.set_defaults(func=run_model_make)


def run_model_make(a: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvtier.modelmaker import Geometry, geometry_like, make_model
    from kvtier.modelspec import build_catalog, resolve_model, spec_from_hf_config

    widths = {k: getattr(a, k) for k in asdict(Geometry()) if getattr(a, k, None) is not None}
    geo = geometry_like(resolve_model(a.like, build_catalog()), **widths) if a.like else Geometry(**widths)
    d = make_model(a.directory, geo, like=a.like, force=a.force)
    spec = spec_from_hf_config(str(d))
    shape = f"{geo.num_layers} layers x {geo.kv_heads} KV heads x head_dim {geo.head_dim} ({geo.dtype})"
    print(
        f"{d}: {spec.name}, {shape} = {spec.kv_bytes_per_token:,} KV bytes per token; "
        f"max_model_len {geo.max_position:,}"
    )
    print(f"serve it: python -m vllm.entrypoints.openai.api_server --model {d} --load-format dummy")
    return 0
