"""#28: a remote tier deletes only what is under its own run's prefix, whatever the server lists. A fake Redis
on loopback ignores SCAN's MATCH (it lists another team's key beside ours) and records every UNLINK."""

from __future__ import annotations

import socket
import threading

from kvtier.engine.backend import OwnKeys
from kvtier.engine.redis_tier import RedisTier


class IgnoresMatch:
    """A RESP server answering INFO, DBSIZE, SCAN (ignoring MATCH: a foreign key in every answer) and UNLINK."""

    def __init__(self, endless_cursor: bool = False) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.unlinked: list[str] = []
        self.scans = 0
        self.endless = endless_cursor
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _read_command(f) -> list[str] | None:  # type: ignore[no-untyped-def]
        head = f.readline()
        if not head:
            return None
        n = int(head[1:])
        out = []
        for _ in range(n):
            size = int(f.readline()[1:])
            out.append(f.read(size + 2)[:-2].decode(errors="replace"))
        return out

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        with conn:
            while (cmd := self._read_command(f)) is not None:
                name = cmd[0].upper()
                if name == "INFO":
                    body = b"redis_version:7.2.0\r\nmaxmemory:0\r\nused_memory:1000\r\n"
                    conn.sendall(b"$%d\r\n%s\r\n" % (len(body), body))
                elif name == "DBSIZE":
                    conn.sendall(b":2\r\n")
                elif name == "SCAN":
                    self.scans += 1
                    ours = cmd[3][:-1] + "0123"  # MATCH <prefix>:* -> one of ours
                    keys = [ours.encode(), b"teamB:precious"]
                    cursor = b"7" if self.endless else b"0"
                    items = b"".join(b"$%d\r\n%s\r\n" % (len(k), k) for k in keys)
                    conn.sendall(b"*2\r\n$%d\r\n%s\r\n*%d\r\n%s" % (len(cursor), cursor, len(keys), items))
                elif name == "UNLINK":
                    self.unlinked += cmd[1:]
                    conn.sendall(b":%d\r\n" % (len(cmd) - 1))
                else:
                    conn.sendall(b"-ERR unknown command\r\n")

    def close(self) -> None:
        self.sock.close()


def test_a_key_the_server_lists_outside_our_prefix_is_never_deleted():
    srv = IgnoresMatch()
    try:
        tier = RedisTier(f"redis://127.0.0.1:{srv.port}", capacity_bytes=1 << 20, connections=1)
        tier.close()
    finally:
        srv.close()
    assert srv.unlinked == [f"{tier.prefix}:0123"] and "teamB:precious" not in srv.unlinked
    assert tier.foreign_keys_listed == 1
    assert any("outside this run's prefix" in p and "teamB:precious" in p for p in tier.cleanup_problems)


def test_a_scan_cursor_that_never_ends_is_bounded(monkeypatch):
    import kvtier.engine.redis_tier as rt

    monkeypatch.setattr(rt, "MAX_SCAN_CALLS", 50)
    srv = IgnoresMatch(endless_cursor=True)
    try:
        tier = RedisTier(f"redis://127.0.0.1:{srv.port}", capacity_bytes=1 << 20, connections=1)
        tier.close()
    finally:
        srv.close()
    assert srv.scans == 50 and any("did not finish in 50 calls" in p for p in tier.cleanup_problems)
    assert "teamB:precious" not in srv.unlinked


def test_only_ours_needs_the_whole_prefix_and_something_after_it():
    own = OwnKeys("run1:")
    assert own.keep(["run1:a", "run10:a", "run1:", "other"]) == ["run1:a"]
    assert (own.foreign, own.examples) == (3, ["run10:a", "run1:", "other"])


class Hung(IgnoresMatch):
    """Answers INFO and DBSIZE, then never answers anything else (a hung server); ``stalls`` counts the
    commands it left unanswered."""

    stalls = 0

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        with conn:
            while (cmd := self._read_command(f)) is not None:
                if cmd[0].upper() == "INFO":
                    body = b"redis_version:7.2.0\r\nmaxmemory:0\r\nused_memory:1000\r\n"
                    conn.sendall(b"$%d\r\n%s\r\n" % (len(body), body))
                elif cmd[0].upper() == "DBSIZE":
                    conn.sendall(b":0\r\n")
                else:
                    self.stalls += 1
                    threading.Event().wait(60)  # never answers
                    return


