"""Running the pipeline's steps: typed config + input paths -> output paths + metrics. No Prefect, DVC or
MLflow here. The steps every method shares live in this package (`experts`, `base`, `bc`, `evaluate`);
each method's own in its package under `qevolve.methods`.

`run_stage` wires a step to the workspace paths its recipe names (`qevolve.recipe`), the paths dvc.yaml
declares, so the CLI (what dvc.yaml calls) and the Prefect tasks run exactly the same thing.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from qevolve import paths
from qevolve.config import recorded_reads
from qevolve.lineage import EXECUTION_PATHS
from qevolve.recipe import Stage, UnknownStage, load_recipe

if TYPE_CHECKING:  # not at import: a hierarchical method's package imports this one while `Params` is being built
    from qevolve.params import Params


def stage_name(stage: str, iteration: int | None = None) -> str:
    """The name dvc.yaml, Prefect and MLflow use: `bc`, `evaluate@0`, `critic@2`, ..."""
    return stage if iteration is None else f"{stage}@{iteration}"


def iteration_stages(params: Params, k: int = 1) -> tuple[str, ...]:
    """The stages of iteration k >= 1 for these parameters, in run order: their method's, then `evaluate`."""
    return tuple(s.name for s in load_recipe(params.method).iteration_stages(params) if s.runs_at(k)) + ("evaluate",)


def pipeline(params: Params, iterations: int | None = None) -> list[tuple[str, int | None]]:
    """(stage, iteration) in run order for these parameters' method and `iterations` iterations
    (default: `evolve.iterations`)."""
    n = params.evolve.iterations if iterations is None else iterations
    return [(s.name, k) for s, k in load_recipe(params.method).order(params, n)]


def run_ranks(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run `torchrun` (`cmd`) to its end; it is killed with this process (and each rank with it,
    `qevolve.lock.under_torchrun`), so a SIGKILLed orchestrator leaves no rank behind."""
    from qevolve.lock import die_with_parent

    return subprocess.run(cmd, env=env, preexec_fn=die_with_parent)


def launch_processes(stage: str, params: Params, iteration: int | None, params_file: Path) -> dict:
    """Run a trainer stage in `train.processes` processes (`torchrun --standalone`, this workspace as the
    working directory) and return its metrics. The children inherit this process's workspace lock
    (`QEVOLVE_LOCK_HELD`), and on a CPU share its cores rather than each taking all of them."""
    from qevolve.lock import inherit_env, workspace_lock
    from qevolve.models.device import resolve_device

    n = params.train.processes
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={n}",
        "-m",
        "qevolve.cli",
        "run",
        stage,
        "--params",
        str(params_file),
    ]
    if iteration is not None:
        cmd += ["--iteration", str(iteration)]
    with workspace_lock(params_file.parent, f"stage {stage_name(stage, iteration)} in {n} processes"):
        env = {**os.environ, **inherit_env(params_file.parent)}
        if resolve_device(params.model.device).type == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // n))
        done = run_ranks(cmd, env)
    if done.returncode != 0:
        raise RuntimeError(
            f"{stage_name(stage, iteration)}: the {n} training processes failed (exit {done.returncode}); "
            f"their output is above. Command: {' '.join(cmd)}"
        )
    return json.loads(paths.metrics(stage_name(stage, iteration)).read_text())


def run_stage(
    stage: str, params: Params, iteration: int | None = None, params_file: Path = Path("params.yaml")
) -> dict:
    """Run one stage of the parameters' method in this workspace (the working directory), with the
    paths its recipe names. A trainer stage with `train.processes` > 1 is launched in that many processes
    unless this is one of them already."""
    spec = load_recipe(params.method).stage(stage, params)
    if spec.once and iteration is not None:
        raise UnknownStage(f"stage {stage!r} runs once, without --iteration")
    k = iteration if iteration is not None else 0
    if not spec.once and k < (0 if stage == "evaluate" else 1):
        raise UnknownStage(f"stage {stage!r} needs --iteration K with K >= {0 if stage == 'evaluate' else 1}")
    name = stage_name(stage, None if spec.once else k)
    if spec.trainer and params.train.processes > 1 and "WORLD_SIZE" not in os.environ:
        return launch_processes(stage, params, iteration, params_file)
    kwargs = {**spec.reads(k), **spec.writes(k), "metrics_path": paths.metrics(name)}
    if spec.curve:
        kwargs["curve_path"] = paths.curve(name)
    if spec.details:
        kwargs["details_path"] = paths.details(name)
    if spec.takes_iteration:
        kwargs["iteration"] = k
    function = getattr(importlib.import_module(spec.module), spec.name)
    with recorded_reads(params) as reads:
        metrics = function(params, **kwargs)
    check_reads(name, spec, reads)
    return metrics


class UndeclaredParams(RuntimeError):
    """A stage read params keys its recipe does not list: dvc.yaml would not re-run it when they change."""


def check_reads(name: str, spec: Stage, reads: set[str]) -> None:
    """Raise unless every params key the stage read is covered by its recipe's `params` (a key or one of
    its parents), where it computes aside (`EXECUTION_PATHS`): the params deps in dvc.yaml come from that
    list, so this is what keeps them complete."""

    def covered(key: str) -> bool:
        return any(key == d or key.startswith(d + ".") for d in (*spec.params, *EXECUTION_PATHS))

    missing = sorted(k for k in reads if not covered(k))
    if missing:
        raise UndeclaredParams(
            f"stage {name} read params {missing}, which its recipe does not list (Stage {spec.name!r} in "
            f"{spec.module.rsplit('.', 1)[0]}): dvc.yaml would not re-run it when they change; add them to its params"
        )
