"""Multi-turn conversations, system prompts and the two KV layouts (no I/O)."""

import itertools

from kvtier.config.tuning import Tuning
from kvtier.keys import KeyScope
from kvtier.workload.conversations import ConversationManager, ConversationSettings, conversation_requests
from kvtier.workload.layout import segment_chunks, system_prompt_key
from kvtier.workload.users import make_users

SCOPE = KeyScope(model_name="tiny-1b", chunk_size=256)


def first(layout, n=40, seed=3, **kw):
    users = make_users(3, Tuning(), seed)
    st = ConversationSettings(layout=layout, **kw)
    mgr = ConversationManager(100)
    return [list(itertools.islice(conversation_requests(u, seed, st, SCOPE, mgr), n)) for u in users], mgr


def test_entry_layout_reads_every_earlier_turn_and_the_system_prompt():
    per_user, _ = first("entry", end_probability=0.0, max_turns_per_conv=4, system_prompt_probability=1.0)
    reqs = per_user[0]
    assert [r.turn for r in reqs[:5]] == [1, 2, 3, 4, 1]
    t3 = reqs[2]
    assert t3.key == f"{t3.conversation}_turn_3"
    assert [r.kind for r in t3.reads] == ["prefix", "history", "history"]
    assert t3.reads[0].key.startswith("kv_system_") and len(t3.reads[0].key) == len("kv_system_") + 16
    assert [r.key for r in t3.reads[1:]] == [f"{t3.conversation}_turn_1", f"{t3.conversation}_turn_2"]
    assert t3.writes[0].key == t3.key and t3.writes[0].tokens == t3.new_tokens == t3.decode_tokens
    assert t3.new_tokens == reqs[2].new_tokens and t3.new_tokens > reqs[1].generate_tokens  # reply included
    assert not t3.prefix_reads


def test_chunked_layout_reads_cached_prefix_and_writes_only_new_chunks():
    per_user, _ = first("chunked", end_probability=0.0, max_turns_per_conv=5, system_prompt_probability=1.0)
    reqs = per_user[1]
    t1, t2 = reqs[0], reqs[1]
    assert t1.prefix_reads and t1.decode_key is None
    # turn 2 looks up exactly what turn 1 left in full chunks (system prompt + turn 1), in order
    stored_after_t1 = [r.key for r in t1.reads] + [w.key for w in t1.writes]
    assert [r.key for r in t2.reads] == stored_after_t1
    assert all(w.tokens == 256 for w in t2.writes)
    assert (len(t2.reads) + len(t2.writes)) * 256 <= t2.context_tokens < (len(t2.reads) + len(t2.writes) + 1) * 256


def test_same_system_prompt_shares_chunks_across_conversations():
    a = segment_chunks([("system-1", 600), ("conv-a/t1", 900)], 256, SCOPE, "system-1")
    b = segment_chunks([("system-1", 600), ("conv-b/t1", 300)], 256, SCOPE, "system-1")
    assert [r.key for r in a[:2]] == [r.key for r in b[:2]]
    assert [r.kind for r in a[:3]] == ["prefix", "prefix", "history"]  # chunk 3 straddles the prompt's end
    assert a[2].key != b[2].key
    assert len(a) == 1500 // 256


def test_prefix_caching_off_means_no_system_prompt_and_single_turn_means_one_turn():
    per_user, mgr = first("entry", prefix_caching=False, multi_turn=False)
    for r in per_user[0][:10]:
        assert r.turn == 1 and r.reads == ()
    assert mgr.started == 3 * 40 and len(mgr) <= 3  # one conversation per request; only the current ones live


def test_conversation_metadata_eviction_forgets_history():
    users = make_users(4, Tuning(), 5)
    mgr = ConversationManager(2)
    st = ConversationSettings(layout="entry", end_probability=0.0, max_turns_per_conv=50)
    gens = [conversation_requests(u, 5, st, SCOPE, mgr) for u in users]
    for _ in range(3):
        for g in gens:
            next(g)
    assert mgr.evicted > 0 and len(mgr) <= 2
    # a user whose conversation was evicted starts again at turn 1
    turns = [next(g).turn for g in gens]
    assert 1 in turns


def test_same_seed_same_conversations():
    a, _ = first("chunked", seed=9)
    b, _ = first("chunked", seed=9)
    assert [[(r.key, r.reads, r.writes) for r in u] for u in a] == [[(r.key, r.reads, r.writes) for r in u] for u in b]


def test_system_prompt_key_format():
    k = system_prompt_key("system-3")
    assert k.startswith("kv_system_") and len(k) == 26


def test_system_prompt_hit_probability_is_the_share_of_conversations_with_a_shared_prompt():
    """prefix_cache.system_prompt_hit_probability (the reference's key, 0.2)."""
    shares = {}
    for p in (0.0, 0.2, 1.0):
        per_user, _ = first("entry", n=400, system_prompt_probability=p, multi_turn=False)
        firsts = [r for reqs in per_user for r in reqs]
        shares[p] = sum(1 for r in firsts if r.reads) / len(firsts)
    assert shares[0.0] == 0.0 and shares[1.0] == 1.0
    assert 0.15 < shares[0.2] < 0.25


def test_a_system_prompt_shorter_than_min_prefix_length_is_the_first_turns_own_context():
    """prefix_cache.min_prefix_length: prompts of 256-2048 tokens are shared at 50, never at 5000."""
    shared, _ = first("entry", n=5, system_prompt_probability=1.0, multi_turn=False, min_prefix_length=50)
    alone, _ = first("entry", n=5, system_prompt_probability=1.0, multi_turn=False, min_prefix_length=5000)
    for a, b in zip(shared[0], alone[0], strict=True):
        assert a.reads and a.reads[0].kind == "prefix" and not b.reads
        assert b.new_tokens == a.new_tokens + a.reads[0].tokens  # the prompt moved into the turn's entry


def test_max_turns_per_conv_and_end_probability():
    per_user, _ = first("entry", n=60, end_probability=0.0, max_turns_per_conv=50, max_context_tokens=10**9)
    assert [r.turn for r in per_user[0][48:52]] == [49, 50, 1, 2]
    per_user, _ = first("entry", n=400, end_probability=0.5)
    turns = [r.turn for reqs in per_user for r in reqs]
    assert 0.4 < turns.count(1) / len(turns) < 0.6  # a new conversation after half the turns
