"""``kvtier plan retention``: how much history can a tier hold before it evicts, for a trace and a model.

The input is a stream of prefix-block accesses, in the order a server sees them:

* a Mooncake trace: each request's ``hash_ids`` (512-token prefix blocks, the last one partial), at its
  recorded arrival time;
* a replay dataset (agent traces, tau2, ShareGPT, ...): each turn's prompt tokenized as the replay sends it and
  cut into ``--block-tokens`` blocks named by the hash of their whole prefix (``keys.chunk_hash``), the
  virtual users taken as a closed loop of ``--concurrency`` users with equal service times (each in-flight
  user sends its next turn in turn, the next user takes a finished one's place); time is then counted in
  requests;
* a replay result (``--from``): its own dataset, in the order and at the times its ok requests were sent.

Over that stream the exact LRU stack distance of every block access is computed (the ``kvtier trace stats``
machinery, ``stats.Fenwick``): the tokens of the distinct blocks touched since the block's previous access,
plus its own. An LRU cache of C tokens (evicting until the new block fits) serves the access if and only if
that need is at most C, so the hit curve over capacity is exact: no sampling, no approximation. Bytes are
tokens times the model's KV bytes per token.

The tiers given (``--tier``, fastest first) are simulated as they run in kvtier's engine: a waterfall of LRU
tiers, each evicting until a block fits and demoting what it evicts to the next, a hit anywhere promoted to the
top (``promotion="on-read"``), the last tier's evictions dropped. With blocks far smaller than the tiers that is
one LRU of their summed capacity; with blocks near a tier's size the tiers' leftover space makes it hold less,
which the simulation counts.

Fanout protection, beside LRU: a block more than one continuation followed in the requests seen so far (a shared
system prompt's, a shared document's; engine/policy.py FanoutMarks, from each request's chain of keys, no session
identity needed) is *protected*: the cache evicts the least recent unprotected block first, and a protected one
only while protected blocks hold more than FANOUT_PROTECT_SHARE of the capacity, or nothing else is left (segmented
LRU, the segments chosen by fanout). It is simulated at a few capacities beside the exact LRU figure there
(``policies``), on the same accesses: the policy kvtier's vLLM index runs with ``eviction: fanout``.

The retention window: at a moment t, the tiers down to tier ``i`` hold the most recently touched blocks (each
tier's blocks are more recent than the next tier's); the oldest, tier ``i``'s least recent, was last touched at
some s, and t - s is the history held then (in seconds, or requests). It is sampled at request boundaries once
tier ``i`` has first evicted; tiers that never evict hold the whole trace and say so.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from kvtier.engine.policy import FANOUT_PROTECT_SHARE, FanoutMarks
from kvtier.errors import DatasetError
from kvtier.results.plan import CurvePoint, PolicyPoint, RetentionReport, TierRetention, Window, WorkingSetPoint
from kvtier.stats import Fenwick, percentile

if TYPE_CHECKING:
    from kvtier.replay.datasets import VirtualUser


@dataclass
class AccessStream:
    """Block accesses in server order: per access its block's key and tokens and its request's index."""

    keys: list[object] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    request: list[int] = field(default_factory=list)
    request_time: list[float] = field(default_factory=list)  # per request, from the first; in ``unit``
    unit: Literal["s", "requests"] = "requests"
    block_tokens: int = 0
    source: str = ""
    order: str = ""  # how the accesses were ordered, in words

    @property
    def requests(self) -> int:
        return len(self.request_time)

    def add_request(self, blocks: Sequence[tuple[object, int]], t: float) -> None:
        i = len(self.request_time)
        self.request_time.append(t)
        for key, n in blocks:
            self.keys.append(key)
            self.tokens.append(n)
            self.request.append(i)


def stream_from_trace(path: str) -> AccessStream:
    """A Mooncake trace's block accesses at their arrival times (a trace without block ids has no reuse to
    measure: a DatasetError says so)."""
    from kvtier.workload.traces import MOONCAKE_BLOCK_TOKENS, load_trace

    trace = load_trace(path)
    if trace.format != "mooncake":
        raise DatasetError(
            f"--trace {path}: {'an' if trace.format[0] in 'aeiou' else 'a'} {trace.format} trace has no prefix-block "
            "ids, so no reuse to measure; give a Mooncake trace (hash_ids) or --dataset"
        )
    bt = trace.block_tokens or MOONCAKE_BLOCK_TOKENS
    s = AccessStream(unit="s", block_tokens=bt, source=path, order="the trace's arrival times")
    t0 = trace.requests[0].arrival_s
    for r in trace.requests:
        ids = r.hash_ids or ()
        last = r.input_tokens - bt * (len(ids) - 1)
        s.add_request([(h, bt if i < len(ids) - 1 else last) for i, h in enumerate(ids)], r.arrival_s - t0)
    return s


def closed_loop_order(turns_per_user: Sequence[int], concurrency: int) -> list[tuple[int, int]]:
    """(user index, turn) in the order a closed loop of ``concurrency`` users with equal service times sends
    them: each in-flight user sends its next turn in turn; a finished user's place goes to the next user."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    slots: list[list[int]] = []  # [user, next turn]
    nxt = 0
    out: list[tuple[int, int]] = []
    n = len(turns_per_user)
    while nxt < n and len(slots) < concurrency:
        slots.append([nxt, 0])
        nxt += 1
    while slots:
        kept: list[list[int]] = []
        for slot in slots:
            u, t = slot
            out.append((u, t))
            if t + 1 < turns_per_user[u]:
                kept.append([u, t + 1])
            elif nxt < n:
                kept.append([nxt, 0])
                nxt += 1
        slots = kept
    return out


