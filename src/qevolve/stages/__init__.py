"""Pipeline steps: typed config + input paths -> output paths + metrics. No Prefect, DVC or MLflow here.

`run_stage` wires each step to the workspace paths that dvc.yaml declares, so the CLI (what dvc.yaml
calls) and the Prefect tasks run exactly the same thing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from qevolve import paths
from qevolve.config import Params

STAGES = ("experts", "base", "bc", "evaluate", "collect", "relabel", "critic", "advantage", "policy", "rerank", "online")
SETUP = ("experts", "base", "bc")
"""Run once, before the loop."""
ITERATION = ("collect", "relabel", "critic", "advantage", "policy", "evaluate")
"""Run in this order in every Q-Evolve iteration k >= 1 (`evaluate@0` evaluates the BC policy)."""
TRAINERS = ("bc", "critic", "policy")
"""The stages that `train.processes` > 1 runs data-parallel under torchrun."""


def iteration_stages(params: Params) -> tuple[str, ...]:
    """The stages of iteration k >= 1 for these parameters: Q-Evolve's (with `rerank@k` before
    `evaluate@k` when `rerank.best_of` is set), or the GRPO baseline's `online@k`."""
    if params.evolve.method == "grpo":
        return ("online", "evaluate")
    return ITERATION[:-1] + ("rerank",) * bool(params.rerank.best_of) + ITERATION[-1:]


def stage_name(stage: str, iteration: int | None = None) -> str:
    """The name dvc.yaml, Prefect and MLflow use: `bc`, `evaluate@0`, `critic@2`, ..."""
    return stage if iteration is None else f"{stage}@{iteration}"


def pipeline(iterations: int, stages: tuple[str, ...] = ITERATION) -> list[tuple[str, int | None]]:
    """(stage, iteration) in run order for an evolution of `iterations` iterations of `stages`."""
    return [(s, None) for s in SETUP] + [("evaluate", 0)] + [(s, k) for k in range(1, iterations + 1) for s in stages]


def launch_processes(stage: str, params: Params, iteration: int | None, params_file: Path) -> dict:
    """Run a trainer stage in `train.processes` processes (`torchrun --standalone`, this workspace as the
    working directory) and return its metrics. The children inherit this process's workspace lock
    (`QEVOLVE_LOCK_HELD`), and on a CPU share its cores rather than each taking all of them."""
    from qevolve.lock import inherit_env, workspace_lock
    from qevolve.models.device import resolve_device

    n = params.train.processes
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "qevolve.cli", "run", stage, "--params", str(params_file)]
    if iteration is not None:
        cmd += ["--iteration", str(iteration)]
    with workspace_lock(params_file.parent, f"stage {stage_name(stage, iteration)} in {n} processes"):
        env = {**os.environ, **inherit_env(params_file.parent)}
        if resolve_device(params.model.device).type == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // n))
        done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{stage_name(stage, iteration)}: the {n} training processes failed (exit {done.returncode}); "
                           f"their output is above. Command: {' '.join(cmd)}")
    return json.loads(paths.metrics(stage_name(stage, iteration)).read_text())


def run_stage(stage: str, params: Params, iteration: int | None = None, params_file: Path = Path("params.yaml")) -> dict:
    """Run one stage in this workspace (the working directory). A trainer stage with
    `train.processes` > 1 is launched in that many processes unless this is one of them already."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    if stage in SETUP and iteration is not None:
        raise ValueError(f"stage {stage!r} runs once, without --iteration")
    k = iteration if iteration is not None else 0
    if stage not in SETUP and stage != "evaluate" and k < 1:
        raise ValueError(f"stage {stage!r} needs --iteration K with K >= 1")
    name = stage_name(stage, iteration if stage not in SETUP else None)
    out = paths.metrics(name)
    if stage in TRAINERS and params.train.processes > 1 and "WORLD_SIZE" not in os.environ:
        return launch_processes(stage, params, iteration, params_file)
    if stage == "experts":
        from qevolve.stages.experts import experts

        return experts(params, paths.EXPERTS, out, paths.details(name))
    if stage == "base":
        from qevolve.stages.base import base

        return base(params, paths.EXPERTS, paths.BASE, out)
    if stage == "bc":
        from qevolve.stages.bc import bc

        return bc(params, paths.BASE, paths.EXPERTS, paths.BC, out, paths.curve("bc"))
    method = params.evolve.method
    if stage == "evaluate":
        from qevolve.stages.evaluate import evaluate

        return evaluate(params, paths.BASE, paths.policy(k), paths.evaluation(k), out, k, paths.env_steps_before(k, method))
    if stage == "rerank":
        from qevolve.stages.rerank import rerank

        return rerank(params, paths.BASE, paths.policy(k - 1), paths.critic(k), paths.reranked(k), out, k, paths.env_steps_before(k))
    if stage == "online":
        from qevolve.stages.online import online

        return online(params, paths.BASE, paths.policy(k - 1), paths.policy(k), out, paths.curve(name), k, paths.env_steps_before(k - 1, method))
    if stage == "collect":
        from qevolve.stages.collect import collect

        return collect(params, paths.BASE, paths.policy(k - 1), paths.collected(k), out, k, paths.env_steps_before(k - 1))
    if stage == "relabel":
        from qevolve.stages.relabel import relabel

        return relabel(params, paths.EXPERTS, paths.collected(k), paths.hybrid(k), out)
    if stage == "critic":
        from qevolve.stages.critic import critic

        return critic(params, paths.BASE, paths.policy(k - 1), paths.hybrid(k), paths.critic(k), out, paths.curve(name))
    if stage == "advantage":
        from qevolve.stages.advantage import advantage

        return advantage(params, paths.BASE, paths.critic(k), paths.hybrid(k), paths.advantages(k), out, paths.curve(name))
    from qevolve.stages.policy import policy

    return policy(
        params, paths.BASE, paths.policy(k - 1), paths.BC, paths.hybrid(k), paths.advantages(k), paths.policy(k), out, paths.curve(name)
    )
