"""The reuse opportunity on hand-built sessions whose answers are counted by hand, and progress lines."""

from __future__ import annotations

import io

import pytest

from kvtier.replay.datasets import Turn, VirtualUser
from kvtier.replay.progress import ReplayProgress, Tally, eta_s, snapshot
from kvtier.replay.reuse import reuse_opportunity

IDS: dict[str, int] = {}


def encode(text: str) -> list[int]:
    """One token per word ("user:" is a word): token counts are readable by eye."""
    return [IDS.setdefault(w, len(IDS)) for w in text.split()]


def msg(role: str, text: str) -> dict[str, str]:
    return {"role": role, "content": text}


def test_reuse_counts_history_cross_session_and_new_blocks():
    sys_ = msg("system", "s1 s2 s3")  # "system: s1 s2 s3" = 4 tokens = one block
    t1 = Turn((sys_, msg("user", "q1 q2 q3 q4")), 8, 0.0)  # 9 tokens: 2 blocks + 1
    t2 = Turn((sys_, msg("user", "q1 q2 q3 q4"), msg("assistant", "r1 r2 r3"), msg("user", "q5 q6 q7")), 8, 1.0)
    other = Turn((sys_, msg("user", "x1 x2 x3 x4")), 8, 0.0)
    users = [VirtualUser("u0", "S1", 0, (t1, t2)), VirtualUser("u1", "S2", 0, (other,))]
    r = reuse_opportunity(users, encode, block_tokens=4, kv_bytes_per_token=10)
    # turn 1: 9 new; turn 2 (17): its first 2 blocks were sent by S1 -> 8 history, 9 new;
    # S2 (9): the system block was first sent by S1 -> 4 cross-session, 5 new
    assert (r["prompt_tokens"], r["history_reuse_tokens"], r["cross_session_reuse_tokens"], r["new_tokens"]) == (
        35, 8, 4, 23,
    )  # fmt: skip
    assert r["history_reuse_fraction"] == round(8 / 35, 6) and r["new_fraction"] == round(23 / 35, 6)
    assert r["session_max_prompt_tokens"] == {"mean": 13.0, "p50": 13.0, "max": 17}
    assert r["kv_bytes_per_session"] == {"mean": 130, "p50": 130, "max": 170}
    assert r["working_set"] == [
        {"requests": 1, "tokens": 8, "bytes": 80},
        {"requests": 2, "tokens": 16, "bytes": 160},
        {"requests": 3, "tokens": 20, "bytes": 200},
    ]


def test_reuse_without_a_known_model_has_token_figures_only():
    t = Turn((msg("user", "a b c d e f g"),), 8, 0.0)
    r = reuse_opportunity([VirtualUser("u", "S", 0, (t, t))], encode, block_tokens=4)
    assert r["kv_bytes_per_session"] is None and r["working_set"][-1]["bytes"] is None
    assert r["history_reuse_tokens"] == 8 and r["new_tokens"] == 8  # "user: a b c" "d e f g" then reused


def test_progress_lines_say_where_the_run_is():
    recs = [
        {"user": "u0", "turn": 0, "status": "ok", "ttft_s": 0.1, "e2e_s": 1.0},
        {"user": "u0", "turn": 1, "status": "ok", "ttft_s": 0.3, "e2e_s": 1.0},
        {"user": "u1", "turn": 0, "status": "http_500", "ttft_s": None, "e2e_s": None},
    ]  # fmt: skip
    s = snapshot(recs, total=6, turns=2, users=3, in_flight=2, rates={"prefix_cache_hit_rate": 0.5})
    assert (s["done"], s["failed"], s["sessions_complete"], s["sessions_error"], s["sessions_open"]) == (3, 1, 1, 1, 1)
    assert s["ttft_p50_s"] == pytest.approx(0.2)
    out = io.StringIO()
    with ReplayProgress("plain", out) as p:
        p.tick(12.5, s, in_dataset=12)
        p.tick(12.5, s, in_dataset=12, duration_s=20)
    first, second = out.getvalue().splitlines()
    line = first
    # 3 of 6 done in 12.5 s: 12.5 s more at that rate; a --duration of 20 s ends sooner, in 7.5 s
    assert line.startswith(
        "[kvtier replay] t=  12.5s requests=3/6 (25% of dataset) eta=12s in_flight=2 sessions ok/open/error=1/1/1"
    )
    assert "eta=8s" in second
    assert "prefix_cache=0.50" in line and "failed=1" in line
    assert eta_s(0.0, 0, 6) is None and eta_s(5.0, 6, 6) == 0.0
    quiet = io.StringIO()
    with ReplayProgress("none", quiet) as p:
        p.tick(1.0, s)
    assert quiet.getvalue() == ""


