import itertools
from collections import Counter

import numpy as np

from kvtier.config.tuning import QoSDistribution, Tuning
from kvtier.keys import KeyScope
from kvtier.workload.conversations import ConversationManager, ConversationSettings, conversation_requests
from kvtier.workload.users import PREFILL_ONLY_CONTEXT_TOKENS, draw_qos, draws, make_users

SINGLE_TURN = ConversationSettings(multi_turn=False, prefix_caching=False)


def _requests(user, seed):
    return conversation_requests(user, seed, SINGLE_TURN, KeyScope(model_name="m"), ConversationManager(1000))


def _first(users, seed, n=20):
    return [list(itertools.islice(_requests(u, seed), n)) for u in users]


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
        for (ctx, gen, _), r in zip(itertools.islice(draws(u, 1), 10), _requests(u, 1)):
            assert max(1, u.context_tokens // 4) <= ctx <= u.context_tokens
            assert max(1, u.generation_tokens // 4) <= gen <= u.generation_tokens
            assert r.context_tokens == ctx and r.generate_tokens == gen  # single turn: the draw is the request
            assert r.phase == ("prefill" if r.context_tokens >= PREFILL_ONLY_CONTEXT_TOKENS else "prefill_decode")


def test_qos_mix_is_roughly_15_35_50():
    users = make_users(4000, Tuning(), 5)
    mix = Counter(u.qos for u in users)
    assert abs(mix["interactive"] / 4000 - 0.15) < 0.03
    assert abs(mix["responsive"] / 4000 - 0.35) < 0.03
    assert abs(mix["batch"] / 4000 - 0.50) < 0.03
    assert {u.priority for u in users if u.qos == "interactive"} == {3}


def test_qos_draw_thresholds():
    dist = QoSDistribution(interactive_probability=0.2, responsive_threshold=0.7)

    class Fixed:
        def __init__(self, r):
            self.r = r

        def random(self):
            return self.r

    assert [draw_qos(Fixed(r), dist) for r in (0.0, 0.1999, 0.2, 0.6999, 0.7, 0.99)] == [
        "interactive",
        "interactive",
        "responsive",
        "responsive",
        "batch",
        "batch",
    ]
    rng = np.random.default_rng(0)
    assert {draw_qos(rng, dist) for _ in range(200)} == {"interactive", "responsive", "batch"}
