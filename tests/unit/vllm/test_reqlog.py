"""The engine's per-request log (kvtier/vllm/reqlog.py) without vLLM: the stamps a connector gives it become one
line per request, written whole, capped and counted; and a worker's loads are tallied per request
(kvtier/vllm/worker.py RequestIO) on real CPU-tier blocks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.results.engine_log import read_engine_log
from kvtier.vllm.reqlog import RequestLog
from kvtier.vllm.worker import BlockLoad, RequestIO


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _log(path: Path, clock: Clock, cap: int = 1 << 20) -> RequestLog:
    header = {
        "engine": "e0",
        "block_tokens": 16,
        "block_bytes": 4096,
        "world_size": 1,
        "tiers": [{"name": "cpu", "source": "host"}],
        "cache_server": None,
    }
    return RequestLog(str(path), cap, header, 16, 4096, clock=clock, wall=lambda: clock.t + 1000.0)


def _one_request(log: RequestLog, clock: Clock, rid: str, *, failed_blocks: int = 0) -> None:
    """A 100-token prompt: 32 from vLLM's cache, 48 loaded from cpu (3 blocks), 20 recomputed."""
    log.seen(rid, 100, arrival_unix_s=1099.99)  # the API server stamped it 10 ms before the scheduler got it
    clock.t = 100.02
    log.lookup(rid, clock.t)
    clock.t = 100.03
    log.admitted(rid, 32, 48, {"cpu": 48}, preemptions=0)
    log.load_planned(rid)
    io = RequestIO()
    io.add([BlockLoad(b"k", i, 4096 if i >= failed_blocks else 0, "cpu", 1_000_000) for i in range(3)], 100.031, 100.04)
    clock.t = 100.05
    log.loads_done({rid: io})
    clock.t = 100.06
    log.scheduled(7, {rid: (80, 20)})  # the step that computes the rest of its prompt
    clock.t = 100.09
    log.step_done(6)  # an earlier step's output: not this request's first token
    clock.t = 100.10
    log.step_done(7)
    log.stores_planned(rid, {"cpu": 2})
    log.finished(rid, "FINISHED_STOPPED")
    log.closed(rid)


def test_a_requests_stamps_become_one_line_with_its_prompt_by_source(tmp_path: Path):
    clock = Clock()
    log = _log(tmp_path / "r.jsonl", clock)
    _one_request(log, clock, "chatcmpl-kvt-1-0-0123abcd")
    log.close()
    got = read_engine_log([tmp_path / "r.jsonl"])
    assert len(got.headers) == 1 and len(got.footers) == 1 and got.footers[0].records == 1
    (r,) = got.requests
    assert r.external_id == "kvt-1-0"
    assert r.tokens == {"gpu": 32, "cpu": 48, "recomputed": 20} and r.external_tokens == 48
    m = r.mono_s
    assert (m.arrived, m.lookup, m.admitted, m.loaded, m.prefill, m.first_token) == (
        100.0,
        100.02,
        100.03,
        100.05,
        100.06,
        100.10,
    )
    assert (m.load_submitted, m.load_done) == (100.031, 100.04)
    assert r.load.blocks == {"cpu": 3} and r.load.bytes == {"cpu": 3 * 4096} and r.load.io_s == {"cpu": 0.003}
    assert r.stores.blocks == {"cpu": 2} and r.stores.bytes == {"cpu": 2 * 4096}
    assert r.arrival_unix_s - r.wall_minus_mono_s == pytest.approx(99.99)


def test_a_failed_block_moves_its_tokens_to_recomputed_and_is_counted(tmp_path: Path):
    clock = Clock()
    log = _log(tmp_path / "r.jsonl", clock)
    _one_request(log, clock, "chatcmpl-kvt-1-1-0123abcd", failed_blocks=1)
    log.close()
    (r,) = read_engine_log([tmp_path / "r.jsonl"]).requests
    assert r.failed_tokens == 16 and r.load.failed_blocks == 1
    assert r.tokens == {"gpu": 32, "cpu": 32, "recomputed": 36} and r.external_tokens == 48


def test_a_failed_block_is_taken_from_the_tier_it_was_planned_from(tmp_path: Path):
    clock = Clock()
    log = _log(tmp_path / "r.jsonl", clock)
    rid = "chatcmpl-kvt-1-2-0123abcd"
    log.seen(rid, 100, None)
    plan = {b"k0": "cpu", b"k1": "cpu", b"k2": "storage"}
    log.admitted(rid, 32, 48, {"cpu": 32, "storage": 16}, preemptions=0, key_tiers=plan)
    io = RequestIO()
    got = [BlockLoad(b"k0", 0, 4096, "cpu", 1000), BlockLoad(b"k1", 1, 4096, "cpu", 1000), BlockLoad(b"k2", 2, 0)]
    io.add(got, 100.0, 100.01)
    log.loads_done({rid: io.merge(io)})  # two workers: each failed its shard of the same block
    log.closed(rid)
    log.close()
    (r,) = read_engine_log([tmp_path / "r.jsonl"]).requests
    assert r.tokens == {"gpu": 32, "cpu": 32, "storage": 0, "recomputed": 36}
    assert (r.failed_tokens, r.load.failed_blocks, r.load.blocks) == (16, 1, {"cpu": 4})


