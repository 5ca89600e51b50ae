"""The shape of the code (#29), from the source alone: lines per package, modules over the house limit of
600 lines, the longest functions, package import cycles (module-level and counting imports inside
functions), file import cycles inside a package (any import, a type-only one under TYPE_CHECKING too: two files
that need each other are one file cut in two, or want a third they both import), who imports the presentation
floor (``report/``), and string-key subscripts on result dicts
outside ``results/`` (``r["summary"]``-style reads of a result that has a typed model).

``--src DIR`` measures another checkout (a before/after pair in one run). Last line:
``architecture modules_over_600=… longest_function=… package_cycles=… file_cycles=… report_importers=…
result_key_subscripts=… cli_add_argument=… plan_add_argument=… plan_answers_without_envelope=… fmt_skip=…``, then
(#54, "one of each"), last: ``one_of_each tier_kind_files=… popen_sites=… mpirun_builders=… mlperf_key_subscripts=…
duplicate_class_names=… report_runner_imports=… src_lines=…`` — the source files that name the newest tier kind (CXL:
its quoted name, its flags, its class), the calls that start a child process (``subprocess.Popen``/``run``), the
places an ``mpirun`` command line is built (its ``-np``), string-key reads (``x["key"]``, ``x.get("key")``) in
``mlperf/``, top-level class names defined twice, imports of a runner package (anything but results/, config/ and the
ground floor) by ``report/``, and the lines of ``src/kvtier``.
"""

from __future__ import annotations

import argparse
import ast
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO

LIMIT = 600
RESULT_KEYS = frozenset(
    ("summary", "cache_stats", "qos_metrics", "totals", "ranks", "process_io", "tier_usage_at_end", "storage_health")
)
"""Keys of result sections: a read ``r["summary"]`` of one outside results/ bypasses the typed model."""


def result_key_reads(tree: ast.AST) -> int:
    """Subscripts that *read* a result section's key (``x["summary"]``; not a write ``out["summary"] = …``, not a
    list literal, not a model's own ``model_fields["summary"]``)."""
    n = 0
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and isinstance(node.slice, ast.Constant)
            and node.slice.value in RESULT_KEYS
            and not (isinstance(node.value, ast.Attribute) and node.value.attr == "model_fields")
        ):
            n += 1
    return n


NEWEST_KIND = ('"cxl"', "'cxl'", "cxl_path", "cxl_mem_gb", "CxlTier")
RUNNERS = frozenset({"bench", "launch", "mlperf", "replay", "sim", "ladder", "plan", "iotrace", "vllm", "cli"})


def one_of_each(root: Path) -> dict[str, int]:
    """#54's figures: how many places do what one place should."""
    kind_files = popen = mpirun = mlperf_keys = runner_imports = src_lines = 0
    classes: collections.Counter[str] = collections.Counter()
    for f in sorted(root.rglob("*.py")):
        text = f.read_text()
        src_lines += text.count("\n")
        rel = f.relative_to(root)
        kind_files += any(k in text for k in NEWEST_KIND)
        tree = ast.parse(text)
        classes.update(n.name for n in tree.body if isinstance(n, ast.ClassDef))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if isinstance(owner, ast.Name) and owner.id == "subprocess" and node.func.attr in ("Popen", "run"):
                    popen += 1
                if rel.parts[0] == "mlperf" and node.func.attr == "get" and node.args:
                    mlperf_keys += isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
            if isinstance(node, ast.Constant) and node.value == "-np":
                mpirun += 1
            if rel.parts[0] == "mlperf" and isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                mlperf_keys += isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)
            if rel.parts[0] == "report" and isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                runner_imports += sum(1 for n in names if n.startswith("kvtier.") and n.split(".")[1] in RUNNERS)
    return {
        "tier_kind_files": kind_files,
        "popen_sites": popen,
        "mpirun_builders": mpirun,
        "mlperf_key_subscripts": mlperf_keys,
        "duplicate_class_names": sum(1 for n in classes.values() if n > 1),
        "report_runner_imports": runner_imports,
        "src_lines": src_lines,
    }


