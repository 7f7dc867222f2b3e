"""The layering (issue 29), checked on the source: no import cycle inside any package or
between packages (imports inside functions and under TYPE_CHECKING count), each package
importing only the packages below it (``LAYERS``: the training library never depends on the
control plane, the product never on its tools), and agent modules small enough to read."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "agent"
MAX_LINES = 500
MAX_SESSION_LINES = 450
# package -> the packages it may import (docs/architecture.md, "Packages")
LAYERS: dict[str, set[str]] = {
    "schemas": set(),                                  # the wire contract
    "plumbing": {"schemas"},                           # bus, logs, telemetry
    "agent": {"schemas", "plumbing"},                  # the training library
    "services": {"schemas", "plumbing"},               # the control plane
    "examples": {"agent", "schemas", "plumbing"},      # training scripts
    "ops": {"schemas", "plumbing", "agent", "services"},  # the operator's tools
    "bench": {"schemas", "plumbing", "agent", "services", "ops", "examples"},
}


def _modules(pkgs: tuple[str, ...] = ("agent",)) -> dict[str, Path]:
    mods = {}
    for pkg in pkgs:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, anywhere in its body, as dotted names."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from . import x` names module x; `from .m import y` names module m
            out.update(f"{mod}.{a.name}" for a in node.names)
            if node.module:
                out.add(mod)
    return out


def _graph(pkgs: tuple[str, ...] = ("agent",)) -> dict[str, set[str]]:
    mods = _modules(pkgs)
    return {n: {i for i in _imports(n, p) if i in mods and i != n and i not in pkgs}
            for n, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

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
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_agent():
    assert _cycles(_graph()) == []


def test_no_import_cycle_in_or_between_packages():
    assert _cycles(_graph(tuple(LAYERS))) == []


def test_each_package_imports_only_the_layers_below_it():
    mods = _modules(tuple(LAYERS))
    bad = []
    for name, path in mods.items():
        pkg = name.split(".")[0]
        for imp in _imports(name, path):
            top = imp.split(".")[0]
            if top in LAYERS and top != pkg and top not in LAYERS[pkg]:
                bad.append(f"{name} imports {imp}")
    assert bad == []


def test_every_import_of_ours_names_a_module_that_exists():
    """A module moved between packages leaves ``from .x import y`` pointing nowhere, which
    only fails when that line runs (a function-level import: at a pod's start)."""
    mods = _modules(tuple(LAYERS))
    bad = []
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    mod = ".".join(base + [node.module])
                else:
                    mod = node.module
            elif isinstance(node, ast.Import):
                mod = node.names[0].name
            else:
                continue
            if mod.split(".")[0] in LAYERS and mod not in mods:
                bad.append(f"{name}:{node.lineno} imports {mod}")
    assert bad == []


def test_no_agent_module_is_over_500_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in _modules().items()}
    assert {n: k for n, k in long.items() if k > MAX_LINES} == {}


def test_session_is_at_most_450_lines():
    assert len((AGENT / "session.py").read_text().splitlines()) <= MAX_SESSION_LINES
