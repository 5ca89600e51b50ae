"""Run the simulated server from its config (the CLI is a thin shell over this).

``start_sim(cfg)`` binds and returns a running server (for tests and embedding: ``await server.close()`` stops it);
``serve`` runs one until SIGINT or SIGTERM, announcing the bound port on stderr and in ``--port-file``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from kvtier.config.sim import OffloadTierConfig, SimConfig, load_presets
from kvtier.errors import ConfigError
from kvtier.keys import KeyScope
from kvtier.modelspec import ModelSpec, build_catalog, resolve_model, spec_from_hf_config
from kvtier.results.ladder import Timing
from kvtier.sim.api import make_app
from kvtier.sim.model import Offload, OffloadConfig, offload_tiers
from kvtier.sim.remote import RemoteOffload
from kvtier.sim.server import SimEngine, SimSettings
from kvtier.vllm.protocol import read_token, tcp_address

MODEL_FIELDS = ("gpu_kv_gb", "prefill_tps", "tpot_ms", "prefill_overhead_ms", "batch_slowdown")
"""Latency-model fields a preset supplies and a flag overrides."""


TIMED_FIELDS = ("prefill_tps", "tpot_ms", "prefill_overhead_ms", "batch_slowdown")
"""The latency-model fields a --calibration supplies (a flag that sets one as well is refused)."""


def calibration_values(path: str, accept_unreliable: bool = False) -> tuple[dict[str, float], Timing, dict[str, Any]]:
    """The latency-model fields from a ladder's fit (results/ladder.py Timing), the Timing itself and the error the
    twin carries (results/ladder.py ``twin_error``, as JSON); an unreliable fit is refused unless
    ``accept_unreliable``."""
    from kvtier.results.ladder import load_fitted, twin_error

    _, fit = load_fitted(path, "--calibration", None if accept_unreliable else "--accept-unreliable")
    t = fit.timing
    err = twin_error(fit, path).model_dump(mode="json")
    values = {
        "prefill_tps": 1.0 / t.prefill.s_per_token if t.prefill.s_per_token > 0 else 1e12,
        "prefill_overhead_ms": t.prefill.overhead_s * 1e3,
        "prefill_pair_s": t.prefill.s_per_token_pair,
        "prefill_prompt_s": t.prefill.s_per_prompt_token,
        "prefill_char_s": t.prefill.s_per_prompt_char,
        "prompt_chars_per_token": t.prefill.prompt_chars_per_token or 0.0,
        "step_share": t.step.share if t.step is not None else 0.0,  # not measured: steps add nothing (a preset's)
        "handling_load": t.step.handling_load if t.step is not None else 0.0,
    }
    if t.decode.tpot_s > 0:  # a ladder without a TPOT sweep leaves decode to the preset (assumed)
        values["tpot_ms"] = t.decode.tpot_s * 1e3
        values["batch_slowdown"] = t.decode.s_per_extra_seq / t.decode.tpot_s
    return values, t, err


def resolve_settings(cfg: SimConfig) -> SimSettings:
    """The preset named by ``cfg.preset`` (or a ladder's fit, ``--calibration``) with every flag the user set laid
    over it."""
    presets = load_presets()
    if cfg.preset not in presets:
        raise ConfigError(f"--preset: unknown preset {cfg.preset!r} (known: {', '.join(sorted(presets))})")
    pr = dict(presets[cfg.preset])
    timing: Timing | None = None
    error: dict[str, Any] | None = None
    if cfg.calibration:
        both = [f"--{n.replace('_', '-')}" for n in TIMED_FIELDS if getattr(cfg, n) is not None]
        if both:
            raise ConfigError(
                f"--calibration: {', '.join(both)} would override the measured figures; give one or the other"
            )
        measured, timing, error = calibration_values(cfg.calibration, cfg.accept_unreliable)
        pr.update(measured)
    if cfg.hf_config and cfg.model:
        raise ConfigError("--hf-config: give it or --model, not both")
    model = (
        spec_from_hf_config(cfg.hf_config)
        if cfg.hf_config
        else resolve_model(cfg.model or pr["model"], build_catalog())
    )
    values: dict[str, float] = {}
    for name in MODEL_FIELDS:
        v = getattr(cfg, name)
        v = pr.get(name) if v is None else v
        if v is None or v < 0 or (name in ("gpu_kv_gb", "prefill_tps") and v <= 0):
            raise ConfigError(f"--{name.replace('_', '-')}: must be > 0, got {v}")
        values[name] = float(v)
    return SimSettings(
        max_waiting=cfg.max_waiting,
        queue_timeout_s=cfg.queue_timeout,
        model=model,
        served_model_name=cfg.served_model_name or cfg.model or pr["model"],
        gpu_kv_gb=values["gpu_kv_gb"],
        prefill_tps=values["prefill_tps"],
        tpot_ms=values["tpot_ms"],
        prefill_overhead_ms=values["prefill_overhead_ms"],
        batch_slowdown=values["batch_slowdown"],
        max_num_seqs=cfg.max_num_seqs,
        seed=cfg.seed,
        block_tokens=cfg.block_tokens,
        gpu_kv_tokens=cfg.gpu_kv_tokens,
        max_model_len=cfg.max_model_len,
        tokenizer=cfg.tokenizer,
        body_timeout_s=cfg.body_timeout,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        prefill_pair_s=float(pr.get("prefill_pair_s", 0.0)),
        prefill_prompt_s=float(pr.get("prefill_prompt_s", 0.0)),
        prefill_char_s=float(pr.get("prefill_char_s", 0.0)),
        prompt_chars_per_token=float(pr.get("prompt_chars_per_token", 0.0)),
        step_share=float(pr.get("step_share", 0.0)),
        handling_load=float(pr.get("handling_load", 0.0)),
        timing_source="measured" if timing is not None else "assumed",
        timing_origin=cfg.calibration if cfg.calibration and timing is not None else f"preset {cfg.preset}",
        measured_prompt_tokens=timing.range.max_prompt_tokens if timing and timing.range else None,
        measured_running=timing.range.max_running if timing and timing.range else None,
        timing_error=error,
    )


def scope_for(model: ModelSpec, chunk_tokens: int = 256) -> KeyScope:
    return KeyScope(
        model_name=model.key, kv_dtype=model.dtype, attention_layout=model.attention, chunk_size=chunk_tokens
    )


def make_offload(kind: str, tier: OffloadTierConfig, model: ModelSpec, seed: int, chunk_tokens: int = 256) -> Offload:
    """The in-process offload tier for ``kind`` cpu or nvme; engine errors name the flags here."""
    if kind == "nvme" and (not tier.nvme_dir or not Path(tier.nvme_dir).is_dir()):
        raise ConfigError(f"--nvme-dir: give an existing directory for --offload nvme (got {tier.nvme_dir!r})")
    if kind == "nvme":  # what killed runs left behind, before the tier sizes itself
        from kvtier.engine.runs import remove_stale_runs

        remove_stale_runs(tier.nvme_dir, lambda line: print(line, file=sys.stderr))
    cfg = OffloadConfig(kind, chunk_tokens, tier)
    tiers = offload_tiers(cfg, model.kv_bytes_per_token, REMOTE_CONNECTIONS)
    return Offload(cfg, scope_for(model, chunk_tokens), model.kv_bytes_per_token, seed, tiers)


REMOTE_CONNECTIONS = 32
"""Connections of a Redis/S3 offload tier: loads and stores run on asyncio's default thread pool
(at most 32 threads)."""


@dataclass
class RunningServer:
    """A bound server: its TCP port, and how to stop it."""

    port: int
    runners: list[web.AppRunner]
    cleanup: Callable[[], Awaitable[None]]

    async def close(self) -> None:
        for r in self.runners:
            await r.cleanup()
        await self.cleanup()


@dataclass
class RunningSim(RunningServer):
    engine: SimEngine | None = None

    @property
    def sim(self) -> SimEngine:
        if self.engine is None:
            raise RuntimeError("not a started sim")
        return self.engine


async def start_sim(cfg: SimConfig) -> RunningSim:
    """Build the engine and its offload tier, bind, and return the running server."""
    settings = resolve_settings(cfg)
    offload: Offload | RemoteOffload | None = None
    if cfg.offload == "remote":
        if not cfg.cache_server:
            raise ConfigError("--offload remote: give --cache-server (kvtier cache-server's socket or tcp://HOST:PORT)")
        token = None
        if tcp_address(cfg.cache_server) is not None:
            if not cfg.cache_server_token_file:
                raise ConfigError("--cache-server: a tcp:// cache server needs --cache-server-token-file")
            try:
                token = read_token(cfg.cache_server_token_file, "--cache-server-token-file")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        offload = RemoteOffload(
            cfg.cache_server,
            scope_for(settings.model, cfg.offload_chunk_tokens),
            settings.model.kv_bytes_per_token,
            cfg.offload_chunk_tokens,
            timeout_s=cfg.cache_timeout,
            engine=cfg.replica_id or f"sim-{os.getpid()}",
            seed=cfg.seed,
            token=token,
        )
        await offload.connect()
    elif cfg.offload != "none":
        offload = make_offload(cfg.offload, cfg, settings.model, cfg.seed, cfg.offload_chunk_tokens)
    if offload is not None:
        offload.gated = not cfg.no_fetch_gate

    async def cleanup() -> None:
        if offload is not None:
            await offload.aclose()
            offload.close()

    engine = SimEngine(settings, offload, replica_id=cfg.replica_id or "")
    # handler_cancellation: a client that leaves cancels its request (slot, KV blocks and decoding freed);
    # auto_decompress off: sim/requests.py inflates bodies itself, with a cap; keepalive_timeout also
    # closes connections that never finish sending their headers
    runner = web.AppRunner(
        make_app(engine),
        access_log=None,
        handler_cancellation=True,
        auto_decompress=False,
        keepalive_timeout=cfg.idle_timeout,
    )
    try:
        await runner.setup()
        await web.TCPSite(runner, cfg.host, cfg.port).start()
    except OSError as e:
        await runner.cleanup()
        await cleanup()
        raise ConfigError(f"--port: cannot listen on {cfg.host}:{cfg.port}: {e.strerror}") from e
    except BaseException:
        await runner.cleanup()
        await cleanup()
        raise
    port = runner.addresses[0][1]
    if not engine.replica_id:  # the default names the address, known only once bound
        engine.replica_id = f"{cfg.host}:{port}"
    return RunningSim(port, [runner], cleanup, engine)


async def _until_signal(port_file: str | None, port: int) -> None:
    """Announce the port (for scripts and tests), then wait for SIGINT or SIGTERM."""
    if port_file:
        from kvtier.results.io import write_text_atomic

        write_text_atomic(port_file, f"{port}\n", "--port-file")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def _run_loop(main: Callable[[], Awaitable[None]], kind: str) -> None:
    """Run a server's main coroutine on uvloop when installed (--event-loop auto), else asyncio."""
    from kvtier.replay.client import event_loop_kind, loop_factory

    async def wrapped() -> None:
        await main()

    with asyncio.Runner(loop_factory=loop_factory(event_loop_kind(kind))) as runner:
        runner.run(wrapped())


def _serve(
    start: Callable[[], Awaitable[RunningServer]], announce: Callable[[Any], str], port_file: str | None, loop_kind: str
) -> None:
    """Start a server, say where it listens (stderr, ``port_file``), serve until SIGINT/SIGTERM, stop it."""

    async def main() -> None:
        server = await start()
        try:
            print(announce(server), file=sys.stderr, flush=True)
            await _until_signal(port_file, server.port)
        finally:
            await server.close()

    _run_loop(main, loop_kind)


def serve(cfg: SimConfig) -> None:
    """Run the simulated server until SIGINT/SIGTERM."""

    def announce(server: RunningSim) -> str:
        e = server.sim
        return (
            f"kvtier sim: {e.s.served_model_name} on http://{cfg.host}:{server.port}/v1 (replica {e.replica_id}, "
            f"GPU {e.gpu.capacity} blocks = {e.max_model_len:,} tokens (the longest prompt + max_tokens it serves; "
            f"/v1/models says max_model_len), offload {cfg.offload}, tokenizer {e.tokenizer.name})"
        )

    _serve(lambda: start_sim(cfg), announce, cfg.port_file, cfg.event_loop)


__all__ = [
    "serve",
    "start_sim",
    "resolve_settings",
    "load_presets",
    "make_offload",
    "RunningServer",
    "RunningSim",
]
