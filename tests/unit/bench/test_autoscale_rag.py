"""Autoscaler decisions on synthetic windows, and the RAG corpus."""

import numpy as np

from kvtier.bench.autoscale import Autoscaler, StorageSample
from kvtier.config.tuning import AutoscalerTuning, SaturationDetection, Tuning
from kvtier.telemetry.recorder import BenchRequest
from kvtier.workload.rag import RagCorpus, RagSettings, chunk_tokens_for, is_large_model


def rec(service_ms: float, qos: str = "batch", tokens: int = 100) -> BenchRequest:
    svc = int(service_ms * 1e6)
    return BenchRequest(0, qos, "prefill_decode", 10, tokens, 0, 0, svc, svc, 0, 0, 0, 0, 0, 0, 0, 0, 0, True, "")


def scaler(mode: str, **kw) -> Autoscaler:
    kw.setdefault("consecutive_samples_required", 1)
    return Autoscaler(mode, 0.8, AutoscalerTuning(cooldown_s=0, **kw), Tuning().qos_profiles, algorithm="kvtier")


def test_qos_adds_below_holds_inside_removes_above():
    a = scaler("qos")
    assert a.step(1, 1, [rec(100)], 10) == ("scale_up", 12)  # batch target 1000 ms: saturation 0.1; x1.2
    assert a.step(2, 1, [rec(800)], 12)[0] == "hold"  # 0.8: inside [0.7, 0.9]
    assert a.step(3, 1, [rec(2000)], 12) == ("scale_down", 9)  # x0.8, rounded down
    assert a.step(4, 1, [rec(20, "interactive")], 9)[1] == 10  # 20/50 = 0.4; x1.2 -> 10
    assert a.step(5, 1, [], 10)[0].startswith("hold")
    sats = [h["saturation"] for h in a.history]
    assert sats[:3] == [0.1, 0.8, 2.0]


def test_qos_scale_factors_and_consecutive_samples_take_effect():
    """autoscaler.scale_up_factor / scale_down_factor / consecutive_samples_required (the reference's keys)."""
    a = scaler("qos", scale_up_factor=2.0, scale_down_factor=0.5, consecutive_samples_required=3)
    assert a.step(1, 1, [rec(100)], 10)[0] == "hold (1 of 3 samples)"
    assert a.step(2, 1, [rec(100)], 10)[0] == "hold (2 of 3 samples)"
    assert a.step(3, 1, [rec(100)], 10) == ("scale_up", 20)
    assert a.step(4, 1, [rec(2000)], 20)[0] == "hold (1 of 3 samples)"
    assert a.step(5, 1, [rec(800)], 20)[0] == "hold"  # back inside the band: the streak restarts
    for t in (6, 7):
        assert a.step(t, 1, [rec(2000)], 20)[0].startswith("hold (")
    assert a.step(8, 1, [rec(2000)], 20) == ("scale_down", 10)


def test_qos_saturation_includes_the_storage_thresholds():
    """saturation_detection: storage read/write p95 and queue depth against their thresholds."""
    a = scaler("qos")
    assert a.saturation([rec(100)]) == 0.1
    assert a.saturation([rec(100)], StorageSample(read_p95_ms=150, write_p95_ms=10, queue_depth=5)) == 1.5
    assert a.saturation([rec(100)], StorageSample(read_p95_ms=1, write_p95_ms=60, queue_depth=5)) == 1.2
    assert a.saturation([rec(100)], StorageSample(queue_depth=300)) == 3.0
    b = Autoscaler(
        "qos",
        0.8,
        AutoscalerTuning(cooldown_s=0, consecutive_samples_required=1),
        Tuning().qos_profiles,
        SaturationDetection(read_latency_p95_threshold_ms=1000),
        algorithm="kvtier",
    )
    assert b.saturation([rec(100)], StorageSample(read_p95_ms=150)) == 0.15
    # a slow storage read p95 scales users down even when every QoS class meets its target
    assert a.step(1, 1, [rec(100)], 10, StorageSample(read_p95_ms=500))[0] == "scale_down"


def test_qos_cooldown_and_limits():
    a = Autoscaler(
        "qos",
        0.8,
        AutoscalerTuning(cooldown_s=10, max_users=11, consecutive_samples_required=1),
        Tuning().qos_profiles,
        algorithm="kvtier",
    )
    assert a.step(1, 1, [rec(10)], 10) == ("scale_up", 11)
    assert a.step(2, 1, [rec(10)], 11)[0] == "hold (cooldown)"
    assert a.step(20, 1, [rec(10)], 11)[0] == "hold (at the user limit)"


def reference(mode: str, **kw) -> Autoscaler:
    return Autoscaler(mode, 0.8, AutoscalerTuning(**kw), Tuning().qos_profiles)  # the default algorithm


