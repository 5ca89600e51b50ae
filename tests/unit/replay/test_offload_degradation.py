"""#41 item 10: a fetch-gate recompute, a failed offload load and a bypassed lookup are counted by the server and
surface in the replay's summary with a rate and a warning past DEGRADED_WARN; a server that loads past each
request's prefix (a decode dependency) is flagged. (The integration test, test_sim_hardening.py, meets a real sim.)"""

from __future__ import annotations

from kvtier.replay.results import DEGRADED_WARN, degradation_warnings, offload_degradation
from kvtier.results.replay import ScrapeSummary


def _m(**kw: object) -> ScrapeSummary:
    return ScrapeSummary(url="http://127.0.0.1:1", samples=5, scrape_errors=0, **kw)  # type: ignore[arg-type]


def test_a_server_counting_nothing_of_it_gives_no_section():
    assert offload_degradation([_m()], 100) is None and degradation_warnings(None) == []


def test_the_sims_counts_give_a_rate_and_a_warning_past_the_threshold():
    d = offload_degradation([_m(sim_fetch_gate_recomputes=3.0, sim_offload_failed_loads=2.0,
                                sim_offload_bypassed=1.0)], 40)  # fmt: skip
    assert d is not None and d["degraded_rate"] == 6 / 40 > DEGRADED_WARN
    assert (d["fetch_gate_recomputes"], d["failed_loads"], d["bypassed_lookups"]) == (3, 2, 1)
    (w,) = degradation_warnings(d)
    assert w.code == "offload-degraded" and "15.0% of ok requests" in w.message and "3 fetch-gate" in w.message
    quiet = offload_degradation([_m(sim_fetch_gate_recomputes=1.0, sim_offload_failed_loads=0.0,
                                    sim_offload_bypassed=0.0)], 100)  # fmt: skip
    assert quiet is not None and quiet["degraded_rate"] == 0.01 and degradation_warnings(quiet) == []


def test_loads_past_each_prefix_are_a_decode_dependency():
    once = _m(kvtier_offload_loaded_blocks={"cpu": 38.0}, block_size=128,
              prompt_tokens_by_source={"external_kv_transfer": 4864.0})  # fmt: skip
    d = offload_degradation([once], 10)
    assert d is not None and d["load_per_served_token"] == 1.0 and d["decode_dependency"] is False
    assert degradation_warnings(d) == []
    again = _m(kvtier_offload_loaded_blocks={"cpu": 38.0, "storage": 76.0}, block_size=128,
               prompt_tokens_by_source={"external_kv_transfer": 4864.0}, kvtier_offload_failed_loads=4.0)  # fmt: skip
    d = offload_degradation([again], 10)
    assert d is not None and d["load_per_served_token"] == 3.0 and d["decode_dependency"] is True
    assert [w.code for w in degradation_warnings(d)] == ["offload-degraded", "offload-decode-dependency"]
    nothing_served = _m(kvtier_offload_loaded_blocks={"cpu": 1.0}, block_size=128, prompt_tokens_by_source={})
    d = offload_degradation([nothing_served], 10)
    assert d is not None and d["decode_dependency"] is None  # no served tokens: not measurable
