"""The run environment bench and replay share (kvtier/mpi.py RunEnvironment): locally the protocol's calls
cost nothing; across ranks, shares and slices partition the work exactly."""

from __future__ import annotations

import time

import pytest

from kvtier.mpi import RunAborted, RunEnvironment


def test_a_local_run_starts_now_and_gathers_only_itself():
    env = RunEnvironment.local()
    assert not env.distributed and env.rank == 0 and env.size == 1 and env.lost == set()
    t0 = time.time()
    window = env.start(duration_s=5.0)
    assert t0 <= window["start_unix_s"] <= time.time()
    assert window["deadline_unix_s"] == pytest.approx(window["start_unix_s"] + 5.0)
    assert 4.0 < env.wait(window) <= 5.0 and env.wait(env.start()) == float("inf")
    assert env.gather({"x": 1}) == {0: {"x": 1}} and env.exit(3) == 3
    with pytest.raises(RunAborted, match="cannot set up"):
        env.start(problem="cannot set up")


@pytest.mark.parametrize("size", [1, 2, 3, 7])
@pytest.mark.parametrize("n", [0, 1, 5, 16])
def test_ranks_shares_and_slices_partition_the_work(size: int, n: int):
    ranks = [RunEnvironment(rank=r, size=size, host="h") for r in range(size)]
    assert sum(e.share(n) for e in ranks) == n
    assert max(e.share(n) for e in ranks) - min(e.share(n) for e in ranks) <= 1
    items = list(range(n))
    mine = [e.mine(items) for e in ranks]
    assert sorted(x for m in mine for x in m) == items  # every item exactly once