def package_of(root: Path, f: Path) -> str:
    rel = f.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(n: str) -> None:
        index[n] = low[n] = len(index)
        stack.append(n)
        for m in graph.get(n, ()):
            if m not in index:
                visit(m)
                low[n] = min(low[n], low[m])
            elif m in stack:
                low[n] = min(low[n], index[m])
        if low[n] == index[n]:
            comp = []
            while True:
                m = stack.pop()
                comp.append(m)
                if m == n:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for n in list(graph):
        if n not in index:
            visit(n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=str(REPO / "src"), help="the src/ folder of the checkout to measure")
    a = ap.parse_args()
    root = Path(a.src) / "kvtier"
    lines: collections.Counter[str] = collections.Counter()
    over, funcs, subscripts = [], [], 0
    top: dict[str, set[str]] = collections.defaultdict(set)
    every: dict[str, set[str]] = collections.defaultdict(set)
    report_importers: set[str] = set()
    files: dict[str, set[str]] = collections.defaultdict(set)  # module -> modules of the same package it imports
    modules = {".".join(f.relative_to(root).with_suffix("").parts) for f in root.rglob("*.py")}
    for f in sorted(root.rglob("*.py")):
        text = f.read_text()
        n = text.count("\n")
        pkg = package_of(root, f)
        lines[pkg] += n
        rel = str(f.relative_to(root))
        if n > LIMIT:
            over.append(f"{rel} {n}")
        tree = ast.parse(text)
        if pkg != "results":
            subscripts += result_key_reads(tree)
        body = {id(x) for x in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))  # type: ignore[operator]
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvtier."):
                dst = node.module.split(".")[1]
                if dst == pkg:
                    me = ".".join(f.relative_to(root).with_suffix("").parts)
                    target = node.module.removeprefix("kvtier.")
                    named = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                    for m in named or ([target] if target in modules else []):
                        if m != me:
                            files[me].add(m)
                    continue
                every[pkg].add(dst)
                if id(node) in body:
                    top[pkg].add(dst)
                if dst == "report":
                    report_importers.add(pkg)
    print("lines per package: " + ", ".join(f"{k} {v}" for k, v in sorted(lines.items(), key=lambda kv: -kv[1])))
    print(f"modules over {LIMIT} lines: {', '.join(over) or 'none'}")
    funcs.sort(reverse=True)
    print("longest functions: " + ", ".join(f"{name} {n}" for n, name in funcs[:8]))
    cyc_top, cyc_all = sccs(top), sccs(every)
    print(f"package cycles: module-level {cyc_top or 'none'}; with imports inside functions {cyc_all or 'none'}")
    file_cycles = sccs(files)
    print(f"file cycles inside a package: {file_cycles or 'none'}")
    others = sorted(report_importers - {"cli"})
    print(f"packages importing report/ (the presentation floor) besides cli: {others or 'none'}")
    print(f"string-key subscripts on result sections outside results/: {subscripts}")
    cli = root / "cli"
    add_argument = {f.name: f.read_text().count(".add_argument(") for f in sorted(cli.glob("*.py"))}
    print("add_argument calls in cli/: " + ", ".join(f"{k} {v}" for k, v in add_argument.items() if v))
    plan_cli = "".join(f.read_text() for f in sorted(cli.glob("plan*.py")))
    # the answering subcommands: the table's rows, or (an older checkout) its parsers but sweep's
    plan_rows = plan_cli.count("    Sub(") or max(0, len(re.findall(r"\.add_parser\(\s*\"(?!plan\b)", plan_cli)) - 1)
    results_plan = root / "results" / "plan.py"
    envelopes = (
        re.findall(r"^class Plan\w+Result\(Envelope\)", results_plan.read_text(), re.M) if results_plan.exists() else []
    )
    plan_envelopes = len(envelopes)
    fmt_skip = sum(f.read_text().count("fmt: skip") for f in root.rglob("*.py"))
    print(f"plan answers: {plan_rows}, with a result envelope: {plan_envelopes}; '# fmt: skip' in src: {fmt_skip}")
    print(
        f"architecture modules_over_600={len(over)} longest_function={funcs[0][0]} "
        f"package_cycles={len(cyc_all)} file_cycles={len(file_cycles)} report_importers={len(others)} "
        f"result_key_subscripts={subscripts} cli_add_argument={sum(add_argument.values())} "
        f"plan_add_argument={sum(v for k, v in add_argument.items() if k.startswith('plan'))} "
        f"plan_answers_without_envelope={max(0, plan_rows - plan_envelopes)} fmt_skip={fmt_skip}"
    )
    print("one_of_each " + " ".join(f"{k}={v}" for k, v in one_of_each(root).items()))


if __name__ == "__main__":
    main()
