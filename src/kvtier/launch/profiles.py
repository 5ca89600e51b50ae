"""Launch profiles (YAML data, one per engine x build x tier) and their resolution into commands.

A profile names the replica command, the optional cache sidecar (exactly one per run; none for the
GPU tier), their health and metrics URLs, environment, and for vLLM the ``--kv-transfer-config``.
``{placeholders}`` are filled from a fixed table (see profiles.yaml); an unknown placeholder, an
unknown key or a missing required value is an error naming the file and the key path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier.config.base import load_yaml
from kvtier.errors import ConfigError

PLACEHOLDERS = (
    "model",
    "host",
    "port",
    "replica",
    "replica_id",
    "workdir",
    "sidecar_port",
    "sidecar_http_port",
    "sidecar_socket",
    "nvme_dir",
    "kv_transfer_config",
    "sim_model",
    "tensor_parallel_size",
    "max_workers",
    "l1_gb",
    "l2_gb",
    "engine_python",
    "model_dir",
    "kv_cache_bytes",
    "max_model_len",
    "l1_bytes",
    "kvtier_pythonpath",
    "staging_gb",
    "staging_bytes",
    "request_log",
)
NUMERIC = frozenset(
    {
        "port",
        "sidecar_port",
        "sidecar_http_port",
        "tensor_parallel_size",
        "max_workers",
        "l1_gb",
        "l2_gb",
        "l1_bytes",
        "staging_gb",
        "staging_bytes",
    }
)
"""Placeholders that become JSON numbers where they stand alone as a value in JSON."""
_PH = re.compile(r"\{([a-z][a-z0-9_]*)\}")


class JsonArg(BaseModel):
    """A command argument built as JSON by a serializer (placeholders filled inside its strings first),
    so a value with quotes or backslashes cannot change the JSON's structure."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] = Field(alias="json")


class ProcessSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    command: list[str | JsonArg] = Field(min_length=1)
    health: str
    metrics: str | None = None
    startup_timeout_s: float = Field(default=120.0, gt=0)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    engine: Literal["vllm", "sim"]
    build: Literal["nvidia", "amd", "cpu"]
    tier: Literal["gpu", "cpu", "nvme"]
    offload_engine: Literal["none", "lmcache", "vllm-native", "kvtier", "kvtier-shared"] | None = Field(
        default=None, description="default: none for the gpu tier, kvtier for the sim, lmcache for vllm"
    )
    env: dict[str, str] = Field(default_factory=dict)
    sim_model: str | None = None
    sidecar_port: int | None = Field(default=None, gt=0, lt=65536, description="fixed data port (else a free one)")
    sidecar_http_port: int | None = Field(default=None, gt=0, lt=65536, description="fixed HTTP port (else a free one)")
    replica: ProcessSpec
    sidecar: ProcessSpec | None = None
    kv_transfer_config: dict[str, Any] | None = None

    @property
    def offload(self) -> str:
        """What moves the KV to the tier: the profile's offload_engine, or the default of its engine x build x tier."""
        from kvtier.config.launch import offload_engine

        return self.offload_engine or offload_engine(self.engine, self.build, self.tier)


def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(x) for x in loc)


def load_profiles(path: str | Path | None = None) -> tuple[dict[str, Profile], str]:
    """All profiles of a file (default: the packaged profiles.yaml), validated; (profiles, source)."""
    if path is None:
        text, source = (
            resources.files("kvtier.launch").joinpath("profiles.yaml").read_text(),
            "profiles.yaml (packaged)",
        )
    else:
        try:
            text, source = Path(path).read_text(), str(path)
        except OSError as e:
            raise ConfigError(f"--profiles: cannot read {path}: {e.strerror}") from e
    try:
        raw = load_yaml(text, source)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from e
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{source}: expected a mapping of profile name -> profile")
    out: dict[str, Profile] = {}
    problems = []
    for name, body in raw.items():
        if str(name).startswith("."):
            continue  # shared pieces for YAML anchors, not a profile
        for where, text in _strings(body):
            for ph in _PH.findall(text):
                if ph not in PLACEHOLDERS:
                    problems.append(
                        f"{source}: {name}.{where}: unknown placeholder {{{ph}}} (known: {', '.join(PLACEHOLDERS)})"
                    )
        if isinstance(body, dict):
            tier, has_sidecar = body.get("tier"), body.get("sidecar") is not None
            engine, offload = body.get("engine"), body.get("offload_engine")
            sidecar_tier = engine == "sim" or offload in (None, "lmcache", "kvtier-shared")  # in-process ones: none
            if tier == "gpu" and has_sidecar:
                problems.append(f"{source}: {name}.sidecar: the GPU tier has no cache sidecar")
            if tier == "gpu" and offload not in (None, "none"):
                problems.append(f"{source}: {name}.offload_engine: the GPU tier offloads nothing")
            if tier in ("cpu", "nvme") and sidecar_tier and not has_sidecar:
                problems.append(f"{source}: {name}.sidecar: required for the {tier} tier")
            text = json.dumps(body)
            if "{sim_model}" in text and not body.get("sim_model"):
                problems.append(f"{source}: {name}.sim_model: required by the {{sim_model}} placeholder")
            if "{kv_transfer_config}" in text and body.get("kv_transfer_config") is None:
                problems.append(
                    f"{source}: {name}.kv_transfer_config: required by the {{kv_transfer_config}} placeholder"
                )
        try:
            out[name] = Profile.model_validate(body)
        except ValidationError as e:
            for err in e.errors():
                problems.append(f"{source}: {name}.{_where(err['loc'])}: {err['msg']}")
    if problems:
        raise ConfigError("\n".join(problems))
    return out, source


