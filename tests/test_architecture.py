"""The house plan (docs/architecture.md), checked on every run: a room (a module or package of `FLOORS`, each method its
own) imports only rooms on floors below its own, with no circle inside a room either (function-level and TYPE_CHECKING
imports included). A module named in a literal string counts as imported: `load_recipe("qevolve")`,
`importlib.import_module("qevolve.methods.x.config")`, `adapter("alfworld")`. No method reaches another's package
unless it declares that it builds on it with `qevolve.recipe.build_on`. A name that comes from the parameters
(`load_recipe(params.method)`) is the plug-in point, not an arrow."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = (
    ("qevolve", "qevolve.errors", "qevolve.paths", "qevolve.environments", "qevolve.algos"),
    ("qevolve.config", "qevolve.data", "qevolve.llm", "qevolve.lock", "qevolve.summary"),
    ("qevolve.envs", "qevolve.params", "qevolve.lineage"),
    ("qevolve.models", "qevolve.recipe"),
    ("qevolve.dvcfile", "qevolve.training", "qevolve.rollout", "qevolve.hierarchy"),
    ("qevolve.policy_update",),
    ("qevolve.stages",),
    ("qevolve.stages.hierarchical",),
    ("qevolve.methods",),
    ("qevolve.cli", "tasks"),
    ("flows",),
)
"""Bottom to top. A room imports only rooms on lower floors; rooms on one floor do not import each other."""
NAMED = {"load_recipe": "qevolve.methods.{}", "build_on": "qevolve.methods.{}", "import_module": "{}", "adapter": None}
"""Calls whose literal string argument names a module (`adapter`'s names an environment: its module is in
`ENVIRONMENTS`)."""


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package, the Prefect tasks and the flows, by dotted name."""
    found = {}
    for folder, top in ((root / "src" / "qevolve", "qevolve"), (root / "tasks", "tasks"), (root / "flows", "flows")):
        for path in folder.rglob("*.py"):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _named(node: ast.Call) -> tuple[str, str] | None:
    """(the module a call names in a literal string, the function) for the calls of `NAMED`."""
    func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    if func not in NAMED or not node.args:
        return None
    arg = node.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return None
    if func == "adapter":
        from qevolve.environments import ENVIRONMENTS

        return (ENVIRONMENTS[arg.value].module if arg.value in ENVIRONMENTS else f"qevolve.envs.{arg.value}"), func
    return NAMED[func].format(arg.value), func


def imports(mods: dict[str, Path], root: Path = ROOT) -> tuple[dict[str, dict[str, str]], set[tuple[str, str]]]:
    """module -> {module it imports: where (file:line)}, from every import statement at any depth and every call of
    `NAMED` with a literal name; and the (module, method package) pairs that `build_on` declares."""

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, str]] = {}
    declared: set[tuple[str, str]] = set()
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
            elif isinstance(node, ast.Call) and (named := _named(node)):
                targets = [named[0]]
                if named[1] == "build_on" and owner(named[0]):
                    declared.add((name, owner(named[0])))
            else:
                continue
            for target in filter(None, map(owner, targets)):
                if target != name:
                    edges.setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
        graph[name] = edges
    return graph, declared


