"""Two real vLLM replicas (the CPU build) on two hosts of the namespace testbed (benchmarks/_fabric.py) sharing
offloaded KV through a store on a third, with no kvtier process between them: a Redis Cluster of three masters
(password-protected, its masters announced at the store host's one address) and an S3 server (moto's), each
as one shared namespace (``remote_namespace: shared:fabric``). What replica A computed, replica B loads from
the store over its own shaped link, with the same answer, as B's own counters and per-request record say.
(kvtier's cache server over TCP is test_fabric.py's.)

Needs root (namespaces, tc) and the engine: skipped with the reason elsewhere. Every namespace and link is the
test's own and gone afterwards.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _fabric import Fabric, World, start_world, stop_world, why_not

WHY = why_not()
pytestmark = [pytest.mark.skipif(WHY is not None, reason=WHY or ""), pytest.mark.serial, pytest.mark.slow,
              pytest.mark.engine]  # fmt: skip


@pytest.fixture(scope="module", params=["redis-cluster", "s3"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from tests.integration.test_real_vllm import ENGINE_PYTHON, PROBLEM, STARTUP_S

    if PROBLEM is not None:
        pytest.skip(PROBLEM)
    pytest.importorskip("boto3", reason="boto3 is not installed (the test extra installs it)")
    from kvtier.modelmaker import Geometry, make_model

    d = tmp_path_factory.mktemp(f"fabric-{request.param}")
    model = make_model(d / "tiny", Geometry())
    with Fabric(["s", "a", "b"]) as fab:
        w = start_world(fab, d, str(ENGINE_PYTHON), str(model), 16384, 8192, 0.25, STARTUP_S, kind=request.param)
        try:
            yield w
        finally:
            stop_world(w)


def test_a_prefix_replica_a_computed_is_loaded_by_replica_b_from_the_shared_store(world: World):
    from kvtier.results.engine_log import EngineLogTail
    from tests.integration.test_vllm_shared_offload import ask
    from tests.integration.test_vllm_shared_offload import metrics as scrape

    rnd = random.Random(5)
    words = [f"w{rnd.randrange(100000)}" for _ in range(900)]
    usage, answer = ask(world.urls["a"], words, "shared-a")
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    blocks = usage["prompt_tokens"] // 128
    deadline = time.monotonic() + 60
    while world.stored_blocks() < blocks and time.monotonic() < deadline:
        time.sleep(0.2)
    assert world.stored_blocks() >= blocks, "A's blocks reached the shared store"
    world.shape(50)  # B's link to the store: 50 Mbit/s
    try:
        before = scrape(world.urls["b"])
        usage_b, answer_b = ask(world.urls["b"], words, "shared-b")
        after = scrape(world.urls["b"])
    finally:
        world.shape(None)
    cached = usage_b["prompt_tokens_details"]["cached_tokens"]
    assert cached == blocks * 128 and answer_b == answer  # B never computed the prefix: A's KV, from the store
    tier = "s3" if world.kind == "s3" else "redis"
    found = (after.get("kvtier:offload_shared_found_blocks_total") or 0) - (
        before.get("kvtier:offload_shared_found_blocks_total") or 0
    )
    loaded = (after.get("kvtier:offload_loaded_blocks_total", tier=tier) or 0) - (
        before.get("kvtier:offload_loaded_blocks_total", tier=tier) or 0
    )
    assert found >= blocks and loaded == blocks  # found by asking the store, and loaded from it
    assert not after.get("kvtier:offload_failed_loads_total") and not after.get("kvtier:offload_server_errors_total")
    log = EngineLogTail([str(world.work / "b.requests.jsonl")])
    deadline = time.monotonic() + 30
    while "shared-b" not in log.by_id and time.monotonic() < deadline:
        time.sleep(0.1)
        log.poll()
    assert log.by_id["shared-b"].tier_tokens == {tier: cached}  # B's own record: its prompt from the store


def test_a_lost_master_costs_only_its_blocks_which_are_recomputed_never_served_wrong(world: World):
    """Last in the module: the cluster stays one master short. B asks about A's prompt after a master died: the
    blocks before the first one that master held are loaded, the rest recomputed, the answer A's, the lost
    master's silence counted."""
    if world.kind != "redis-cluster":
        pytest.skip("a Redis Cluster's master lost (the S3 server is one process)")
    from tests.integration.test_vllm_shared_offload import ask
    from tests.integration.test_vllm_shared_offload import metrics as scrape

    rnd = random.Random(11)
    words = [f"m{rnd.randrange(100000)}" for _ in range(2000)]  # some 30 blocks: each master holds some of them
    had = world.stored_blocks()
    usage, answer = ask(world.urls["a"], words, "lost-a")
    blocks = usage["prompt_tokens"] // 128
    deadline = time.monotonic() + 60
    while world.stored_blocks() < had + blocks and time.monotonic() < deadline:
        time.sleep(0.2)
    world.store.popen.kill()  # the first master
    world.store.popen.wait(10)
    before = scrape(world.urls["b"])
    usage_b, answer_b = ask(world.urls["b"], words, "lost-b")
    after = scrape(world.urls["b"])
    cached = usage_b["prompt_tokens_details"]["cached_tokens"]
    assert answer_b == answer and cached % 128 == 0 and cached < blocks * 128
    errors = (after.get("kvtier:offload_server_errors_total") or 0) - (
        before.get("kvtier:offload_server_errors_total") or 0
    )
    assert errors >= 1 and not after.get("kvtier:offload_failed_loads_total")  # asked, not answered: counted
