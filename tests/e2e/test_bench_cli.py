"""``kvtier bench`` as a user runs it: real processes, real files, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import kvtier_cmd

pytestmark = pytest.mark.slow  # real multi-second runs; CI runs them (scripts/test.sh -m "not slow" skips)


REQUIRED = [
    ("summary", "avg_throughput_tokens_per_sec"),
    ("summary", "storage_io_latency_ms", "p95"),
    ("summary", "cache_stats", "cache_hit_rate"),
    ("summary", "cache_stats", "tier_storage_kv_bytes_read_gb"),
    ("summary", "cache_stats", "storage_write_device_p95_ms"),
    ("summary", "cache_stats", "storage_read_host_p95_ms"),
    ("summary", "cache_stats", "nvme_read_device_p95_ms"),
    ("summary", "cache_stats", "decode_bytes_read_gb"),
    ("summary", "qos_metrics", "interactive", "target_latency_p95_ms"),
    ("summary", "host_time_fraction"),
    ("requests_completed",),
    ("total_tokens_generated",),
    ("status",),
    ("kvtier_version",),
    ("config", "num_users"),
    ("host", "cpu_model"),
    ("storage", "direct_io"),
    ("warnings",),
    ("errors",),
    ("summary", "cache_stats", "storage_health", "overall_status"),
    ("stop_reason", "code"),
    ("result_schema_version",),
    ("host", "directories", "cache_dir", "fs_type"),
    ("host", "libraries", "numpy"),
    ("started_at",),
    ("finished_at",),
]


def codes(r):
    return {w["code"] for w in r["warnings"]}


SMALL = """\
user_templates:
  chatbot: {context_range: [64, 512], generation_range: [8, 64], think_time_range: [0.01, 0.05]}
  coding: {context_range: [256, 2048], generation_range: [8, 64], think_time_range: [0.01, 0.05]}
  document: {context_range: [256, 1024], generation_range: [8, 64], think_time_range: [0.01, 0.05]}