def test_the_reference_qos_band_steps_and_cooldown():
    """kv_cache/monitoring.py's qos mode: up x1.2 below 0.72, down x0.8 after two samples above 0.88, then a
    3-sample hold; fewer than 5 users never grow (int(users x 1.2) == users)."""
    a = reference("qos")
    assert a.algorithm == "reference"
    assert a.step(1, 1, [rec(100)], 10) == ("scale_up", 12)  # saturation 0.1 < 0.72
    assert a.step(2, 1, [rec(800)], 12) == ("hold", 12)  # 0.8: in the band
    assert a.step(3, 1, [rec(2000)], 12)[0] == "hold (1 of 2 samples above)"  # 2.0 > 0.88, once
    assert a.step(4, 1, [rec(2000)], 12) == ("scale_down", 9)  # twice: x0.8
    assert [a.step(t, 1, [rec(100)], 9)[0] for t in (5, 6, 7)] == ["hold (cooldown)"] * 3
    assert a.step(8, 1, [rec(100)], 9) == ("scale_up", 10)
    assert reference("qos").step(1, 1, [rec(100)], 4) == ("hold", 4)  # int(4 x 1.2) = 4
    assert reference("qos").step(1, 1, [rec(100)], 480) == ("scale_up", 500)  # capped at 500 users


def test_the_reference_capacity_steps_and_stop_rule():
    """+max(40 %, 5) first, +max(20 %, 5) (at most 100) per 1 % gain of the mean throughput since the start,
    stop after two samples without it."""
    a = reference("capacity")
    assert a.step(1, 1, [rec(10, tokens=100)], 10) == ("scale_up", 15)  # +max(4, 5)
    assert a.step(2, 1, [rec(10, tokens=300)], 15) == ("scale_up", 20)  # 200 tok/s > 100 x 1.01: +max(3, 5)
    assert a.step(3, 1, [rec(10, tokens=200)], 20) == ("hold", 20)  # 200 tok/s: no 1 % gain
    assert a.step(4, 1, [rec(10, tokens=200)], 20) == ("stop", 20)  # twice: the peak
    assert a.stop_reason == "Peak capacity found" and a.peak == (15, 200.0)


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
    st = a.stats(2, users)
    assert st["peak_users"] == 8 and st["peak_throughput_tokens_per_sec"] == 230


def test_rag_corpus_and_seeded_retrieval():
    c = RagCorpus(RagSettings(num_docs=5, top_k=3, doc_tokens=(1000, 2000), chunk_tokens=512), seed=1)
    assert all(ch.key.startswith("rag_doc") and 0 < ch.tokens <= 512 for ch in c.chunks)
    assert len({ch.key for ch in c.chunks}) == len(c.chunks)
    a = c.retrieve(np.random.default_rng(4))
    b = c.retrieve(np.random.default_rng(4))
    assert a == b and len(a) == 3 and len(set(a)) == 3
    assert len({ch.key.split("_")[1] for ch in a}) == 1  # one document per query, as the reference


def chunk_index(key: str) -> int:
    return int(key.rsplit("chunk", 1)[1])


def test_rag_retrieval_distribution():
    """rag.retrieval_distribution: zipfian favours a document's first chunks, uniform does not."""
    counts = {}
    for dist in ("zipfian", "uniform"):
        c = RagCorpus(RagSettings(num_docs=1, top_k=1, doc_tokens=(5120, 5120), chunk_tokens=512, distribution=dist), 1)
        rng = np.random.default_rng(0)
        idx = [chunk_index(c.retrieve(rng)[0].key) for _ in range(3000)]
        counts[dist] = (idx.count(0), idx.count(9))
    assert counts["zipfian"][0] > 5 * counts["zipfian"][1]  # weights 1 and 1/10
    assert 0.7 < counts["uniform"][0] / counts["uniform"][1] < 1.4


def test_rag_max_documents_evicts_the_oldest_at_ingest():
    c = RagCorpus(RagSettings(num_docs=4, doc_tokens=(1000, 1000), chunk_tokens=512, max_documents=2), 1)
    steps = c.ingest_steps()
    puts = [k for op, k, _ in steps if op == "put"]
    deletes = [k for op, k, _ in steps if op == "delete"]
    assert len(puts) == 8 and deletes == [f"rag_doc{d}_chunk{i}" for d in (0, 1) for i in (0, 1)]
    # a document is deleted before the one that would exceed the limit is written
    assert steps.index(("delete", "rag_doc0_chunk0", 0)) < steps.index(("put", "rag_doc2_chunk0", 512))
    rng = np.random.default_rng(0)
    assert {ch.key.split("_")[1] for _ in range(50) for ch in c.retrieve(rng)} == {"doc2", "doc3"}


def test_rag_chunk_size_and_model_aware_document_sizes():
    assert chunk_tokens_for(512, 256 * 1024**2, 131072) == 512
    assert chunk_tokens_for(512, 1024**2, 131072) == 8  # 1 MiB of KV holds 8 tokens of llama3.1-8b
    assert chunk_tokens_for(512, 1, 131072) == 1
    assert is_large_model(8192, 80) and is_large_model(4096, 64) and not is_large_model(4096, 32)


def test_rag_top_k_larger_than_corpus():
    c = RagCorpus(RagSettings(num_docs=1, top_k=50, doc_tokens=(600, 600), chunk_tokens=512), seed=1)
    assert len(c.retrieve(np.random.default_rng(1))) == 2
