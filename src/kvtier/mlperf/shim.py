"""``kvtier mlperf shim DIR``: a folder that the MLPerf Storage v3.0 tooling runs unchanged, with kvtier inside.

``mlpstorage {open,closed} kvcache run --kvcache-bin-path DIR/kv-cache.py`` runs ``DIR/mlperf_wrapper.py`` on
every MPI rank with ``--config DIR/config.yaml`` (the folder of the file it is given, never the file itself), and
the reference's own ``kv-cache-wrapper.sh`` runs ``python3 kv-cache.py``. So the folder holds:

* ``kv-cache.py``: ``kvtier bench`` with the same argv (under ``__main__`` only: importing it does nothing);
* ``mlperf_wrapper.py``: kvtier's rank launcher (``kvtier.mlperf.wrapper``) with the same argv;
* ``config.yaml``: the reference's settings in the reference's layout (kvtier's defaults are the reference's), with
  the reference's nine models under ``model_configs``.

The two scripts re-execute the Python that kvtier is installed in, whichever Python starts them (mlpstorage starts
the wrapper with its own interpreter).

The scripts run as whoever runs mlpstorage (often root), so nobody else may be able to change them: the folder
is refused when it is a symlink, or when it or a folder above it belongs to another user (not root) or is
writable by its group or others — a parent with the sticky bit (``/tmp``) excepted, since others cannot rename
what is ours there. Files already in the folder are replaced only with ``--force``, the old ones kept as
``NAME.bak``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml

from kvtier.config.tuning import Tuning
from kvtier.errors import ConfigError
from kvtier.modelspec import BUILTIN_MODELS
from kvtier.results.io import atomic_file
from kvtier.unixsock import folder_problem

# The models of the reference's config.yaml (kvtier's catalog holds them with the same geometry, and more).
REFERENCE_MODELS = (
    "tiny-1b",
    "mistral-7b",
    "llama2-7b",
    "llama3.1-8b",
    "llama3.1-70b-instruct",
    "deepseek-v3",
    "qwen3-32b",
    "gpt-oss-120b",
    "gpt-oss-20b",
)

HEADER = """#!{python}
# Written by `kvtier mlperf shim` (kvtier {version}). {what}
# It re-executes the Python kvtier is installed in ({python}), whichever Python starts this file, and does
# nothing when imported.
import os
import sys

PYTHON = {python!r}


def main() -> None:
    os.execv(PYTHON, [PYTHON, {head}, *sys.argv[1:]])


if __name__ == "__main__":
    main()
"""

KV_CACHE_WHAT = (
    "`python3 kv-cache.py ARGS` (the reference's\n"
    "# kv-cache-wrapper.sh, any script of the reference's) runs `kvtier bench ARGS`."
)
WRAPPER_WHAT = (
    "mlpstorage's kvcache benchmark runs\n"
    "# `mpirun ... python mlperf_wrapper.py --rank-output-base ... ARGS` on every rank; this runs kvtier's "
    "rank launcher\n# (kvtier.mlperf.wrapper): one kvtier bench per rank, its result where mlpstorage reads it."
)


def reference_layout(value: Any) -> Any:
    """A dumped setting as the reference's file writes it: ranges as [low, high], whole numbers without '.0'."""
    if isinstance(value, dict):
        if set(value) == {"low", "high"}:
            return [reference_layout(value["low"]), reference_layout(value["high"])]
        return {k: reference_layout(v) for k, v in value.items()}
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def config_text(version: str) -> str:
    settings = reference_layout(Tuning().model_dump(mode="json"))
    # kvtier's default is no cap (what the reference's code does: it never reads these keys); the reference's file
    # sets them, and kvtier gives every key of that file its documented meaning, so a run on this file caps as it.
    settings["sharegpt"].update(max_context_tokens=8192, max_generation_tokens=2048)
    models = {k: dict(BUILTIN_MODELS[k]) for k in REFERENCE_MODELS}
    # The reference's file and code give qwen3-32b 128-wide heads; kvtier's catalog entry of that name keeps the
    # spec table's 5120 / 64 = 80 (modelspec.SPEC_GEOMETRY). This file is the reference's, so its runs use 128.
    models["qwen3-32b"].update(name="Qwen3 32B", head_dim=128)
    for m in models.values():  # the reference's word for the head width, and its explicit dtype
        if "head_dim" in m:
            m["kv_dim_per_head"] = m.pop("head_dim")
        m.setdefault("dtype", "float16")
    settings["model_configs"] = models
    head = (
        f"# Written by `kvtier mlperf shim` (kvtier {version}): the MLPerf Storage v3.0 KV cache reference's\n"
        "# settings in its config.yaml layout (kvtier's defaults are the reference's), and kvtier's own keys beside\n"
        "# them (docs/mlperf.md lists them). mlpstorage passes this file to every rank as --config.\n"
    )
    return head + yaml.safe_dump(settings, sort_keys=False, default_flow_style=None, width=110)


def write_shim(folder: Path, python: str | None = None, force: bool = False) -> list[Path]:
    """Write the three files into ``folder`` (created if missing, mode 0755), refused where another user could change
    them (``folder_problem``) and, unless ``force``, where any of them is already there (``force``: the old ones are
    kept as ``NAME.bak``). Each goes through the atomic writer, so a file or link planted at a name is replaced,
    never written through."""
    from kvtier import __version__

    py = python or sys.executable
    files = {
        "kv-cache.py": (
            HEADER.format(python=py, version=__version__, what=KV_CACHE_WHAT, head='"-m", "kvtier", "bench"'),
            0o755,
        ),
        "mlperf_wrapper.py": (
            HEADER.format(python=py, version=__version__, what=WRAPPER_WHAT, head='"-m", "kvtier.mlperf.wrapper"'),
            0o755,
        ),
        "config.yaml": (config_text(__version__), 0o644),
    }
    if not folder.is_symlink():
        folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    why = folder_problem(folder)
    if why is not None:
        raise ConfigError(f"DIR: {folder}: {why}; its scripts run as whoever runs mlpstorage, so another user could "
                          "run code as them: choose a folder only this user can write")  # fmt: skip
    there = [name for name in files if os.path.lexists(folder / name)]
    if there and not force:
        raise ConfigError(f"DIR: {folder} already holds {', '.join(there)}: give --force to replace them (the old "
                          "ones are kept as NAME.bak)")  # fmt: skip
    for name in there:
        os.replace(folder / name, folder / f"{name}.bak")
    written = []
    for name, (text, perm) in files.items():
        with atomic_file(folder / name, "w", "DIR", perm=perm) as f:
            f.write(text)
        written.append(folder / name)
    return written
