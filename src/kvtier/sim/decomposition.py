"""The sim's TTFT decomposition: a prompt's tokens by source, the parts of its time to the first token from the
request's stamps (``first_info``), and the front's send part (``add_send``); the one shape the client checks
(results/replay.py ``decomposition_problem``)."""

from __future__ import annotations

from typing import Any


def tokens_by_source(
    prompt: int, gpu_hit: int, ext: int, sources: list[str], first_chunk: int, chunk_tokens: int
) -> dict[str, int]:
    """A prompt's tokens by where they came from: ``gpu`` (the prefix cache), each offload tier that served
    a loaded chunk (``sources``: the tier of each chunk from ``first_chunk`` on; a chunk counts only its tokens
    past the GPU hit and within the ``ext`` tokens taken), and ``recomputed`` (the rest). Sums to ``prompt``."""
    out: dict[str, int] = {"gpu": gpu_hit}
    lo, hi = gpu_hit, gpu_hit + ext
    for j, tier in enumerate(sources):
        a = max(lo, (first_chunk + j) * chunk_tokens)
        b = min(hi, (first_chunk + j + 1) * chunk_tokens)
        if b > a:
            out[tier] = out.get(tier, 0) + b - a
    out["recomputed"] = prompt - gpu_hit - ext
    return out


def first_info(
    gpu_hit: int, ext: int, load_s: float, by_source: dict[str, int], stamps: tuple[float, float, float, float, float]
) -> dict[str, Any]:
    """What the first yield of ``SimEngine.generate`` tells the front: the cache hits, and the request's TTFT
    decomposition from its time stamps (received, arrived, admitted, fetched, first token; perf_counter)."""
    t_recv, t_arrive, t_admit, t_fetched, t_first = stamps
    return {
        "cached_tokens": gpu_hit + ext,
        "gpu_hit_tokens": gpu_hit,
        "external_tokens": ext,
        "load_s": load_s,
        "queue_s": t_admit - t_arrive,
        "ttft_decomposition": {
            "tokens": by_source,
            "seconds": {
                "receive": round(t_arrive - t_recv, 6),  # body parsed, prompt rendered and tokenized
                "queue": round(t_admit - t_arrive, 6),  # waiting for a slot and blocks (vLLM's rules)
                "lookup": round(t_fetched - t_admit - load_s, 6),  # offload keys and lookup
                "fetch": round(load_s, 6),  # the offload tier's real reads
                "recompute": round(t_first - t_fetched, 6),  # prefill of what no tier held
                "first_decode": 0.0,  # token 0 leaves with the prefill
                "send": 0.0,  # the front sets it: until the first token's frame goes to the socket (add_send)
            },
            "server_ttft_s": round(t_first - t_recv, 6),
        },
        # the host's monotonic clock (perf_counter: CLOCK_MONOTONIC, one clock for every process on a Linux host), so a
        # client on this host measures both transits: its start to "received", and "first_sent" to its first token
        "monotonic_s": {"received": round(t_recv, 7)},
        FIRST_TOKEN_AT: t_first,  # perf_counter; the front takes it out (add_send) before the info is sent
    }


FIRST_TOKEN_AT = "_first_token_at"


def add_send(info: dict[str, Any], sent_at: float | None) -> dict[str, Any]:
    """The front's part of the decomposition: from the first token's readiness until its frame is handed to the
    socket, the response's headers and first chunks written before it (``sent_at``, perf_counter; None: not
    streamed, 0). Returns the info without the private stamp."""
    t_first = info.pop(FIRST_TOKEN_AT, None)
    if sent_at is not None and t_first is not None:
        d = info["ttft_decomposition"]
        send = max(0.0, sent_at - t_first)
        d["seconds"]["send"] = round(send, 6)
        d["server_ttft_s"] = round(sum(d["seconds"].values()), 6)
        info["monotonic_s"]["first_sent"] = round(sent_at, 7)
    return info


__all__ = ["FIRST_TOKEN_AT", "add_send", "first_info", "tokens_by_source"]
