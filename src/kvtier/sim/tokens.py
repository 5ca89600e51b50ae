"""Deterministic rendering of chat messages into the text the simulator tokenizes.

For each message ``<|role|>\\n`` + content (and its tool calls) + ``<|end|>\\n``, then
``<|assistant|>\\n``. The same messages always give the same text, so — through kvtier.tokenizer,
which is deterministic across processes — identical histories give identical prefixes. A message of
the wrong shape is a ValueError naming the problem (the server answers 400).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any


def content_text(content: Any) -> str:
    """OpenAI content: a string, or a list of parts with type 'text'."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            elif isinstance(part, str):
                out.append(part)
            else:
                raise ValueError("content parts must be text")
        return "".join(out)
    raise ValueError("content must be a string or a list of text parts")


def tool_call_text(calls: Any) -> str:
    """OpenAI tool calls: a list of ``{type, id, function: {name, arguments}}`` (arguments a JSON string
    or an object). Anything else is a ValueError naming what is wrong."""
    if calls is None:
        return ""
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tool_calls[{i}] needs a function with a name")
        args = fn.get("arguments", "")
        if isinstance(args, dict):
            args = json.dumps(args, sort_keys=True)
        elif not isinstance(args, str):
            raise ValueError(f"tool_calls[{i}].function.arguments must be a string or an object")
        out.append(f"<|tool_call|>{fn['name']}({args})")
    return "".join(out)


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        text = content_text(m.get("content")) + tool_call_text(m.get("tool_calls"))
        parts.append(f"<|{m['role']}|>\n{text}<|end|>\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def render_kvtier_model_chat(messages: Sequence[dict[str, Any]]) -> str:
    """The chat template ``kvtier model make`` writes (kvtier.modelmaker.CHAT_TEMPLATE), in Python: a real vLLM
    serving such a folder renders the same text, so the sim's prompt ids equal the server's. Like that template,
    only message contents are rendered (tool calls are not)."""
    from kvtier.modelmaker import BOS, IM_END, IM_START

    parts = [BOS]
    for m in messages:
        parts.append(f"{IM_START}{m['role']}\n{content_text(m.get('content'))}{IM_END}\n")
    parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


def chat_renderer(tokenizer: str) -> Callable[[Sequence[dict[str, Any]]], str]:
    """How messages become the prompt text: the chat template of a ``kvtier model make`` folder when the sim
    counts with that folder's tokenizer (so its prompt ids are the ids vLLM serving that folder computes),
    else the sim's own rendering (``render_chat``)."""
    from pathlib import Path

    from kvtier.modelmaker import MARKER

    if tokenizer.startswith("hf:") and (Path(tokenizer[3:]) / MARKER).exists():
        return render_kvtier_model_chat
    return render_chat
