"""Prefect tasks: thin wrappers over the stage functions, with DVC doing the caching.

A task asks DVC whether its stage is up to date (same code, params and input hashes as in dvc.lock and outputs present).
If so it does nothing and returns the recorded metrics. Otherwise, if DVC's run cache holds a run of the stage with the
same code, params and input hashes (here or in any workspace sharing this DVC cache, e.g. the benchmark table's rows),
its outputs are checked out from the cache. Otherwise it runs the stage in-process (timing it: `compute_s`) and records
it with `dvc commit`, so `dvc.lock` always agrees with what the flow produced and `dvc repro` / `dvc status` see the
same state."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prefect import get_run_logger, task

from qevolve import paths
from qevolve.envs.task_images import REGISTRY_ENV
from qevolve.params import load_params
from qevolve.stages import run_stage, stage_name
from tasks.dvc import (
    RemoteUnreachable,
    dvc_repo,
    push_stage,
    remote_errors,
    restore_changed_outputs,
    restore_from_run_cache,
    stage_is_current,
)
from tasks.scaleout import dispatch, load_settings

__all__ = [
    "RemoteUnreachable",
    "compute_stage",
    "dvc_repo",
    "push_stage",
    "remote_errors",
    "restore_changed_outputs",
    "restore_from_run_cache",
    "run_pipeline_stage",
    "stage_is_current",
]


def compute_stage(root: Path, stage: str, iteration: int | None) -> dict:
    """Run the stage here and record it in dvc.lock (and DVC's run cache)."""
    start = time.perf_counter()
    metrics = run_stage(stage, load_params(root / "params.yaml"), iteration)
    compute = time.perf_counter() - start
    with dvc_repo(root) as repo:
        repo.commit(stage_name(stage, iteration), force=True)
    return {"stage": stage_name(stage, iteration), "ran": True, "metrics": metrics, "compute_s": compute}


def _run_name() -> str:
    from prefect.runtime import task_run

    return stage_name(task_run.parameters["stage"], task_run.parameters.get("iteration"))


@task(name="stage", task_run_name=_run_name)
def run_pipeline_stage(stage: str, iteration: int | None = None, root: str = ".") -> dict:
    """Run one stage unless DVC says it is up to date; return its metrics and whether it ran. With a DVC
    remote (`tasks.scaleout`), a stage is restored from the remote's run cache when some clone computed it,
    runs on its work pool's worker when it has one, and is pushed to the remote once done."""
    root_path = Path(root).resolve()
    name = stage_name(stage, iteration)
    logger = get_run_logger()
    scaleout = load_settings(root_path)
    if scaleout.images:  # terminal tasks' images: shared through the registry, never part of a stage's lineage
        os.environ[REGISTRY_ENV] = scaleout.images.registry
    result = {"stage": name, "ran": False}
    if stage_is_current(root_path, name):
        logger.info("%s is up to date in DVC (same code, params and inputs as dvc.lock): not run", name)
    elif restore_changed_outputs(root_path, name):
        logger.warning(
            "%s: its outputs no longer matched dvc.lock (deleted or damaged); restored the recorded version "
            "from DVC's cache: not run",
            name,
        )
    elif restore_from_run_cache(root_path, name):
        logger.info("%s restored from DVC's run cache (a run with the same code, params and inputs): not run", name)
    elif scaleout.remote and restore_from_run_cache(root_path, name, scaleout.remote.url):
        logger.info("%s restored from the remote's run cache (%s): not run", name, scaleout.remote.url)
        return {**result, "metrics": json.loads((root_path / paths.metrics(name)).read_text())}
    elif stage in scaleout.pools:
        pool = scaleout.pools[stage]
        result["flow_run_id"] = dispatch(
            root_path, stage, iteration, pool, scaleout.remote, scaleout.images.registry if scaleout.images else ""
        )
        if not restore_from_run_cache(root_path, name, scaleout.remote.url):
            raise RuntimeError(
                f"{name} ran on work pool {pool!r}, but the remote {scaleout.remote.url} holds no run of it with this "
                "workspace's code, params and inputs"
            )
        logger.info("%s computed on work pool %r and restored from the remote's run cache", name, pool)
        result["pool"] = pool
    else:
        result = compute_stage(root_path, stage, iteration)
    if scaleout.remote:
        push_stage(root_path, name, scaleout.remote.url)
    if "metrics" not in result:
        result["metrics"] = json.loads((root_path / paths.metrics(name)).read_text())
    return result
