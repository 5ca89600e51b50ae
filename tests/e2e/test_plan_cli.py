"""``kvtier plan`` as a user runs it: the two check invocations, JSON, plot, bad input, --from."""

import json
import subprocess

import pytest

from tests.conftest import kvtier_cmd

BREAKEVEN = [
    "plan",
    "breakeven",
    "--model",
    "llama3.1-70b-instruct",
    "--context",
    "8192",
    "--prefill-tps",
    "5000",
    "--hbm-bw",
    "3.35TB/s",
    "--stages",
    "4",
    "--net-bw",
    "100Gbit/s",
    "--net-bw",
    "1Gbit/s",
    "--rtt",
    "1ms",
    "--rtt",
    "20ms",
    "--compression",
    "3.5",
]
GATE = [
    "plan",
    "gate",
    "--model",
    "llama3.1-70b-instruct",
    "--context",
    "8192",
    "--prefill-tps",
    "5000",
    "--case",
    "100Gbit/s,1ms",
    "--case",
    "1Gbit/s,20ms",
    "--case",
    "5Gbit/s,20ms",
    "--case",
    "5Gbit/s,20ms,3.5",
]


def run(args, cwd=None):
    return subprocess.run(kvtier_cmd() + args, capture_output=True, text=True, timeout=60, cwd=cwd)


def test_breakeven_json_reproduces_published_figures():
    p = run(BREAKEVEN + ["--json"])
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["kv_bytes_per_token"] == 327_680
    assert round(d["breakeven_gbit_per_s"], 1) == 13.1 and round(d["breakeven_compressed_gbit_per_s"], 1) == 3.7
    fast, slow = d["links"]
    assert round(slow["decode_local_s_per_token"] * 1e3, 1) == 80.8
    assert round(fast["stream_remote_s_per_token"] * 1e3) == 216
    assert round(slow["stream_remote_s_per_token"], 1) == 21.5
    assert round(slow["query_shipping_s_per_token"], 2) == 1.6


def test_breakeven_table_and_plot(tmp_path):
    png = tmp_path / "be.png"
    p = run(BREAKEVEN + ["--plot", str(png)])
    assert p.returncode == 0, p.stderr
    assert "13.1 Gbit/s" in p.stdout and "3.74 Gbit/s" in p.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plot_without_matplotlib_stops_before_any_work_with_the_install_line(tmp_path):
    """#44 item 5: a missing extra fails first, exit 4, with the line that installs it (the ladder drew nothing after
    its minutes of requests and said "plot: FILE" anyway)."""
    import os

    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('matplotlib is not installed here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")])}
    png = tmp_path / "be.png"
    for args in (BREAKEVEN + ["--plot", str(png)],
                 ["ladder", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--plot", str(png)]):  # fmt: skip
        p = subprocess.run(kvtier_cmd() + args, capture_output=True, text=True, timeout=60, env=env)
        assert p.returncode == 4, (args, p.returncode, p.stderr)
        assert "--plot: drawing the plot needs matplotlib: pip install 'kvtier[plot]'" in p.stderr
        assert not png.exists() and "Traceback" not in p.stderr


def test_gate_table_json_and_text():
    p = run(GATE + ["--json"])
    assert p.returncode == 0, p.stderr
    rows = [(c["fetch_s"], c["recompute_s"], c["verdict"]) for c in json.loads(p.stdout)["cases"]]
    assert rows == [
        (0.2157, 1.6384, "fetch"),
        (21.4948, 1.6384, "recompute"),
        (4.315, 1.6384, "recompute"),
        (1.2471, 1.6384, "fetch"),
    ]
    t = run(GATE)
    assert "21.4948" in t.stdout and "4.3150" in t.stdout and "1.2471" in t.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["plan", "gate", "--model", "llama3.1-8b", "--context", "100", "--prefill-tps", "10", "--case", "fast,1ms"],
            "cannot read 'fast' as a bandwidth",
        ),
        (
            ["plan", "gate", "--model", "llama3.1-8b", "--context", "100", "--prefill-tps", "0", "--case", "1GB/s,1ms"],
            "--prefill-tps: Input should be greater than 0",
        ),
        (
            ["plan", "breakeven", "--model", "nope", "--context", "1", "--prefill-tps", "1", "--net-bw", "1GB/s"],
            "unknown model",
        ),
        (
            [
                "plan",
                "breakeven",
                "--model",
                "llama3.1-8b",
                "--context",
                "1",
                "--prefill-tps",
                "1",
                "--net-bw",
                "1GB/s",
                "--net-bw",
                "2GB/s",
                "--rtt",
                "1ms",
                "--rtt",
                "2ms",
                "--rtt",
                "3ms",
            ],
            "pair in order",
        ),
    ],
)
def test_bad_input(args, needle):
    p = run(args)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr


def test_bytes_capacity_and_custom_geometry():
    p = run(
        [
            "plan",
            "bytes",
            "--layers",
            "61",
            "--attention",
            "mla",
            "--kv-lora-rank",
            "512",
            "--qk-rope-head-dim",
            "64",
            "--dtype",
            "fp8",
            "--json",
        ]
    )
    assert json.loads(p.stdout)["kv_bytes_per_token"] == 61 * 576
    p = run(["plan", "capacity", "--model", "llama3.1-8b", "--tokens", "1000000", "--tier", "cpu=512", "--json"])
    d = json.loads(p.stdout)
    assert d["tokens"]["kv_bytes"] == 131_072e6 and d["tiers"]["cpu"]["users"] > 0
    assert "llama3.1-8b" in run(["plan", "bytes", "--list"]).stdout


def test_fetch_from_a_real_bench_result(tiny_bench_result):
    result, path = tiny_bench_result
    p = run(["plan", "fetch", "--from", str(path), "--prefill-tps", "20000", "--context", "256,4096", "--json"])
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["model"] == "tiny-1b" and {r["tier"] for r in d["rows"]} >= {"storage"}
    for r in d["rows"]:
        rd = result.tiers[r["tier"]].read  # the measured figures, through the documented formulas
        mean_op = rd.bytes / rd.ops
        assert r["measured_mean_op_bytes"] == pytest.approx(mean_op)
        assert r["fetch_mean_s"] == pytest.approx(r["kv_bytes"] * (rd.latency_ms.mean / 1e3) / mean_op)
        assert r["fetch_p95_s"] == pytest.approx(r["kv_bytes"] * (rd.latency_ms.p95 / 1e3) / mean_op)
        assert r["recompute_s"] == pytest.approx(r["context_tokens"] / 20000)
        assert r["verdict"] == ("fetch" if r["fetch_p95_s"] < r["recompute_s"] else "recompute")