"""


@pytest.fixture
def small_workload(tmp_path: Path) -> str:
    """Short requests so that a few-second run completes many of them."""
    p = tmp_path / "small.yaml"
    p.write_text(SMALL)
    return str(p)


def bench(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        kvtier_cmd() + ["bench", "--progress", "plain", "--progress-interval", "1"] + args,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def dig(d, path):
    for p in path:
        d = d[p]
    return d


def test_short_run_writes_complete_result_and_xlsx(tmp_path, cache_dir, small_workload):
    foreign = cache_dir / "user_file.npy"
    foreign.write_bytes(b"mine")
    out, xlsx = tmp_path / "r.json", tmp_path / "r.xlsx"
    p = bench(
        [
            "--model",
            "tiny-1b",
            "--num-users",
            "4",
            "--duration",
            "3",
            "--gpu-mem-gb",
            "0",
            "--cpu-mem-gb",
            "0.05",
            "--generation-mode",
            "fast",
            "--seed",
            "1",
            "--cache-dir",
            str(cache_dir),
            "--output",
            str(out),
            "--xlsx-output",
            str(xlsx),
            "--max-concurrent-allocs",
            "2",
            "--config",
            small_workload,
            "--request-log",
            str(tmp_path / "req.jsonl"),
        ],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    for path in REQUIRED:
        dig(r, path)
    # the request log: one line per request that ran, agreeing with the result
    log = [json.loads(x) for x in (tmp_path / "req.jsonl").read_text().splitlines()]
    ok = [x for x in log if x["status"] == "ok"]
    assert len(ok) == r["requests_completed"] and len(log) == len(ok) + r["requests_cut_at_stop"]
    assert all(x["rank"] is None and x["request_id"] for x in log) and len({x["request_id"] for x in log}) == len(log)
    assert all(isinstance(x["turn"], int) and x["turn"] >= 1 for x in log)
    for x in log:  # the lookups by kind add up to the request's hits and misses
        by = x["lookups"]
        assert sum(n for k, n in by.items() if k.endswith("_hits")) == x["hits"], x
        assert sum(n for k, n in by.items() if k.endswith("_misses")) == x["misses"], x
    assert max(x["e2e_ms"] for x in ok) == pytest.approx(r["summary"]["end_to_end_latency_ms"]["max"], abs=1e-3)
    assert sum(x["bytes_written"] for x in ok) > 0 and all(set(x["tier_ms"]) <= {"gpu", "cpu", "storage"} for x in ok)
    assert all(sum(x["tier_ms"].values()) == pytest.approx(x["storage_ms"], abs=1e-3) for x in ok)
    assert r["status"] == "complete" and r["requests_completed"] > 0 and r["requests_failed"] == 0
    assert r["summary"]["generation_latency_ms"]["mean"] > 0  # fast mode sleeps 2 ms per token
    assert r["config"]["seed"] == 1 and r["seed"] == 1
    assert foreign.read_bytes() == b"mine"
    assert sorted(os.listdir(cache_dir)) == ["user_file.npy"]  # our run dir is gone
    assert "[kvtier] t=" in p.stderr  # plain progress lines without a terminal
    # before it writes, the run says how much the file tier may write and where (#44 item 4)
    gib = r["storage"]["capacity_bytes"] / 2**30
    assert f"the file tier may write up to {gib:.1f} GiB under {cache_dir}" in p.stderr
    assert "throughput" in p.stdout and "arrival, workers, allocation bound" in p.stdout and "open, " in p.stdout
    import openpyxl

    wb = openpyxl.load_workbook(xlsx)
    # the reference's sheets first, by its labels; then kvtier's
    assert wb.sheetnames[:3] == ["Summary", "Run Parameters", "Performance Metrics"]
    assert {"QoS Metrics", "kvtier summary", "Cache", "QoS", "Tiers", "Config"} <= set(wb.sheetnames)
    head = [c.value for c in wb["Summary"][1]]
    values = dict(zip(head, [c.value for c in wb["Summary"][2]], strict=True))
    assert values["Total Requests"] == r["requests_completed"] and values["Num Users"] == r["config"]["num_users"]
    metrics = {row[0].value: row[1].value for row in wb["Performance Metrics"].iter_rows(min_row=2)}
    cs = r["summary"]["cache_stats"]
    assert metrics["Storage Throughput (tok/s)"] == r["summary"]["storage_throughput_tokens_per_sec"]
    assert metrics["Storage Tier Read Device P95 (ms)"] == cs["storage_read_device_p95_ms"]
    assert metrics["Tier Storage Write Bandwidth (GiB/s)"] == cs["tier_storage_write_bandwidth_gbps"]
    assert metrics["Storage Tier Write Total P50 (ms)"] == cs["storage_write_p50_ms"]  # filled from the model's
    assert metrics["Tier Storage KV Bytes Written (GiB)"] == cs["tier_storage_kv_bytes_written_gb"]  # attributes
    assert metrics["Storage Entries"] == cs["storage_entries"] and len(metrics) == 72
    qos = {row[0].value: row[1].value for row in wb["QoS Metrics"].iter_rows(min_row=2)}
    assert sum(qos.values()) == r["requests_completed"]
    rows = {row[0].value: row[1].value for row in wb["kvtier summary"].iter_rows(min_row=2)}
    assert rows["requests_completed"] == r["requests_completed"]
    # how the load was offered: the arrival mode and the allocation bound are in the workbook
    load = {row[0].value: row[1].value for row in wb["Load"].iter_rows(min_row=2)}
    assert load["arrival"] == r["load"]["arrival"] == "open" and load["alloc_bound"] == r["load"]["alloc_bound"]
    assert load["workers"] == r["load"]["workers"] and "Setup" in wb.sheetnames
    # the device's own figures: a sheet of totals and one row per sampling interval
    assert {"Device", "Device timeline"} <= set(wb.sheetnames)
    dev = r["device"]
    assert wb["Device timeline"].max_row == 1 + len(dev["timeline"])
    if dev["devices"]:
        head = [c.value for c in wb["Device timeline"][1]]
        assert f"{dev['devices'][0]}.write_bytes" in head and "kvtier_storage_write_bytes" in head


def test_bytes_agree_with_process_io_counters(tmp_path, cache_dir):
    """The 'done when' check at a shorter duration: our byte counts vs /proc/self/io."""
    out = tmp_path / "r.json"
    p = bench(
        [
            "--model",
            "llama3.1-8b",
            "--num-users",
            "10",
            "--duration",
            "6",
            "--gpu-mem-gb",
            "0",
            "--cpu-mem-gb",
            "0",
            "--max-concurrent-allocs",
            "4",
            "--generation-mode",
            "none",
            "--seed",
            "42",
            "--cache-dir",
            str(cache_dir),
            "--output",
            str(out),
        ],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    io = r["process_io"]
    assert io["storage_tier_bytes_written_on_disk"] > 0
    assert 0.9 <= io["write_ratio"] <= 1.1, io
    if io["storage_tier_bytes_read_on_disk"] > 0:
        assert 0.9 <= io["read_ratio"] <= 1.1, io
    assert r["elapsed_s"] < 6 + 5
    # Python's share of the storage path is a speed figure, measured by the demo (docs/performance.md), not bounded
    # here: other tests' CPU load took it from ~0.0003 to 0.11-0.18 (#44 item 11)
    assert 0.0 <= r["summary"]["host_time_fraction"] <= 1.0


def test_cpu_tier_demotes_into_file_tier_with_timed_writes(tmp_path, cache_dir, small_workload):
    out = tmp_path / "r.json"
    p = bench(
        [
            "--model",
            "tiny-1b",
            "--num-users",
            "6",
            "--duration",
            "4",
            "--gpu-mem-gb",
            "0",
            "--cpu-mem-gb",
            "0.02",
            "--generation-mode",
            "none",
            "--seed",
            "3",
            "--cache-dir",
            str(cache_dir),
            "--output",
            str(out),
            "--config",
            small_workload,
        ],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    w = r["tiers"]["storage"]["write"]
    assert r["summary"]["cache_stats"]["demotions"] > 0
    assert w["by_cause"]["demotion"]["ops"] == r["summary"]["cache_stats"]["demotions"]
    assert w["by_cause"]["demotion"]["latency_ms"]["p95"] > 0
    assert r["summary"]["cache_stats"]["storage_write_p95_ms"] is not None
    cpu = r["tier_usage_at_end"]["cpu"]
    assert cpu["used_bytes"] <= cpu["capacity_bytes"]
    # paged (#31): 256 tokens of tiny-1b's KV asked for, cut to 1/16 of the 20 MB tier; whole pages held
    assert cpu["page_bytes"] == 1_339_392 and cpu["capacity_bytes"] % cpu["page_bytes"] == 0
    assert cpu["used_bytes"] % cpu["page_bytes"] == 0 and 0 <= cpu["waste_bytes"] <= cpu["used_bytes"]
    assert r["summary"]["cache_stats"]["fragmented_fallthroughs"] == 0


def test_gpu_without_device_is_a_recorded_warning(tmp_path, cache_dir, small_workload):
    out = tmp_path / "r.json"
    p = bench(
        [
            "--model",
            "tiny-1b",
            "--num-users",
            "2",
            "--duration",
            "3",
            "--gpu-mem-gb",
            "4",
            "--cpu-mem-gb",
            "0.01",
            "--generation-mode",
            "none",
            "--cache-dir",
            str(cache_dir),
            "--output",
            str(out),
            "--config",
            small_workload,
        ],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    except ImportError:
        pass
    assert "gpu-tier-off" in codes(r)
    w = next(w for w in r["warnings"] if w["code"] == "gpu-tier-off")
    assert w["message"].startswith("GPU tier off") and w["requested_gb"] == 4
    assert "gpu" not in r["tiers"]


def test_a_missing_validation_trace_is_a_dataset_error_before_any_load(tmp_path):
    base = ["--duration", "1", "--gpu-mem-gb", "0", "--cpu-mem-gb", "0.1", "--output", str(tmp_path / "r.json")]
    p = bench([*base, "--validation-trace", "/nonexistent/trace.csv"], tmp_path, timeout=30)
    assert p.returncode == 3 and "kvtier: error: /nonexistent/trace.csv: no such file" in p.stderr
    assert not (tmp_path / "r.json").exists() and "kvtier bench:" not in p.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "llama-9000"], "--model: unknown model 'llama-9000'"),
        (["--cache-dir", "/proc/kvtier-missing"], "--cache-dir /proc/kvtier-missing: a system directory (/proc)"),
        (["--cache-dir", "/proc"], "--cache-dir /proc: a system directory (/proc)"),
        (["--cache-dir", "/etc/kv_cache"], "--cache-dir /etc/kv_cache: a system directory (/etc)"),
        (["--cache-dir", "/nonexistent-kvtier/x/../../usr/sbin/kv"], "a system directory (/usr/sbin)"),
        (["--num-users", "0"], "--num-users"),
        (["--config", "BAD"], "eviction.target_usage_ratio"),
        (["--io-trace-log", "/nonexistent/dir/t.csv"], "--io-trace-log: directory /nonexistent/dir does not exist"),
        (["--noise-mb", "65536", "--cpu-mem-gb", "0"], "--noise-mb 65536: the I/O buffers need"),
        (["--cpu-mem-gb", "100000"], "--cpu-mem-gb 100000 exceeds validation_limits (16384)"),
        (["--output", "/nonexistent/dir/r.json"], "--output: directory /nonexistent/dir does not exist"),
    ],
)
def test_bad_input_is_one_clear_line_before_any_load(tmp_path, args, needle):
    if "--noise-mb" in args:
        from kvtier.telemetry.host import mem_available_bytes

        if mem_available_bytes() > 60 * 2**30:
            pytest.skip("a 64 GiB noise buffer fits this host: no refusal to see")
    if "BAD" in args:
        bad = tmp_path / "bad.yaml"
        bad.write_text("eviction:\n  target_usage_ratio: 7\n")
        args = [str(bad) if a == "BAD" else a for a in args]
    base = ["--duration", "1", "--gpu-mem-gb", "0", "--output", str(tmp_path / "r.json")]
    if "--cpu-mem-gb" not in args:
        base += ["--cpu-mem-gb", "0.1"]
    p = bench(base + args, tmp_path, timeout=30)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert needle in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "r.json").exists()
    assert "kvtier bench:" not in p.stderr  # nothing started
    assert not os.path.lexists("/etc/kv_cache")  # refused before the folder is made (the reference refuses it too)


def test_a_cpu_tier_larger_than_the_host_starts_and_takes_pages_as_entries_arrive(tmp_path, cache_dir, small_workload):
    """#42 item 3: the spec's --cpu-mem-gb 32 on its 32 GB host. A tier twice the host's RAM starts (it was refused
    at start); its pages are taken as entries arrive, and the run says the tier is more than the host has."""
    from kvtier.telemetry.host import mem_total_bytes

    asked = 2 * mem_total_bytes() / 2**30
    out = tmp_path / "r.json"
    args = ["--model", "tiny-1b", "--num-users", "2", "--duration", "3", "--gpu-mem-gb", "0", "--seed", "3"]
    args += ["--cpu-mem-gb", f"{asked:.0f}", "--generation-mode", "none", "--config", small_workload]
    p = bench([*args, "--cache-dir", str(cache_dir), "--output", str(out)], tmp_path)
    assert p.returncode in (0, 1), p.stderr
    r = json.loads(out.read_text())
    w = next(w for w in r["warnings"] if w["code"] == "cpu-tier-exceeds-host")
    assert w["cpu_tier_bytes"] == int(float(f"{asked:.0f}") * 2**30) > w["host_available_bytes"]
    assert r["summary"]["cache_stats"]["host_memory_short"] == 0  # a small run never came near the floor
    assert r["tiers"]["cpu"]["write"]["bytes"] > 0


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm tmpfs to stand in for CXL memory")
def test_a_cxl_tier_on_dev_shm_sits_behind_cpu_ram_in_the_waterfall(tmp_path, cache_dir, small_workload):
    """#54 item 2: --cxl-path/--cxl-mem-gb put the CXL tier between CPU RAM and the file tier; demotions from RAM
    land in it, and its pages are counted and reported as any tier's."""
    out = tmp_path / "r.json"
    args = ["--model", "tiny-1b", "--num-users", "4", "--duration", "4", "--gpu-mem-gb", "0", "--seed", "3"]
    args += ["--cpu-mem-gb", "0.01", "--cxl-path", "/dev/shm", "--cxl-mem-gb", "0.5", "--generation-mode", "none"]
    p = bench([*args, "--config", small_workload, "--cache-dir", str(cache_dir), "--output", str(out)], tmp_path)
    assert p.returncode in (0, 1), p.stderr
    r = json.loads(out.read_text())
    assert list(r["tiers"]) == ["cpu", "cxl", "storage"]
    assert r["tiers"]["cxl"]["write"]["bytes"] > 0
    usage = r["tier_usage_at_end"]["cxl"]
    assert 2**28 < usage["capacity_bytes"] <= 2**29 and usage["capacity_bytes"] % usage["page_bytes"] == 0


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        kvtier_cmd() + ["bench", "--progress", "plain", "--progress-interval", "1"] + args,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert line.startswith("kvtier bench:"), line
    return proc


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_writes_partial_result_and_cleans_up(tmp_path, cache_dir, sig, code):
    out = tmp_path / "r.json"
    proc = _start(
        [
            "--model",
            "llama3.1-8b",
            "--num-users",
            "6",
            "--duration",
            "60",
            "--gpu-mem-gb",
            "0",
            "--cpu-mem-gb",
            "0.5",
            "--generation-mode",
            "realistic",
            "--cache-dir",
            str(cache_dir),
            "--output",
            str(out),
        ],
        tmp_path,
    )
    deadline = time.monotonic() + 30  # wait until the load loop reports, not a fixed time
    while time.monotonic() < deadline and not proc.stderr.readline().startswith("[kvtier] t="):
        pass
    assert proc.poll() is None, "the run ended before the signal"
    t0 = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 20
    assert proc.returncode == code, err
    assert "Traceback" not in err
    r = json.loads(out.read_text())
    assert r["status"] == "partial"
    assert r["stop_reason"]["code"] == {2: "interrupted", 15: "terminated"}[sig]
    assert r["stop_reason"]["message"].startswith(("interrupted", "terminated"))
    assert "run-not-complete" in codes(r)
    assert os.listdir(cache_dir) == []


