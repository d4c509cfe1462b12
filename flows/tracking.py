"""MLflow logging for an evolution, read from the stages' metrics files.

Stages never log themselves: a stage that DVC skips does not run, so the flow logs what each stage
recorded, whether it ran now or earlier.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow

from qevolve import paths
from qevolve.config import Params
from qevolve.data.store import read_store

SAMPLE_TRAJECTORIES = 4


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def start_evolution(params: Params, run_name: str):
    mlflow.set_experiment(params.mlflow.experiment)
    run = mlflow.start_run(run_name=run_name)
    mlflow.log_params({k: str(v)[:500] for k, v in flatten(params.model_dump()).items()})
    return run


def render_trajectories(store: Path, limit: int = SAMPLE_TRAJECTORIES) -> str:
    """A few trajectories as readable markdown: instruction, then each action and what followed."""
    lines = []
    for t in read_store(store)[:limit]:
        lines += [f"## {t.task_id} ({t.split}, {t.source}) — {'won' if t.won else 'lost: ' + t.failure}", f"**Task:** {t.instruction}", ""]
        lines.append(f"> {t.steps[0].observation}" if t.steps else "")
        for s in t.steps:
            flag = "" if s.valid else "  *(rejected)*"
            lines += [f"{s.step + 1}. `{s.output}`{flag} (logp {s.logp:.2f})", f"   > {s.next_observation}"]
        lines.append("")
    return "\n".join(lines)


def log_stage(result: dict) -> None:
    """Metrics (numbers only) under the stage's name, plus its artifacts."""
    name = result["stage"]
    stage, _, iteration = name.partition("@")
    step = int(iteration or 0)
    numbers = {k: v for k, v in flatten(result["metrics"]).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    mlflow.log_metrics({f"{stage}/{k}".replace(".", "/"): float(v) for k, v in numbers.items()}, step=step)
    if stage == "experts":
        mlflow.log_text(render_trajectories(paths.EXPERTS), "trajectories/experts.md")
    elif stage == "bc":
        curve = json.loads((paths.METRICS / "bc_curve.json").read_text())
        for point in curve:
            mlflow.log_metric("bc/train_loss", point["loss"], step=point["step"])
        mlflow.log_artifacts(str(paths.BC), "bc_adapter")
    elif stage == "evaluate":
        mlflow.log_text(render_trajectories(paths.evaluation(step)), f"trajectories/{name}.md")
