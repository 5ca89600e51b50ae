"""The scheduler-side index of kvtier's vLLM offloading backend (kvtier/vllm/index.py) and its settings."""

from __future__ import annotations

import random

import pytest

from kvtier.errors import ConfigError
from kvtier.vllm import kv_transfer_config
from kvtier.vllm.index import BlockIndex
from kvtier.vllm.settings import VllmOffloadSettings


def _stored(ix: BlockIndex[str], keys: list[str]) -> list[tuple[str, str, int]]:
    plan = ix.plan_store(keys)
    assert plan is not None
    ix.complete_store(plan.keys_to_store)
    return plan.actions


def test_a_new_block_goes_to_the_top_and_the_lru_block_is_demoted_then_dropped_at_the_bottom():
    ix: BlockIndex[str] = BlockIndex([("cpu", 2, "host"), ("storage", 2, "disk")])
    assert _stored(ix, ["a", "b"]) == [("place", "a", 0), ("place", "b", 0)]
    ix.touch(["a"])  # b is now the cpu tier's LRU block
    assert _stored(ix, ["c"]) == [("move", "b", 1), ("place", "c", 0)]
    assert _stored(ix, ["d"]) == [("move", "a", 1), ("place", "d", 0)]
    # storage is full (b, a): making room in cpu demotes c, which first drops storage's LRU block (b)
    plan = ix.plan_store(["e"])
    assert plan is not None and plan.actions == [("evict", "b", 1), ("move", "c", 1), ("place", "e", 0)]
    assert plan.evicted == ["b"] and ix.lookup("b") == "miss"
    assert ix.tier_of("c").source == "disk" and ix.tier_of("e").source == "host"
    assert ix.counters.evicted == {"storage": 1} and ix.counters.demoted == {"cpu": 3}


def test_pinned_and_pending_blocks_are_never_victims_and_a_full_index_refuses():
    ix: BlockIndex[str] = BlockIndex([("cpu", 2, "host")])
    plan = ix.plan_store(["a", "b"])
    assert plan is not None and ix.lookup("a") == "pending"
    assert ix.plan_store(["c"]) is None  # both slots are being stored: nothing to evict
    assert ix.counters.rejected == 1
    ix.complete_store(["a", "b"])
    ix.pin(["a", "b"])  # both being loaded
    assert ix.plan_store(["c"]) is None
    ix.unpin(["b"])
    assert _stored(ix, ["c"]) == [("evict", "b", 0), ("place", "c", 0)]
    assert ix.lookup("a") == "hit"  # the pinned one stayed
    ix.unpin(["a"])  # a load is a use: a is now newer than c
    assert _stored(ix, ["d"]) == [("evict", "c", 0), ("place", "d", 0)]


def test_a_failed_store_leaves_the_index_and_frees_its_slot():
    ix: BlockIndex[str] = BlockIndex([("cpu", 1, "host")])
    assert ix.plan_store(["a"]) is not None
    assert ix.complete_store(["a"], success=False) == ["a"]
    assert ix.lookup("a") == "miss" and ix.usage() == {"cpu": (0, 1)} and ix.counters.failed_stores == 1


def test_the_index_never_holds_more_than_its_slots_and_its_actions_replay_to_the_same_state():
    """A random workload: replaying the plans' actions on a plain model of the tiers (what the workers do) gives
    exactly the index's placement, and no tier is ever over its slots."""
    rnd = random.Random(7)
    slots = [("cpu", 5, "host"), ("storage", 9, "disk")]
    ix: BlockIndex[int] = BlockIndex(slots)
    model: dict[int, int] = {}  # key -> tier, as a worker's tiers hold them
    pinned: list[int] = []
    for _ in range(2000):
        op = rnd.random()
        if op < 0.6:
            plan = ix.plan_store([rnd.randrange(60) for _ in range(rnd.randint(1, 4))])
            if plan is None:
                continue
            for what, k, tier in plan.actions:
                if what == "evict":
                    del model[k]
                else:
                    assert what == "place" or k in model
                    model[k] = tier
                held = [sum(1 for t in model.values() if t == i) for i in range(len(slots))]
                assert all(h <= s for h, (_, s, _) in zip(held, slots, strict=True))
            ix.complete_store(plan.keys_to_store)
        elif op < 0.8 and model:
            k = rnd.choice(sorted(model))
            if ix.lookup(k) == "hit":
                ix.pin([k])
                pinned.append(k)
        elif pinned:
            ix.unpin([pinned.pop(rnd.randrange(len(pinned)))])
        for k in pinned:
            assert ix.lookup(k) == "hit"
    assert {k: ix.tiers.index(ix.tier_of(k)) for k in model} == model
    assert len(ix) == len(model)


def test_settings_take_the_sims_offload_flags_and_name_an_unknown_key():
    s = VllmOffloadSettings.from_extra({"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm.spec",
                                        "offload": "cpu", "cpu_offload_gb": 1})  # fmt: skip
    block = 2 * 1024 * 1024
    assert s.slots(block) == [("cpu", 512, "host")]
    assert s.slots(block, world_size=2) == [("cpu", 256, "host")]  # each rank holds its share
    with pytest.raises(ConfigError, match="cpu_offload_gbb: not a kvtier offload setting"):
        VllmOffloadSettings.from_extra({"offload": "cpu", "cpu_offload_gbb": 1})
    with pytest.raises(ConfigError, match="cpu_offload_gb"):
        VllmOffloadSettings.from_extra({"cpu_offload_gb": -1})
    with pytest.raises(ConfigError, match="--nvme-dir"):
        VllmOffloadSettings.from_extra({"offload": "nvme"}).slots(block)


