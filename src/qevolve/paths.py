"""Where each stage's artifacts live, relative to the workspace root. dvc.yaml names the same paths."""

from __future__ import annotations

from pathlib import Path

EXPERTS = Path("data/experts")
BASE = Path("models/base")
BC = Path("models/bc")
METRICS = Path("metrics")


def evaluation(iteration: int) -> Path:
    return Path(f"data/evaluate@{iteration}")


def policy(iteration: int) -> Path:
    """The policy evaluated at iteration k (0 = the BC policy)."""
    return BC if iteration == 0 else Path(f"models/policy@{iteration}")


def metrics(stage: str) -> Path:
    return METRICS / f"{stage}.json"
