"""--target-hit-rate's requests (replay/hitrate.py): each a shared document of R x ISL tokens then its own, the
documents cycled in the order the requests are sent; the flags that make no sense without it are refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvtier.config import ReplayConfig
from kvtier.errors import ConfigError
from kvtier.replay.hitrate import controlled_dataset, rate_of
from kvtier.replay.scrape import parse_snapshot
from kvtier.tokenizer import load_tokenizer


def test_each_request_is_a_document_of_r_x_isl_tokens_then_its_own():
    tok = load_tokenizer("auto")
    cfg = ReplayConfig(synthetic=True, users=3, turns=4, isl=200, target_hit_rate=0.3, working_set=1000, concurrency=3)
    loaded = controlled_dataset(cfg, tok)
    plan = loaded.hit_plan
    assert (len(plan.documents), plan.prefix_tokens, plan.own_tokens) == (5, 60, 140)  # 1,000 / 200 documents
    assert all(tok.count(d) == 60 for d in plan.documents)
    sent = [loaded.sessions[u].turns[t] for t in range(4) for u in range(3)]  # the order the users interleave in
    for i, turn in enumerate(sent):
        (msg,) = turn.messages  # no history: each request is its own prompt
        assert msg["content"].startswith(plan.documents[i % 5]) and tok.count(msg["content"]) == 200
    owns = {t.messages[0]["content"][len(plan.documents[0]) :] for t in sent}
    assert len(owns) == 12  # every request's own tokens are its own


def test_the_rate_is_the_prefix_caches_and_the_connectors_hits_over_the_queries():
    a = parse_snapshot("vllm:prefix_cache_queries_total 100\nvllm:prefix_cache_hits_total 10\n")
    b = parse_snapshot(
        "vllm:prefix_cache_queries_total 1100\nvllm:prefix_cache_hits_total 210\n"
        "vllm:external_prefix_cache_hits_total 300\n"
    )
    assert rate_of(a, b) == (0.5, 200.0, 300.0)


def test_flags_without_their_mode_are_refused():
    with pytest.raises(ValidationError, match="give --synthetic"):
        ReplayConfig(target_hit_rate=0.5)
    with pytest.raises(ValidationError, match="give it"):
        ReplayConfig(synthetic=True, working_set=1000)
    with pytest.raises(ValidationError):
        ReplayConfig(synthetic=True, target_hit_rate=1.0)  # every token cached leaves nothing to prefill
    from kvtier.replay.driver import load_users

    with pytest.raises(ConfigError, match="--shared-prefix 0"):
        load_users(ReplayConfig(synthetic=True, target_hit_rate=0.5, shared_prefix=100, concurrency=8))


def test_the_documents_come_round_in_turn_order_only_with_every_user_in_flight():
    with pytest.raises(ValidationError, match="--concurrency >= --users"):
        ReplayConfig(synthetic=True, users=8, concurrency=4, target_hit_rate=0.5)
