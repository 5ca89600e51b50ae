"""The pre-flight engine check against fake engine environments: real packages on disk (dist-info
metadata and modules) whose compiled LMCache module fails to import as it does under a mismatched
torch, probed by a real child interpreter; and the install pins agreeing everywhere they are written."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvtier.launch.engines import KNOWN_GOOD, check_engines, engine_python
from tests.conftest import REPO, kvtier_cmd

UNDEFINED = "undefined symbol: _ZN3c1017RegisterOperatorsD1Ev"


def fake_env(root: Path, vllm: str | None, lmcache: str | None, torch: str, c_ops_imports: bool) -> dict[str, str]:
    """A site folder with the given distributions; PYTHONPATH points the child interpreter at it."""
    site = root / "site"
    site.mkdir(parents=True)
    for name, version in (("vllm", vllm), ("lmcache", lmcache), ("torch", torch)):
        if version is None:
            continue
        dist = site / f"{name}-{version}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(f"__version__ = {version!r}\n")
    if lmcache is not None:
        body = "" if c_ops_imports else f"raise ImportError({UNDEFINED!r})\n"
        (site / "lmcache" / "cuda_ops.py").write_text(body)
    return {**os.environ, "PYTHONPATH": str(site)}


def test_a_compiled_module_that_does_not_import_is_refused(tmp_path: Path):
    env = fake_env(tmp_path, "0.33.0", "0.5.6", "2.14.0", c_ops_imports=False)
    chk = check_engines(needs_lmcache=True, python=sys.executable, environ=env)
    assert (chk.vllm, chk.lmcache, chk.torch) == ("0.33.0", "0.5.6", "2.14.0")
    assert chk.compiled_import == f"ImportError: {UNDEFINED}" and not chk.pinned
    assert not chk.ok and len(chk.problems) == 1 and "lmcache.cuda_ops does not import" in chk.problems[0]
    assert "--allow-fallback" in chk.problems[0] and chk.lines()[-1] == "check: FAILED"
    # the GPU tier runs vLLM alone: LMCache's state does not matter there
    assert check_engines(needs_lmcache=False, python=sys.executable, environ=env).ok


def test_the_known_good_pair_passes(tmp_path: Path):
    env = fake_env(tmp_path, KNOWN_GOOD["vllm"], KNOWN_GOOD["lmcache"], "2.13.0", c_ops_imports=True)
    chk = check_engines(needs_lmcache=True, python=sys.executable, environ=env)
    assert chk.ok and chk.pinned and chk.compiled_import == "ok" and not chk.notes
    assert "lmcache.cuda_ops: imports" in chk.lines()
    assert chk.as_dict()["ok"] is True


def test_missing_engines_are_named(tmp_path: Path):
    env = fake_env(tmp_path, None, None, "2.13.0", c_ops_imports=True)
    chk = check_engines(needs_lmcache=True, python=sys.executable, environ=env)
    assert chk.vllm is None and chk.lmcache is None and chk.compiled_import is None
    assert [p.split(" ")[0] for p in chk.problems] == ["vLLM", "LMCache"]
    broken = check_engines(needs_lmcache=True, python=str(tmp_path / "no-python"), environ=env)
    assert not broken.ok and "cannot probe the engine environment" in broken.problems[0]


def test_the_check_runs_in_the_interpreter_behind_vllm(tmp_path: Path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "vllm"
    script.write_text(f"#!{sys.executable}\nprint('vllm')\n")
    script.chmod(0o755)
    assert engine_python({"PATH": str(bin_dir)}) == sys.executable
    script.write_text("#!/bin/sh\necho vllm\n")  # not a Python launcher: this interpreter
    assert engine_python({"PATH": str(bin_dir)}) == sys.executable
    assert engine_python({"PATH": str(tmp_path / "empty")}) == sys.executable


@pytest.mark.parametrize("allow", [False, True])
def test_launch_check_command(tmp_path: Path, allow: bool):
    env = fake_env(tmp_path, "0.33.0", "0.5.6", "2.14.0", c_ops_imports=False)
    env["PATH"] = str(tmp_path / "nobin") + os.pathsep + env["PATH"]
    argv = ["launch", "--tier", "nvme", "--engine", "vllm", "--check"] + (["--allow-fallback"] if allow else [])
    p = subprocess.run(kvtier_cmd() + argv, capture_output=True, text=True, timeout=120, env=env)
    assert "vllm     0.33.0" in p.stdout and "lmcache.cuda_ops: ImportError" in p.stdout
    assert p.returncode == (0 if allow else 1), p.stdout + p.stderr


def test_the_pins_agree_everywhere():
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["engines"]
    assert sorted(extra) == sorted(f"{k}=={v}" for k, v in KNOWN_GOOD.items())
    script = (REPO / "scripts" / "install-engines.sh").read_text()
    assert re.search(r"^VLLM_VERSION=(\S+)$", script, re.M)[1] == KNOWN_GOOD["vllm"]  # type: ignore[index]
    assert re.search(r"^LMCACHE_VERSION=(\S+)$", script, re.M)[1] == KNOWN_GOOD["lmcache"]  # type: ignore[index]
    dry = subprocess.run(
        ["bash", str(REPO / "scripts" / "install-engines.sh"), "--dry-run", "--venv", "/nonexistent/engines"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0 and f"vllm=={KNOWN_GOOD['vllm']} lmcache=={KNOWN_GOOD['lmcache']}" in dry.stdout
    rocm = subprocess.run(
        ["bash", str(REPO / "scripts" / "install-engines.sh"), "--rocm"], capture_output=True, text=True
    )
    assert rocm.returncode == 0 and "BUILD_WITH_HIP=1" in rocm.stdout


def test_install_engines_checks_with_the_python_kvtier_is_in_and_says_so_when_none_is():
    """#44 item 11: the script checked with .venv/bin/python, which fails where kvtier is installed elsewhere. It now
    takes KVTIER_PYTHON (else .venv, else python3) and, when none imports kvtier, says what to do (exit 4)."""
    engines = REPO / ".engines-cpu" / "bin" / "python"
    if not engines.exists():
        pytest.skip("the CPU build is not installed here (bash scripts/install-engines.sh cpu): nothing to check")
    bare = shutil.which("python3", path="/usr/bin:/bin")
    if bare is None or subprocess.run([bare, "-c", "import kvtier"], capture_output=True).returncode == 0:
        pytest.skip("no python3 without kvtier on this host")
    p = subprocess.run(["bash", str(REPO / "scripts" / "install-engines.sh"), "cpu"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "KVTIER_PYTHON": bare})  # fmt: skip
    assert p.returncode == 4, p.stdout + p.stderr
    assert "no Python here imports kvtier" in p.stderr and "KVTIER_PYTHON" in p.stderr
