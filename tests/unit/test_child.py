"""#54 item 4: one runner for every child process (kvtier/child.py): a stop reaches the whole group and escalates to
SIGKILL, a probe has a time limit, a launcher's stop is passed on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvtier.child import run, start
from kvtier.errors import LaunchError

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except OSError:
        return False


def test_a_child_that_ignores_sigterm_is_killed_with_its_own_children_after_the_grace():
    parent = (
        "import subprocess, sys, time; "
        f"c = subprocess.Popen([sys.executable, '-c', {STUBBORN!r}]); print(c.pid, flush=True); time.sleep(60)"
    )
    c = start([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    assert c.popen.stdout is not None
    grandchild = int(c.popen.stdout.readline())
    assert c.stop(grace_s=0.5) == -signal.SIGTERM  # the leader took SIGTERM; its child ignores it (below)
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)  # its session's group got the SIGKILL too


def test_a_program_that_does_not_exist_is_a_launch_error_naming_it():
    with pytest.raises(LaunchError, match="nope: cannot start '/nonexistent/x'"):
        start(["/nonexistent/x"], name="nope")


def test_a_probe_has_a_time_limit_and_reports_its_output():
    assert run([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5) is None
    p = run([sys.executable, "-c", "print('hi')"], timeout_s=30)
    assert p is not None and p.returncode == 0 and p.stdout == "hi\n"
    assert run(["/nonexistent/x"], timeout_s=5) is None


def test_a_launchers_stop_is_passed_on_to_the_child():
    c = start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE,
              text=True, group=False)  # fmt: skip
    assert c.popen.stdout is not None and c.popen.stdout.readline() == "up\n"
    stopping: list[int] = []
    with c.forwarding(stopping):
        os.kill(os.getpid(), signal.SIGTERM)  # what a launcher sends kvtier: recorded, and the child gets it
        assert c.wait(10) == -signal.SIGTERM
    assert stopping == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is back