def test_a_preemption_before_the_first_token_is_said_and_the_first_admission_kept(tmp_path: Path):
    clock = Clock()
    log = _log(tmp_path / "r.jsonl", clock)
    log.seen("a-0123abcd", 100, None)
    log.admitted("a-0123abcd", 32, 0, {}, preemptions=0)
    log.admitted("a-0123abcd", 0, 0, {}, preemptions=0)  # allocated again after its load: not a preemption
    log.admitted("a-0123abcd", 64, 0, {}, preemptions=1)  # preempted, readmitted: vLLM counts it as preempted
    log.closed("a-0123abcd")
    log.close()
    (r,) = read_engine_log([tmp_path / "r.jsonl"]).requests
    assert r.preemptions == 1 and r.preempted_before_first_token
    assert r.tokens["gpu"] == 32 and r.mono_s.first_token is None


def test_past_the_cap_records_are_dropped_and_counted_and_every_line_is_whole(tmp_path: Path):
    clock = Clock()
    sizing = _log(tmp_path / "sizing.jsonl", clock)
    for i in range(2):
        _one_request(sizing, clock, f"chatcmpl-kvt-1-{i}-0123abcd")
    sizing.close()
    two = sum(len(x) + 1 for x in (tmp_path / "sizing.jsonl").read_bytes().split(b"\n")[:3])  # header, 2 records
    path = tmp_path / "r.jsonl"
    clock = Clock()
    log = _log(path, clock, cap=two + 10)
    for i in range(6):
        _one_request(log, clock, f"chatcmpl-kvt-1-{i}-0123abcd")
    log.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(x) for x in lines[:-1])
    got = read_engine_log([path])
    assert len(got.requests) == 2 and got.dropped == {"cap": 4}
    assert got.footers[0].records == 2


def test_the_queue_bound_drops_and_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import kvtier.vllm.reqlog as reqlog

    monkeypatch.setattr(reqlog, "MAX_PENDING", 1)
    clock = Clock()
    log = _log(tmp_path / "r.jsonl", clock)
    with log._cv:  # held (it is re-entrant): the writer cannot take the queue, so finished records pile up there
        for i in range(3):
            log.seen(f"r{i}-0123abcd", 10, None)
            log.closed(f"r{i}-0123abcd")
    log.close()
    got = read_engine_log([tmp_path / "r.jsonl"])
    assert len(got.requests) == 1 and got.dropped == {"queue": 2}


def test_the_log_is_never_opened_through_a_link_nor_on_a_non_file(tmp_path: Path):
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "link.jsonl").symlink_to(target)
    with pytest.raises(ConfigError, match="request_log"):
        _log(tmp_path / "link.jsonl", Clock())
    with pytest.raises(ConfigError, match="not a regular file"):
        os.mkfifo(tmp_path / "fifo")
        fd = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)  # a reader, so the writer's open returns
        try:
            _log(tmp_path / "fifo", Clock())
        finally:
            os.close(fd)
    with pytest.raises(ConfigError, match="cannot open"):
        _log(tmp_path / "missing" / "r.jsonl", Clock())
    assert target.read_text() == ""


def test_a_line_still_being_written_is_left_for_the_next_read(tmp_path: Path):
    clock = Clock()
    path = tmp_path / "r.jsonl"
    log = _log(path, clock)
    _one_request(log, clock, "chatcmpl-kvt-1-0-0123abcd")
    log.close()
    with path.open("ab") as f:
        f.write(b'{"kind":"request","id":"half')
    got = read_engine_log([path])
    assert len(got.requests) == 1 and got.partial_lines == 1


def test_a_worker_tallies_each_requests_loads_from_real_tier_blocks(tmp_path: Path):
    torch = pytest.importorskip("torch")
    from kvtier.engine.memory import MemoryTier
    from kvtier.vllm.worker import BlockLayout, BlockWorker

    block = 4096
    kv = torch.zeros((8, block), dtype=torch.int8)
    kv[:4] = torch.arange(4, dtype=torch.int8).view(4, 1)  # blocks 0-3 hold 0, 1, 2, 3
    w = BlockWorker([MemoryTier(1 << 20, name="cpu")], BlockLayout([(kv, block)]), lambda k: f"k{k}", io_threads=2)
    try:

        class Plan:
            keys_to_store = [0, 1, 2, 3]
            actions = [("place", k, 0) for k in range(4)]

        w.submit_store(1, [0, 1, 2, 3], Plan())
        assert w.wait({1}, timeout_s=30)
        w.submit_load(2, [0, 1, 9], [4, 5, 6], tag="req-a")  # key 9 was never stored: a failed block
        w.submit_load(3, [2, 3], [6, 7], tag="req-b")
        assert w.wait({2, 3}, timeout_s=30)
        io = w.take_request_io()
        assert set(io) == {"req-a", "req-b"}
        a, b = io["req-a"], io["req-b"]
        assert a.blocks == {"cpu": 2} and a.nbytes == {"cpu": 2 * block} and a.failed_blocks == 1
        assert b.blocks == {"cpu": 2} and b.failed_blocks == 0 and b.io_s["cpu"] > 0
        assert a.submitted_s <= a.done_s and b.submitted_s <= b.done_s
        assert int(kv[4, 0]) == 0 and int(kv[5, 0]) == 1 and int(kv[7, 0]) == 3
        assert w.take_request_io() == {}  # taken once
        merged = a.merge(b)
        assert merged.blocks == {"cpu": 4} and merged.failed_blocks == 1
        assert merged.submitted_s == min(a.submitted_s, b.submitted_s)
        assert w.counters.take()["load_ns:cpu"] == pytest.approx((a.io_s["cpu"] + b.io_s["cpu"]) * 1e9, abs=8)
    finally:
        w.close()