def test_disk_full_ends_cleanly_with_partial_result(tmp_path, small_fs):
    out = tmp_path / "r.json"
    p = bench(
        [
            "--model",
            "llama3.1-8b",
            "--num-users",
            "4",
            "--duration",
            "30",
            "--gpu-mem-gb",
            "0",
            "--cpu-mem-gb",
            "0",
            "--storage-capacity-gb",
            "2",
            "--generation-mode",
            "none",
            "--cache-dir",
            str(small_fs),
            "--output",
            str(out),
        ],
        tmp_path,
        timeout=90,
    )
    assert p.returncode == 5, p.stderr
    assert "Traceback" not in p.stderr
    r = json.loads(out.read_text())
    assert r["status"] == "partial" and r["stop_reason"]["code"] == "device-full"
    assert "ENOSPC" in r["stop_reason"]["message"]
    assert r["requests_failed"] >= 1
    assert r["errors"]["tier_operations"]
    assert "errors-seen" in codes(r)
    assert [p for p in os.listdir(small_fs) if p != "lost+found"] == []


def _summary(tmp_path, cache_dir, small_workload, extra, name="r.json"):
    out = tmp_path / name
    p = bench(
        [
            "--model",
            "tiny-1b",
            "--num-users",
            "4",
            "--duration",
            "4",
            "--gpu-mem-gb",
            "0",
            "--cpu-mem-gb",
            "0.05",
            "--generation-mode",
            "none",
            "--seed",
            "5",
            "--cache-dir",
            str(cache_dir),
            "--output",
            str(out),
            "--config",
            small_workload,
        ]
        + extra,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(out.read_text())


def test_chunked_layout_reads_less_than_entry_layout(tmp_path, cache_dir, small_workload):
    entry = _summary(tmp_path, cache_dir, small_workload, ["--kv-layout", "entry"], "e.json")
    chunked = _summary(
        tmp_path, cache_dir, small_workload, ["--kv-layout", "chunked", "--kv-chunk-tokens", "64"], "c.json"
    )
    ea = entry["summary"]["kv_layout_stats"]["read_amplification"]
    ca = chunked["summary"]["kv_layout_stats"]["read_amplification"]
    assert ea is not None and ca is not None and ca < ea
    assert entry["summary"]["multi_turn_stats"]["turns_max"] >= 2
    assert chunked["summary"]["multi_turn_stats"]["multi_turn_cache_hits"] > 0
    assert (
        entry["summary"]["prefix_cache_stats"]["prefix_hits"] + entry["summary"]["prefix_cache_stats"]["prefix_misses"]
        > 0
    )


def test_prefill_only_never_decodes_and_decode_only_never_writes(tmp_path, cache_dir, small_workload):
    pre = _summary(tmp_path, cache_dir, small_workload, ["--prefill-only"], "p.json")
    assert pre["summary"]["kv_layout_stats"]["decode"]["hits"] == 0 and pre["requests_completed"] > 0
    dec = _summary(tmp_path, cache_dir, small_workload, ["--decode-only"], "d.json")
    assert dec["requests_completed"] > 0
    assert dec["tiers"]["storage"]["write"]["by_cause"].get("request") is None
    assert all(t["write"]["by_cause"].get("request") is None for t in dec["tiers"].values())
    assert dec["summary"]["kv_layout_stats"]["decode"]["hits"] > 0
    assert "prepopulation-excluded" in codes(dec)


def test_rag_burst_is_measured_and_ingest_reported(tmp_path, cache_dir, small_workload):
    cfg = tmp_path / "rag.yaml"
    cfg.write_text(
        Path(small_workload).read_text()
        + "rag:\n  request_probability: 0.6\n  small_model_doc_tokens_min: 600\n  small_model_doc_tokens_max: 1500\n"
    )
    out = tmp_path / "r.json"
    p = bench(
        [
            "--model",
            "tiny-1b",
            "--num-users",
            "3",
            "--duration",
            "4",
            "--gpu-mem-gb",
            "0",
            "--cpu-mem-gb",
            "0.05",
            "--generation-mode",
            "none",
            "--seed",
            "2",
            "--cache-dir",
            str(cache_dir),
            "--output",
            str(out),
            "--config",
            str(cfg),
            "--enable-rag",
            "--rag-num-docs",
            "4",
            "--rag-top-k",
            "3",
        ],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    rs = json.loads(out.read_text())["summary"]["rag_stats"]
    assert rs["queries"] > 0 and rs["burst_latency_ms"]["count"] == rs["queries"]
    # one document per query (as the reference); 600-1500 tokens make 2-3 chunks of 512: top-3 reads 2 or 3
    assert rs["burst_bytes_gb"] > 0 and rs["chunk_hits"] + rs["chunk_misses"] >= 2 * rs["queries"]
    assert rs["ingest"]["entries"] > 0 and rs["ingest"]["bytes"] > 0


def test_precondition_writes_keeps_until_needed_then_removes(tmp_path, cache_dir, small_workload):
    out = tmp_path / "r.json"
    p = bench(
        [
            "--model",
            "tiny-1b",
            "--num-users",
            "2",
            "--duration",
            "2",
            "--gpu-mem-gb",
            "0",
            "--cpu-mem-gb",
            "0.05",
            "--generation-mode",
            "none",
            "--cache-dir",
            str(cache_dir),
            "--output",
            str(out),
            "--config",
            small_workload,
            "--precondition",
            "--precondition-size-gb",
            "0.25",
            "--precondition-threads",
            "2",
        ],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    pc = r["setup"]["precondition"]
    assert pc["completed"] and pc["written_bytes"] == int(0.25 * 2**30) and pc["threads"] == 2
    # the data stayed on the device until the load began (removed only as the tier needed room)
    assert pc["kept_bytes"] == pc["written_bytes"] and pc["kept_files"] == 1
    assert r["process_io"]["write_ratio"] is None or r["process_io"]["write_ratio"] < 1.5  # excluded from the run
    assert r["summary"]["cache_stats"]["evictions"] == 0  # filler is not the run's eviction
    assert os.listdir(cache_dir) == []


def test_a_precondition_that_writes_less_than_asked_says_so(tmp_path, cache_dir, small_workload):
    """#41 item 10: a 0.2 GB precondition file cannot enter a 0.1 GB tier: the shortfall is recorded in
    setup.precondition and a coded warning names it (the run said complete with no word before)."""
    out = tmp_path / "r.json"
    args = ["--model", "tiny-1b", "--num-users", "2", "--duration", "3", "--gpu-mem-gb", "0", "--cpu-mem-gb", "0"]
    args += ["--storage-capacity-gb", "0.1", "--generation-mode", "none", "--cache-dir", str(cache_dir), "--config"]
    args += [small_workload, "--precondition", "--precondition-size-gb", "0.2", "--output", str(out)]
    p = bench(args, tmp_path)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    pc = r["setup"]["precondition"]
    assert not pc["completed"] and pc["shortfall_bytes"] == pc["requested_bytes"] - pc["written_bytes"] > 0
    (w,) = [w for w in r["warnings"] if w["code"] == "precondition-short"]
    assert w["shortfall_bytes"] == pc["shortfall_bytes"] and w["requested_bytes"] == int(0.2 * 2**30)
    assert "--precondition wrote" in p.stdout + p.stderr


def test_autoscaling_capacity_really_changes_users(tmp_path, cache_dir, small_workload):
    """The reference's capacity search grows the users and stops the run itself. Its throughput is the average
    since the start, which climbs ~1 %/sample for a while after a slow start (a CI run at 1 s samples and 16 users
    was still climbing at 25 s); half-second samples and an 8-user cap stop it in 3-7 s here, and --duration 60 is
    only the bound."""
    cfg = tmp_path / "as.yaml"
    cfg.write_text(Path(small_workload).read_text() + "autoscaler:\n  interval_s: 0.5\n  max_users: 8\n")
    out = tmp_path / "r.json"
    p = bench(
        [
            "--model",
            "tiny-1b",
            "--num-users",
            "2",
            "--duration",
            "60",
            "--gpu-mem-gb",
            "0",
            "--cpu-mem-gb",
            "0.05",
            "--generation-mode",
            "fast",
            "--seed",
            "4",
            "--cache-dir",
            str(cache_dir),
            "--output",
            str(out),
            "--config",
            str(cfg),
            "--enable-autoscaling",
            "--autoscaler-mode",
            "capacity",
        ],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    a = r["summary"]["autoscaling_summary"]
    assert a["mode"] == "capacity" and len(a["steps"]) >= 2
    users = [s["users"] for s in a["steps"]]
    assert users[1] > users[0]  # the live worker count grew
    assert a["stop_reason"].startswith("Peak capacity found") and r["stop_reason"]["message"] == a["stop_reason"]
    assert r["stop_reason"]["code"] == "peak-capacity"
    assert r["status"] == "complete"
    # the reference's layout: the scale events, and a summary of them
    events = r["summary"]["autoscaling_stats"]
    assert [e["action"] for e in events][-1] == "stop" and events[0]["action"] == "scale_up"
    assert a["total_scale_events"] == len(events) and a["initial_users"] == 2 and a["peak_user_count"] >= 2
    assert events[0]["users"] == users[1] and events[0]["timestamp"] >= r["started_at"]


def test_zero_valued_flags_take_the_reference_meaning(tmp_path, small_workload):
    """--max-concurrent-allocs 0: one worker per user (buffers within the budget); a missing --cache-dir
    is created; --precondition-size-gb 0: twice the tier; --precondition-threads 0: the CPU count."""
    cache = tmp_path / "new" / "cache"
    out = tmp_path / "r.json"
    args = ["--model", "tiny-1b", "--num-users", "40", "--duration", "2", "--gpu-mem-gb", "0"]
    args += ["--cpu-mem-gb", "0.01", "--generation-mode", "none", "--config", small_workload, "--seed", "3"]
    args += ["--max-concurrent-allocs", "0", "--io-buffer-budget-mb", "20", "--cache-dir", str(cache)]
    args += ["--storage-capacity-gb", "0.01", "--precondition", "--log-level", "CRITICAL", "--output", str(out)]
    p = bench(args, tmp_path)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert cache.is_dir()
    m = r["memory"]
    assert m["io_slots"] == 40 and m["io_chunk_bytes"] == 1 << 20  # 20 MiB / 40 workers, at least 1 MiB
    w = next(w for w in r["warnings"] if w["code"] == "io-chunk-reduced")
    assert w["io_slots"] == 40 and w["requested_io_chunk_bytes"] == 64 << 20
    pre = r["setup"]["precondition"]
    assert pre["requested_bytes"] == 2 * r["storage"]["capacity_bytes"] and pre["threads"] == os.cpu_count()
    assert "warning" not in p.stderr.lower()  # --log-level CRITICAL silences the warnings on stderr


def test_the_load_ends_at_its_deadline_at_200_users(tmp_path, small_workload):
    """After --duration no request does any I/O: judged from what the run recorded (each request's start in
    --request-log against the load's start + duration), not from the wall clock of a loaded machine
    (benchmarks/stop_latency.py measures how soon after the deadline the load phase ends). The removal of
    the run's files is timed apart, in teardown. Entries of 1.5-50 MB (tiny-1b, short contexts) still span
    several I/O chunks; with llama3.1-8b's default contexts, on a disk throttled to 0.4 GB/s, 200 users shared
    it so thinly that no request finished in 4 s and the run was rightly judged failed."""
    out, log = tmp_path / "r.json", tmp_path / "req.jsonl"
    args = ["--model", "tiny-1b", "--num-users", "200", "--duration", "4", "--gpu-mem-gb", "0", "--config"]
    args += [small_workload, "--cpu-mem-gb", "0", "--max-concurrent-allocs", "16", "--generation-mode", "none"]
    args += ["--seed", "42", "--io-chunk-mb", "4"]
    args += ["--cache-dir", str(tmp_path / "c"), "--output", str(out), "--request-log", str(log)]
    (tmp_path / "c").mkdir()
    p = bench(args, tmp_path, timeout=180)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["stop_reason"]["code"] == "duration"
    deadline = r["load_start_unix_s"] + 4.0
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    late = [x for x in lines if x["submit_unix_s"] + x["queue_ms"] / 1e3 > deadline + 0.01]  # 10 ms: clock mapping
    assert lines and all(x["status"] == "cut" and x["bytes_read"] == x["bytes_written"] == 0 for x in late), late[:3]
    td = r["teardown"]
    assert td["seconds"] >= 0 and td["storage_bytes"] > 0 and not td["kept"]


def test_a_store_no_tier_can_take_is_dropped_not_failed(tmp_path, cache_dir):
    """Entries of 0.1-3 GB into a 0.05 GB tier: no tier can take them, so each store is dropped (counted by
    cause, warned of), the requests complete and later reads miss; no request failed, so the status rule
    (results/outcome.py) leaves the run complete. The rule itself on failed requests: tests/unit/bench."""
    out = tmp_path / "r.json"
    p = bench(
        [
            "--model",
            "llama3.1-8b",
            "--num-users",
            "4",
            "--duration",
            "3",
            "--gpu-mem-gb",
            "0",
            "--cpu-mem-gb",
            "0",
            "--storage-capacity-gb",
            "0.05",
            "--generation-mode",
            "none",
            "--seed",
            "1",
            "--cache-dir",
            str(cache_dir),
            "--output",
            str(out),
        ],  # fmt: skip
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    cs = r["summary"]["cache_stats"]
    assert r["status"] == "complete" and r["requests_failed"] == 0 and r["requests_completed"] >= 1
    assert cs["stores_dropped"] >= 1 and cs["stores_dropped_by_cause"]["entry-too-large"] == cs["stores_dropped"]
    assert cs["stores_dropped_bytes"] > 0.05 * 2**30 and cs["cache_misses"] >= 1
    assert "stores-dropped" in codes(r) and "requests-failed" not in codes(r)


def test_a_runs_files_hold_no_repeated_block_and_its_result_says_so(tmp_path, cache_dir, small_workload):
    """#32: with a 1 MiB noise buffer a run's entries wrap it many times, yet no 4 KiB block of its files
    repeats; storage.payload records the scheme and the run's own sample (distinct, incompressible)."""
    import hashlib

    out = tmp_path / "r.json"
    p = bench(
        [
            "--model",
            "tiny-1b",
            "--num-users",
            "4",
            "--duration",
            "2",
            "--gpu-mem-gb",
            "0",
            "--cpu-mem-gb",
            "0",
            "--generation-mode",
            "none",
            "--config",
            small_workload,
            "--seed",
            "5",
            "--noise-mb",
            "1",
            "--keep-cache",
            "--cache-dir",
            str(cache_dir),
            "--output",
            str(out),
        ],  # fmt: skip
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    pay = r["storage"]["payload"]
    assert pay["payload"] == "unique" and pay["block_bytes"] == 4096 and pay["noise_bytes"] <= 2 << 20
    s = pay["sample"]
    assert s["blocks_sampled"] > 0 and s["distinct_fraction"] == 1.0 and s["compress_ratio"] <= 1.01
    seen, total = set(), 0
    for f in Path(r["storage"]["run_dir"]).glob("*.kv"):
        data = f.read_bytes()
        for i in range(0, len(data), 4096):
            seen.add(hashlib.blake2b(data[i : i + 4096], digest_size=16).digest())
            total += 1
    assert total * 4096 > 4 * pay["noise_bytes"] and len(seen) == total  # past the noise buffer, no block repeated
