"""Retrieval-augmented generation: a document corpus stored as chunk KV, and top-k retrieval.

The reference's model, key by key (config ``rag``):

* ``--rag-num-docs`` documents, each of a length drawn uniformly from the model-aware range:
  ``large_model_doc_tokens_min/max`` for models with hidden_dim >= 8192 or >= 64 layers (bigger KV
  per token, so fewer tokens per document), ``small_model_doc_tokens_min/max`` otherwise.
* Each document is cut into chunks of ``chunk_size_tokens``, fewer where a chunk would exceed
  ``max_chunk_bytes`` of KV; each chunk is one KV entry ``rag_doc{d}_chunk{c}``.
* Ingestion (before the load, outside the statistics) writes the documents in order; with
  ``max_documents`` > 0 the oldest document is evicted (its chunks deleted) when a new one would
  exceed the limit, so only the last ``max_documents`` stay retrievable.
* A request is a RAG query with probability ``request_probability``: it picks a document uniformly
  and retrieves ``top_k_chunks`` (``--rag-top-k``) of its chunks without replacement — earlier chunks
  likelier (weight 1/(i+1)) with ``retrieval_distribution: zipfian``, all alike with ``uniform`` or
  ``random``. Their KV is read before the first token (the burst); a chunk the cache evicted is
  re-ingested (written).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvtier.workload.layout import KVRef


@dataclass(frozen=True)
class RagSettings:
    num_docs: int = 10
    top_k: int = 5
    request_probability: float = 0.1
    doc_tokens: tuple[int, int] = (4000, 12000)
    chunk_tokens: int = 512
    distribution: Literal["zipfian", "uniform", "random"] = "zipfian"
    max_documents: int = 0


def is_large_model(hidden_dim: int, num_layers: int) -> bool:
    """The reference's split for document sizes: hidden_dim >= 8192 or at least 64 layers."""
    return hidden_dim >= 8192 or num_layers >= 64


def chunk_tokens_for(chunk_size_tokens: int, max_chunk_bytes: int, bytes_per_token: int) -> int:
    """Tokens per chunk: ``chunk_size_tokens``, fewer where the chunk's KV would exceed ``max_chunk_bytes``."""
    return max(1, min(chunk_size_tokens, max_chunk_bytes // max(1, bytes_per_token)))


IngestStep = tuple[Literal["put", "delete"], str, int]
"""One ingestion step: ("put", key, tokens) writes a chunk, ("delete", key, 0) evicts one."""


class RagCorpus:
    def __init__(self, settings: RagSettings, seed: int) -> None:
        self.settings = settings
        rng = np.random.default_rng(np.random.SeedSequence([seed, 2**31 - 2, 11]))
        lo, hi = settings.doc_tokens
        self.documents: list[tuple[KVRef, ...]] = []
        for d in range(settings.num_docs):
            tokens = int(rng.integers(lo, hi + 1))
            step = settings.chunk_tokens
            self.documents.append(
                tuple(
                    KVRef(f"rag_doc{d}_chunk{c}", min(step, tokens - start), "rag")
                    for c, start in enumerate(range(0, tokens, step))
                )
            )
        keep = settings.max_documents or settings.num_docs
        self.evicted_documents = max(0, settings.num_docs - keep)
        self.retained = self.documents[self.evicted_documents :]
        self._p = [self._weights(len(doc)) for doc in self.retained]

    def _weights(self, n: int) -> np.ndarray | None:
        if self.settings.distribution != "zipfian":
            return None
        w = 1.0 / np.arange(1, n + 1)
        return np.asarray(w / w.sum())

    @property
    def chunks(self) -> list[KVRef]:
        """The chunks of the documents that stay retrievable."""
        return [c for doc in self.retained for c in doc]

    def ingest_steps(self) -> list[IngestStep]:
        """Ingestion in order, evicting the oldest document once ``max_documents`` are held."""
        steps: list[IngestStep] = []
        held: list[tuple[KVRef, ...]] = []
        limit = self.settings.max_documents
        for doc in self.documents:
            while limit and len(held) >= limit:
                steps += [("delete", c.key, 0) for c in held.pop(0)]
            steps += [("put", c.key, c.tokens) for c in doc]
            held.append(doc)
        return steps

    def retrieve(self, rng: np.random.Generator) -> tuple[KVRef, ...]:
        """One query: a document drawn uniformly, then top-k of its chunks without replacement."""
        if not self.retained:
            return ()
        d = int(rng.integers(0, len(self.retained)))
        doc = self.retained[d]
        k = min(self.settings.top_k, len(doc))
        idx = rng.choice(len(doc), size=k, replace=False, p=self._p[d])
        return tuple(doc[i] for i in sorted(idx))
