"""The I/O trace: its rows pinned, reading both kvtier's and the reference's files, the engine's rows,
and the analyses (stats, reuse distance, fio distilling) on hand-built traces with known answers."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvtier.config.iotrace import TraceFioConfig
from kvtier.engine.backend import aligned_buffer, round_up
from kvtier.engine.null import NullTier
from kvtier.engine.tiered import StoreConfig, TieredStore
from kvtier.errors import ConfigError, DatasetError
from kvtier.iotrace.fio import FREE_SPACE_SHARE, bssplit, distil
from kvtier.iotrace.stats import reuse_distances, trace_stats
from kvtier.tracefile import HEADER, IOTraceWriter, rank_trace_path, read_trace

MiB = 1024**2


class _Clock:
    def __init__(self) -> None:
        self.t = 1_764_500_000.0

    def __call__(self) -> float:
        self.t += 0.25
        return self.t


def test_rows_have_the_references_columns_and_values(tmp_path: Path):
    p = tmp_path / "t.csv"
    w = IOTraceWriter(str(p), batch_rows=2, clock=_Clock())
    w.io("write", "gpu", "conv_u1_00000_turn_1", "request", 131072)
    w.io("read", "gpu", "conv_u1_00000_turn_1", "request", 131072)
    w.io("read", "gpu", "conv_u1_00000_turn_1", "demotion", 131072)
    w.io("write", "cpu", "conv_u1_00000_turn_1", "demotion", 131072)
    w.io("write", "storage", 'odd,key "x"', "request", 7)
    w.io("write", "gpu", "k", "promotion", 4096)
    stats = w.close()
    assert stats["rows"] == 6 and stats["rows_dropped"] == 0 and stats["error"] is None
    assert p.read_text() == (
        "Timestamp,Operation,Object_Size_Bytes,Tier,Key,Phase\n"
        "1764500000.250000,Write,131072,Tier-0,conv_u1_00000_turn_1,Prefill\n"
        "1764500000.500000,Read,131072,Tier-0,conv_u1_00000_turn_1,Decode\n"
        "1764500000.750000,Read,131072,Tier-0,conv_u1_00000_turn_1,Evict\n"
        "1764500001.000000,Write,131072,Tier-1,conv_u1_00000_turn_1,Evict\n"
        '1764500001.250000,Write,7,Tier-2,"odd,key ""x""",Prefill\n'
        "1764500001.500000,Write,4096,Tier-0,k,Promote\n"
    )
    assert stats["csv_bytes"] == p.stat().st_size
    t = read_trace(str(p))
    assert t.keys[t.key[4]] == 'odd,key "x"' and t.size.tolist() == [131072] * 4 + [7, 4096]
    assert t.tier.tolist() == [0, 0, 0, 1, 2, 0] and t.op.tolist() == [1, 0, 0, 1, 1, 1]
    assert [t.phases[i] for i in t.phase] == ["Prefill", "Decode", "Evict", "Evict", "Prefill", "Promote"]


def test_zstd_trace_round_trips(tmp_path: Path):
    pytest.importorskip("zstandard")
    p = tmp_path / "t.csv.zst"
    w = IOTraceWriter(str(p))
    for i in range(10_000):
        w.io("write" if i % 2 else "read", "storage", f"k{i % 100}", "request", 4096 * (i % 7 + 1))
    assert w.close()["rows"] == 10_000
    assert p.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"  # a zstd frame
    t = read_trace(str(p))
    assert len(t) == 10_000 and int(t.size.sum()) == sum(4096 * (i % 7 + 1) for i in range(10_000))


def test_rows_after_close_are_counted_not_lost_silently(tmp_path: Path):
    w = IOTraceWriter(str(tmp_path / "t.csv"))
    w.io("write", "cpu", "a", "request", 1)
    w.close()
    w.io("write", "cpu", "b", "request", 1)
    assert w.rows_dropped == 1 and len(read_trace(str(tmp_path / "t.csv"))) == 1


