"""A replay's requests joined to the engine's own records (kvtier/replay/engine_join.py, results/engine_log.py):
what a joined request gets, what does not join and why, and the checks against the engine's counters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import DatasetError
from kvtier.replay.engine_join import collect, engine_checks, join, join_warnings
from kvtier.replay.summary import ttft_decomposition
from kvtier.results.engine_log import read_engine_log
from kvtier.results.replay import ScrapeSummary

WALL = 1000.0  # the engine's wall clock minus its monotonic one
HEADER = {
    "kind": "header",
    "schema": "kvtier-engine-requests/1",
    "engine": "e",
    "block_tokens": 16,
    "block_bytes": 4096,
    "world_size": 1,
    "tiers": [{"name": "cpu", "source": "host"}],
    "cache_server": None,
    "cap_bytes": 1 << 20,
    "pid": 1,
    "wall_minus_mono_s": WALL,
}


def engine_rec(rid: str, *, loaded: bool = True, **over: Any) -> dict[str, Any]:
    """A 100-token prompt that arrived at the API server at 10.000 (monotonic), the engine core at 10.010."""
    stamps = {
        "arrived": 10.010,
        "lookup": 10.030,
        "admitted": 10.031,
        "loaded": 10.051 if loaded else None,
        "prefill": 10.061 if loaded else 10.031,
        "first_token": 10.161,
        "load_submitted": 10.035 if loaded else None,
        "load_done": 10.049 if loaded else None,
    }
    rec = {
        "kind": "request",
        "id": f"chatcmpl-{rid}-0a1b2c3d",
        "status": "FINISHED_STOPPED",
        "prompt_tokens": 100,
        "tokens": {"gpu": 32, "cpu": 48, "recomputed": 20} if loaded else {"gpu": 32, "recomputed": 68},
        "external_tokens": 48 if loaded else 0,
        "failed_tokens": 0,
        "preemptions": 0,
        "preempted_before_first_token": False,
        "load": {
            "jobs": int(loaded),
            "blocks": {"cpu": 3} if loaded else {},
            "bytes": {"cpu": 12288} if loaded else {},
            "io_s": {"cpu": 0.012} if loaded else {},
            "failed_blocks": 0,
        },
        "stores": {"blocks": {"cpu": 1}, "bytes": {"cpu": 4096}},
        "mono_s": stamps,
        "arrival_unix_s": 10.0 + WALL,
        "wall_minus_mono_s": WALL,
    }
    for k, v in over.items():
        if k in stamps:
            stamps[k] = v
        else:
            rec[k] = v
    return rec


def client_rec(rid: str | None, status: str = "ok", prompt: int = 100) -> dict[str, Any]:
    """Sent at 9.995 (monotonic), its first token read at 10.171: TTFT 0.176 s."""
    r: dict[str, Any] = {
        "user": "u",
        "session": "s",
        "turn": 1,
        "session_turn": 1,
        "max_tokens": 4,
        "status": status,
        "cause": None,
        "error": None,
        "http_status": 200,
        "replica": None,
        "ttft_s": 0.176,
        "itl_s": [],
        "e2e_s": 0.2,
        "prompt_tokens": prompt,
        "completion_tokens": 4,
        "cached_tokens": 80,
        "start_unix_s": 1.0,
        "prompt_sources": None,
        "server_ttft_parts": None,
        "server_ttft_s": None,
        "start_mono_s": 9.995,
    }
    if rid is not None:
        r["request_id"] = rid
    return r


def write_log(path: Path, *recs: dict[str, Any], footer: dict[str, Any] | None = None) -> Path:
    lines = [HEADER, *recs, *([footer] if footer else [])]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_a_joined_request_gets_its_sources_its_parts_and_the_transits(tmp_path: Path):
    path = write_log(tmp_path / "e.jsonl", engine_rec("kvt-a-0"), engine_rec("kvt-a-1", loaded=False))
    records = [client_rec("kvt-a-0"), client_rec("kvt-a-1")]
    j = join(records, read_engine_log([path]))
    assert (j.joined_ok, j.requests_ok, j.joined_share, j.unjoined, j.parts_dropped) == (2, 2, 1.0, {}, {})
    r = records[0]
    assert r["decomposition"] == "measured-in-engine"
    assert r["prompt_sources"] == {"gpu": 32, "cpu": 48, "recomputed": 20}
    p = r["server_ttft_parts"]
    assert p == pytest.approx(
        {
            "receive": 0.010,
            "queue": 0.020 + 0.010,
            "lookup": 0.001,
            "fetch": 0.020,
            "recompute": 0.100,
            "first_decode": 0.0,
            "send": 0.0,
        }
    )
    assert r["server_ttft_s"] == pytest.approx(0.161)
    assert r["transit_s"] == pytest.approx({"to_server": 0.005, "to_client": 0.010})
    # one clock: the parts and the transits add up to the client's TTFT
    assert r["server_ttft_s"] + sum(r["transit_s"].values()) == pytest.approx(r["ttft_s"])
    assert r["engine"]["load_wall_s"] == pytest.approx(0.014) and r["engine"]["load_io_s"] == {"cpu": 0.012}
    q = records[1]["server_ttft_parts"]  # no load: prefill starts at the admission
    assert q["fetch"] == 0.0 and q["recompute"] == pytest.approx(0.130) and q["queue"] == pytest.approx(0.020)
    assert (j.external_tokens, j.load_io_s, j.load_bytes) == (48, {"cpu": 0.012}, {"cpu": 12288})
    d = ttft_decomposition(records)  # the summary reads them as it reads the sim's
    assert d["requests"] == 2 and d["closure_within_5pct"] == 1.0 and d["transit_measured"] == 2


def test_what_does_not_join_is_counted_by_cause(tmp_path: Path):
    path = write_log(
        tmp_path / "e.jsonl",
        engine_rec("kvt-a-1"),
        engine_rec("kvt-a-1"),  # two engine requests for one id
        engine_rec("kvt-a-2"),
        engine_rec("kvt-a-3", preempted_before_first_token=True, preemptions=1),
        engine_rec("kvt-a-4", first_token=None),
        engine_rec("kvt-a-5", first_token=10.040),  # before its prefill was scheduled
        engine_rec("kvt-a-6"),
        engine_rec("warmup-0"),  # no request of this replay
    )
    records = [
        client_rec("kvt-a-0"),
        client_rec("kvt-a-1"),
        client_rec("kvt-a-2", prompt=99),
        client_rec("kvt-a-3"),
        client_rec("kvt-a-4"),
        client_rec("kvt-a-5"),
        client_rec(None),
        client_rec("kvt-a-6", status="error"),
    ]
    j = join(records, read_engine_log([path]))
    assert j.requests_ok == 7 and j.joined_ok == 3
    assert j.unjoined == {"not-in-engine-log": 1, "ambiguous": 1, "prompt-mismatch": 1, "no-request-id": 1}
    assert j.parts_dropped == {"preempted": 1, "no-first-token": 1, "stamps-out-of-order": 1}
    assert j.engine_only == 1
    # a joined request whose stamps cannot be parts keeps its prompt's sources
    assert records[3]["prompt_sources"] is not None and records[3]["server_ttft_parts"] is None
    # the failed request the engine admitted counts toward its counters, not as a join
    assert "decomposition" not in records[7] and j.external_tokens == 48 * 5
    (w,) = join_warnings(j)
    assert w.code == "engine-join-incomplete" and "ambiguous 1" in w.message


def test_the_join_is_held_against_the_engines_counters(tmp_path: Path):
    path = write_log(tmp_path / "e.jsonl", engine_rec("kvt-a-0"), engine_rec("kvt-a-1"))
    records = [client_rec("kvt-a-0"), client_rec("kvt-a-1")]
    j = join(records, read_engine_log([path]))
    m = ScrapeSummary(
        url="u",
        samples=3,
        scrape_errors=0,
        external_prefix_cache_hits=96.0,
        kvtier_offload_load_io_s={"cpu": 0.024},
        queue_time_s_mean=0.05,
        prefill_time_s_mean=0.1,
    )
    ok = engine_checks(j, records, [m])
    assert ok.external_match and ok.external_hits_counter == 96.0 and ok.load_io_ratio == pytest.approx(1.0)
    assert ok.queue_s_mean == pytest.approx(0.051) and ok.vllm_queue_s_mean == 0.05
    assert ok.recompute_s_mean == pytest.approx(0.1) and ok.vllm_prefill_s_mean == 0.1
    assert join_warnings(ok) == []
    off = engine_checks(
        j,
        records,
        [m.model_copy(update={"external_prefix_cache_hits": 112.0, "kvtier_offload_load_io_s": {"cpu": 0.03}})],
    )
    assert off.external_match is False
    assert [w.code for w in join_warnings(off)] == ["engine-counts-differ", "engine-counts-differ"]


def test_collect_waits_for_a_record_the_engine_writes_late(tmp_path: Path):
    path = write_log(tmp_path / "e.jsonl", engine_rec("kvt-a-0"))
    records = [client_rec("kvt-a-0"), client_rec("kvt-a-1")]
    t = [0.0]

    def sleep(s: float) -> None:  # the engine writes the second record while the join waits
        t[0] += s
        write_log(path, engine_rec("kvt-a-0"), engine_rec("kvt-a-1"))

    log = collect(records, [str(path)], wait_s=5.0, sleep=sleep, clock=lambda: t[0])
    assert len(log.requests) == 2 and t[0] == pytest.approx(0.2)
    t[0] = 0.0
    late = collect(
        [client_rec("kvt-a-9")], [str(path)], wait_s=1.0, sleep=lambda s: t.__setitem__(0, t[0] + s), clock=lambda: t[0]
    )
    assert len(late.requests) == 2 and t[0] >= 1.0  # gave up after the wait: the join counts what is missing


def test_a_line_that_is_not_the_schema_names_file_and_line(tmp_path: Path):
    bad = engine_rec("kvt-a-0")
    bad["tokens"] = {"gpu": 32, "recomputed": 20}
    path = write_log(tmp_path / "e.jsonl", engine_rec("kvt-a-1"), bad)
    with pytest.raises(DatasetError, match=r"e\.jsonl:3: tokens .* do not sum to prompt_tokens 100"):
        read_engine_log([path])
    path.write_text(json.dumps(HEADER) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"e\.jsonl:2: not valid JSON"):
        read_engine_log([path])
    path.write_text(json.dumps({**engine_rec("x"), "extra": 1}) + "\n")
    with pytest.raises(DatasetError, match=r"e\.jsonl:1: extra"):
        read_engine_log([path])
    with pytest.raises(DatasetError, match="cannot read"):
        read_engine_log([tmp_path / "missing.jsonl"])


def test_a_hit_whose_fetch_outlasts_the_recompute_it_saved_is_counted():
    """The replay's own prefill rate (Σ recomputed tokens / Σ recompute seconds: 200 / 2 s) prices what each hit saved:
    100 tokens from cpu save 1 s against a 0.5 s fetch (paid); 10 tokens save 0.1 s against 0.5 s (did not)."""
    from kvtier.replay.summary import hits_that_did_not_pay

    rows = [
        {"prompt_sources": {"cpu": 100, "recomputed": 100}, "server_ttft_parts": {"fetch": 0.5, "recompute": 1.0}},
        {"prompt_sources": {"cpu": 10, "recomputed": 100}, "server_ttft_parts": {"fetch": 0.5, "recompute": 1.0}},
        {"prompt_sources": {"gpu": 10, "recomputed": 0}, "server_ttft_parts": {"fetch": 0.0, "recompute": 0.0}},
    ]
    # over both hits: 1.0 s of fetch against 1.1 s of recompute replaced
    assert hits_that_did_not_pay(rows) == (2, 1, 100.0, 0.9091)  # type: ignore[arg-type]


def test_hits_that_made_ttft_worse_are_said_as_one_pair_hit_rate_and_fetch():
    """#55: a high hit rate alone reads as success; the warning puts the fetch beside it."""
    from kvtier.replay.results import not_paying_warnings

    share = {"gpu": 0.05, "cpu": 0.9, "recomputed": 0.05}
    d = {"offload_hits": 10, "hits_not_paying": 9, "prefill_tokens_per_s": 1000.0,
         "offload_fetch_over_recompute": 3.48, "token_share": share}  # fmt: skip
    (w,) = not_paying_warnings(d)
    assert w.message.startswith("hits, but the fleet got slower: the offload tiers served 90.0% of the prompt tokens")
    assert "3.48x" in w.message and w.model_extra is not None and w.model_extra["fetch_over_recompute"] == 3.48
    ok = d | {"hits_not_paying": 0, "offload_fetch_over_recompute": 0.4}
    assert not_paying_warnings(ok) == []


@pytest.mark.parametrize(
    "engine_id,sent",
    [("chatcmpl-kvt-ab12-17-1a2b3c4d", "kvt-ab12-17"), ("cmpl-kvt-ab12-17-0-1a2b3c4d", "kvt-ab12-17"),
     ("chatcmpl-x-0-0123abcd", "x-0"), ("no-random-suffix", None)],
)  # fmt: skip
def test_the_id_the_client_sent_is_read_back_from_vllms_engine_id(engine_id: str, sent: str | None):
    """vLLM 0.32 names a chat request chatcmpl-<X-Request-Id>-<8 hex>, a completion cmpl-<X-Request-Id>-<prompt index>-
    <8 hex>."""
    from kvtier.results.engine_log import EngineRequest

    assert EngineRequest.model_validate(engine_rec("x") | {"id": engine_id}).external_id == sent
