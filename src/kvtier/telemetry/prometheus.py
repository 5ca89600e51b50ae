"""A registry in the Prometheus plain text format, as kvtier's servers expose it (the sim, the cache server, the
vLLM block server's /metrics): ``exposition`` leaves out prometheus_client's ``*_created`` series, which vLLM and
LMCache do not expose, so scrapers see the same names from kvtier as from the real servers.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _WithoutCreated:
    """A registry view that drops the ``_created`` samples of counters and histograms."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for m in self.registry.collect():
            m.samples = [s for s in m.samples if not s.name.endswith("_created")]
            yield m


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus plain text format (0.0.4), without ``*_created`` series."""
    return generate_latest(_WithoutCreated(registry))  # type: ignore[arg-type,unused-ignore]  # duck-typed collector


__all__ = ["CONTENT_TYPE", "exposition"]
