"""What the Prefect tasks ask of DVC: whether a stage is up to date, restoring it from DVC's cache or run
cache (here or on the remote of scaleout.yaml), and pushing it to that remote."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from qevolve.errors import UserError


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

    hint = (
        "check `remote` in scaleout.yaml (url, endpointurl) and the remote's credentials in the environment "
        "(AWS_ACCESS_KEY_ID, ...), then rerun: what is missing there is pushed then. Without `remote` the evolution "
        "runs on this machine alone"
    )


@contextmanager
def remote_errors(remote: str, what: str):
    """Any failure of a transfer with the remote as a `RemoteUnreachable` naming it and what was being done."""
    from dvc.stage.cache import RunCacheNotFoundError

    try:
        yield
    except RunCacheNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - botocore, fsspec and DVC raise many kinds for an unreachable remote
        raise RemoteUnreachable(
            f"{what}: the DVC remote {remote} failed ({type(err).__name__}: {str(err)[:300]}); "
            "nothing written in this workspace is lost"
        ) from err


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
    with (
        dvc_repo(root) as repo,
        remote_errors(remote, f"{name}: pushing its outputs (kept here, recorded in dvc.lock)"),
    ):
        repo.push(targets=[name])
        with repo.lock:
            runs = repo.stage_cache.push(None)
            for objs in repo.stage_cache.get_used_objs(runs).values():
                repo.cloud.push(objs)
