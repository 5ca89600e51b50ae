"""Synthetic sessions: each message has exactly the tokens asked for under both tokenizers, the system
prompt is shared, and the reuse opportunity sees it as cross-session reuse."""

from __future__ import annotations

import pytest

from kvtier.config.replay import ReplayConfig
from kvtier.errors import ConfigError
from kvtier.replay.datasets import virtual_users
from kvtier.replay.driver import prepare
from kvtier.replay.reuse import reuse_opportunity
from kvtier.replay.synthetic import synthetic_dataset
from kvtier.tokenizer import chars_tokenizer, load_tokenizer


@pytest.mark.parametrize("kind", ["chars", "auto"])
def test_message_lengths_are_exact(kind: str):
    tok = chars_tokenizer() if kind == "chars" else load_tokenizer("auto")
    d = synthetic_dataset(users=3, turns=4, isl=100, osl=30, shared_prefix=250, tok=tok, seed=1)
    assert len(d.sessions) == 3 and all(len(s.turns) == 4 for s in d.sessions)
    for s in d.sessions:
        last = s.turns[-1].messages
        assert [m["role"] for m in last] == ["system"] + ["user", "assistant"] * 3 + ["user"]
        n = {m["role"]: [] for m in last}
        for m in last:
            n[m["role"]].append(tok.count(m["content"]))
        assert n == {"system": [250], "user": [100] * 4, "assistant": [30] * 3}
        assert all(t.max_tokens == 30 and t.gap_s == 0 for t in s.turns)
        # each turn is the previous turn's messages plus its reply and a new user message
        for a, b in zip(s.turns, s.turns[1:]):
            assert b.messages[: len(a.messages)] == a.messages and len(b.messages) == len(a.messages) + 2
    prefixes = {s.turns[0].messages[0]["content"] for s in d.sessions}
    users = {s.turns[0].messages[1]["content"] for s in d.sessions}
    assert len(prefixes) == 1 and len(users) == 3  # one shared system prompt, a different user text each
    assert d.notes and "ISL 100, OSL 30, shared prefix 250" in d.notes[0]


def test_the_shared_prefix_is_cross_session_reuse():
    tok = chars_tokenizer()
    d = synthetic_dataset(users=4, turns=2, isl=64, osl=16, shared_prefix=512, tok=tok)
    r = reuse_opportunity(virtual_users(d.sessions, 2), tok.encode, block_tokens=64)
    # users 2..4 find the system prompt's full blocks, first sent by user 1, on both of their turns
    assert r["cross_session_reuse_tokens"] >= 3 * 2 * (512 // 64 - 1) * 64
    assert r["history_reuse_tokens"] > 0


def test_synthetic_flags():
    plan = prepare(ReplayConfig(base_url="http://127.0.0.1:9/v1", model="m", synthetic=True, users=3, turns=4,
                                isl=64, osl=8))  # fmt: skip
    assert plan.config.num_rounds == 4 and len(plan.users) == 3 and plan.dataset.format == "synthetic"
    with pytest.raises(ConfigError, match="--num-rounds 5 exceeds --turns 4"):
        prepare(ReplayConfig(base_url="http://127.0.0.1:9/v1", model="m", synthetic=True, turns=4, num_rounds=5))
    with pytest.raises(ConfigError, match="either --dataset or --synthetic"):
        prepare(ReplayConfig(base_url="http://127.0.0.1:9/v1", model="m", synthetic=True, dataset="x"))
    with pytest.raises(ConfigError, match="--dataset: required"):
        prepare(ReplayConfig(base_url="http://127.0.0.1:9/v1", model="m"))


def test_max_tokens_cap_cuts_every_turn_and_keeps_the_rest():
    base = {"base_url": "http://127.0.0.1:9/v1", "model": "m", "synthetic": True, "users": 2, "turns": 3, "isl": 32}
    plain = prepare(ReplayConfig(**base, osl=50))
    capped = prepare(ReplayConfig(**base, osl=50, max_tokens_cap=7))
    assert {t.max_tokens for u in plain.users for t in u.turns} == {50}
    assert {t.max_tokens for u in capped.users for t in u.turns} == {7}
    assert [t.messages for u in capped.users for t in u.turns] == [t.messages for u in plain.users for t in u.turns]
    assert capped.config.max_tokens_cap == 7


def test_a_replay_counting_tokens_by_characters_says_so_with_the_install_line(monkeypatch: pytest.MonkeyPatch):
    """#44 item 5: without tiktoken a replay counted tokens at 4 characters a token and said nothing."""
    import kvtier.tokenizer

    base = {"base_url": "http://127.0.0.1:9/v1", "model": "m", "synthetic": True, "users": 2, "turns": 2, "isl": 32}
    assert "tokenizer-estimated" not in [w.code for w in prepare(ReplayConfig(**base, tokenizer="chars")).warnings]
    monkeypatch.setattr(kvtier.tokenizer, "_tiktoken", lambda: None)  # no tokenizer installed
    plan = prepare(ReplayConfig(**base))
    (w,) = [w for w in plan.warnings if w.code == "tokenizer-estimated"]
    assert "pip install 'kvtier[tokenizer]'" in w.message and plan.tokenizer.kind == "chars"
