"""The report's reading of requests.jsonl: the fast path and the JSON fallback agree, and a broken line is
named; and its sentences state the direction of a change correctly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvtier.errors import DatasetError
from kvtier.replay.client import new_record
from kvtier.replay.datasets import VirtualUser
from kvtier.report.figures import HIGHER, LOWER, Figure, Loaded, sentences
from kvtier.results.records import ReplayRecords


def _record(turn: int, status: str, ttft: float | None, e2e: float | None, n: int | None, t: float, **extra):
    """A record as the client makes it (its field order is what the fast path reads), then filled in."""
    r = new_record(VirtualUser("u", "s", 0, ()), turn, 8)
    r.update({"status": status, "http_status": 200, "ttft_s": ttft, "itl_s": [0.001, 0.002], "e2e_s": e2e,
              "prompt_tokens": 10, "completion_tokens": n, "cached_tokens": 0, "start_unix_s": t})  # fmt: skip
    r.update(extra)
    return r


def test_fast_path_and_json_agree(tmp_path: Path):
    recs = [
        _record(0, "ok", 0.5, 1.5, 11, 100.0),
        _record(1, "ok", 0.25, 0.35, 1, 101.0),  # one token: no TPOT
        _record(2, "http_500", None, None, None, 102.0),
        _record(3, "ok", 0.1, 0.6, 6, 103.0, rank=2),  # a field after start_unix_s (an MPI rank's line)
    ]
    p = tmp_path / "requests.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = ReplayRecords.read(p)
    assert r is not None
    assert r.turn.tolist() == [0, 1, 2, 3] and r.ok.tolist() == [True, True, False, True]
    assert r.ttft_s[0] == 0.5 and math.isnan(r.ttft_s[2]) and r.ttft_s[3] == 0.1
    assert r.tpot_s[0] == pytest.approx(0.1) and math.isnan(r.tpot_s[1]) and r.tpot_s[3] == pytest.approx(0.1)
    assert r.start_s.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert r.ttft_ok(later=True).tolist() == [0.25, 0.1] and r.ttft_ok(later=False).tolist() == [0.5]
    p.write_text(json.dumps(recs[0]) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"requests.jsonl:2: not valid JSON"):
        ReplayRecords.read(p)


def test_an_mpi_rank_s_lines_and_any_key_order_take_the_fast_path(tmp_path: Path, monkeypatch):
    """A line with ``rank`` after start_unix_s (replay/mpi.py) or its keys in another order is read without
    json.loads, with the same values; a string holding an escaped quote still goes to JSON."""
    from kvtier.results import records

    mpi = _record(3, "ok", 0.1, 0.6, 6, 103.0, rank=2)
    shuffled = dict(reversed(list(_record(4, "ok", 0.2, 0.5, 4, 104.0).items())))
    p = tmp_path / "requests.jsonl"
    p.write_text(json.dumps(mpi) + "\n" + json.dumps(shuffled) + "\n")

    def no_json(text: str):
        raise AssertionError(f"the JSON path read {text[:60]!r}")

    monkeypatch.setattr(records.json, "loads", no_json)
    r = ReplayRecords.read(p)
    assert r is not None and r.turn.tolist() == [3, 4] and r.ttft_s.tolist() == [0.1, 0.2]
    assert r.tpot_s.tolist() == pytest.approx([0.1, 0.1]) and r.start_s.tolist() == [0.0, 1.0]
    assert records._fast_fields(json.dumps(_record(0, 'o"k', 0.1, 0.2, 3, 1.0))) is None


def test_sentences_say_better_or_worse():
    base = Loaded("a", "none", "replay", None, figures=[Figure("TTFT p95 s", 1.0, "s", LOWER),
                                                        Figure("requests/s", 10.0, "req/s", HIGHER)])  # fmt: skip
    other = Loaded("b", "cpu", "replay", None, figures=[Figure("TTFT p95 s", 0.36, "s", LOWER),
                                                        Figure("requests/s", 9.0, "req/s", HIGHER)])  # fmt: skip
    assert sentences(base, other) == [
        "cpu: TTFT p95 s -64 % vs none (better)",
        "cpu: requests/s -10 % vs none (worse)",
    ]
    assert sentences(base, other, threshold_pct=20) == ["cpu: TTFT p95 s -64 % vs none (better)"]


def test_a_change_of_a_percentage_is_said_in_points():
    base = Loaded("a", "none", "replay", None, figures=[Figure("TTFT degradation median %", 4.2, "%", LOWER)])
    other = Loaded("b", "cpu", "replay", None, figures=[Figure("TTFT degradation median %", -37.5, "%", LOWER)])
    assert sentences(base, other) == ["cpu: TTFT degradation median % -41.7 points vs none (better)"]


def test_a_crafted_requests_line_costs_linear_time(tmp_path):
    """#28 low 3: a lazy regular expression backtracked for minutes on a 54 KB line of repeated keys; the fields
    are now found left to right, and a line that is not the client's own is parsed as JSON (or named)."""
    from kvtier.errors import DatasetError
    from kvtier.results.records import ReplayRecords

    evil = '{"a": "' + '\\"turn\\": 1, ' * 2000 + '", ' + '"turn": 1, "status": "x", ' * 2000 + '"z": 1}\n'
    p = tmp_path / "requests.jsonl"
    good = ('{"user": "u", "session": "s", "turn": 2, "status": "ok", "cause": null, "ttft_s": 0.5, "itl_s": '
            '[0.1, 0.1], "e2e_s": 0.7, "prompt_tokens": 9, "completion_tokens": 3, "cached_tokens": 0, '
            '"start_unix_s": 100.0}\n')  # fmt: skip
    p.write_text(good + evil)
    # read left to right, then refused by its line: not a record (the time: benchmarks/hostile_inputs.py; the old
    # regex took over 30 s)
    with pytest.raises(DatasetError, match=r":2: status: Input should be 'ok', 'error', 'timeout' or 'cut'"):
        ReplayRecords.read(p)
    p.write_text(good)
    r = ReplayRecords.read(p)
    assert r is not None and r.turn.tolist() == [2] and r.ok.tolist() == [True] and r.ttft_s[0] == 0.5
    p.write_text(good + '{"turn": "x", "status": "ok"\n')
    with pytest.raises(DatasetError, match=":2: not valid JSON"):
        ReplayRecords.read(p)


