import itertools
from collections import Counter

from kvtier.config.bench import Tuning
from kvtier.workload.users import PREFILL_ONLY_CONTEXT_TOKENS, make_users, requests_for


def _first(users, seed, n=20):
    return [list(itertools.islice(requests_for(u, seed), n)) for u in users]


def test_same_seed_same_requests_other_seed_differs():
    t = Tuning()
    a, b, c = make_users(8, t, 42), make_users(8, t, 42), make_users(8, t, 43)
    assert a == b and a != c
    assert _first(a, 42) == _first(b, 42)
    assert _first(a, 42) != _first(c, 43)


def test_requests_follow_profiles_and_phase_rule():
    t = Tuning()
    for u in make_users(50, t, 1):
        tmpl = t.user_templates[u.profile]
        assert tmpl.context_range.low <= u.context_tokens <= tmpl.context_range.high
        for r in itertools.islice(requests_for(u, 1), 10):
            assert max(1, u.context_tokens // 4) <= r.context_tokens <= u.context_tokens
            assert r.phase == ("prefill" if r.context_tokens >= PREFILL_ONLY_CONTEXT_TOKENS else "prefill_decode")
            assert r.key.startswith(f"user{u.user_id}_req_")


def test_qos_mix_is_roughly_15_35_50():
    users = make_users(4000, Tuning(), 5)
    mix = Counter(u.qos for u in users)
    assert abs(mix["interactive"] / 4000 - 0.15) < 0.03
    assert abs(mix["responsive"] / 4000 - 0.35) < 0.03
    assert abs(mix["batch"] / 4000 - 0.50) < 0.03
    assert {u.priority for u in users if u.qos == "interactive"} == {3}
