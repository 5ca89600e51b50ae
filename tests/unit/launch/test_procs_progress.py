"""Launch progress: a process that takes a while to answer is reported every interval with its log's last
line; the health watch reports a process that dies. Real child processes and a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

from kvtier.launch.procs import HealthWatch, Supervisor, free_ports
from kvtier.launch.profiles import ProcPlan

SLOW_SERVER = """
import http.server, sys, time
print("loading weights", flush=True)
time.sleep(2.5)
print("serving", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_starting_lines_then_healthy_then_a_death_is_seen(tmp_path: Path):
    port = free_ports(1)[0]
    script = tmp_path / "slow.py"
    script.write_text(SLOW_SERVER)
    sup = Supervisor(tmp_path / "logs")
    plan = ProcPlan("replica0", [sys.executable, str(script), str(port)], {}, f"http://127.0.0.1:{port}/", None, 30)
    proc = sup.start(plan)
    try:
        said: list[tuple[float, str]] = []
        dt = sup.wait_healthy(proc, plan.health, 30, None, lambda s, st: said.append((s, st)), every_s=0.5)
        assert dt >= 2.4 and len(said) >= 3 and said[0][0] >= 0.5
        assert all(st.startswith("not answering yet; log: ") for _, st in said)
        assert any(st.endswith("log: loading weights") for _, st in said)  # its log's last line then
        changes: list[tuple[str, str]] = []
        with HealthWatch([("replica0", proc, plan.health)], lambda n, s: changes.append((n, s)), every_s=0.2):
            proc.popen.kill()
            proc.popen.wait()
        assert changes == [("replica0", "exited (status -9)")]
    finally:
        sup.stop_all()
