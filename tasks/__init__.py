"""Prefect tasks: thin wrappers over the stage functions, with DVC doing the caching.

A task asks DVC whether its stage is up to date (same code, params and input hashes as in dvc.lock and
outputs present). If so it does nothing and returns the recorded metrics. Otherwise, if DVC's run cache
holds a run of the stage with the same code, params and input hashes (here or in any workspace sharing
this DVC cache, e.g. the benchmark table's rows), its outputs are checked out from the cache. Otherwise
it runs the stage in-process (timing it: `compute_s`) and records it with `dvc commit`, so `dvc.lock` always agrees with what the flow produced
and `dvc repro` / `dvc status` see the same state.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import get_run_logger, task

from qevolve import paths
from qevolve.config import load_params
from qevolve.stages import run_stage, stage_name


def dvc_repo(root: Path):
    from dvc.repo import Repo

    return Repo(str(root))


def stage_is_current(root: Path, name: str) -> bool:
    with dvc_repo(root) as repo:
        return not repo.status(targets=[name])


def restore_changed_outputs(root: Path, name: str) -> bool:
    """When only the stage's outputs changed since dvc.lock (deleted, edited, damaged) and DVC's cache holds
    the recorded version, check that version out; True if the stage is then up to date."""
    with dvc_repo(root) as repo:
        entries = repo.status(targets=[name]).get(name, [])
        if not entries or any(not isinstance(e, dict) or set(e) != {"changed outs"} for e in entries):
            return False
        try:
            repo.checkout(targets=[name], force=True)
        except Exception:  # noqa: BLE001 - DVC raises several kinds when its cache lacks the version
            return False
        return not repo.status(targets=[name])


def restore_from_run_cache(root: Path, name: str) -> bool:
    """Check out the stage's outputs from DVC's run cache and record it in dvc.lock; False if no run
    with the same code, params and input hashes is cached."""
    from dvc.stage.cache import RunCacheNotFoundError

    with dvc_repo(root) as repo:
        stage = repo.stage.collect(name)[0]
        try:
            with repo.lock:
                repo.stage_cache.restore(stage)
        except RunCacheNotFoundError:
            return False
        repo.commit(name, force=True)
    return True


def _run_name() -> str:
    from prefect.runtime import task_run

    return stage_name(task_run.parameters["stage"], task_run.parameters.get("iteration"))


@task(name="stage", task_run_name=_run_name)
def run_pipeline_stage(stage: str, iteration: int | None = None, root: str = ".") -> dict:
    """Run one stage unless DVC says it is up to date; return its metrics and whether it ran."""
    root_path = Path(root).resolve()
    name = stage_name(stage, iteration)
    logger = get_run_logger()
    if stage_is_current(root_path, name):
        logger.info("%s is up to date in DVC (same code, params and inputs as dvc.lock): not run", name)
        return {"stage": name, "ran": False, "metrics": json.loads((root_path / paths.metrics(name)).read_text())}
    if restore_changed_outputs(root_path, name):
        logger.warning("%s: its outputs no longer matched dvc.lock (deleted or damaged); restored the recorded version "
                       "from DVC's cache: not run", name)
        return {"stage": name, "ran": False, "metrics": json.loads((root_path / paths.metrics(name)).read_text())}
    if restore_from_run_cache(root_path, name):
        logger.info("%s restored from DVC's run cache (a run with the same code, params and inputs): not run", name)
        return {"stage": name, "ran": False, "metrics": json.loads((root_path / paths.metrics(name)).read_text())}
    start = time.perf_counter()
    metrics = run_stage(stage, load_params(root_path / "params.yaml"), iteration)
    compute = time.perf_counter() - start
    with dvc_repo(root_path) as repo:
        repo.commit(name, force=True)
    return {"stage": name, "ran": True, "metrics": metrics, "compute_s": compute}