def test_reads_the_references_rows(tmp_path: Path):
    """The reference's trace (rows as its io_trace_log_usage.md shows them), column order shuffled."""
    p = tmp_path / "ref.csv"
    p.write_text(
        "Operation,Timestamp,Object_Size_Bytes,Tier,Key,Phase\n"
        "Write,1740553426.194021,131072,Tier-0,layer0/user0,Prefill\n"
        "Read,1740553426.194308,131072,Tier-0,layer0/user0,Decode\n"
        "Write,1740553426.194521,131072,Tier-2,layer0/user0,Evict\n"
        "Read,1740553426.194590,131072,Tier-2,layer0/user0,Decode\n"
    )
    t = read_trace(str(p))
    assert len(t) == 4 and t.tier.tolist() == [0, 0, 2, 2] and t.op.tolist() == [1, 0, 1, 0]
    assert t.keys == ["layer0/user0"] and t.duration_s == pytest.approx(0.000569, abs=1e-6)


def test_bad_traces_name_file_and_line(tmp_path: Path):
    p = tmp_path / "bad.csv"
    p.write_text("Timestamp,Operation,Size\n1,Write,3\n")
    with pytest.raises(DatasetError, match=r"bad.csv:1: not an I/O trace: columns \['Object_Size_Bytes'"):
        read_trace(str(p))
    p.write_text(
        HEADER + "1.0,Write,10,Tier-1,a,Prefill\n2.0,Delete,10,Tier-1,a,Prefill\n3.0,Read,10,Tier-1,a,Decode\n"
    )
    with pytest.raises(DatasetError, match=r"bad.csv:3: bad row \(Operation 'Delete' is not Write or Read\)"):
        read_trace(str(p))
    t = read_trace(str(p), max_bad_rows=1)
    assert len(t) == 2 and t.rows_skipped == 1
    p.write_text(HEADER)
    with pytest.raises(DatasetError, match="no operations"):
        read_trace(str(p))
    with pytest.raises(DatasetError, match="no such file"):
        read_trace(str(tmp_path / "missing.csv"))


def test_rank_paths_keep_the_extension():
    assert rank_trace_path("/x/t.csv", 3) == "/x/t.rank_3.csv"
    assert rank_trace_path("/x/t.csv.zst", 0) == "/x/t.rank_0.csv.zst"
    assert rank_trace_path("/x/trace", 1) == "/x/trace.rank_1"


def test_zst_without_its_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    import builtins

    from kvtier.tracefile import check_trace_path

    real = builtins.__import__

    def no_zstd(name: str, *a: object, **k: object) -> object:
        if name == "zstandard":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_zstd)
    with pytest.raises(ConfigError, match=r"--io-trace-log: .*zstandard.*kvtier\[zstd\]"):
        check_trace_path("--io-trace-log", str(tmp_path / "t.csv.zst"))
    with pytest.raises(ConfigError, match="does not exist"):
        check_trace_path("--io-trace-log", str(tmp_path / "nope" / "t.csv"))


def test_the_waterfall_writes_one_row_per_operation_with_its_phase(tmp_path: Path):
    """GPU 1 MiB > CPU 1 MiB > storage: a third 512 KiB entry demotes the first down a tier."""
    store = TieredStore(
        [NullTier("gpu", MiB), NullTier("cpu", MiB), NullTier("storage", 64 * MiB, lambda n: 4096 + round_up(n))],
        StoreConfig(target_usage_ratio=1.0),
    )
    w = IOTraceWriter(str(tmp_path / "t.csv"))
    store.io_log = w
    buf = aligned_buffer(4096)
    for k in ("a", "b", "c"):
        store.put(k, list, 512 * 1024, buf)
    assert store.get("a", buf).tier == "cpu"
    assert store.get("zz", buf).hit is False  # a miss is no operation
    w.close()
    rows = [ln.split(",")[1:] for ln in (tmp_path / "t.csv").read_text().splitlines()[1:]]
    assert rows == [
        ["Write", "524288", "Tier-0", "a", "Prefill"],
        ["Write", "524288", "Tier-0", "b", "Prefill"],
        ["Read", "524288", "Tier-0", "a", "Evict"],
        ["Write", "524288", "Tier-1", "a", "Evict"],
        ["Write", "524288", "Tier-0", "c", "Prefill"],
        ["Read", "524288", "Tier-1", "a", "Decode"],
    ]
    assert store.usage()["cpu"]["used_bytes"] == 512 * 1024  # the null tiers still account as real ones


