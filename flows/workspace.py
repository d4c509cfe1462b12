"""A workspace of an evolution: preparing one (the code, params.yaml, a DVC repository) and reading the env
steps its metrics count. Used by the evolution flow (`--workspace`, `--profile`) and the benchmark table."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from qevolve.data.atomic import atomic_path
from qevolve.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent


def get_dotted(params: dict, key: str):
    for part in key.split("."):
        params = params[part]
    return params


def set_dotted(params: dict, key: str, value) -> None:
    *path, last = key.split(".")
    node = params
    for part in path:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = copy.deepcopy(value)  # the spec's own values are never changed by later keys


def prepare(root: Path, params: dict, cache: Path | None = None) -> None:
    """A workspace: the stages' code (identical everywhere, so the run cache matches across workspaces),
    params.yaml, and a DVC repository whose cache is `cache` (the table's; its own without one)."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root / "src", ignore_errors=True)  # a file deleted from the checkout goes from the copy too
    shutil.copytree(ROOT / "src", root / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    text = yaml.safe_dump(params, sort_keys=False)
    if not (root / "params.yaml").exists() or (root / "params.yaml").read_text() != text:
        with atomic_path(root / "params.yaml") as tmp:
            tmp.write_text(text)
    if not (root / ".dvc").exists():
        subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
        if cache is not None:
            subprocess.run([sys.executable, "-m", "dvc", "cache", "dir", str(cache)], cwd=root, check=True)


def read_metrics(root: Path, stage: str) -> dict:
    return json.loads((root / "metrics" / f"{stage}.json").read_text())


def demonstration_steps(root: Path) -> int:
    """Env steps the workspace's demonstrations took: the experts' (TerminalTraj's: its teacher's)."""
    return read_metrics(root, load_recipe(method_of(root)).demonstrations)["cumulative_env_steps"]


def own_env_steps(root: Path, cumulative: int) -> int:
    """Env steps of the workspace's own rollouts in a cumulative count (the demonstrations' steps taken off)."""
    return cumulative - demonstration_steps(root)


def spent_env_steps(root: Path, iterations: int) -> int:
    """Env steps the workspace's own rollouts took in its first `iterations` iterations."""
    return own_env_steps(root, json.loads(steps_file(root, iterations).read_text())["cumulative_env_steps"])


def steps_file(root: Path, k: int) -> Path:
    """The metrics file whose `cumulative_env_steps` counts what policy k cost (`Recipe.steps_before`)."""
    return root / load_recipe(method_of(root)).steps_before(k)


def method_of(root: Path) -> str:
    return yaml.safe_load((root / "params.yaml").read_text()).get("method", "qevolve")
