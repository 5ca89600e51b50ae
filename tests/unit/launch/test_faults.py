"""kvtier launch --fault: the spec, and the miss storm read from replay records."""

from __future__ import annotations

import pytest

from kvtier.config.launch import LaunchConfig
from kvtier.config.replay import ReplayConfig
from kvtier.errors import ConfigError
from kvtier.launch.faults import Fault, Injected, parse_faults, storm_outcome


def rec(t: float, tier: int, prompt: int = 1000, ttft: float = 0.1, queue: float = 0.01, status: str = "ok"):
    return {
        "user": "u", "session": "s", "turn": 1, "session_turn": 1, "max_tokens": 8, "status": status, "cause": None,
        "error": None, "http_status": 200, "replica": None, "ttft_s": ttft, "itl_s": [], "e2e_s": ttft,
        "prompt_tokens": prompt, "completion_tokens": 8, "cached_tokens": tier, "start_unix_s": t,
        "prompt_sources": {"gpu": 0, "cpu": tier, "recomputed": prompt - tier},
        "server_ttft_parts": {"queue": queue}, "server_ttft_s": ttft,
    }  # fmt: skip


def test_parse_faults_sorted_and_refused():
    assert parse_faults(["restart-cache@30s", "restart-cache@5"]) == [Fault("restart-cache", 5.0),
                                                                      Fault("restart-cache", 30.0)]  # fmt: skip
    for bad in ("restart-cache", "kill-gpu@3", "restart-cache@-1", "restart-cache@x"):
        with pytest.raises(ConfigError, match="--fault"):
            parse_faults([bad])


def test_launch_config_refuses_a_fault_without_a_sidecar():
    replay = ReplayConfig(model="m", dataset="d")
    with pytest.raises(ValueError, match="no cache sidecar"):
        LaunchConfig(tier="gpu", engine="sim", output="o", fault=["restart-cache@5"], replay=replay)
    with pytest.raises(ValueError, match="expected KIND@SECONDS"):
        LaunchConfig(tier="cpu", engine="sim", output="o", fault=["restart@5"], replay=replay)
    assert LaunchConfig(tier="cpu", engine="sim", output="o", fault=["restart-cache@5"], replay=replay).fault


def test_storm_windows_and_recovery():
    t0 = 1000.0
    records = [rec(t0 + i, 500, queue=0.01) for i in range(10)]  # baseline: half the prompt from the tier
    records += [rec(t0 + 10 + i, 0, ttft=1.0, queue=0.5) for i in range(5)]  # the storm: all recomputed
    records += [rec(t0 + 15 + i, 100 if i < 3 else 480) for i in range(20)]  # coming back
    records.append(rec(t0 + 12.5, 0, status="error") | {"prompt_sources": None, "ttft_s": None})
    f = storm_outcome(records, Injected(Fault("restart-cache", 10.0), t0 + 10, t0 + 11), t0)
    assert f.downtime_s == 1 and f.basis == "prompt_sources"
    assert f.baseline.requests == 10 and f.baseline.offload_hit_rate == 0.5 and f.baseline.queue_s_mean == 0.01
    assert f.zero_hit_s == 5  # the first request served by the tier again started 5 s after the kill
    assert f.storm.requests == 6 and f.storm.failed == 1 and f.storm.offload_hit_rate == 0
    assert f.storm.ttft_s_p95 == pytest.approx(1.0) and f.storm.queue_s_mean == 0.5
    # 8 trailing requests reach 0.9 x 0.5 = 0.45 only when all are 480/1000 ones (7 x 480 + 100 = 3460 < 3600):
    # the 8th of those starts at t0 + 18 + 7, 15 s after the kill
    assert f.recovered_after_s == 15
    assert sum(p.requests for p in f.timeline) == 35


def test_no_recovery_and_no_hit_are_null():
    t0 = 0.0
    records = [rec(t0 + i, 500) for i in range(5)] + [rec(t0 + 5 + i, 0) for i in range(5)]
    f = storm_outcome(records, Injected(Fault("restart-cache", 5.0), 5.0, None, "gone"), t0)
    assert f.zero_hit_s is None and f.recovered_after_s is None and f.downtime_s is None and f.error == "gone"
    assert f.storm.requests == 5


def test_outcomes_warn_of_faults_not_injected_or_not_recovered():
    from kvtier.launch.faults import FaultInjector, outcomes

    inj = FaultInjector([Fault("restart-cache", 5.0), Fault("restart-cache", 50.0)], lambda f, stopping: None)
    inj.done = [Injected(Fault("restart-cache", 5.0), 5.0, None, "gone")]
    storms, warns = outcomes(inj, [rec(float(i), 100) for i in range(10)])
    assert len(storms) == 1 and storms[0].error == "gone"
    assert [w.code for w in warns] == ["fault-not-recovered", "fault-not-injected"]
    # one still restarting when the replay ended is measured, and says so
    inj.done, inj.current = (
        [],
        Injected(Fault("restart-cache", 5.0), 5.0, None, "the replay ended while it was restarting"),
    )
    storms, warns = outcomes(inj, [rec(float(i), 100) for i in range(10)])
    assert len(storms) == 1 and "restarting" in storms[0].error and warns[0].code == "fault-not-recovered"


def test_a_restarted_part_that_never_answers_does_not_hold_the_launchs_end(tmp_path):
    """#41 item 6: a sidecar restarted by --fault that hangs (alive, its port accepting, never answering) held a
    20 s replay's launch for 80.7 s and Ctrl+C for 71 s: teardown joined the fault thread while it waited out the
    start-up timeout. Now the wait for health is cancelled at teardown: the restart is recorded as not back."""
    import socket
    import sys
    import time

    from kvtier.launch.faults import FaultInjector
    from kvtier.launch.procs import Supervisor
    from kvtier.launch.profiles import ProcPlan

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)  # accepts, never answers
    url = f"http://127.0.0.1:{hung.getsockname()[1]}/health"
    sup = Supervisor(tmp_path)
    proc = sup.start(ProcPlan("sidecar", [sys.executable, "-c", "import time; time.sleep(300)"], {}, url, None, 300))
    waited: list[str] = []

    def restart(f: Fault, stopping) -> str | None:  # type: ignore[no-untyped-def]
        from kvtier.errors import LaunchError

        try:
            sup.wait_healthy(proc, url, 300.0, cancel=stopping)  # start-up timeout far beyond this test
        except LaunchError as e:
            waited.append(str(e))
            return str(e)
        return None

    inj = FaultInjector([Fault("restart-cache", 0.0)], restart)
    try:
        inj.start()
        deadline = time.monotonic() + 30
        while inj.current is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inj.current is not None, "the fault never began"
        inj.stop()
        assert not inj._thread.is_alive()  # it ended within STOP_JOIN_S, not after the 300 s start-up timeout
    finally:
        sup.stop_all()
        hung.close()
    assert waited and "the launch stopped while it was waiting" in waited[0]
    assert [d.error for d in inj.done] == [waited[0]] and inj.done[0].up_unix_s is None