def _trace(tmp_path: Path, rows: list[tuple[str, str, int, str]], name: str = "t.csv") -> Path:
    """rows: (op, key, size, tier label); one row per 0.5 s."""
    p = tmp_path / name
    p.write_text(
        HEADER
        + "".join(
            f"{100 + i * 0.5:.6f},{op},{size},{tier},{key},{'Prefill' if op == 'Write' else 'Decode'}\n"
            for i, (op, key, size, tier) in enumerate(rows)
        )
    )
    return p


def test_reuse_distance_counts_distinct_objects_and_bytes_between_accesses(tmp_path: Path):
    t = read_trace(
        str(
            _trace(
                tmp_path,
                [
                    ("Write", "a", 100, "Tier-1"),
                    ("Write", "b", 200, "Tier-1"),
                    ("Write", "c", 400, "Tier-1"),
                    ("Read", "b", 200, "Tier-1"),  # since b: c -> 1 object, 400 B
                    ("Read", "a", 100, "Tier-1"),  # since a: b, c -> 2 objects, 600 B
                    ("Read", "a", 100, "Tier-1"),  # nothing between -> 0
                    ("Read", "d", 50, "Tier-2"),  # never seen: cold
                    ("Read", "c", 400, "Tier-1"),  # since c: b, a, d -> 3 objects, 350 B
                ],
            )
        )
    )
    objs, nbytes, cold = reuse_distances(t)
    assert objs.tolist() == [1, 2, 0, 3] and nbytes.tolist() == [400, 600, 0, 350] and cold == 1
    s = trace_stats(t, interval_s=1.0)
    assert s["read"] == {"ops": 5, "bytes": 850} and s["write"] == {"ops": 3, "bytes": 700}
    assert s["by_tier"]["Tier-2"]["read"] == {"ops": 1, "bytes": 50}
    assert s["objects"] == 4 and s["working_set_bytes"] == 750 and s["duration_s"] == pytest.approx(3.5)
    assert [p["ops_per_s"] for p in s["rate_timeline"]] == [2, 2, 2, 2]
    r = s["reuse"]
    assert r["cold_reads"] == 1 and r["reads_with_earlier_access"] == 4
    # an LRU of 375 B (half the working set) holds the reads with <375 B between: 0 and 350 -> 2 of 5
    half = next(c for c in r["lru_hit_curve"] if c["cache_bytes"] == 375)
    assert half["read_hit_fraction"] == pytest.approx(2 / 5)
    hist = {(h["low_bytes"], h["high_bytes"]): (h["reads"], h["writes"]) for h in s["size_histogram"]}
    assert hist[(64, 128)] == (2, 1) and hist[(256, 512)] == (1, 1) and hist[(32, 64)] == (1, 0)


def test_bssplit_percentages_sum_to_100():
    assert bssplit({4096: 1, 8192: 1, 12288: 1}) == "4k/34:8k/33:12k/33"
    s = bssplit({64 * MiB: 930, 20 * MiB: 60, 4096: 4, 8192: 6})
    parts = dict(p.split("/") for p in s.split(":"))
    assert sum(int(v) for v in parts.values()) == 100 and parts["64m"] == "93" and parts["20m"] == "6"
    assert bssplit({}) == ""


