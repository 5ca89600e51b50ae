"""The sweep's plot draws the table's 95 % interval, its low end clipped at 0 (#58 item 19)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from kvtier.report import plan


def point(cpu_gb: float, mean: float, low: float | None, high: float | None) -> SimpleNamespace:
    return SimpleNamespace(concurrency=4, nvme_gb=0.0, cpu_gb=cpu_gb, offload_hit_share=SimpleNamespace(mean=0.5),
                           ttft_p95_s=SimpleNamespace(mean=mean, low=low, high=high))  # fmt: skip


def test_the_sweeps_error_bars_are_the_interval_clipped_at_zero(monkeypatch):
    figs: list[Any] = []
    monkeypatch.setattr(plan, "_png", lambda fig, right_in=0.0: figs.append(fig) or b"png")
    # a noisy point whose interval reaches below 0 (three trials, a wide t interval), a tight one, and one
    # trial only (no interval: no bar beyond the mean)
    r = SimpleNamespace(points=[point(1, 0.2, -0.3, 0.7), point(2, 0.5, 0.4, 0.6), point(4, 0.3, None, None)],
                        slo_ttft_p95_s=None)  # fmt: skip
    try:
        assert plan.recommend_png([("", r)]) == b"png"
        bars = figs[0].axes[0].containers[0].lines[2][0].get_segments()
        ends = [(float(s[0][1]), float(s[1][1])) for s in bars]
        assert np.allclose(ends, [(0.0, 0.7), (0.4, 0.6), (0.3, 0.3)]), ends
    finally:
        for f in figs:
            plt.close(f)