def _bench_argv(srv: Hung, tmp_path, *extra: str) -> list[str]:  # type: ignore[no-untyped-def]
    """A small bench whose CPU tier is tiny, so its writes go to the (hung) Redis; the result at tmp_path/r.json."""
    import json

    from tests.conftest import TINY_TEMPLATES, kvtier_cmd

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(json.dumps({"user_templates": TINY_TEMPLATES}))
    return [*kvtier_cmd(), "bench", "--model", "tiny-1b", "--num-users", "2", "--gpu-mem-gb", "0", "--cpu-mem-gb",
            "0.004", "--redis-url", f"redis://127.0.0.1:{srv.port}", "--redis-mem-gb", "0.5", "--generation-mode",
            "none", "--progress", "none", "--cache-dir", str(tmp_path), "--output", str(tmp_path / "r.json"),
            "--config", str(cfg), "--noise-mb", "16", "--io-chunk-mb", "4", *extra]  # fmt: skip


def test_ctrl_c_ends_a_bench_on_a_hung_redis_at_once(tmp_path):
    """#28 medium 4: with a hung Redis a 10 s run ended 80-91 s late with Ctrl+C ignored. Now SIGINT shuts the
    tier's connections (in-flight operations fail at once) and cleanup gets a 1 s deadline a call."""
    import json
    import signal
    import subprocess
    import time

    srv = Hung()
    out = tmp_path / "r.json"
    try:
        p = subprocess.Popen(_bench_argv(srv, tmp_path, "--duration", "60"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 30  # until the load has begun: a write to Redis hangs (a fixed 4 s was once
        while srv.stalls == 0 and time.monotonic() < deadline and p.poll() is None:  # too short beside other tests)
            time.sleep(0.1)
        assert srv.stalls, "the bench never wrote to Redis"
        time.sleep(0.5)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        srv.close()
    r = json.loads(out.read_text())
    assert r["status"] == "partial" and r["stop_reason"]["code"] == "interrupted", (r["stop_reason"], err[-2000:])
    # what the run recorded: its cleanup met the hung server with the 1 s deadline an interrupt gives it, not
    # the 10 s of --remote-timeout (the seconds it takes: benchmarks/hostile_inputs.py)
    cleanup = [w["message"] for w in r["warnings"] if w["code"] == "cleanup-failed"]
    assert cleanup and "the operation took more than 1 s" in cleanup[0], (cleanup, took)


def test_the_deadline_cuts_a_bench_on_a_hung_redis_as_partial_tier_unavailable(tmp_path):
    """#41 item 6: a hung Redis held a `--duration 5` run for 36 s (until --remote-timeout) and called it done. Now
    an operation blocked STALL_CUT_S at the run's end cuts the run as SIGINT does: its tier aborted, the result
    partial with `tier-unavailable`. (--remote-timeout 120: the old code ran past this test's 60 s limit.)"""
    import json
    import subprocess

    from kvtier.bench.runner import STALL_CUT_S

    srv = Hung()
    out = tmp_path / "r.json"
    try:
        p = subprocess.run(_bench_argv(srv, tmp_path, "--duration", "2", "--remote-timeout", "120"),
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        srv.close()
    assert p.returncode == 7, p.stderr[-2000:]  # tier-unavailable's exit code
    r = json.loads(out.read_text())
    assert r["status"] == "partial" and r["stop_reason"]["code"] == "tier-unavailable", r["stop_reason"]
    assert f"did not answer an operation for {STALL_CUT_S:g} s" in r["stop_reason"]["message"]
    assert srv.stalls >= 1
    cleanup = [w["message"] for w in r["warnings"] if w["code"] == "cleanup-failed"]
    assert cleanup and "the operation took more than 1 s" in cleanup[0], cleanup  # the abort's cleanup deadline