@pytest.mark.parametrize("turn", ["1e308", "-1e308", "9" * 400, "-3"])
def test_a_turn_number_past_int64_is_named_not_a_crash(tmp_path, turn):
    """#41 item 6: `1e308` as a launch's replay record's turn crashed `kvtier report` (OverflowError converting to
    int64); now the line is named."""
    from kvtier.errors import DatasetError
    from kvtier.results.records import ReplayRecords

    p = tmp_path / "requests.jsonl"
    p.write_text('{"turn": 0, "status": "ok", "ttft_s": 0.5}\n{"turn": ' + turn + ', "status": "ok", "ttft_s": 0.5}\n')
    with pytest.raises(DatasetError, match=r"requests.jsonl:2: turn .* is not a turn number"):
        ReplayRecords.read(p)


def test_where_ttft_went_is_said_from_the_decomposition():
    from types import SimpleNamespace

    from kvtier.report.figures import ttft_sentence
    from kvtier.results.replay import TtftDecomposition

    d = TtftDecomposition.model_validate(
        {
            "requests": 3,
            "closure_within_5pct": 1.0,
            "client_overhead_s_p50": 0.002,
            "token_share": {"cpu": 0.5, "recomputed": 0.5},
            "by_turn": [
                {"turn": 0, "requests": 1, "ttft_s_mean": 0.03, "server_ttft_s_mean": 0.029,
                 "seconds_mean": {"recompute": 0.028, "queue": 0.001}, "token_share": {"recomputed": 1.0}},
                {"turn": 1, "requests": 2, "ttft_s_mean": 0.01, "server_ttft_s_mean": 0.009,
                 "seconds_mean": {"fetch": 0.004, "recompute": 0.002}, "token_share": {"cpu": 0.8, "recomputed": 0.2}},
            ],
        }
    )  # fmt: skip
    said = ttft_sentence(SimpleNamespace(ttft_decomposition=d))
    assert said is not None
    assert "turn 0 (1 requests): prompt tokens 100% recomputed; TTFT 30.0 ms, of it (ms) recompute 28.0" in said
    assert "later turns (2 requests): prompt tokens 80% cpu, 20% recomputed; TTFT 10.0 ms" in said
    assert "fetch 4.0, recompute 2.0" in said and "within 5 % in 100% of requests" in said
    assert ttft_sentence(SimpleNamespace(ttft_decomposition=None)) is None


def test_every_record_the_client_writes_reads_back_validated(tmp_path: Path):
    """#43 item 4: the one reader refuses what is not a record, so it must accept all the client writes: every key of
    ``ReplayRecord`` (the optional ones too) and every status the client sets (results/records.py's model)."""
    from kvtier.results.records import RequestRecord, read_records
    from kvtier.results.replay import ReplayRecord

    assert set(ReplayRecord.__annotations__) == set(RequestRecord.model_fields)
    lines = []
    for status in ("ok", "error", "timeout", "cut"):
        r = _record(1, status, 0.2, 0.5, 4, 100.0, rank=1, first_event_s=0.19, sim_timing="measured",
                    transit_s={"to_server": 0.001}, decomposition_dropped=None,
                    prompt_sources={"gpu": 6, "recomputed": 4}, server_ttft_parts={"queue": 0.01},
                    server_ttft_s=0.01)  # fmt: skip
        lines.append(json.dumps(r))
    p = tmp_path / "requests.jsonl"
    p.write_text("\n".join(lines) + "\n")
    got = read_records(p)
    assert [r.status for _, r in got] == ["ok", "error", "timeout", "cut"] and got[0][1].rank == 1
    cols = ReplayRecords.read(p)
    assert cols is not None and cols.ok.tolist() == [True, False, False, False]
