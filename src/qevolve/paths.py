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


def collected(iteration: int) -> Path:
    return Path(f"data/collect@{iteration}")


def hybrid(iteration: int) -> Path:
    return Path(f"data/relabel@{iteration}")


def reranked(iteration: int) -> Path:
    return Path(f"data/rerank@{iteration}")


def critic(iteration: int) -> Path:
    return Path(f"models/critic@{iteration}")


def advantages(iteration: int) -> Path:
    return Path(f"data/advantage@{iteration}")


def metrics(stage: str) -> Path:
    return METRICS / f"{stage}.json"


def details(stage: str) -> Path:
    """Per-item details of a stage (e.g. each failed demonstration), kept out of its metrics file so that
    `dvc metrics show` and `dvc exp show` get only numbers to compare across experiments."""
    return METRICS / f"{stage}_details.json"


def curve(stage: str) -> Path:
    """Per-step training curve (or, for `advantage@k`, the histogram) of a stage, a DVC plot."""
    return METRICS / f"{stage}_curve.json"
