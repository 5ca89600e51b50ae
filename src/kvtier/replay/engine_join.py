"""A replay's requests joined to the engine's own records of them (kvtier/vllm/reqlog.py, read by
results/engine_log.py): each joined request gets its prompt by source and its time to the first token by part,
measured inside the engine (``decomposition: measured-in-engine``).

The join key is the X-Request-Id the client sent (vLLM names the engine's request after it). A joined ok request's
record gets:

* ``prompt_sources``: the engine's split at admission — ``gpu`` (vLLM's prefix cache), each kvtier tier, and
  ``recomputed`` — summing to the prompt tokens (a block whose load failed counts as recomputed);
* ``server_ttft_parts`` from the engine's stamps, all on the host's CLOCK_MONOTONIC, so they are contiguous:
  ``receive`` (vLLM's API server stamped its arrival → the engine core's scheduler got it), ``queue`` (waiting for
  the scheduler, and after a load for a batch slot), ``lookup`` (the lookup that admitted it and its allocation),
  ``fetch`` (admitted → the scheduler learnt its loads were done), ``recompute`` (prefill scheduled → the step that
  produced its first token came back); ``first_decode`` and ``send`` are 0 (the engine's first token is the
  prefill's, and the API server's send is in the transit to the client);
* ``transit_s``: ``to_server`` (the client's start → the API server's arrival stamp: the HTTP request, the
  template and the tokenizer) and ``to_client`` (the engine's first token → the client read it: the API server's
  detokenizer, the stream, the network and the client's parse);
* ``engine``: the loads' wall time and the tiers' own read time by tier, bytes, failed tokens, stores started.

Because every stamp is on one clock, the parts and transits add up to the client's TTFT by construction: the closure
checks the stamps (one clock, in order), not a model. What checks them independently is vLLM's own histograms of the
same requests (``engine_checks``): its queue time (queued → scheduled) against queue + lookup + fetch, its prefill
time against recompute. A request joined but whose stamps cannot be read as parts (preempted before its first
token, a stamp missing or out of order) keeps its prompt sources and is counted by cause; a request the engine has
no record of is counted by cause; engine records no request of the replay names are counted too.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvtier.results.engine_log import EngineLog, EngineLogTail, EngineRequest
from kvtier.results.envelope import ResultWarning, WarningCode, warning
from kvtier.results.replay import EngineJoin, ReplayRecord, ScrapeSummary

SLACK_S = 0.002
"""A part may come out this far below zero and be read as 0: the API server's arrival stamp is on the wall clock,
converted with the engine's offset between the clocks (sampled microseconds apart)."""


def parts(e: EngineRequest) -> tuple[dict[str, float], float, float] | str:
    """(server parts, the engine-side start on the monotonic clock, the first token on it), or why there are none."""
    m = e.mono_s
    if e.preempted_before_first_token:
        return "preempted"
    if m.first_token is None or m.admitted is None or m.lookup is None:
        return "no-first-token"
    start = m.arrived
    receive = 0.0
    if e.arrival_unix_s is not None:
        api = e.arrival_unix_s - e.wall_minus_mono_s
        receive, start = m.arrived - api, api
    if m.loaded is not None:
        if m.prefill is None:
            return "no-first-token"
        fetch = m.loaded - m.admitted
        queue = (m.lookup - m.arrived) + (m.prefill - m.loaded)
        recompute = m.first_token - m.prefill
    else:
        fetch = 0.0
        queue = m.lookup - m.arrived
        recompute = m.first_token - m.admitted
    out = {
        "receive": receive,
        "queue": queue,
        "lookup": m.admitted - m.lookup,
        "fetch": fetch,
        "recompute": recompute,
        "first_decode": 0.0,
        "send": 0.0,
    }
    if any(v < -SLACK_S for v in out.values()):
        return "stamps-out-of-order"
    return {k: round(max(0.0, v), 7) for k, v in out.items()}, start, m.first_token


