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
from contextlib import contextmanager
from pathlib import Path

from prefect import get_run_logger, task

from qevolve import paths
from qevolve.config import load_params
from qevolve.errors import UserError
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


class RemoteUnreachable(UserError):
    """The DVC remote of scaleout.yaml failed a transfer."""

    hint = ("check `remote` in scaleout.yaml (url, endpointurl) and the remote's credentials in the environment "
            "(AWS_ACCESS_KEY_ID, ...), then rerun: what is missing there is pushed then. Without `remote` the evolution "
            "runs on this machine alone")


@contextmanager
def remote_errors(remote: str, what: str):
    """Any failure of a transfer with the remote as a `RemoteUnreachable` naming it and what was being done."""
    from dvc.stage.cache import RunCacheNotFoundError

    try:
        yield
    except RunCacheNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - botocore, fsspec and DVC raise many kinds for an unreachable remote
        raise RemoteUnreachable(f"{what}: the DVC remote {remote} failed ({type(err).__name__}: {str(err)[:300]}); "
                                "nothing written in this workspace is lost") from err


def restore_from_run_cache(root: Path, name: str, remote: str | None = None) -> bool:
    """Check out the stage's outputs from DVC's run cache and record it in dvc.lock; False if no run
    with the same code, params and input hashes is cached. With `remote` (the default remote's URL),
    its run cache is fetched first and the outputs are pulled from it."""
    from dvc.stage.cache import RunCacheNotFoundError

    with dvc_repo(root) as repo:
        stage = repo.stage.collect(name)[0]
        try:
            with repo.lock:
                if remote:
                    with remote_errors(remote, f"{name}: looking for it in the remote's run cache"):
                        repo.stage_cache.pull(None)
                        repo.stage_cache.restore(stage, pull=True)
                else:
                    repo.stage_cache.restore(stage)
        except RunCacheNotFoundError:
            return False
        repo.commit(name, force=True)
    return True


def push_stage(root: Path, name: str, remote: str) -> None:
    """Push the stage's outputs, its run-cache entry and the objects that entry names (the metrics DVC does
    not cache in the workspace, which `dvc push --run-cache` leaves behind) to the default remote."""
    with dvc_repo(root) as repo, remote_errors(remote, f"{name}: pushing its outputs (kept here, recorded in dvc.lock)"):
        repo.push(targets=[name])
        with repo.lock:
            runs = repo.stage_cache.push(None)
            for objs in repo.stage_cache.get_used_objs(runs).values():
                repo.cloud.push(objs)


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
    remote (`flows.scaleout`), a stage is restored from the remote's run cache when some clone computed it,
    runs on its work pool's worker when it has one, and is pushed to the remote once done."""
    from flows.scaleout import dispatch, load_settings

    root_path = Path(root).resolve()
    name = stage_name(stage, iteration)
    logger = get_run_logger()
    scaleout = load_settings(root_path)
    result = {"stage": name, "ran": False}
    if stage_is_current(root_path, name):
        logger.info("%s is up to date in DVC (same code, params and inputs as dvc.lock): not run", name)
    elif restore_changed_outputs(root_path, name):
        logger.warning("%s: its outputs no longer matched dvc.lock (deleted or damaged); restored the recorded version "
                       "from DVC's cache: not run", name)
    elif restore_from_run_cache(root_path, name):
        logger.info("%s restored from DVC's run cache (a run with the same code, params and inputs): not run", name)
    elif scaleout.remote and restore_from_run_cache(root_path, name, scaleout.remote.url):
        logger.info("%s restored from the remote's run cache (%s): not run", name, scaleout.remote.url)
        return {**result, "metrics": json.loads((root_path / paths.metrics(name)).read_text())}
    elif stage in scaleout.pools:
        pool = scaleout.pools[stage]
        result["flow_run_id"] = dispatch(root_path, stage, iteration, pool, scaleout.remote)
        if not restore_from_run_cache(root_path, name, scaleout.remote.url):
            raise RuntimeError(f"{name} ran on work pool {pool!r}, but the remote {scaleout.remote.url} holds no run of it with this "
                               "workspace's code, params and inputs")
        logger.info("%s computed on work pool %r and restored from the remote's run cache", name, pool)
        result["pool"] = pool
    else:
        result = compute_stage(root_path, stage, iteration)
    if scaleout.remote:
        push_stage(root_path, name, scaleout.remote.url)
    if "metrics" not in result:
        result["metrics"] = json.loads((root_path / paths.metrics(name)).read_text())
    return result
