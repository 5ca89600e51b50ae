"""kvtier's tiers as a vLLM offloading backend (vLLM 0.32's offloading connector, out-of-tree spec).

``kvtier.vllm.spec`` imports vLLM and runs inside the engine; the rest (the scheduler-side index, the settings,
the block mover) is importable without it. ``kv_transfer_config`` builds the engine's ``--kv-transfer-config``.
"""

from __future__ import annotations

import json
from typing import Any

SPEC_MODULE = "kvtier.vllm.spec"
SPEC_NAME = "KvtierOffloadingSpec"
CONNECTOR_NAME = "KvtierOffloadingConnector"


def kv_transfer_config(settings: dict[str, Any], failure_policy: str = "recompute") -> dict[str, Any]:
    """vLLM's KV-transfer config for kvtier's backend with these offload settings (kvtier/vllm/settings.py keys)."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": SPEC_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": {"spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE, **settings},
    }


def kv_transfer_arg(settings: dict[str, Any]) -> str:
    return json.dumps(kv_transfer_config(settings), separators=(",", ":"))


__all__ = ["SPEC_MODULE", "SPEC_NAME", "CONNECTOR_NAME", "kv_transfer_config", "kv_transfer_arg", "engine_pythonpath"]


def engine_pythonpath(folder: str) -> str:
    """A folder holding only a link to this kvtier package, for an engine's PYTHONPATH: the engine's own
    environment keeps its packages (numpy, pydantic, torch) and imports kvtier from here. Returns the folder."""
    import os
    from pathlib import Path

    pkg = Path(__file__).resolve().parent.parent
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    link = d / "kvtier"
    if link.is_symlink() and link.resolve() != pkg:
        link.unlink()
    if not link.exists():
        os.symlink(pkg, link, target_is_directory=True)
    return str(d)
