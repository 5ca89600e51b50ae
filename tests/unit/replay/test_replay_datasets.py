import json
import re

import pytest

from kvtier.errors import DatasetError
from kvtier.replay.datasets import load_sessions as _load_sessions
from kvtier.replay.datasets import virtual_users
from kvtier.replay.scrape import Scraper, parse
from kvtier.replay.summary import summarize
from kvtier.tokenizer import chars_tokenizer
from tests.conftest import SHARED_DATA

AGENT = SHARED_DATA / "lmcache_agent_trace"
TAU2 = SHARED_DATA / "tau2_bench" / "gpt-4.1_airline_default_gpt-4.1_1trials.json"
needs = pytest.mark.skipif(not AGENT.exists(), reason="../shared/data not present")


def load_sessions(path, fmt="auto", count=None):
    d = _load_sessions(path, fmt, count or chars_tokenizer().count)
    return d.sessions, d.warnings, d.format


@needs
def test_agent_traces_sorted_by_timestamp_and_sliced():
    sessions, warnings, fmt = load_sessions(AGENT)
    assert fmt == "agent-trace" and len(sessions) == 34 and not warnings
    assert sum(len(s.turns) for s in sessions) == 194 + 238 + 387
    assert all(t.gap_s >= 0 for s in sessions for t in s.turns)
    users = virtual_users(sessions, 5)
    assert users and all(len(u.turns) == 5 for u in users)
    assert len(users) == sum(len(s.turns) // 5 for s in sessions)


@needs
def test_tau2_calls_and_history():
    sessions, _, fmt = load_sessions(TAU2)
    assert fmt == "tau2" and len(sessions) == 20
    t = sessions[0].turns[1]
    assert t.messages[0]["role"] == "system" and t.max_tokens >= 1
    assert all(len(b.messages) > len(a.messages) for a, b in zip(sessions[0].turns, sessions[0].turns[1:]))


def test_folder_with_empty_file_and_generic_jsonl(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    turn = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "pre_gap": 0.5}
    (tmp_path / "s.jsonl").write_text(json.dumps({"session_id": "a", "turns": [turn] * 7}) + "\n")
    sessions, warnings, fmt = load_sessions(tmp_path)
    assert (
        fmt == "jsonl"
        and len(sessions) == 1
        and any("empty" in w.message and w.code == "dataset-file-skipped" for w in warnings)
    )
    assert [u.first_turn for u in virtual_users(sessions, 3)] == [0, 3]
    assert virtual_users(sessions, 3, min_chunk_rounds=8) == []


@pytest.mark.parametrize(
    "name,text,needle",
    [
        ("a.jsonl", '{"session_id": "x", "turns": [{"messages": []}]}\n', "a.jsonl:1: turns[0].messages"),
        ("b.jsonl", '{"timestamp": 1, "input": "x"}\n{bad\n', "b.jsonl:2: not valid JSON"),
        ("c.json", '{"x": 1}', "cannot tell the dataset format"),
    ],
)
def test_malformed(tmp_path, name, text, needle):
    (tmp_path / name).write_text(text)
    with pytest.raises(DatasetError, match=re.escape(needle)):
        load_sessions(tmp_path / name)
    with pytest.raises(DatasetError, match="does not exist"):
        load_sessions(tmp_path / "nope")


def test_scraper_deltas_resets_and_missing_series():
    sc = Scraper("http://x", 1, 300)
    text = 'vllm:prefix_cache_hits_total{model_name="m"} {h}\nvllm:prefix_cache_queries_total{model_name="m"} {q}\n'
    for t, (h, q) in enumerate([(0, 0), (50, 100), (150, 200), (30, 40)]):  # last one: the server restarted
        sc.samples.append(
            (
                float(t),
                parse(
                    "# TYPE vllm:prefix_cache_hits counter\n# TYPE vllm:prefix_cache_queries counter\n"
                    + text.replace("{h}", str(h)).replace("{q}", str(q))
                ),
            )
        )
    out = sc.summary()
    assert out.prefix_cache_hit_rate_overall == pytest.approx((50 + 100 + 30) / (100 + 100 + 40))
    assert out.external_prefix_cache_hit_rate is None  # absent series: null, not zero
    assert out.external_prefix_cache_queries is None and out.prefill_time_s_mean is None


def test_summary_degradation_and_sessions():
    def rec(user, turn, ttft, status="ok"):
        return {
            "user": user,
            "turn": turn,
            "ttft_s": ttft if status == "ok" else None,
            "e2e_s": ttft + 0.1,
            "status": status,
            "completion_tokens": 11,
            "prompt_tokens": 100,
            "cached_tokens": 50,
            "replica": "r1",
        }

    recs = [
        rec("a", 0, 1.0),
        rec("a", 1, 2.0),
        rec("b", 0, 1.0),
        rec("b", 1, 1.5),
        rec("c", 0, 1.0),
        rec("c", 1, 0, "error"),
    ]
    s = summarize(recs, 4, 2, 10.0)
    assert s["ttft_degradation"]["median_pct"] == 75.0
    assert s["sessions"] == {"total": 4, "complete": 2, "incomplete": 1, "error": 1}
    assert s["requests_failed"] == 1 and s["requests_by_replica"] == {"r1": 6}
    # #58 item 21: a session whose turn the run's own end cut is incomplete, not an error
    s = summarize([*recs[:5], rec("c", 1, 0, "cut")], 4, 2, 10.0)
    assert s["sessions"] == {"total": 4, "complete": 2, "incomplete": 2, "error": 0}


def test_agentic_traces_rows_and_tools(tmp_path):
    from kvtier.replay.datasets import tool_schemas

    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    rows = [
        {
            "session_id": "s1",
            "model": "m",
            "input": [{"role": "user", "content": "fix it"}],
            "output_length": 12,
            "pre_gap": 0.0,
        },
        {
            "session_id": "s1",
            "model": "m",
            "input": [
                {"role": "user", "content": "fix it"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ],
            "output_length": 30,
            "pre_gap": 1.5,
        },
        {"session_id": "s2", "model": "m", "input": [{"role": "user", "content": "hi"}], "output_length": 3},
    ]
    p = tmp_path / "agentic.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    sessions, _, fmt = load_sessions(p)
    assert fmt == "agentic-traces" and [len(s.turns) for s in sessions] == [2, 1]
    assert sessions[0].turns[1].gap_s == 1.5 and sessions[0].turns[1].max_tokens == 30
    assert [t["function"]["name"] for t in tool_schemas(sessions)] == ["bash"]
    p.write_text(json.dumps({"session_id": "x", "input": [], "output_length": 3}) + "\n")
    with pytest.raises(DatasetError, match=re.escape(f"{p}:1: 'input' must be")):
        load_sessions(p, "agentic-traces")


def test_dispatch_order_interleaves_sessions_by_default():
    turn = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    from kvtier.replay.datasets import Session, Turn

    t = Turn(tuple(turn["messages"]), 3, 0.0)
    sessions = [Session("a", (t,) * 6, "x"), Session("b", (t,) * 2, "x"), Session("c", (t,) * 4, "x")]
    inter = [u.user_id for u in virtual_users(sessions, 2)]
    assert inter == ["a#0", "b#0", "c#0", "a#1", "c#1", "a#2"]
    assert [u.user_id for u in virtual_users(sessions, 2, order="session")] == [
        "a#0",
        "a#1",
        "a#2",
        "b#0",
        "c#0",
        "c#1",
    ]
    assert sorted(inter) == sorted(u.user_id for u in virtual_users(sessions, 2, order="session"))


def test_an_empty_recorded_output_still_asks_for_one_token(tmp_path):
    from kvtier.tokenizer import load_tokenizer

    rows = [
        {
            "timestamp": 1_000_000 * i,
            "input": f"call {i}",
            "output": "" if i % 2 else "some reply text",
            "session_id": "s",
        }
        for i in range(4)
    ]
    f = tmp_path / "trace.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for kind in ("chars", "auto"):
        sessions, _, fmt = load_sessions(f, count=load_tokenizer(kind).count)
        assert fmt == "agent-trace" and min(t.max_tokens for t in sessions[0].turns) == 1


@pytest.mark.parametrize(
    "name,content,needle",
    [
        (
            "deep.jsonl",
            b'{"session_id": "s", "turns": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
            "deep.jsonl:1: JSON nested too deeply",
        ),
        ("utf.jsonl", b'{"session_id": "a", "turns": []}\n{"session_id": "\xff"}\n', "utf.jsonl:2: not UTF-8 text"),
        (
            "gap.jsonl",
            b'{"turns": [{"messages": [{"role": "user", "content": "x"}], "pre_gap": "abc"}]}\n',
            "gap.jsonl:1: turns[0]: pre_gap must be seconds",
        ),
        (
            "inf.jsonl",
            b'{"turns": [{"messages": [{"role": "user", "content": "x"}], "pre_gap": 1e400}]}\n',
            "inf.jsonl:1: turns[0]: pre_gap must be seconds",
        ),
        (
            "huge.jsonl",
            b'{"turns": [{"messages": [{"role": "user", "content": "x"}], "pre_gap": 1e308}]}\n',
            "huge.jsonl:1: turns[0]: pre_gap must be seconds",
        ),
        (
            "trace.jsonl",
            b'{"timestamp": 0, "input": "a", "session_id": "s"}\n'
            b'{"timestamp": 999999999999999999, "input": "b", "session_id": "s"}\n',
            "trace.jsonl:2: the timestamp gap",
        ),
        (
            "tau.json",
            json.dumps(
                {
                    "simulations": [
                        {
                            "messages": [
                                {
                                    "role": "assistant",
                                    "usage": {"completion_tokens": "x"},
                                    "timestamp": "2025-01-01T00:00:00",
                                }
                            ]
                        }
                    ]
                }
            ).encode(),
            "simulations[0].messages[0]: usage.completion_tokens",
        ),
    ],
)
def test_hostile_dataset_files_get_one_line_naming_file_and_line(tmp_path, name, content, needle):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DatasetError) as e:
        load_sessions(tmp_path / name)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_sharegpt_record_without_an_exchange_is_said_in_the_notes(tmp_path):
    """#58 item 21: ShareGPT records with no reply were dropped silently."""
    recs = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "only a question"}]},
        {"id": "c", "conversations": []},
    ]
    (tmp_path / "sg.json").write_text(json.dumps(recs))
    d = _load_sessions(tmp_path / "sg.json", "sharegpt", chars_tokenizer().count)
    assert [s.session_id for s in d.sessions] == ["a"]
    assert d.notes == ["sg.json: 2 of 3 records left out: no usable exchange (no reply, or only empty texts); the "
                       "first is record [1]"]  # fmt: skip