def stream_from_users(
    users: Sequence[VirtualUser],
    encode: Callable[[str], list[int]],
    block_tokens: int,
    order: Sequence[tuple[int, int]],
    times: Sequence[float] | None = None,
    source: str = "",
    order_text: str = "",
) -> AccessStream:
    """The full blocks of each (user, turn) of ``order``, at ``times`` (seconds) or one request a step."""
    from kvtier.keys import prefix_chunk_hashes
    from kvtier.replay.reuse import turn_tokens

    s = AccessStream(
        unit="requests" if times is None else "s", block_tokens=block_tokens, source=source, order=order_text
    )
    cache: dict[str, list[int]] = {}
    for i, (u, t) in enumerate(order):
        hashes = prefix_chunk_hashes(turn_tokens(users[u].turns[t], encode, cache), block_tokens)
        s.add_request([(h, block_tokens) for h in hashes], float(i) if times is None else times[i])
    return s


POLICY_POINTS = (0.05, 0.1, 0.25, 0.5)
"""The capacities, as shares of the stream's distinct tokens, the policies are compared at (and the tiers' sum)."""


def fanout_served(s: AccessStream, cap: int, protect_share: float = FANOUT_PROTECT_SHARE) -> int:
    """The tokens a cache of ``cap`` tokens serves over ``s`` under fanout protection (module docstring): each
    request's chain is noted first (engine/policy.py FanoutMarks, as kvtier's vLLM index notes it), then its blocks
    are accessed; the cache evicts until a new block fits, the least recent unshared block first, a shared one only
    while shared blocks hold more than ``protect_share`` of ``cap`` or no unshared block is left."""
    marks = FanoutMarks()
    segments: tuple[OrderedDict[object, int], OrderedDict[object, int]] = (OrderedDict(), OrderedDict())
    used = [0, 0]  # tokens held: unshared, shared

    def now_shared(key: Hashable) -> None:
        size = segments[0].pop(key, None)
        if size is not None:
            used[0] -= size
            segments[1][key] = size
            used[1] += size

    marks.on_shared = now_shared
    served = 0
    keys, toks, req = s.keys, s.tokens, s.request
    start = 0
    while start < len(keys):
        end = start
        while end < len(keys) and req[end] == req[start]:
            end += 1
        marks.note(keys[start:end])
        for k, size in zip(keys[start:end], toks[start:end], strict=True):
            for i in (0, 1):
                held = segments[i].pop(k, None)
                if held is not None:
                    served += size
                    used[i] -= held
                    break
            j = int(k in marks.shared)
            segments[j][k] = size
            used[j] += size
            while used[0] + used[1] > cap:
                i = 1 if segments[1] and (used[1] > protect_share * cap or not segments[0]) else 0
                used[i] -= segments[i].popitem(last=False)[1]
        start = end
    return served


class _Waterfall:
    """LRU tiers in tokens, fastest first: evict until a block fits, demote to the next tier, drop from the last;
    a hit in any tier is promoted to the top. Per tier: the tokens it served and whether it has evicted."""

    def __init__(self, caps: Sequence[int]) -> None:
        self.caps = list(caps)
        self.tiers: list[OrderedDict[object, int]] = [OrderedDict() for _ in caps]
        self.used = [0] * len(caps)
        self.served = [0] * len(caps)
        self.evicted = [False] * len(caps)

    def access(self, key: object, size: int) -> None:
        if not self.caps:
            return
        for i, tier in enumerate(self.tiers):
            held = tier.pop(key, None)
            if held is not None:
                self.served[i] += size
                self.used[i] -= held
                break
        self._put(0, key, size)

    def _put(self, i: int, key: object, size: int) -> None:
        if i == len(self.tiers):
            return  # evicted from the last tier: dropped
        tier = self.tiers[i]
        tier[key] = size
        self.used[i] += size
        while self.used[i] > self.caps[i]:
            self.evicted[i] = True
            old, osize = tier.popitem(last=False)  # least recent first: each is newer than the tier below's
            self.used[i] -= osize
            self._put(i + 1, old, osize)

    def oldest(self, i: int) -> object | None:
        """The oldest block held in tiers 0..i (tier i's least recent, or the nearest non-empty tier above's)."""
        for j in range(i, -1, -1):
            if self.tiers[j]:
                return next(iter(self.tiers[j]))
        return None