def test_fio_job_splits_objects_into_pieces_and_keeps_the_mix(tmp_path: Path):
    rows = [("Write", f"k{i}", 150 * MiB, "Tier-2") for i in range(4)]
    rows += [("Read", f"k{i % 4}", 150 * MiB, "Tier-2") for i in range(12)]
    rows += [("Write", "x", 8 * MiB, "Tier-1")]  # another tier: not in the job
    t = read_trace(str(_trace(tmp_path, rows)))
    text, f = distil(t, TraceFioConfig(trace=t.path, output=str(tmp_path / "j.fio"), max_bs_mb=64))
    # 150 MiB = 64 + 64 + 22 MiB (22 MiB on the grid: 24 MiB); 4 writes and 12 reads of objects
    assert f["write_ios"] == 12 and f["read_ios"] == 36 and f["rwmixread"] == 75
    assert "bssplit=24m/33:64m/67,24m/33:64m/67" in text
    assert f"rate={int(12 * 150 * MiB / 8)},{int(4 * 150 * MiB / 8)}" in text  # 16 rows over 8 s
    assert "size=1g" in text and "runtime=8" in text  # the 600 MiB working set, at least 1 GiB and "direct=1" in text
    for opt in ("refill_buffers=1", "randrepeat=0", "dedupe_percentage=0", "buffer_compress_percentage=0"):
        assert opt in text.splitlines()  # the data fio writes is as unique and incompressible as kvtier's
    with pytest.raises(DatasetError, match=r"no operations on Tier-0 \(the trace has Tier-1, Tier-2\)"):
        distil(t, TraceFioConfig(trace=t.path, output="j.fio", tiers="0"))


def test_fio_tiers_flag_is_validated():
    with pytest.raises(ValueError, match="comma-separated list"):
        TraceFioConfig(trace="t", output="j", tiers="3")
    assert TraceFioConfig(trace="t", output="j", tiers="Tier-2, 1").tiers == "1,2"


def test_peak_bytes_follow_moves(tmp_path: Path):
    from kvtier.iotrace.replay import peak_bytes

    p = tmp_path / "t.csv"
    p.write_text(
        HEADER
        + "1,Write,100,Tier-1,a,Prefill\n2,Write,100,Tier-1,b,Prefill\n"
        + "3,Read,100,Tier-1,a,Evict\n4,Write,100,Tier-2,a,Evict\n5,Write,100,Tier-1,c,Prefill\n"
    )
    assert peak_bytes(read_trace(str(p))) == {
        0: 0,
        1: 200,
        2: 100,
        5: 0,
    }  # every tier trace replay runs rows on (Tier-5: CXL)


def test_ks_and_wasserstein():
    from kvtier.bench.validation import compare, ks_statistic, w1_relative

    a = np.arange(1000, dtype=float)
    assert ks_statistic(a, a) == 0 and w1_relative(a, a) == 0
    assert ks_statistic(a, a + 1000) == 1.0
    assert w1_relative(a * 2, a) == pytest.approx(1.0, rel=1e-3)  # mean |2x - x| over the mean of x
    assert compare(np.array([]), a)["ks"] is None


def test_each_mpi_rank_writes_its_own_trace(tmp_path: Path):
    from kvtier.bench.mpi import rank_config
    from kvtier.config.bench import BenchConfig
    from kvtier.mpi import RunEnvironment

    cfg = BenchConfig(io_trace_log=str(tmp_path / "kv.csv.zst"), output=str(tmp_path / "r.json"), seed=1)
    mine = rank_config(cfg, RunEnvironment(rank=2, size=4, host="h"), 1)
    assert mine.io_trace_log == str(tmp_path / "kv.rank_2.csv.zst") and mine.output == str(tmp_path / "r.rank_2.json")
    assert rank_config(BenchConfig(seed=1), RunEnvironment(rank=1, size=2, host="h"), 1).io_trace_log is None


