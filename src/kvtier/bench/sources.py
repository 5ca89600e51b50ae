"""Where a bench run's requests come from: synthetic users, a ShareGPT dataset, a trace, or the
entries a decode-only node reads. Pure iterators over the derived workload; no I/O, no threads."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

from kvtier.bench.plan import Plan
from kvtier.workload.conversations import conversation_requests
from kvtier.workload.layout import KVRef, hash_id_chunks, segment_chunks
from kvtier.workload.sharegpt import dataset_requests
from kvtier.workload.users import Request, UserProfile, draw_qos, draws, phase_for, user_rng

PREPOPULATED_PER_USER = 10
"""--decode-only: entries each user's share of the prepopulation holds (num_users x 10, as the reference)."""


def prepopulated_entries(plan: Plan) -> list[tuple[str, int]]:
    """(key, tokens) of the entries --decode-only writes before the load (stable per seed)."""
    out = []
    for user in plan.workload.users:
        for i, (ctx, _, _) in zip(range(PREPOPULATED_PER_USER), draws(user, plan.seed + 1)):
            out.append((f"prepop_user{user.user_id}_{i}", ctx))
    return out


def decode_only_requests(plan: Plan, user: UserProfile, entries: list[tuple[str, int]]) -> Iterator[Request]:
    """A decode node's requests: each reads one of the prepopulated entries (seeded choice)."""
    rng = user_rng(plan.seed, user.user_id, stream=3)
    for seq, (_, gen, think) in enumerate(draws(user, plan.seed)):
        key, tokens = entries[int(rng.integers(0, len(entries)))]
        yield Request(
            user.user_id,
            seq,
            f"user{user.user_id}_decode_{seq:06d}",
            user.qos,
            user.priority,
            "prefill_decode",
            tokens,
            gen,
            think,
            decode_key=key,
            decode_tokens=tokens,
        )


def user_requests(plan: Plan, user: UserProfile) -> Iterator[Request]:
    """A closed-loop user's requests: its share of a dataset, or its synthetic conversations (with
    RAG queries mixed in when enabled)."""
    w, cfg = plan.workload, plan.config
    if w.dataset is not None:
        mine = w.dataset.conversations[user.user_id :: len(w.users)]
        yield from dataset_requests(user, mine, plan.seed, cfg.replay_cycles, w.settings, w.scope, w.conversations)
        return
    reqs = conversation_requests(user, plan.seed, w.settings, w.scope, w.conversations)
    if w.rag is None:
        yield from reqs
        return
    rng = user_rng(plan.seed, user.user_id, stream=6)
    p = w.rag.settings.request_probability
    for req in reqs:
        yield dataclasses.replace(req, rag_reads=w.rag.retrieve(rng)) if rng.random() < p else req


def trace_requests(plan: Plan) -> Iterator[Request]:
    """The trace's requests in arrival order, ``--replay-cycles`` times (0: over and over until the
    run ends, as the reference); each cycle starts one second after the previous one's last arrival."""
    w, cfg = plan.workload, plan.config
    trace = w.trace
    if trace is None:
        raise ValueError("trace_requests needs a trace")
    rng = user_rng(plan.seed, 0, stream=4)
    n = 0
    for cycle in itertools.count() if cfg.replay_cycles == 0 else range(cfg.replay_cycles):
        for i, tr in enumerate(trace.requests):
            qos = draw_qos(rng, cfg.tuning.qos_distribution)
            key = f"trace_c{cycle}_{i:07d}"
            base = Request(
                user_id=n % max(1, cfg.num_users),
                seq=n,
                key=key,
                qos=qos,
                priority=cfg.tuning.qos_profiles[qos].priority,
                phase=phase_for(tr.input_tokens),
                context_tokens=tr.input_tokens,
                generate_tokens=tr.output_tokens,
                think_before_s=0.0,
                new_tokens=tr.input_tokens,
                arrival_s=cycle * (trace.requests[-1].arrival_s + 1.0) + tr.arrival_s,
            )
            if cfg.kv_layout == "chunked" and tr.hash_ids is not None:
                blocks = hash_id_chunks(tr.hash_ids, tr.input_tokens, trace.block_tokens or 512, w.scope)
                yield dataclasses.replace(base, reads=tuple(blocks), prefix_reads=True)
            elif cfg.kv_layout == "chunked":
                chunks = segment_chunks([(key, tr.input_tokens)], cfg.kv_chunk_tokens, w.scope)
                yield dataclasses.replace(base, writes=tuple(KVRef(c.key, c.tokens, "context") for c in chunks))
            else:
                yield dataclasses.replace(
                    base,
                    writes=(KVRef(key, tr.input_tokens, "context"),),
                    decode_key=key,
                    decode_tokens=tr.input_tokens,
                )
            n += 1


__all__ = ["user_requests", "trace_requests", "decode_only_requests", "prepopulated_entries", "PREPOPULATED_PER_USER"]
