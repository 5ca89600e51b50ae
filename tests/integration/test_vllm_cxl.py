"""#54 item 2 on a real engine: vLLM (the CPU build) offloading into kvtier's CXL / DAX tier, mapped from a file in
/dev/shm (a tmpfs standing in for CXL memory), through kvtier's spec (``offload: cxl`` in kv_connector_extra_config).
A prefix pushed out of vLLM's own cache comes back from the CXL tier, as vLLM's counters and kvtier's say. Skips, with
the reason, where the engine is not installed."""

from __future__ import annotations

import os
import random

import pytest

from kvtier.launch.procs import free_ports
from tests.integration.test_real_vllm import ENGINE_PYTHON, PROBLEM, STARTUP_S
from tests.integration.test_vllm_offload import BLOCK, KV_TOKENS, MAX_LEN, Offloading, delta

pytest.importorskip("tokenizers")
pytestmark = [pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or ""), pytest.mark.slow, pytest.mark.engine]


def test_a_prefix_pushed_out_of_vllms_cache_comes_back_from_kvtiers_cxl_tier(tmp_path):
    from kvtier.launch import cpu_engine
    from kvtier.launch.devices import cpu_inventory
    from kvtier.modelmaker import Geometry, make_model
    from kvtier.vllm import engine_pythonpath, kv_transfer_arg

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm tmpfs to stand in for CXL memory")
    model = make_model(tmp_path / "tiny", Geometry())
    block_bytes = BLOCK * Geometry().kv_bytes_per_token
    settings = {"offload": "cxl", "cxl_path": "/dev/shm", "cxl_mem_gb": 256 * block_bytes / 2**30}
    (port,) = free_ports(1)
    extra = ["--kv-transfer-config", kv_transfer_arg(settings)]
    srv = cpu_engine.start(str(ENGINE_PYTHON), str(model), port, tmp_path, KV_TOKENS * Geometry().kv_bytes_per_token,
                           MAX_LEN, cpu_inventory(None).devices, extra=extra,
                           env={"PYTHONPATH": engine_pythonpath(str(tmp_path / "pylib"))})  # fmt: skip
    try:
        srv.wait_healthy(STARTUP_S)
        o = Offloading(srv.url, srv.log, tmp_path, random.Random(5), model, tmp_path / "none.jsonl")
        target = o.prompt("c")
        _, cold, _ = o.ask(target)
        o.push_out("p")
        before = o.metrics()
        _, usage, _ = o.ask(target)
        after = o.metrics()
    finally:
        srv.stop()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= cold["prompt_tokens"] - BLOCK  # every whole block but the last came back
    assert delta(before, after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == cached
    assert delta(before, after, "vllm:prompt_tokens_cached_by_source_total", source="host") == cached
    assert delta(before, after, "kvtier:offload_loaded_blocks_total", tier="cxl") == cached // BLOCK
    assert after.get("kvtier:offload_failed_loads_total") in (None, 0.0)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("kvtier-cxl-")]  # its file was never visible
