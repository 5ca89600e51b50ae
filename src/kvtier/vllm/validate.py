"""Check vLLM command lines with the installed vLLM's own parser and config classes, short of starting an engine.

Run inside the engine's environment (kvtier importable through ``kvtier.vllm.engine_pythonpath``)::

    PYTHONPATH=DIR ENGINE_PYTHON -m kvtier.vllm.validate < commands.json

stdin: a JSON list of {"name": ..., "argv": [...]} (``vllm serve MODEL ...`` or ``python -m
vllm.entrypoints.openai.api_server ...``); stdout: one JSON list of {"name", "ok", "checks", "problems"}. Each
command is parsed by vLLM's OpenAI server argument parser (an unknown flag or a bad value is a problem), its
engine arguments built (``AsyncEngineArgs.from_cli_args``), its ``--kv-transfer-config`` built as vLLM's
``KVTransferConfig``, the connector class it names resolved through vLLM's connector factory (or its module
imported), the offloading spec it names resolved through vLLM's spec factory, and a tiering spec's secondary
tier types through vLLM's tier factory; ``--kv-offloading-backend``/``--kv-offloading-size`` are checked as
vLLM's CacheConfig fields. Nothing allocates memory or touches a device.
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any

SERVE_MODULE = "vllm.entrypoints.openai.api_server"


def server_args(argv: list[str]) -> list[str]:
    """The arguments of vLLM's OpenAI server parser for a launch command line."""
    if len(argv) >= 3 and argv[0].endswith("vllm") and argv[1] == "serve":
        return ["--model", argv[2], *argv[3:]]
    if SERVE_MODULE in argv:
        return argv[argv.index(SERVE_MODULE) + 1 :]
    raise ValueError(f"not a vLLM server command: {argv[:3]}")


def check(argv: list[str]) -> tuple[list[str], list[str]]:
    """(checks passed, problems) for one command line."""
    from vllm.config import KVTransferConfig
    from vllm.config.cache import CacheConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    done: list[str] = []
    problems: list[str] = []
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    try:
        ns = parser.parse_args(server_args(argv))
    except SystemExit:
        return done, ["vLLM's argument parser refused the command line (see its message above)"]
    done.append("parsed by vLLM's OpenAI server parser")
    try:
        ea = AsyncEngineArgs.from_cli_args(ns)
    except Exception as e:  # noqa: BLE001 - any refusal is the finding
        return done, [f"engine arguments: {type(e).__name__}: {e}"]
    done.append("engine arguments built")
    if ea.kv_offloading_size is not None or ea.kv_offloading_backend != "native":
        try:
            CacheConfig(kv_offloading_size=ea.kv_offloading_size, kv_offloading_backend=ea.kv_offloading_backend)
            done.append(f"kv offloading backend {ea.kv_offloading_backend}, {ea.kv_offloading_size} GB")
        except Exception as e:  # noqa: BLE001
            problems.append(f"--kv-offloading-*: {type(e).__name__}: {e}")
    ktc = ea.kv_transfer_config
    if ktc is None:
        return done, problems
    if isinstance(ktc, dict):
        try:
            ktc = KVTransferConfig(**ktc)
        except Exception as e:  # noqa: BLE001
            return done, [*problems, f"--kv-transfer-config: {type(e).__name__}: {e}"]
    done.append(f"KVTransferConfig built ({ktc.kv_connector}, {ktc.kv_role})")
    problems += _connector(ktc, done)
    return done, problems


def _connector(ktc: Any, done: list[str]) -> list[str]:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    name, module = ktc.kv_connector, ktc.kv_connector_module_path
    try:
        cls = KVConnectorFactory.get_connector_class(ktc)
        done.append(f"connector {cls.__module__}.{cls.__name__}")
    except ModuleNotFoundError as e:
        # a connector whose package is not in this environment (LMCache on the CPU build): named, not judged
        done.append(f"connector {name} from {module}: its package is not installed here ({e.name})")
        return []
    except Exception as e:  # noqa: BLE001
        return [f"connector {name}: {type(e).__name__}: {e}"]
    extra = dict(ktc.kv_connector_extra_config or {})
    if "spec_name" not in extra and name not in ("OffloadingConnector",) and "Offloading" not in name:
        return []
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    try:
        spec = OffloadingSpecFactory.get_spec_cls(extra)
        done.append(f"offloading spec {spec.__module__}.{spec.__name__}")
    except Exception as e:  # noqa: BLE001
        return [f"offloading spec {extra.get('spec_name')}: {type(e).__name__}: {e}"]
    problems = []
    for tier in extra.get("secondary_tiers", []):
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

        try:
            tcls = SecondaryTierFactory.get_tier_class(tier)
            params = inspect.signature(tcls.__init__).parameters
            unknown = sorted(set(tier) - set(params) - {"type", "module_path", "backpressure", "locality"})
            if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                problems.append(f"secondary tier {tier.get('type')}: {tcls.__name__} takes no {', '.join(unknown)}")
                continue
            done.append(
                f"secondary tier {tier.get('type')}: {tcls.__name__}({', '.join(sorted(set(tier) - {'type'}))})"
            )
        except Exception as e:  # noqa: BLE001
            problems.append(f"secondary tier {tier.get('type')}: {type(e).__name__}: {e}")
    if spec.__module__ == "kvtier.vllm.spec":
        from kvtier.errors import ConfigError
        from kvtier.vllm.settings import VllmOffloadSettings

        try:
            VllmOffloadSettings.from_extra(extra)
            done.append("kvtier offload settings valid")
        except ConfigError as e:
            problems.append(str(e))
    return problems


def main() -> int:
    commands = json.load(sys.stdin)
    out = []
    for c in commands:
        try:
            done, problems = check(list(c["argv"]))
        except Exception as e:  # noqa: BLE001 - reported per command
            done, problems = [], [f"{type(e).__name__}: {e}"]
        out.append({"name": c["name"], "ok": not problems, "checks": done, "problems": problems})
    print(json.dumps(out))
    return 0 if all(o["ok"] for o in out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