def room(module: str) -> tuple[int, str]:
    """(floor, room) of a module: the longest name of `FLOORS` it is or lies in; each method is a room of its own."""
    best = None
    for i, names in enumerate(FLOORS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and (best is None or len(n) > len(best[1])):
                best = (i, n)
    if best is None or best[1] == "qevolve" and module != "qevolve":
        raise AssertionError(f"{module} is on no floor: add it to FLOORS here and to docs/architecture.md")
    if best[1] == "qevolve.methods" and module.count(".") >= 2:
        return best[0], ".".join(module.split(".")[:3])
    return best


def wrong_way(graph: dict[str, dict[str, str]], declared: set[tuple[str, str]]) -> list[str]:
    """Each import of a room on the same floor or above, except what `build_on` declares."""
    found = []
    for a, edges in graph.items():
        (fa, ra) = room(a)
        for b, where in edges.items():
            (fb, rb) = room(b)
            if ra != rb and fb >= fa and not any(m == a and b.startswith(d) for m, d in declared):
                found.append(f"{where}: {a} ({ra}, floor {fa}) imports {b} ({rb}, floor {fb})")
    return sorted(found)


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


def test_imports_run_down_the_floors_and_no_method_reaches_another_undeclared():
    assert wrong_way(*imports(modules())) == []


def test_there_is_no_import_circle():
    graph, _ = imports(modules())
    assert [describe(graph, c) for c in circles(graph)] == []


def test_what_builds_on_what_is_declared_once():
    """TerminalTraj runs Q-Evolve's iterations: its package says so with `build_on`, the only arrow between methods."""
    _, declared = imports(modules())
    assert {(room(a)[1], b) for a, b in declared} == {("qevolve.methods.terminaltraj", "qevolve.methods.qevolve")}


def test_the_checks_find_what_they_look_for(tmp_path):
    """Each kind of violation, injected into a small tree, is named with its file and line (so no check can pass by
    finding nothing), and the declared way is let through."""
    tree = {
        "src/qevolve/__init__.py": "",
        "src/qevolve/config.py": "def f():\n    from qevolve.models import base\n",
        "src/qevolve/models/__init__.py": "",
        "src/qevolve/models/base.py": "from qevolve import config\n",
        "src/qevolve/recipe.py": "def g():\n    from qevolve import training\n",
        "src/qevolve/training.py": "from qevolve import rollout\n",
        "src/qevolve/rollout.py": "",
        "src/qevolve/hierarchy/__init__.py": "",
        "src/qevolve/hierarchy/agent.py": "from qevolve.stages import bc\n",
        "src/qevolve/stages/__init__.py": "",
        "src/qevolve/stages/bc.py": "",
        "src/qevolve/envs/__init__.py": "",
        "src/qevolve/envs/alfworld.py": "",
        "src/qevolve/lock.py": "from qevolve.environments import adapter\nadapter('alfworld')\n",
        "src/qevolve/methods/__init__.py": "",
        "src/qevolve/methods/a/__init__.py": "from qevolve.methods.b import x\n",
        "src/qevolve/methods/b/__init__.py": "x = 1\n",
        "src/qevolve/methods/multi2/__init__.py": "import importlib\n"
        "importlib.import_module('qevolve.methods.step_hrl.config')\n",
        "src/qevolve/methods/step_hrl/__init__.py": "",
        "src/qevolve/methods/step_hrl/config.py": "",
        "src/qevolve/methods/c/__init__.py": "from qevolve.recipe import load_recipe\nR = load_recipe('b')\n",
        "src/qevolve/methods/d/__init__.py": "from qevolve.recipe import build_on\nR = build_on('b')\nfrom "
        "qevolve.methods.b import x\n",
        "src/qevolve/methods/e/__init__.py": "from qevolve.recipe import load_recipe\ndef f(params):\n    return "
        "load_recipe(params.method)\n",
        "tasks/__init__.py": "",
        "flows/__init__.py": "",
    }
    for rel, text in tree.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph, declared = imports(modules(tmp_path), tmp_path)
    assert wrong_way(graph, declared) == [
        "src/qevolve/config.py:2: qevolve.config (qevolve.config, floor 1) imports qevolve.models.base "
        "(qevolve.models, floor 3)",
        "src/qevolve/hierarchy/agent.py:1: qevolve.hierarchy.agent (qevolve.hierarchy, floor 4) imports "
        "qevolve.stages.bc "
        "(qevolve.stages, floor 6)",
        "src/qevolve/lock.py:2: qevolve.lock (qevolve.lock, floor 1) imports qevolve.envs.alfworld (qevolve.envs, "
        "floor 2)",
        "src/qevolve/methods/a/__init__.py:1: qevolve.methods.a (qevolve.methods.a, floor 8) imports qevolve.methods.b "
        "(qevolve.methods.b, floor 8)",
        "src/qevolve/methods/c/__init__.py:2: qevolve.methods.c (qevolve.methods.c, floor 8) imports qevolve.methods.b "
        "(qevolve.methods.b, floor 8)",
        "src/qevolve/methods/multi2/__init__.py:2: qevolve.methods.multi2 (qevolve.methods.multi2, floor 8) imports "
        "qevolve.methods.step_hrl.config (qevolve.methods.step_hrl, floor 8)",
        "src/qevolve/recipe.py:2: qevolve.recipe (qevolve.recipe, floor 3) imports qevolve.training "
        "(qevolve.training, floor 4)",
        "src/qevolve/training.py:1: qevolve.training (qevolve.training, floor 4) imports qevolve.rollout "
        "(qevolve.rollout, floor 4)",
    ]
    assert declared == {("qevolve.methods.d", "qevolve.methods.b")}  # d's import of b is let through
    # a name that comes from the parameters is the plug-in point, no arrow
    assert graph["qevolve.methods.e"] == {"qevolve.recipe": "src/qevolve/methods/e/__init__.py:1"}
    assert [describe(graph, c) for c in circles(graph)] == [
        "qevolve.config -> qevolve.models.base (src/qevolve/config.py:2); "
        "qevolve.models.base -> qevolve.config (src/qevolve/models/base.py:1)"
    ]
    with pytest.raises(AssertionError, match="on no floor"):
        room("qevolve.nowhere")
