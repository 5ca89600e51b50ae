"""Autoscaler decisions on synthetic windows, and the RAG corpus."""

import numpy as np

from kvtier.bench.autoscale import Autoscaler
from kvtier.config.bench import AutoscalerTuning, Tuning
from kvtier.telemetry.recorder import RequestRecord
from kvtier.workload.rag import RagCorpus, RagSettings


def rec(service_ms: float, qos: str = "batch", tokens: int = 100) -> RequestRecord:
    svc = int(service_ms * 1e6)
    return RequestRecord(0, qos, "prefill_decode", 10, tokens, 0, 0, svc, svc, 0, 0, 0, 0, 0, 0, 0, 0, 0, True, "")


def scaler(mode: str, **kw) -> Autoscaler:
    return Autoscaler(mode, 0.8, AutoscalerTuning(cooldown_s=0, **kw), Tuning().qos_profiles)


def test_qos_adds_below_holds_inside_removes_above():
    a = scaler("qos")
    assert a.step(1, 1, [rec(100)], 10) == ("scale_up", 12)  # batch target 1000 ms: saturation 0.1
    assert a.step(2, 1, [rec(800)], 12)[0] == "hold"  # 0.8: inside [0.7, 0.9]
    assert a.step(3, 1, [rec(2000)], 12) == ("scale_down", 10)
    assert a.step(4, 1, [rec(20, "interactive")], 10)[1] == 12  # 20/50 = 0.4
    assert a.step(5, 1, [], 12)[0].startswith("hold")
    sats = [h["saturation"] for h in a.history]
    assert sats[:3] == [0.1, 0.8, 2.0]


def test_qos_cooldown_and_limits():
    a = Autoscaler("qos", 0.8, AutoscalerTuning(cooldown_s=10, max_users=11), Tuning().qos_profiles)
    assert a.step(1, 1, [rec(10)], 10) == ("scale_up", 11)
    assert a.step(2, 1, [rec(10)], 11)[0] == "hold (cooldown)"
    assert a.step(20, 1, [rec(10)], 11)[0] == "hold (at the user limit)"


def test_capacity_doubles_then_grows_then_stops_at_peak():
    a = scaler("capacity")
    thr = [100, 200, 230, 220]
    users = 2
    actions = []
    for i, t in enumerate(thr):
        action, users = a.step(i, 1.0, [rec(10, tokens=t)], users)
        actions.append(action)
    assert actions == ["scale_up x2", "scale_up x2", "scale_up x1.5", "stop"]
    assert a.stop_reason == "Peak capacity found"
    st = a.stats(users)
    assert st["peak_users"] == 8 and st["peak_throughput_tokens_per_sec"] == 230


def test_rag_corpus_and_seeded_retrieval():
    c = RagCorpus(RagSettings(num_docs=5, top_k=3, doc_tokens=(1000, 2000), chunk_tokens=512), seed=1)
    assert all(ch.key.startswith("rag_doc") and 0 < ch.tokens <= 512 for ch in c.chunks)
    assert len({ch.key for ch in c.chunks}) == len(c.chunks)
    a = c.retrieve(np.random.default_rng(4))
    b = c.retrieve(np.random.default_rng(4))
    assert a == b and len(a) == 3 and len(set(a)) == 3
    # popularity skew: the first document is retrieved more than the last
    rng = np.random.default_rng(0)
    docs = [int(ch.key.split("_")[1][3:]) for _ in range(300) for ch in c.retrieve(rng)]
    assert docs.count(0) > docs.count(4)


def test_rag_top_k_larger_than_corpus():
    c = RagCorpus(RagSettings(num_docs=1, top_k=50, doc_tokens=(600, 600), chunk_tokens=512), seed=1)
    assert len(c.retrieve(np.random.default_rng(1))) == 2