def _strings(node: Any, where: str = "") -> list[tuple[str, str]]:
    if isinstance(node, str):
        return [(where, node)]
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in _strings(v, f"{where}.{k}" if where else str(k))]
    if isinstance(node, list):
        return [x for i, v in enumerate(node) for x in _strings(v, f"{where}[{i}]")]
    return []


def pick(
    profiles: Mapping[str, Profile], engine: str, build: str, tier: str, source: str, offload: str | None = None
) -> tuple[str, Profile]:
    """The one profile for engine x build x tier x offload engine (``offload`` None: the default one,
    ``kvtier.config.launch.offload_engine``)."""
    from kvtier.config.launch import offload_engine

    want = offload or offload_engine(engine, build, tier)
    found = [
        (n, p) for n, p in profiles.items() if (p.engine, p.build, p.tier, p.offload) == (engine, build, tier, want)
    ]
    what = f"engine {engine}, build {build}, tier {tier}, offload engine {want}"
    if not found:
        raise ConfigError(f"{source}: no profile for {what}")
    if len(found) > 1:
        raise ConfigError(f"{source}: several profiles for {what}: {', '.join(n for n, _ in found)}")
    return found[0]


def fill(s: str, values: Mapping[str, str]) -> str:
    """Replace {name} placeholders; other braces (JSON in an argument) are left alone."""

    def one(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in values:
            return m.group(0) if key not in PLACEHOLDERS else _missing(key)
        return values[key]

    return _PH.sub(one, s)


def _missing(key: str) -> str:
    raise ConfigError(f"placeholder {{{key}}} has no value in this run")


WHOLE = re.compile(r"^\{([a-z][a-z0-9_]*)\}$")


def fill_arg(arg: str | JsonArg, values: Mapping[str, str]) -> str:
    """One command argument, filled. A value that stands alone as an argument may not look like an
    option (``--model=--trust-remote-code`` must not become a flag of the engine)."""
    if isinstance(arg, JsonArg):
        return json.dumps(_fill_tree(arg.json_, values))
    m = WHOLE.match(arg)
    out = fill(arg, values)
    if m and out.startswith("-") and m.group(1) not in ("kv_transfer_config",):
        raise ConfigError(f"{{{m.group(1)}}} = {out!r} would be read as an option by the command; refused")
    return out


def _fill_tree(node: Any, values: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        m = WHOLE.match(node)
        out = fill(node, values)
        if m and m.group(1) in NUMERIC:
            number = float(out)
            return int(number) if number.is_integer() else number
        return out
    if isinstance(node, dict):
        return {fill(k, values): _fill_tree(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill_tree(v, values) for v in node]
    return node


@dataclass(frozen=True)
class ProcPlan:
    """One process to start: name, argv, extra environment (and variables removed from the inherited
    one), health and metrics URLs, and for a replica its devices."""

    name: str
    argv: list[str]
    env: dict[str, str]
    health: str
    metrics: str | None
    startup_timeout_s: float
    unset: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()


def request_log_path(workdir: str, replica: int) -> str:
    """Where replica ``replica``'s engine writes its per-request log (kvtier's offload spec, ``request_log``)."""
    return str(Path(workdir) / f"replica{replica}.engine-requests.jsonl")


def resolve(
    profile: Profile,
    values: Mapping[str, str],
    replica_ports: list[int],
    replica_devices: list[tuple[list[str], dict[str, str], list[str]]] | None = None,
) -> tuple[ProcPlan | None, list[ProcPlan]]:
    """The sidecar (or None) and one plan per replica, every placeholder filled. ``replica_devices``:
    per replica (devices, variables to set, variables to remove), from launch.devices."""
    base = dict(values)
    if profile.sim_model:
        base["sim_model"] = profile.sim_model
    sidecar = None
    if profile.sidecar is not None:
        s = profile.sidecar
        sidecar = ProcPlan(
            "sidecar",
            [fill_arg(x, base) for x in s.command],
            {},
            fill(s.health, base),
            fill(s.metrics, base) if s.metrics else None,
            s.startup_timeout_s,
        )
    replicas = []
    for i, port in enumerate(replica_ports):
        v = dict(base, port=str(port), replica=str(i), replica_id=f"{values['host']}:{port}")
        v["request_log"] = request_log_path(values.get("workdir", ""), i)
        if profile.kv_transfer_config is not None:  # per replica: its own request log
            ktc = _fill_tree(profile.kv_transfer_config, v)  # ports are numbers in the connector's JSON
            v["kv_transfer_config"] = json.dumps(ktc, separators=(",", ":"))
        r = profile.replica
        devices, dev_env, dev_unset = replica_devices[i] if replica_devices else ([], {}, [])
        replicas.append(
            ProcPlan(
                f"replica{i}",
                [fill_arg(x, v) for x in r.command],
                {**{k: fill(x, v) for k, x in profile.env.items()}, **dev_env},
                fill(r.health, v),
                fill(r.metrics, v) if r.metrics else None,
                r.startup_timeout_s,
                tuple(dev_unset),
                tuple(devices),
            )
        )
    return sidecar, replicas


__all__ = [
    "Profile",
    "ProcessSpec",
    "ProcPlan",
    "load_profiles",
    "pick",
    "resolve",
    "fill",
    "PLACEHOLDERS",
    "request_log_path",
]
