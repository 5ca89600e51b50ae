"""#59 item 1: the CPU tier's page copies stream past the cache (glibc's non-temporal stores) in kvtier bench."""

from __future__ import annotations

import platform
import sys

import pytest

from kvtier.engine.backend import NT_COPY_BYTES, NT_COPY_TUNABLE, nt_copy_environ

X86_LINUX = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


@pytest.mark.skipif(not X86_LINUX, reason="glibc's streaming threshold is an x86-64 tunable")
def test_the_tunable_is_added_once_and_beside_the_users_own():
    env = nt_copy_environ({"PATH": "/bin"})
    assert env is not None and env["GLIBC_TUNABLES"] == f"{NT_COPY_TUNABLE}={NT_COPY_BYTES:#x}"
    assert nt_copy_environ(env) is None  # already so: no second re-execution
    mine = nt_copy_environ({"GLIBC_TUNABLES": "glibc.malloc.check=3"})
    assert mine is not None and mine["GLIBC_TUNABLES"] == f"glibc.malloc.check=3:{NT_COPY_TUNABLE}={NT_COPY_BYTES:#x}"
    assert nt_copy_environ({"GLIBC_TUNABLES": f"{NT_COPY_TUNABLE}=0x10000000"}) is None  # the user's value stands


def test_kvtier_bench_from_the_command_line_reexecutes_once_and_a_caller_never(monkeypatch: pytest.MonkeyPatch):
    from kvtier.cli import main as cli

    calls: list[tuple[str, list[str], dict[str, str]]] = []

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        calls.append((path, argv, env))
        raise SystemExit(0)  # what execve does to this process, for the test

    monkeypatch.setattr("os.execve", execve)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(sys, "argv", ["kvtier", "bench", "--model", "tiny-1b"])
    with pytest.raises(SystemExit):
        cli.main()  # the command line itself
    if X86_LINUX:
        ((path, argv, env),) = calls
        assert argv == [sys.executable, "-m", "kvtier", "bench", "--model", "tiny-1b"] and path == sys.executable
        assert NT_COPY_TUNABLE in env["GLIBC_TUNABLES"]
    calls.clear()
    # a caller's own process (main(argv)) is never replaced: the bench runs (here: is refused) in it
    assert cli.main(["bench", "--model", "no-such-model", "--duration", "1"]) != 0
    assert calls == []


@pytest.mark.skipif(not X86_LINUX, reason="glibc's streaming threshold is an x86-64 tunable")
def test_the_kv_cache_console_script_runs_as_kvtier_bench_does(monkeypatch: pytest.MonkeyPatch):
    from kvtier.cli import main as cli

    seen: list[list[str]] = []

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        seen.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr("os.execve", execve)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(sys, "argv", ["kv-cache", "--model", "tiny-1b"])
    with pytest.raises(SystemExit):
        cli.kv_cache()
    assert seen == [[sys.executable, "-m", "kvtier", "bench", "--model", "tiny-1b"]]
