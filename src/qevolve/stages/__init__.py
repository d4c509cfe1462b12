"""Pipeline steps: typed config + input paths -> output paths + metrics. No Prefect, DVC or MLflow here.

`run_stage` wires each step to the workspace paths that dvc.yaml declares, so the CLI (what dvc.yaml
calls) and the Prefect tasks run exactly the same thing.
"""

from __future__ import annotations

from qevolve import paths
from qevolve.config import Params

STAGES = ("experts", "base", "bc", "evaluate")


def stage_name(stage: str, iteration: int | None = None) -> str:
    """The name dvc.yaml, Prefect and MLflow use: `bc`, `evaluate@0`, ..."""
    return stage if iteration is None else f"{stage}@{iteration}"


def run_stage(stage: str, params: Params, iteration: int | None = None) -> dict:
    if stage == "experts":
        from qevolve.stages.experts import experts

        return experts(params, paths.EXPERTS, paths.metrics("experts"))
    if stage == "base":
        from qevolve.stages.base import base

        return base(params, paths.EXPERTS, paths.BASE, paths.metrics("base"))
    if stage == "bc":
        from qevolve.stages.bc import bc

        return bc(params, paths.BASE, paths.EXPERTS, paths.BC, paths.metrics("bc"), paths.METRICS / "bc_curve.json")
    if stage == "evaluate":
        from qevolve.stages.evaluate import evaluate

        k = iteration or 0
        return evaluate(params, paths.BASE, paths.policy(k), paths.evaluation(k), paths.metrics(stage_name("evaluate", k)), k)
    raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