def _engine_facts(e: EngineRequest) -> dict[str, Any]:
    m = e.mono_s
    wall = None if m.load_submitted is None or m.load_done is None else round(m.load_done - m.load_submitted, 7)
    return {
        "id": e.id,
        "load_wall_s": wall,
        "load_io_s": e.load.io_s,
        "load_bytes": e.load.bytes,
        "failed_tokens": e.failed_tokens,
        "stored_bytes": e.stores.bytes,
        "preemptions": e.preemptions,
    }


def join(records: list[ReplayRecord], log: EngineLog) -> EngineJoin:
    """Join the engine's records to the replay's (in place: the matched records gain the fields of the module
    docstring) and count what did not join, by cause."""
    by_id: dict[str, list[EngineRequest]] = {}
    for e in log.requests:
        ext = e.external_id
        if ext is not None:
            by_id.setdefault(ext, []).append(e)
    sent = {r.get("request_id") for r in records}
    engine_only = sum(1 for e in log.requests if e.external_id not in sent)
    unjoined: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    joined_ok = ok = 0
    external = failed = 0
    load_io: dict[str, float] = {}
    load_bytes: dict[str, int] = {}
    load_wall = 0.0
    for r in records:
        rid = r.get("request_id")
        mine = by_id.get(rid or "", [])
        is_ok = r["status"] == "ok"
        ok += is_ok
        if rid is None:
            unjoined["no-request-id"] += is_ok
            continue
        if len(mine) != 1:
            if is_ok:
                unjoined["not-in-engine-log" if not mine else "ambiguous"] += 1
            continue
        e = mine[0]
        # every request the engine admitted counts toward its counters, whatever the client made of it
        external += e.external_tokens
        failed += e.failed_tokens
        for k, v in e.load.io_s.items():
            load_io[k] = load_io.get(k, 0.0) + v
        for k, n in e.load.bytes.items():
            load_bytes[k] = load_bytes.get(k, 0) + n
        facts = _engine_facts(e)
        load_wall += facts["load_wall_s"] or 0.0
        if not is_ok:
            continue
        if r.get("prompt_tokens") is not None and r["prompt_tokens"] != e.prompt_tokens:
            unjoined["prompt-mismatch"] += 1
            continue
        joined_ok += 1
        r["prompt_sources"] = dict(e.tokens)
        r["engine"] = facts
        r["decomposition"] = "measured-in-engine"
        got = parts(e)
        start_mono = r.get("start_mono_s")
        if isinstance(got, str):
            dropped[got] += 1
            continue
        seconds, start, first = got
        ttft = r["ttft_s"]
        if start_mono is None or ttft is None:
            dropped["no-client-stamp"] += 1
            continue
        to_server = start - start_mono
        to_client = start_mono + ttft - first
        if to_server < -SLACK_S or to_client < -SLACK_S:
            dropped["stamps-out-of-order"] += 1
            continue
        r["server_ttft_parts"] = seconds
        r["server_ttft_s"] = round(sum(seconds.values()), 7)
        r["transit_s"] = {"to_server": round(max(0.0, to_server), 7), "to_client": round(max(0.0, to_client), 7)}
    return EngineJoin(
        logs=log.paths,
        engine_segments=len(log.headers),
        clean_shutdowns=len(log.footers),
        engine_records=len(log.requests),
        engine_only=engine_only,
        log_dropped=log.dropped,
        requests_ok=ok,
        joined_ok=joined_ok,
        joined_share=round(joined_ok / ok, 6) if ok else None,
        unjoined=dict(unjoined),
        parts_dropped=dict(dropped),
        external_tokens=external,
        external_tokens_failed=failed,
        load_io_s=load_io,
        load_bytes=load_bytes,
        load_wall_s=round(load_wall, 6),
    )