def test_the_nvme_tier_is_a_cpu_staging_tier_in_front_of_the_files(tmp_path):
    s = VllmOffloadSettings.from_extra({"offload": "nvme", "staging_gb": 0.0625, "nvme_dir": str(tmp_path),
                                        "nvme_offload_gb": 1})  # fmt: skip
    block = 1024 * 1024
    # the file tier stores a header block in front of each entry (engine/file.py)
    assert s.slots(block) == [("cpu", 64, "host"), ("storage", 1020, "disk")]
    cfg = kv_transfer_config({"offload": "cpu"})
    assert cfg["kv_connector"] == "KvtierOffloadingConnector" and cfg["kv_load_failure_policy"] == "recompute"
    assert cfg["kv_connector_extra_config"]["spec_module_path"] == "kvtier.vllm.spec"


def test_a_shared_index_asks_the_store_once_per_run_of_keys_and_backs_off_when_it_fails():
    from kvtier.errors import TierUnavailable
    from kvtier.vllm.index import SharedIndex

    held = {"a", "b"}  # what another replica put in the namespace
    asked: list[list[str]] = []
    down = False

    def present(keys):  # type: ignore[no-untyped-def]
        asked.append(list(keys))
        if down:
            raise TierUnavailable("redis tier: lookup: server unreachable")
        return [k in held for k in keys]

    ix: SharedIndex[str] = SharedIndex([("redis", 8, "external_unspecified")], present)
    assert ix.lookup("a", lambda: ["a", "b", "c"]) == "hit"
    assert ix.lookup("b") == "hit" and ix.lookup("c") == "miss"
    assert asked == [["a", "b", "c"]]  # one question for the request's run
    assert ix.tier_of("a") is not None and ix.tier_of("a").name == "redis"  # type: ignore[union-attr]
    assert ix.shared_found == 2
    plan = ix.plan_store(["b", "c"])  # another replica's block is not stored again
    assert plan is not None and plan.keys_to_store == ["c"]
    ix.complete_store(plan.keys_to_store)
    assert ix.lookup("c") == "hit" and len(asked) == 1  # its own block: answered without asking
    lost = {"p"}  # a part of the store that does not answer (a cluster's lost master): its keys are misses
    orig = present

    def partly(keys):  # type: ignore[no-untyped-def]
        return [None if k in lost else a for k, a in zip(keys, orig(keys), strict=True)]

    ix._present = partly
    held |= {"o", "q"}
    assert ix.lookup("o", lambda: ["o", "p", "q"]) == "hit" and ix.lookup("p") == "miss" and ix.lookup("q") == "hit"
    assert ix.server_errors == 1 and len(asked) == 2  # counted once, and the rest of the store still used
    ix._present = present
    down = True
    assert ix.lookup("x", lambda: ["x", "y"]) == "miss" and ix.server_errors == 2
    assert ix.lookup("y") == "miss" and len(asked) == 3  # backing off: a dead store does not stall each lookup


def test_a_shared_namespace_is_for_redis_or_s3_and_puts_blocks_straight_on_the_store():
    s = VllmOffloadSettings.from_extra(
        {"offload": "redis", "redis_url": "redis://127.0.0.1:1", "redis_mem_gb": 1, "remote_namespace": "shared:t"}
    )
    assert [kind for kind, _, _ in s.plan(4096)] == ["redis"]  # no staging tier the other replicas cannot see
    with pytest.raises(ConfigError, match="remote_namespace shared:t: needs offload redis or s3"):
        VllmOffloadSettings.from_extra({"offload": "cpu", "remote_namespace": "shared:t"})


def test_fanout_eviction_keeps_the_block_two_requests_continued_and_lru_does_not():
    """eviction fanout: the system prompt's block s, followed by a's and by b's own, is shared; when room is needed
    the least recent unshared block goes, where LRU would take s (the oldest)."""

    def run(eviction: str) -> list[str]:
        ix: BlockIndex[str] = BlockIndex([("cpu", 3, "host")], eviction)  # type: ignore[arg-type]
        ix.note_chain(["s", "a1"])
        _stored(ix, ["s", "a1"])
        ix.note_chain(["s", "b1"])  # a second continuation of s: s is shared
        _stored(ix, ["b1"])
        ix.note_chain(["c0", "c1"])
        plan = ix.plan_store(["c0"])
        assert plan is not None
        return plan.evicted

    assert run("lru") == ["s"]
    assert run("fanout") == ["a1"]


def test_fanout_eviction_lets_shared_blocks_go_past_their_share_and_keeps_the_index_whole():
    """Shared blocks keep at most FANOUT_PROTECT_SHARE of a tier: past it the oldest shared one is a victim too; the
    index never holds more than its slots and every block it holds is in exactly one tier."""
    ix: BlockIndex[str] = BlockIndex([("cpu", 4, "host"), ("storage", 4, "disk")], "fanout")
    rnd = random.Random(5)
    for n in range(300):
        root = f"p{rnd.randrange(6)}"
        chain = [root, f"{root}-{rnd.randrange(3)}", f"x{n}"]
        ix.note_chain(chain)
        plan = ix.plan_store(chain)
        if plan is not None:
            ix.complete_store(plan.keys_to_store)
        assert len(ix) <= 8 and sum(t.held for t in ix.tiers) == len(ix)
        for t in ix.tiers:
            assert set(t.unshared) <= set(t.lru) and not (set(t.unshared) & ix.marks.shared)  # type: ignore[union-attr]
    assert ix.counters.evicted


def test_fanout_eviction_is_the_engines_own_index_not_a_cache_servers():
    with pytest.raises(ConfigError, match="eviction: fanout is the engine's own index's"):
        VllmOffloadSettings.from_extra({"cache_server": "/tmp/x.sock", "eviction": "fanout"})
    assert VllmOffloadSettings.from_extra({"eviction": "fanout"}).eviction == "fanout"