def test_offload_never_exercised_never_contradicts_a_counter_beside_it():
    from kvtier.replay.results import offload_never_hit
    from kvtier.results.replay import ScrapeSummary

    def m(**kw: float) -> ScrapeSummary:
        return ScrapeSummary(url="u", samples=3, scrape_errors=0, **kw)

    # vLLM's external counter saw no hit, but LMCache's own lookup counter saw 9,728 hit tokens: no warning
    both = m(external_prefix_cache_queries=20_000, external_prefix_cache_hits=0,
             lmcache_lookup_requested_tokens=20_000, lmcache_lookup_hit_tokens=9_728)  # fmt: skip
    assert not offload_never_hit(both)
    assert offload_never_hit(m(external_prefix_cache_queries=20_000, external_prefix_cache_hits=0))
    assert offload_never_hit(m(lmcache_lookup_requested_tokens=5, lmcache_lookup_hit_tokens=0))
    assert not offload_never_hit(m())  # nothing looked up: nothing to say


def test_failures_are_classified_by_cause_and_counted_once_each():
    from kvtier.replay.summary import http_cause, summarize

    vllm_400 = "This model's maximum context length is 8192 tokens. However, you requested 9001 tokens"
    assert http_cause(400, vllm_400) == "context-length"
    assert http_cause(400, "messages: expected a list") == "bad-request"
    assert http_cause(404, "The model `llama-typo` does not exist.") == "model-not-found"
    assert http_cause(404, "Not Found") == "not-found"
    assert http_cause(429, "busy") == "rate-limited" and http_cause(503, "") == "server-error"
    base = {"user": "u", "turn": 0, "ttft_s": None, "e2e_s": 1.0, "itl_s": []}
    recs = [
        {**base, "status": "ok", "ttft_s": 0.1, "cause": None, "http_status": 200},
        {**base, "status": "error", "cause": "context-length", "error": vllm_400, "http_status": 400},
        {**base, "status": "error", "cause": "context-length", "error": "again", "http_status": 400},
        {**base, "status": "cut", "cause": "cut-at-stop", "error": "stopped", "http_status": 200},
        {**base, "status": "timeout", "error": "slow", "http_status": None},  # a record without a cause: derived
    ]
    s = summarize(recs, 1, 1, 1.0)
    assert (s["requests_failed"], s["requests_cut_at_stop"]) == (3, 1)
    f = s["failures"]
    assert list(f) == ["context-length", "cut-at-stop", "timeout"]  # largest first
    assert f["context-length"] == {"count": 2, "first_message": vllm_400, "http_status": 400}
    assert f["cut-at-stop"]["http_status"] is None and f["timeout"]["count"] == 1


