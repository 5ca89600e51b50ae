"""Retrieval-augmented generation: a document corpus stored as chunk KV, and top-k retrieval.

Documents (``--rag-num-docs``, lengths drawn from ``rag.doc_tokens``) are cut into chunks of
``rag.chunk_tokens`` tokens, each one KV entry ``rag_doc{d}_chunk{c}``, ingested before the load
starts. A request is a RAG query with probability ``rag.request_probability``: it retrieves
``--rag-top-k`` chunks (seeded draw without replacement, skewed towards popular documents by a Zipf
weight ``rag.popularity_skew``) and reads their KV before its first token — the burst — then
prefills and decodes as usual. A retrieved chunk that the cache evicted is re-ingested (written).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.workload.layout import KVRef


@dataclass(frozen=True)
class RagSettings:
    num_docs: int = 10
    top_k: int = 5
    request_probability: float = 0.1
    doc_tokens: tuple[int, int] = (2048, 16384)
    chunk_tokens: int = 512
    popularity_skew: float = 1.0


class RagCorpus:
    def __init__(self, settings: RagSettings, seed: int) -> None:
        self.settings = settings
        rng = np.random.default_rng(np.random.SeedSequence([seed, 2**31 - 2, 11]))
        self.chunks: list[KVRef] = []
        self.doc_of: list[int] = []
        lo, hi = settings.doc_tokens
        for d in range(settings.num_docs):
            tokens = int(rng.integers(lo, hi + 1))
            for c, start in enumerate(range(0, tokens, settings.chunk_tokens)):
                self.chunks.append(KVRef(f"rag_doc{d}_chunk{c}", min(settings.chunk_tokens, tokens - start), "rag"))
                self.doc_of.append(d)
        doc_w = 1.0 / np.arange(1, settings.num_docs + 1) ** settings.popularity_skew
        w = doc_w[np.array(self.doc_of)]
        self._p = w / w.sum()

    def retrieve(self, rng: np.random.Generator) -> tuple[KVRef, ...]:
        k = min(self.settings.top_k, len(self.chunks))
        idx = rng.choice(len(self.chunks), size=k, replace=False, p=self._p)
        return tuple(self.chunks[i] for i in sorted(idx))