def collect(
    records: list[ReplayRecord],
    paths: list[str],
    wait_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> EngineLog:
    """The engines' logs once they hold every ok request the replay sent, or as they are after ``wait_s`` (an engine
    writes a request's record after its last store was started, a step or two after the reply ended)."""
    want = {r.get("request_id") for r in records if r["status"] == "ok" and r.get("request_id")}
    deadline = clock() + wait_s
    tail = EngineLogTail(paths)  # each pass reads only what the engines wrote since the last
    while True:
        log = tail.poll()
        if want <= tail.by_id.keys() or clock() >= deadline:
            return log
        sleep(0.2)


def _mean_part(records: list[ReplayRecord], names: tuple[str, ...]) -> float | None:
    rows = [r for r in records if r.get("decomposition") == "measured-in-engine" and r.get("server_ttft_parts")]
    if not rows:
        return None
    return round(sum(sum((r["server_ttft_parts"] or {}).get(k, 0.0) for k in names) for r in rows) / len(rows), 6)


def engine_checks(j: EngineJoin, records: list[ReplayRecord], metrics: list[ScrapeSummary]) -> EngineJoin:
    """The join held against the engine's own counters over the run (the scraped deltas): the external hit tokens
    against vLLM's ``external_prefix_cache_hits``, the tiers' read time against kvtier's ``offload_load_io_seconds``,
    the queue and prefill parts against vLLM's per-request histograms."""
    hits = [m.external_prefix_cache_hits for m in metrics if m.external_prefix_cache_hits is not None]
    io = [m.kvtier_offload_load_io_s for m in metrics if m.kvtier_offload_load_io_s is not None]
    counter_hits = sum(hits) if hits else None
    counter_io = sum(sum(d.values()) for d in io) if io else None
    ours_io = sum(j.load_io_s.values())
    queues = [m.queue_time_s_mean for m in metrics if m.queue_time_s_mean is not None]
    prefills = [m.prefill_time_s_mean for m in metrics if m.prefill_time_s_mean is not None]
    return j.model_copy(
        update={
            "external_hits_counter": counter_hits,
            "external_match": None if counter_hits is None else int(round(counter_hits)) == j.external_tokens,
            "load_io_s_counter": None if counter_io is None else round(counter_io, 6),
            "load_io_ratio": round(ours_io / counter_io, 6) if counter_io else None,
            "queue_s_mean": _mean_part(records, ("queue", "lookup", "fetch")),
            "vllm_queue_s_mean": queues[0] if len(queues) == 1 else None,
            "recompute_s_mean": _mean_part(records, ("recompute",)),
            "vllm_prefill_s_mean": prefills[0] if len(prefills) == 1 else None,
        }
    )


JOINED_WARN = 0.99
"""Warn when fewer than this share of the ok requests joined their engine record."""
IO_AGREE = 0.10
"""The joined records' read time agrees with the tiers' own counter within this fraction."""


def join_warnings(j: EngineJoin) -> list[ResultWarning]:
    out = []
    if (j.joined_share is not None and j.joined_share < JOINED_WARN) or j.log_dropped:
        causes = {**j.unjoined, **{f"engine-dropped-{k}": n for k, n in j.log_dropped.items()}}
        out.append(
            warning(
                WarningCode.engine_join_incomplete,
                f"{j.joined_ok} of {j.requests_ok} ok requests joined their engine record "
                f"({', '.join(f'{k} {n}' for k, n in sorted(causes.items())) or 'no cause known'})",
                joined_ok=j.joined_ok,
                requests_ok=j.requests_ok,
                causes=causes,
            )
        )
    if j.external_match is False:
        out.append(
            warning(
                WarningCode.engine_counts_differ,
                f"the joined records planned {j.external_tokens:,} tokens from kvtier's tiers, vLLM's "
                f"external_prefix_cache_hits counted {j.external_hits_counter:,.0f} over the run (requests the replay "
                "did not send, or records the engine did not write)",
                records=j.external_tokens,
                counter=j.external_hits_counter,
            )
        )
    if j.load_io_ratio is not None and abs(j.load_io_ratio - 1) > IO_AGREE:
        out.append(
            warning(
                WarningCode.engine_counts_differ,
                f"the joined records' tier read time is {j.load_io_ratio:.3f} of the tiers' own counter "
                "(kvtier:offload_load_io_seconds) over the run",
                ratio=j.load_io_ratio,
            )
        )
    return out


__all__ = ["collect", "join_warnings", "join", "engine_checks", "parts"]
