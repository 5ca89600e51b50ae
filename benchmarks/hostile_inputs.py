"""How long kvtier takes on the hostile inputs #28 found, measured here (the tests assert what was recorded,
not seconds): a crafted 70 KB requests.jsonl line in ``kvtier report`` (the lazy regular expression it replaced
ran past 30 s on it), ``kvtier trace stats`` on two rows a billion seconds apart (its timeline once had a bin
per second), and a ``kvtier bench`` on a hung Redis stopped by SIGINT (28 s before the tier's connections were
shut down on an interrupt). Last line: ``hostile_inputs report_line_s=… trace_span_s=… ctrl_c_exit_s=…``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO

sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))
from kvtier.iotrace.stats import trace_stats
from kvtier.report.figures import ReplayRecords
from kvtier.telemetry.iotrace import HEADER, read_trace


def report_line(d: Path) -> float:
    evil = '{"a": "' + '\\"turn\\": 1, ' * 2000 + '", ' + '"turn": 1, "status": "x", ' * 2000 + '"z": 1}\n'
    p = d / "requests.jsonl"
    p.write_text(evil)
    t0 = time.perf_counter()
    ReplayRecords.read(p)
    return time.perf_counter() - t0


def trace_span(d: Path) -> float:
    p = d / "wide.csv"
    p.write_text(HEADER + "1.0,Write,100,Tier-1,a,Prefill\n1000000001.0,Read,100,Tier-1,a,Decode\n")
    t0 = time.perf_counter()
    trace_stats(read_trace(str(p)), interval_s=1.0)
    return time.perf_counter() - t0


def ctrl_c_exit(d: Path) -> float:
    from tests.conftest import TINY_TEMPLATES
    from tests.unit.engine.test_remote_cleanup_trust import Hung

    srv = Hung()
    cfg = d / "tiny.yaml"
    cfg.write_text(json.dumps({"user_templates": TINY_TEMPLATES}))
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "bench", "--model", "tiny-1b", "--num-users", "2", "--duration", "60",
             "--gpu-mem-gb", "0", "--cpu-mem-gb", "0.004", "--redis-url", f"redis://127.0.0.1:{srv.port}",
             "--redis-mem-gb", "0.5", "--generation-mode", "none", "--progress", "none", "--cache-dir", str(d),
             "--output", str(d / "r.json"), "--config", str(cfg), "--noise-mb", "16", "--io-chunk-mb", "4"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
        )  # fmt: skip
        time.sleep(4)
        t0 = time.perf_counter()
        p.send_signal(signal.SIGINT)
        p.wait(timeout=120)
        return time.perf_counter() - t0
    finally:
        srv.close()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvtier-hostile-") as tmp:
        d = Path(tmp)
        r, t, c = report_line(d), trace_span(d), ctrl_c_exit(d)
    print(f"hostile_inputs report_line_s={r:.3f} trace_span_s={t:.3f} ctrl_c_exit_s={c:.2f}")


if __name__ == "__main__":
    main()
