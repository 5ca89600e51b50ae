"""The bench's derived run (``Plan``) and its workload: the types ``bench/setup.py`` builds and every later step
reads (tier set-up, the runner, the results), apart so the files that read them need not import the one that makes
them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.bench.autoscale import Autoscaler
from kvtier.config.bench import BenchConfig
from kvtier.keys import KeyScope
from kvtier.modelspec import ModelSpec
from kvtier.results.envelope import ResultWarning
from kvtier.workload.conversations import ConversationManager, ConversationSettings
from kvtier.workload.rag import RagCorpus
from kvtier.workload.sharegpt import Dataset
from kvtier.workload.traces import Trace
from kvtier.workload.users import UserProfile


@dataclass
class Workload:
    """What the simulated users ask for, derived from the config (no I/O)."""

    users: list[UserProfile]
    scope: KeyScope
    settings: ConversationSettings
    conversations: ConversationManager
    rag: RagCorpus | None
    trace: Trace | None
    dataset: Dataset | None
    autoscaler: Autoscaler | None
    per_token_s: float
    decode_batch: int


@dataclass
class Plan:
    """The derived run: everything the config implies before any tier exists."""

    config: BenchConfig
    model: ModelSpec
    seed: int
    io_slots: int
    io_chunk_bytes: int
    workload: Workload
    warnings: list[ResultWarning] = field(default_factory=list)
    validation: Trace | None = None  # --validation-trace, read before the run

    def entry_bytes(self, tokens: int) -> int:
        """Bytes of this rank's KV entry of ``tokens`` tokens (ModelSpec's per-rank rule)."""
        return self.model.kv_bytes_per_rank(tokens, self.config.tensor_parallel)


__all__ = ["Workload", "Plan"]
