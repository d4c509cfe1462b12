"""The house plan (docs/architecture.md), checked on every run: imports run one way, down the floors, with
no circle (function-level and TYPE_CHECKING imports included), and no method imports another's package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = (
    ("qevolve.errors", "qevolve.paths", "qevolve.environments", "qevolve.algos", "qevolve.lock", "qevolve.llm"),
    ("qevolve.config",),
    ("qevolve.data", "qevolve.models", "qevolve.envs"),
    (
        "qevolve.training",
        "qevolve.rollout",
        "qevolve.policy_update",
        "qevolve.hierarchy",
        "qevolve.recipe",
        "qevolve.dvcfile",
        "qevolve.stages",
        "qevolve.summary",
    ),
    ("qevolve.methods",),
    ("qevolve.cli", "tasks"),
    ("flows",),
)
"""Bottom to top: a module may import its own floor's and those below (docs/architecture.md draws them)."""


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package, the Prefect tasks and the flows, by dotted name."""
    found = {}
    for folder, top in ((root / "src" / "qevolve", "qevolve"), (root / "tasks", "tasks"), (root / "flows", "flows")):
        for path in folder.rglob("*.py"):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(mods: dict[str, Path], root: Path = ROOT) -> dict[str, dict[str, str]]:
    """module -> {module it imports: where (file:line)}, from every import statement at any depth."""

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, str] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        [*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])]
                    )
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in filter(None, map(owner, targets)):
                if target != name:
                    edges.setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
        graph[name] = edges
    return graph


def floor(module: str) -> int:
    for i, names in enumerate(FLOORS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{module} is on no floor: add it to FLOORS here and to docs/architecture.md")


def upward(graph: dict[str, dict[str, str]]) -> list[str]:
    return sorted(
        f"{where}: {a} (floor {floor(a)}) imports {b} (floor {floor(b)})"
        for a, edges in graph.items()
        for b, where in edges.items()
        if floor(b) > floor(a)
    )


def circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The import cycles: each strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph: dict[str, dict[str, str]], component: list[str]) -> str:
    return "; ".join(f"{a} -> {b} ({graph[a][b]})" for a in component for b in graph[a] if b in component)


def method_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["qevolve", "methods"] and len(parts) > 2 else None


def test_imports_run_down_the_floors():
    assert upward(imports(modules())) == []


def test_there_is_no_import_circle():
    graph = imports(modules())
    assert [describe(graph, c) for c in circles(graph)] == []


def test_no_method_imports_another_methods_package():
    graph = imports(modules())
    crossing = sorted(
        f"{where}: {a} imports {b}"
        for a, edges in graph.items()
        for b, where in edges.items()
        if method_of(a) and method_of(b) and method_of(a) != method_of(b)
    )
    assert crossing == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """Each check names the offending import in a small tree built to break it (so none can pass by finding nothing)."""
    for rel, text in {
        "src/qevolve/__init__.py": "",
        "src/qevolve/config.py": "def f():\n    from qevolve.models import base\n",
        "src/qevolve/models/__init__.py": "",
        "src/qevolve/models/base.py": "from qevolve import config\n",
        "src/qevolve/methods/__init__.py": "",
        "src/qevolve/methods/a/__init__.py": "from qevolve.methods.b import x\n",
        "src/qevolve/methods/b/__init__.py": "x = 1\n",
        "tasks/__init__.py": "",
        "flows/__init__.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = imports(modules(tmp_path), tmp_path)
    assert upward(graph) == ["src/qevolve/config.py:2: qevolve.config (floor 1) imports qevolve.models.base (floor 2)"]
    assert [describe(graph, c) for c in circles(graph)] == [
        "qevolve.config -> qevolve.models.base (src/qevolve/config.py:2); qevolve.models.base -> qevolve.config "
        "(src/qevolve/models/base.py:1)"
    ]
    assert graph["qevolve.methods.a"] == {"qevolve.methods.b": "src/qevolve/methods/a/__init__.py:1"}
    with pytest.raises(AssertionError, match="on no floor"):
        floor("qevolve.nowhere")
