"""The replay client's stream accounting (replay/client.py StreamRecorder), fed by hand with chunks
and arrival times: TTFT, inter-token gaps and e2e without a server."""

from __future__ import annotations

import json

import pytest

from kvtier.replay.client import StreamRecorder, new_record
from kvtier.replay.datasets import VirtualUser


def event(payload) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def delta(**d) -> bytes:
    return event({"choices": [{"index": 0, "delta": d}]})


def recorder(t0: float = 10.0) -> StreamRecorder:
    return StreamRecorder(new_record(VirtualUser("u#0", "u", 0, ()), 0, 8), t0)


def test_ttft_gaps_and_the_timing_identity():
    sr = recorder()
    chunks = [
        (10.5, delta(role="assistant", content="")),
        (10.8, delta(content="a")),
        (11.0, delta(content="b")),
        (11.25, delta(content="c") + delta(content="d")),  # two tokens in one network chunk share its time
        (
            11.25,
            event(
                {
                    "choices": [],
                    "usage": {
                        "prompt_tokens": 7,
                        "completion_tokens": 4,
                        "prompt_tokens_details": {"cached_tokens": 3},
                    },
                }
            )
            + b"data: [DONE]\n\n",
        ),
    ]
    done = [sr.feed(data, now) for now, data in chunks]
    assert done == [False, False, False, False, True]
    rec = sr.rec
    assert rec["ttft_s"] == pytest.approx(0.8)  # the role-only first delta is not a token
    assert rec["itl_s"] == pytest.approx([0.2, 0.25, 0.0])
    e2e = 11.25 - 10.0  # the last token arrived with [DONE]
    assert e2e - rec["ttft_s"] == pytest.approx(sum(rec["itl_s"]))  # e2e - ttft = sum of inter-token gaps
    assert (rec["prompt_tokens"], rec["completion_tokens"], rec["cached_tokens"]) == (7, 4, 3)
    assert sr.reply == "abcd"


def test_events_split_across_chunks_crlf_and_reasoning():
    sr = recorder(0.0)
    whole = (delta(reasoning_content="think") + delta(content="x")).replace(b"\n", b"\r\n")
    assert not sr.feed(whole[:7], 1.0)  # half an event: nothing yet
    assert sr.rec["ttft_s"] is None
    assert not sr.feed(whole[7:], 2.0)
    assert sr.rec["ttft_s"] == 2.0 and sr.rec["itl_s"] == [0.0]  # reasoning counts as the first token
    assert sr.reply == "x"  # the reply keeps content only
    assert sr.feed(b"data: [DO", 3.0) is False and sr.feed(b"NE]\n\n", 3.5) is True


@pytest.mark.parametrize("bad", [b"data: {not json\n\n", b"data: 1\n\n", b"data: \xff\xfe\n\n"])
def test_malformed_events_raise_value_error(bad):
    with pytest.raises(ValueError):
        recorder().feed(bad, 1.0)


def _ext(received: float, sent: float | None, server_ttft: float) -> bytes:
    stamps = {"received": received} if sent is None else {"received": received, "first_sent": sent}
    d = {"tokens": {"gpu": 0, "recomputed": 7}, "seconds": {"recompute": server_ttft}, "server_ttft_s": server_ttft}
    return event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                  "kvtier": {"ttft_decomposition": d, "monotonic_s": stamps, "timing": "measured"}})  # fmt: skip


def test_transits_from_the_servers_monotonic_stamps_close_the_ttft():
    sr = recorder(100.0)
    sr.feed(delta(role="assistant", content=""), 100.030)  # the role delta: the ladder's first-token time
    sr.feed(delta(content="a"), 100.031)
    sr.feed(_ext(100.0004, 100.0302, 0.0298), 100.040)
    sr.finish(0.040)
    rec = sr.rec
    assert rec["first_event_s"] == pytest.approx(0.030) and rec["ttft_s"] == pytest.approx(0.031)
    assert rec["transit_s"] == {"to_server": pytest.approx(0.0004), "to_client": pytest.approx(0.0008)}
    assert rec["transit_s"]["to_server"] + rec["server_ttft_s"] + rec["transit_s"]["to_client"] == pytest.approx(
        rec["ttft_s"]
    )
    assert rec["sim_timing"] == "measured"


def test_stamps_of_another_clock_give_no_transit():
    for received, sent in ((5.0, 5.03), (100.0004, None), (99.0, 100.03)):  # another host; not streamed; before start
        sr = recorder(100.0)
        sr.feed(delta(content="a"), 100.031)
        sr.feed(_ext(received, sent, 0.0298), 100.040)
        assert "transit_s" not in sr.rec


def _decomp(**change: object) -> bytes:
    d: dict[str, object] = {"tokens": {"gpu": 3, "cpu": 4}, "seconds": {"queue": 0.001, "fetch": 0.002},
                            "server_ttft_s": 0.003}  # fmt: skip
    for k, v in change.items():
        d[k] = v
    return event({"choices": [], "kvtier": {"ttft_decomposition": d, "monotonic_s": {"received": 100.0001}}})


def _finished(ext: bytes, e2e: float = 0.05, prompt: int | None = 7):  # type: ignore[no-untyped-def]
    sr = recorder(100.0)
    sr.rec["prompt_tokens"] = prompt
    sr.feed(delta(content="a"), 100.01)
    sr.feed(ext, 100.02)
    sr.finish(e2e)
    return sr.rec