def _window(a: list[float]) -> Window:
    return Window(p10=percentile(a, 10), p50=percentile(a, 50), p90=percentile(a, 90))


@dataclass
class _Walked:
    need: np.ndarray  # per access, the LRU capacity (tokens) that serves it; int64 max: cold
    live: int  # distinct tokens touched
    filled: list[float | None]
    windows: list[list[float]]
    windows_req: list[list[float]]
    ws: list[WorkingSetPoint]
    waterfall: _Waterfall


def _walk(s: AccessStream, bpt: int, caps: list[int], samples: int) -> _Walked:
    """One pass over the accesses: each one's stack distance (the Fenwick tree over last accesses), the tiers'
    waterfall, their windows sampled at request boundaries, and the working set."""
    n = len(s.keys)
    fw = Fenwick(n)
    last: dict[object, int] = {}
    need = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)  # cold: no capacity serves it
    live = 0
    filled: list[float | None] = [None] * len(caps)
    windows: list[list[float]] = [[] for _ in caps]
    windows_req: list[list[float]] = [[] for _ in caps]
    requests = s.requests
    sample_every = max(1, requests // samples)
    ws_every = max(1, requests // 50)
    ws: list[WorkingSetPoint] = []
    interval: set[object] = set()
    interval_tokens = 0
    keys, toks, req, times = s.keys, s.tokens, s.request, s.request_time
    waterfall = _Waterfall(caps)
    for pos in range(n):
        k, size = keys[pos], toks[pos]
        prev = last.get(k)
        if prev is not None:
            need[pos] = fw.prefix(pos) - fw.prefix(prev + 1) + size
            fw.add(prev, -toks[prev])
        else:
            live += size
        fw.add(pos, size)
        last[k] = pos
        waterfall.access(k, size)
        if k not in interval:
            interval.add(k)
            interval_tokens += size
        r = req[pos]
        if pos + 1 < n and req[pos + 1] == r:
            continue  # a request's state is read after its last block
        now = times[r]
        for i in range(len(caps)):
            if not waterfall.evicted[i]:
                continue
            if filled[i] is None:
                filled[i] = now
            if r % sample_every == 0:
                block = waterfall.oldest(i)
                oldest = req[last[block]] if block is not None else 0  # the request that last touched it
                windows[i].append(now - times[oldest])
                windows_req[i].append(float(r - oldest))
        if r % ws_every == 0 or r == requests - 1:
            ws.append(
                WorkingSetPoint(
                    t=now,
                    requests=r + 1,
                    distinct_tokens=live,
                    distinct_bytes=live * bpt,
                    interval_tokens=interval_tokens,
                    interval_bytes=interval_tokens * bpt,
                )
            )
            interval, interval_tokens = set(), 0
    return _Walked(need, live, filled, windows, windows_req, ws, waterfall)


def retention_report(
    s: AccessStream,
    model: str,
    kv_bytes_per_token: int,
    tiers: Sequence[tuple[str, float]] = (),
    curve_points: int = 24,
    samples: int = 400,
) -> RetentionReport:
    """The report of the module docstring; ``tiers`` are (name, decimal GB) fastest first (a waterfall)."""
    if not s.keys:
        raise DatasetError(f"{s.source}: no full prefix block in any request: nothing to retain")
    bpt = kv_bytes_per_token
    tier_caps = [(name, int(gb * 1e9)) for name, gb in tiers]
    cum_tokens: list[int] = []
    acc = 0
    for _, cap_bytes in tier_caps:
        acc += cap_bytes // bpt
        cum_tokens.append(acc)
    w = _walk(s, bpt, [cap_bytes // bpt for _, cap_bytes in tier_caps], samples)
    need, live, filled, windows, windows_req, ws = w.need, w.live, w.filled, w.windows, w.windows_req, w.ws
    toks, times, requests = s.tokens, s.request_time, s.requests
    tok_arr = np.asarray(toks, dtype=np.int64)
    total = int(tok_arr.sum())
    reused = need != np.iinfo(np.int64).max
    reused_tokens = int(tok_arr[reused].sum())
    order = np.argsort(need[reused], kind="stable")
    sorted_need = need[reused][order]
    cum_hit = np.concatenate([[0], np.cumsum(tok_arr[reused][order])])

    def served(cap: int) -> int:
        return int(cum_hit[int(np.searchsorted(sorted_need, cap, side="right"))])

    lo, hi = max(1, s.block_tokens), max(live, s.block_tokens)
    grid = sorted(
        {int(round(math.exp(x))) for x in np.linspace(math.log(lo), math.log(hi), max(2, curve_points))}
        | set(cum_tokens)
    )
    curve = [
        CurvePoint(
            capacity_tokens=c,
            capacity_bytes=c * bpt,
            hit_fraction=round(served(c) / total, 6),
            reuse_hit_fraction=round(served(c) / reused_tokens, 6) if reused_tokens else None,
        )
        for c in grid
    ]
    out_tiers = []
    done = 0
    for i, ((name, cap_bytes), c) in enumerate(zip(tier_caps, cum_tokens)):
        mine = w.waterfall.served[i]
        done += mine
        out_tiers.append(
            TierRetention(
                tier=name,
                capacity_bytes=cap_bytes,
                capacity_tokens=cap_bytes // bpt,
                cumulative_capacity_tokens=c,
                hit_fraction=round(mine / total, 6),
                cumulative_hit_fraction=round(done / total, 6),
                fills_at=filled[i],
                window=_window(windows[i]),
                window_requests=_window(windows_req[i]),
                holds_whole_trace=filled[i] is None,
            )
        )
    needs = sorted_need.astype(np.float64)
    policies = []
    for c in sorted({max(s.block_tokens, int(p * live)) for p in POLICY_POINTS} | set(cum_tokens[-1:])):
        policies.append(
            PolicyPoint(
                capacity_tokens=c,
                capacity_bytes=c * bpt,
                lru_hit_fraction=round(served(c) / total, 6),
                fanout_hit_fraction=round(fanout_served(s, c) / total, 6),
            )
        )
    return RetentionReport(
        source=s.source,
        order=s.order,
        unit=s.unit,
        model=model,
        kv_bytes_per_token=bpt,
        block_tokens=s.block_tokens,
        requests=requests,
        accesses=len(s.keys),
        accessed_tokens=total,
        reused_tokens=reused_tokens,
        distinct_tokens=live,
        distinct_bytes=live * bpt,
        span=times[-1],
        need_tokens={f"p{q}": percentile(needs, q) for q in (50, 90, 99)},
        tiers=out_tiers,
        curve=curve,
        working_set=ws,
        policies=policies,
        protect_share=FANOUT_PROTECT_SHARE,
    )


def stream_from_replay(path: str) -> AccessStream:
    """A replay result's own dataset, in the order and at the times its ok requests were sent."""
    from kvtier.replay.driver import load_users
    from kvtier.results import load

    folder = Path(path)
    summary = folder / "summary.json" if folder.is_dir() else folder
    result = load(summary)
    from kvtier.results.records import read_records
    from kvtier.results.replay import ReplayResult

    if not isinstance(result, ReplayResult):
        raise DatasetError(f"--from {path}: not a kvtier replay result")
    cfg, _, users, tokenizer, _ = load_users(result.config)
    records = summary.parent / "requests.jsonl"
    index = {u.user_id: i for i, u in enumerate(users)}
    sent: list[tuple[float, int, int]] = []
    for n, rec in read_records(records):
        if not rec.ok or rec.start_unix_s is None:
            continue
        u = index.get(rec.user)
        if u is None or not rec.turn < len(users[u].turns):
            raise DatasetError(
                f"{records}:{n}: user {rec.user!r} turn {rec.turn!r} is not in the replay's dataset "
                f"({cfg.dataset}) as it reads now: has the file changed?"
            )
        sent.append((rec.start_unix_s, u, rec.turn))
    if not sent:
        raise DatasetError(f"{records}: no ok request to order the dataset by")
    sent.sort()
    t0 = sent[0][0]
    return stream_from_users(
        users,
        tokenizer.encode,
        cfg.reuse_block_tokens,
        [(u, t) for _, u, t in sent],
        [t - t0 for t, _, _ in sent],
        source=str(summary),
        order_text=f"the {len(sent)} ok requests of the replay, as sent",
    )


__all__ = [
    "AccessStream",
    "fanout_served",
    "RetentionReport",
    "closed_loop_order",
    "retention_report",
    "stream_from_replay",
    "stream_from_trace",
    "stream_from_users",
]