def test_an_offload_tier_that_held_tokens_but_never_served_one_is_named_with_the_flag_to_change():
    """#44 item 2: the README's sim held every prefix in its modelled GPU; its offload tier found tokens on lookup
    (LMCache's counter counts the whole prompt) but served none, and nothing said so."""
    from kvtier.replay.results import offload_never_hit, offload_never_served
    from kvtier.results.replay import ScrapeSummary

    def m(**kw: object) -> ScrapeSummary:
        return ScrapeSummary(url="u", samples=3, scrape_errors=0, **kw)  # type: ignore[arg-type]

    readme = m(external_prefix_cache_queries=11_249, external_prefix_cache_hits=0,
               lmcache_lookup_requested_tokens=16_881, lmcache_lookup_hit_tokens=4_096, lmcache_chunks_loaded=0,
               prompt_tokens_by_source={"local_cache_hit": 5_632, "local_compute": 11_249})  # fmt: skip
    assert offload_never_served(readme) and not offload_never_hit(readme)
    served = readme.model_copy(update={"external_prefix_cache_hits": 256.0})
    assert not offload_never_served(served)  # one served token: the tier was used
    vllm = m(external_prefix_cache_queries=9_000, external_prefix_cache_hits=0,
             lmcache_lookup_requested_tokens=9_000, lmcache_lookup_hit_tokens=512, lmcache_chunks_loaded=2)  # fmt: skip
    assert not offload_never_served(vllm)  # LMCache loaded chunks: served, whatever vLLM's counter says
    assert not offload_never_served(m(external_prefix_cache_queries=10, external_prefix_cache_hits=0))  # found none
    assert not offload_never_served(m())


def test_the_eta_weighs_the_requests_left_by_what_their_turns_have_cost():
    """#58 item 16: later turns of a conversation (longer prompts) take longer than first ones, which counting
    requests alike misses. Users a and b (3 turns each) start first; turn 0 took 1 s, turn 1 took 5 s."""

    def rec(user: str, turn: int, e2e: float) -> dict[str, object]:
        return {"user": user, "turn": turn, "status": "ok", "ttft_s": 0.1, "e2e_s": e2e}

    plan = [("a", 3), ("b", 3), ("c", 3)]
    t = Tally(plan)
    s = snapshot([rec("a", 0, 1.0), rec("b", 0, 1.0)], total=6, turns=3, users=3, in_flight=2, rates={}, tally=t)
    # nothing past turn 0 seen: the four left weigh 1 s each, as counting requests does
    assert s["work"] == (4.0, 2.0) and eta_s(10.0, 2, 6, work=s["work"]) == pytest.approx(20.0)
    recs = [rec("a", 0, 1.0), rec("b", 0, 1.0), rec("a", 1, 5.0)]
    s = snapshot(recs, total=6, turns=3, users=3, in_flight=2, rates={}, tally=t)
    # left: a's turn 2 (not reached: as turn 1, 5 s), b's turns 1 and 2 (5 s each); 7 s of e2e ended so far
    assert s["work"] == (15.0, 7.0)
    assert eta_s(10.0, 3, 6, work=s["work"]) == pytest.approx(10.0 * 15 / 7)
    assert eta_s(10.0, 3, 6) == pytest.approx(10.0)  # requests counted alike
    # a --max-requests bound of 5 leaves two: a's turn 2 and b's turn 1, in the order users start
    assert Tally(plan).work_left(5) is None  # nothing ended: no weights yet
    assert t.work_left(5) == pytest.approx(10.0)


def test_a_request_long_in_flight_is_taken_to_need_as_long_again():
    """The README's replay said eta=1s for its last 30 s: its last requests waited in the server's queue. A request
    in flight longer than requests have taken is counted as needing as long again, and its time so far as work
    done; a young one as the rest of a typical request."""

    def rec(user: str, turn: int, e2e: float) -> dict[str, object]:
        return {"user": user, "turn": turn, "status": "ok", "ttft_s": 0.1, "e2e_s": e2e}

    t = Tally([("a", 2), ("b", 2)])
    recs = [rec("a", 0, 2.0), rec("b", 0, 2.0)]
    # a and b's turn 1 in flight, one for 10 s and one for 0.5 s: 10 more and 1.5 more
    s = snapshot(recs, total=4, turns=2, users=2, in_flight=2, rates={}, tally=t, ages=[10.0, 0.5])
    assert s["work"] == (pytest.approx(11.5), pytest.approx(14.5))
    assert eta_s(20.0, 2, 4, work=s["work"]) == pytest.approx(20.0 * 11.5 / 14.5)
    assert eta_s(20.0, 2, 4) == pytest.approx(20.0)  # requests counted alike: 20 s, whatever waits
