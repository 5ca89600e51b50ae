"""kvtier.sim as a library: start the simulated server in this process, talk to it on 127.0.0.1, stop it."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvtier.config import SimConfig
from kvtier.errors import ConfigError
from kvtier.sim import start_sim


def test_start_request_and_close_in_process():
    async def main():
        server = await start_sim(SimConfig(preset="cpu-test", port=0, offload="cpu", cpu_offload_gb=0.05))
        try:
            assert server.sim.replica_id == f"127.0.0.1:{server.port}"  # named once bound, not before
            body = {"model": "tiny-1b", "messages": [{"role": "user", "content": "w " * 600}], "max_tokens": 3}
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body) as r:
                    assert r.status == 200 and r.headers["x-kvtier-replica"] == server.sim.replica_id
                    reply = await r.json()
                async with s.get(f"http://127.0.0.1:{server.port}/metrics") as r:
                    text = await r.text()
            assert reply["usage"]["completion_tokens"] == 3
            assert "vllm:prompt_tokens_total" in text and "_created" not in text  # no process-wide switch needed
        finally:
            await server.close()

    asyncio.run(main())


def test_two_servers_in_one_process_keep_their_own_metrics():
    async def main():
        a = await start_sim(SimConfig(preset="cpu-test", port=0))
        b = await start_sim(SimConfig(preset="cpu-test", port=0, served_model_name="other"))
        try:
            async with aiohttp.ClientSession() as s:
                body = {"model": "tiny-1b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                async with s.post(f"http://127.0.0.1:{a.port}/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                async with s.get(f"http://127.0.0.1:{b.port}/metrics") as r:
                    text = await r.text()
            assert 'vllm:request_success_total{model_name="other"} 0.0' in text
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


def test_bad_preset_is_a_config_error():
    with pytest.raises(ConfigError, match="--preset: unknown preset"):
        asyncio.run(start_sim(SimConfig(preset="nope", port=0)))