def test_a_fio_job_larger_than_the_targets_free_space_is_scaled_down_or_refused(tmp_path: Path):
    import shutil

    from kvtier.errors import ConfigError

    free = shutil.disk_usage(tmp_path).free
    huge = free * 2 // MiB  # objects whose working set is twice what the target has free
    rows = [("Write", "k0", huge * MiB, "Tier-2"), ("Read", "k0", huge * MiB, "Tier-2")]
    t = read_trace(str(_trace(tmp_path, rows)))
    text, f = distil(t, TraceFioConfig(trace=t.path, output="j.fio", directory=str(tmp_path)))
    assert f["size_note"] and "scaled down" in f["size_note"]
    # the free space distil saw (other tests running beside this one move it between two readings)
    seen = int(re.search(r"of the (\d+) bytes free", f["size_note"]).group(1))
    assert abs(seen - free) < free * 0.05 and f["size_bytes"] == int(seen * FREE_SPACE_SHARE) // MiB * MiB < huge * MiB
    assert f"; {f['size_note']}" in text
    with pytest.raises(ConfigError, match="--size-gb .* exceed"):
        distil(t, TraceFioConfig(trace=t.path, output="j.fio", directory=str(tmp_path), size_gb=free * 2 / 2**30))
    _, f = distil(t, TraceFioConfig(trace=t.path, output="j.fio", directory=str(tmp_path / "absent")))
    assert "does not exist here" in f["size_note"]


def test_trace_replay_says_how_its_tiers_were_sized_in_the_flags_terms(tmp_path: Path):
    from kvtier.config.iotrace import TraceReplayConfig
    from kvtier.iotrace.replay import sizing

    rows = [("Write", "a", 100 * MiB, "Tier-2"), ("Write", "b", 50 * MiB, "Tier-1")]
    t = read_trace(str(_trace(tmp_path, rows)))
    cpu, st, said = sizing(TraceReplayConfig(trace=t.path, workers=2), t)
    # storage: the 100 MiB peak + 2 workers x the largest object (100 MiB), at 95 % fill
    assert st == pytest.approx(round(300 * MiB / 0.95 / 2**30 + 0.01, 3))
    assert "--storage-capacity-gb 0: the trace's Tier-2 peak 0.098 GiB + --workers 2 x the largest object" in said
    cpu, st, said = sizing(TraceReplayConfig(trace=t.path, cpu_mem_gb=3, storage_capacity_gb=4), t)
    assert (cpu, st) == (3, 4) and "CPU tier 3 GB (--cpu-mem-gb)" in said and "4 GB (--storage-capacity-gb)" in said


def test_the_rate_timeline_follows_the_rows_not_the_timestamps_span(tmp_path: Path):
    """#28: two rows a billion seconds apart once made a timeline of a billion bins (22 s, 387 MB, 106 MB of JSON
    at a much smaller span); the bins are capped and widened, and the interval used is recorded."""
    import json

    from kvtier.iotrace.stats import MAX_TIMELINE_BINS

    p = tmp_path / "wide.csv"
    p.write_text(HEADER + "1.0,Write,100,Tier-1,a,Prefill\n1000000001.0,Read,100,Tier-1,a,Decode\n")
    s = trace_stats(read_trace(str(p)), interval_s=1.0)  # the time it takes: benchmarks/hostile_inputs.py
    assert len(s["rate_timeline"]) <= MAX_TIMELINE_BINS and s["rate_interval_s"] > 1e5
    assert sum(b["ops_per_s"] for b in s["rate_timeline"]) * s["rate_interval_s"] == pytest.approx(2)
    # #41: and at most 4 bins a row (64 at least): two rows wrote 1.1 MB of empty bins under the first cap alone
    assert len(s["rate_timeline"]) <= 64 and len(json.dumps(s)) < 20_000


