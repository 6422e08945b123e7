"""The house's rules (docs/architecture.md), checked from the source: no import cycle between
modules (imports inside functions and under ``TYPE_CHECKING`` counted: a cycle is a cycle),
each package imports only the packages below it (``common`` none of them), and each part of
the gateway only its own layer and those below."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "gateway", "sched_core", "workers")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each module of the packages, and the modules of the packages it imports."""
    modules = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    for pyx in (ROOT / "sched_core").glob("*.pyx"):
        modules[_module(pyx)] = pyx
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        source = path.read_text()
        if path.suffix == ".pyx":  # Cython: read its Python import lines only
            source = "\n".join(line for line in source.splitlines() if line.startswith(("import ", "from ")))
            source = "\n".join(line for line in source.splitlines() if " cimport " not in line)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: up from the module's package
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_round_a_cycle() -> None:
    assert cycles(imports()) == []


#: which package may import which (docs/architecture.md)
ALLOWED = {"common": set(), "sched_core": {"common"}, "workers": {"common"},
           "gateway": {"common", "sched_core", "workers"}}


def test_each_package_imports_only_those_below_it() -> None:
    leaks = {f"{m} -> {t}" for m, ts in imports().items() for t in ts
             if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in ALLOWED[m.split(".")[0]]}
    assert not leaks, sorted(leaks)


#: the gateway's layers, bottom up (docs/architecture.md): its own modules (errors, settings,
#: metrics, Redis glue), the API's vocabulary, tenancy, dispatch, the HTTP app, the commands
GATEWAY_LAYERS = ("", "api", "tenancy", "dispatch", "console", "http", "cli")


def _layer(module: str) -> int:
    parts = module.split(".")
    sub = parts[1] if len(parts) > 1 and parts[1] in GATEWAY_LAYERS else ""
    return GATEWAY_LAYERS.index(sub)


def test_each_part_of_the_gateway_imports_only_its_own_layer_and_those_below() -> None:
    graph = imports()
    assert {m.split(".")[1] for m in graph if m.count(".") >= 2 and m.startswith("gateway.")} <= set(GATEWAY_LAYERS)
    up = {f"{m} -> {t}" for m, ts in graph.items() if m.startswith("gateway.") for t in ts
          if t.startswith("gateway.") and _layer(t) > _layer(m)}
    assert not up, sorted(up)


def test_the_walk_sees_imports_in_functions_and_relative_ones() -> None:
    graph = imports()
    assert "gateway.cli.server" in graph["gateway.cli.main"]  # `serve` imports it inside main()
    assert graph["sched_core"] >= {"sched_core._core", "sched_core.reference"}


def test_no_benchmark_is_named_after_a_product_module() -> None:
    """``bench.policies`` beside ``sched_core.policies`` reads as the one testing the other:
    a benchmark's name says what it measures, not which module it happens to run."""
    product = {p.stem for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py*")} | set(PACKAGES)
    product |= {p.name for pkg in PACKAGES for p in (ROOT / pkg).rglob("*") if p.is_dir()}
    product.discard("__init__")
    clash = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem in product)
    assert not clash, clash


#: The line limit of a product module, and the classes' method limit (docs/architecture.md).
MAX_LINES = 500
MAX_METHODS = 30
#: Past the limits by their nature: the compiled core, its pure-Python twin (tested in
#: lockstep, one method for each of the core's) and its declaration tables.
EXEMPT = {"sched_core/_core.pyx", "sched_core/reference.py", "sched_core/_core.pyi", "sched_core/_fast.pxd",
          "sched_core/_heap.pxd", "sched_core/_idtable.pxd"}

def _product_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*")
                  if p.suffix in (".py", ".pyx", ".pyi", ".pxd") and ".egg-info" not in str(p))


def test_no_product_module_is_longer_than_the_limit() -> None:
    over = {}
    for path in _product_files():
        name = str(path.relative_to(ROOT))
        lines = len(path.read_text().splitlines())
        if name not in EXEMPT and lines > MAX_LINES:
            over[name] = lines
    assert not over, over


def test_no_class_has_more_methods_than_the_limit() -> None:
    over = {}
    for path in _product_files():
        name = str(path.relative_to(ROOT))
        if path.suffix != ".py" or name in EXEMPT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(x, ast.FunctionDef | ast.AsyncFunctionDef) for x in node.body)
                if methods > MAX_METHODS:
                    over[f"{name}:{node.name}"] = methods
    assert not over, over