def test_a_decomposition_of_the_schema_within_the_requests_time_is_kept():
    rec = _finished(_decomp())
    assert rec["prompt_sources"] == {"gpu": 3, "cpu": 4} and rec["server_ttft_s"] == 0.003
    assert rec["server_ttft_parts"] == {"queue": 0.001, "fetch": 0.002} and "decomposition_dropped" not in rec


@pytest.mark.parametrize(
    "change, why",
    [
        ({"seconds": {"queue": float("nan")}}, "finite"),
        ({"seconds": {"queue": float("inf")}}, "finite"),
        ({"server_ttft_s": float("inf")}, "server_ttft_s"),
        ({"seconds": {"x" * 10_000: 0.001}}, "known parts"),
        ({"tokens": {"y" * 100: 1}}, "named like tiers"),
        ({"tokens": {"gpu": 10**400}}, "2^40"),
        ({"tokens": {f"t{i}": 0 for i in range(17)}}, "at most 16"),
        ({"seconds": {"queue": 5.0}}, "longer than the request's own"),
        ({"server_ttft_s": 7.5}, "longer than the request's own"),
        ({"tokens": {"gpu": 8}}, "more than the prompt's 7"),
        ({"seconds": [1, 2]}, "known parts"),
    ],
)
def test_a_decomposition_outside_its_schema_or_bounds_is_dropped_not_the_request(change, why):
    rec = _finished(_decomp(**change))
    assert why in rec["decomposition_dropped"], rec["decomposition_dropped"]
    assert len(rec["decomposition_dropped"]) <= 200
    assert rec["prompt_sources"] is rec["server_ttft_parts"] is rec["server_ttft_s"] is None
    assert "transit_s" not in rec and rec["ttft_s"] == pytest.approx(0.01)  # the request itself is as it went


def test_the_summary_counts_dropped_decompositions():
    from kvtier.replay.summary import summarize

    good, bad = _finished(_decomp()), _finished(_decomp(seconds={"queue": float("nan")}))
    for r in (good, bad):
        r["status"], r["e2e_s"] = "ok", 0.05
    d = summarize([good, bad], 2, 1, 1.0)["ttft_decomposition"]
    assert (d["requests"], d["dropped"]) == (1, 1)


def test_an_unknown_timing_word_is_malformed():
    sr = recorder()
    with pytest.raises(ValueError, match="timing"):
        sr.feed(event({"choices": [], "kvtier": {"timing": "guessed"}}), 1.0)


def _usage(completion: int) -> bytes:
    return event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": completion}})


def test_a_token_whose_text_is_empty_still_sets_the_ttft():
    """#41 item 8: against a real vLLM six one-token requests whose token decoded to empty text got no TTFT and were
    counted nowhere. vLLM sends such a token as a delta with content "" and no role."""
    sr = recorder(0.0)
    sr.feed(delta(role="assistant", content=""), 0.3)  # the role-only delta: not a token
    sr.feed(event({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "length"}]}), 0.7)
    assert sr.feed(_usage(1) + b"data: [DONE]\n\n", 0.71)
    sr.settle()
    assert sr.rec["status"] == "ok" and sr.rec["ttft_s"] == pytest.approx(0.7) and sr.reply == ""


def test_tokens_no_delta_showed_take_the_finishing_chunks_time():
    sr = recorder(0.0)
    sr.feed(delta(role="assistant"), 0.3)
    sr.feed(event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), 0.9)
    sr.feed(_usage(2) + b"data: [DONE]\n\n", 0.95)
    sr.settle()
    assert sr.rec["status"] == "ok" and sr.rec["ttft_s"] == pytest.approx(0.9)


def test_a_stream_without_a_generated_token_is_a_counted_failure():
    sr = recorder(0.0)
    sr.feed(delta(role="assistant", content=""), 0.3)
    sr.feed(_usage(0) + b"data: [DONE]\n\n", 0.4)
    sr.settle()
    rec = sr.rec
    assert (rec["status"], rec["cause"], rec["ttft_s"]) == ("error", "no-output", None)


def test_every_record_is_ok_failed_or_cut_and_the_summary_adds_up():
    """requests_total = ok + failed + cut on every summary, an ok record without a TTFT (a file written before
    settle existed) included: it is a no-output failure, never dropped."""
    from kvtier.replay.summary import summarize

    base = {"user": "u", "turn": 0, "e2e_s": 1.0, "itl_s": [], "http_status": 200, "cause": None}
    recs = [
        {**base, "status": "ok", "ttft_s": 0.1},
        {**base, "status": "ok", "ttft_s": None},
        {**base, "status": "error", "ttft_s": None, "cause": "connection", "error": "reset"},
        {**base, "status": "cut", "ttft_s": None, "cause": "cut-at-stop", "error": "stopped"},
        {**base, "status": "timeout", "ttft_s": 0.2, "error": "slow"},
    ]
    s = summarize(recs, 1, 5, 1.0)
    assert s["requests_total"] == s["requests_ok"] + s["requests_failed"] + s["requests_cut_at_stop"] == 5
    assert (s["requests_ok"], s["requests_failed"], s["requests_cut_at_stop"]) == (1, 3, 1)
    assert s["failures"]["no-output"]["count"] == 1