@pytest.mark.parametrize(
    ("row", "words"),
    [
        ("nan,Write,100,Tier-1,a,Prefill", "Timestamp 'nan' is not a finite number"),
        ("inf,Write,100,Tier-1,a,Prefill", "Timestamp 'inf' is not a finite number"),
        ("1.0,Write,99999999999999999999999,Tier-1,a,Prefill", "Object_Size_Bytes 99999999999999999999999 is outside"),
        ("1.0,Write,9223372036854775000,Tier-1,a,Prefill", "is outside 0..184467440737 "),
        ("1.0,Write,281474976710656,Tier-1,a,Prefill", "must sum within int64"),  # 2^48: wrapped at 32,768 rows
        ("1.0,Write,1e3,Tier-1,a,Prefill", "Object_Size_Bytes '1e3' is not an integer"),
        ("1.0,Wrte,100,Tier-1,a,Prefill", "Operation 'Wrte' is not Write or Read"),
        ("1.0,Write,100,Tier-9,a,Prefill", "Tier 'Tier-9' is not one of"),
    ],
)
def test_hostile_trace_values_are_one_line_naming_file_line_and_column(tmp_path: Path, row: str, words: str):
    """#28 low 5: NaN, inf, sizes past int64 and unknown labels gave tracebacks or wrapped silently."""
    p = tmp_path / "t.csv"
    p.write_text(HEADER + "0.5,Read,1,Tier-1,a,Decode\n" + row + "\n")
    with pytest.raises(DatasetError, match=rf"t\.csv:3: bad row \(.*{re.escape(words)}"):
        read_trace(str(p))


def test_more_phases_than_an_int8_holds_are_refused(tmp_path: Path):
    p = tmp_path / "t.csv"
    p.write_text(HEADER + "".join(f"{i}.0,Read,1,Tier-1,a,phase{i}\n" for i in range(140)))
    with pytest.raises(DatasetError, match="more than 127 distinct Phase values"):
        read_trace(str(p))


def test_a_trace_longer_than_max_rows_is_refused_at_the_row_past_it(tmp_path: Path):
    """#28 low 5: rows had no cap (about 330 bytes each in Python lists). Columns are typed arrays now and
    --max-rows bounds them: the first row past it is named with the flag."""
    p = tmp_path / "t.csv"
    p.write_text(HEADER + "".join(f"{1764530000 + i}.0,Write,100,Tier-1,k{i},Prefill\n" for i in range(5)))
    trace = read_trace(str(p), max_rows=5)
    assert len(trace) == 5 and trace.ts.dtype == np.float64 and trace.size.tolist() == [100] * 5
    with pytest.raises(DatasetError, match=r"t\.csv:6: more than 4 operations; give --max-rows"):
        read_trace(str(p), max_rows=4)
    import subprocess

    from tests.conftest import kvtier_cmd

    out = subprocess.run([*kvtier_cmd(), "trace", "stats", str(p), "--max-rows", "3"], capture_output=True, text=True)
    assert out.returncode != 0 and "t.csv:5: more than 3 operations" in out.stderr, out.stderr


def test_sizes_of_a_whole_trace_always_sum_within_int64(tmp_path: Path):
    """#41: sizes inside 0..2^48 wrapped the totals at 32,768 rows (negative bytes); the limit now falls with
    --max-rows, so max_rows x limit fits int64, and a short trace may still hold 2^48."""
    from kvtier.tracefile import INT64_MAX, MAX_OBJECT_BYTES, size_limit

    for rows in (1, 2, 32_768, 40_000, 50_000_000, 10**9):
        assert size_limit(rows) * rows <= INT64_MAX and size_limit(rows) <= MAX_OBJECT_BYTES
    p = tmp_path / "big.csv"
    p.write_text(
        HEADER + f"0.5,Write,{MAX_OBJECT_BYTES},Tier-1,a,Prefill\n1.0,Read,{MAX_OBJECT_BYTES},Tier-1,a,Decode\n"
    )
    t = read_trace(str(p), max_rows=2)
    assert int(t.size.sum()) == 2 * MAX_OBJECT_BYTES


@pytest.mark.parametrize("comm", ["vllm\n", "x" * 16, "", "a b", 'x"; system("id")'])
def test_a_command_name_with_a_trailing_newline_or_any_other_character_is_refused(comm: str):
    """#58 item 9: ``^...$`` with ``match`` let ``--comm 'vllm\\n'`` through into the bpftrace program."""
    from pydantic import ValidationError

    from kvtier.config.iotrace import TraceAttachConfig

    with pytest.raises(ValidationError, match="a command name is 1-15"):
        TraceAttachConfig(comm=comm, duration=1)
    assert TraceAttachConfig(comm="python3.11", duration=1).comm == "python3.11"
