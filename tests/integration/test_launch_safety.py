"""kvtier launch refuses to be fooled: a busy port, another server answering on a health URL, values
that would become options or break JSON, an alias-bomb profile file; and it cleans up after killed
launches. (Caddy's bind and admin API: test_launch.py's Ctrl+C run checks every process's listeners.)"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.conftest import kvtier_cmd
from tests.integration.test_launch import conversations


def launch(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(kvtier_cmd() + ["launch", *args], capture_output=True, text=True, timeout=timeout)


def test_a_busy_port_is_refused_before_anything_starts(tmp_path: Path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        profiles = tmp_path / "p.yaml"
        profiles.write_text(f"""
s:
  engine: sim
  build: nvidia
  tier: cpu
  sim_model: tiny-1b
  sidecar_http_port: {port}
  sidecar:
    command: [kvtier, cache-server, --socket, "{{sidecar_socket}}", --port,
              "{{sidecar_http_port}}"]
    health: "http://{{host}}:{{sidecar_http_port}}/health"
  replica:
    command: [kvtier, sim, --preset, cpu-test, --port, "{{port}}", --served-model-name, "{{model}}"]
    health: "http://{{host}}:{{port}}/health"
""")
        data = conversations(tmp_path / "data", users=1)
        p = launch(
            [
                "--tier",
                "cpu",
                "--engine",
                "sim",
                "--profiles",
                str(profiles),
                "--output",
                str(tmp_path / "o"),
                "--",
                "--model",
                "m",
                "--dataset",
                str(data),
            ]
        )
    assert p.returncode == 6 and f"port {port} on 127.0.0.1 is already in use" in p.stderr, p.stderr
    rec = json.loads((tmp_path / "o" / "launch.json").read_text())
    assert rec["pids"] == {} and rec["stop_reason"]["code"] == "startup-failed"


class Impostor(BaseHTTPRequestHandler):
    """A server that is healthy but is not the replica: it serves another model."""

    def do_GET(self):
        body = b"{}" if self.path == "/health" else json.dumps({"data": [{"id": "someone-else"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_another_server_on_the_health_url_does_not_pass_for_the_replica(tmp_path: Path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        profiles = tmp_path / "p.yaml"
        profiles.write_text(f"""
s:
  engine: sim
  build: nvidia
  tier: gpu
  replica:
    command: [sleep, "60"]   # alive, listening nowhere
    health: "http://{{host}}:{server.server_address[1]}/health"
    startup_timeout_s: 3
""")
        data = conversations(tmp_path / "data", users=1)
        p = launch(
            [
                "--tier",
                "gpu",
                "--engine",
                "sim",
                "--profiles",
                str(profiles),
                "--output",
                str(tmp_path / "o"),
                "--",
                "--model",
                "m",
                "--dataset",
                str(data),
            ]
        )
    finally:
        server.shutdown()
    assert p.returncode == 6 and "serves ['someone-else'], not 'm'" in p.stderr, p.stderr


def test_values_that_would_become_options_or_break_json(tmp_path: Path):
    p = launch(
        [
            "--tier",
            "gpu",
            "--engine",
            "vllm",
            "--gpus",
            "0",
            "--dry-run",
            "--",
            "--model=--trust-remote-code",
            "--dataset",
            "d",
        ],
        timeout=60,
    )
    assert p.returncode == 2 and "would be read as an option" in p.stderr
    odd = tmp_path / 'a"b\\c'
    p = launch(
        [
            "--tier",
            "nvme",
            "--engine",
            "vllm",
            "--replicas",
            "2",
            "--gpus",
            "0,1",
            "--dry-run",
            "--nvme-dir",
            str(odd),
            "--",
            "--model",
            "m",
            "--dataset",
            "d",
        ],
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    adapter = p.stdout.splitlines()[0].split("--l2-adapter ", 1)[1]
    import shlex

    assert json.loads(shlex.split(adapter)[0])["base_path"] == str(odd)  # a real JSON argument, path intact


def test_an_alias_bomb_profile_file_is_refused_fast(tmp_path: Path):
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]" for i in range(8)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    t0 = time.monotonic()
    p = launch(
        [
            "--tier",
            "cpu",
            "--engine",
            "sim",
            "--profiles",
            str(bomb),
            "--dry-run",
            "--",
            "--model",
            "m",
            "--dataset",
            "d",
        ],
        timeout=60,
    )
    assert p.returncode == 2 and "alias bomb" in p.stderr
    assert time.monotonic() - t0 < 30  # refused while parsing, not after expanding


def test_socket_folders_of_killed_launches_are_removed(tmp_path: Path):
    from kvtier.launch.running import remove_stale_sockdirs as _remove_stale_sockdirs

    dead = subprocess.Popen(["true"])
    dead.wait()
    base = Path(tempfile.gettempdir())
    gone = base / f"kvtier-launch-{dead.pid}-dead00"
    live = base / f"kvtier-launch-{os.getpid()}-live00"
    for d in (gone, live):
        d.mkdir(exist_ok=True)
    try:
        _remove_stale_sockdirs()
        assert not gone.exists() and live.exists()
    finally:
        shutil.rmtree(gone, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)
