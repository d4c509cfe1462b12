"""Scale-out settings (`scaleout.yaml`: a DVC remote and the work pool of each stage) and `dispatch`, which
runs a stage on its pool's worker: what the Prefect task of a stage needs (`tasks.run_pipeline_stage`). The
worker's side, the `qevolve-stage` flow, and the deployment are in `flows.scaleout`, which documents both."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from qevolve.config import ConfigError
from qevolve.errors import BadName, inside
from tasks.dvc import dvc_repo, remote_errors

ROOT = Path(__file__).resolve().parent.parent
FILE = "scaleout.yaml"
DEPLOYMENT = "qevolve-stage"
SRC = "src"


class Remote(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    """Where DVC keeps the artifacts: `s3://bucket/path` (needs the `scaleout` extra) or a directory."""
    endpointurl: str | None = None
    """An S3-compatible server's URL (MinIO, moto); credentials come from the environment (AWS_ACCESS_KEY_ID, ...)."""


REGISTRY = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*(:[0-9]{1,5})?(/[a-z0-9][a-z0-9._-]*)*")
"""A registry as `docker pull` reads one (`host[:port][/path]`): never an option, a space or an upper-case path."""


def registry_name(value: str, where: str) -> str:
    if not isinstance(value, str) or not REGISTRY.fullmatch(value):
        raise BadName(f"{where}: {value!r} is not a registry (host[:port][/path], e.g. registry.lab:5000/qevolve)")
    return value


class Images(BaseModel):
    model_config = ConfigDict(extra="forbid")
    registry: str
    """Where the workers share terminal tasks' images (`registry.lab:5000/qevolve`): one missing on a machine is pulled
    from it before it is built, and one built is pushed to it (`qevolve.envs.task_images`)."""

    @model_validator(mode="after")
    def _a_registry(self) -> Images:
        try:
            registry_name(self.registry, "images.registry")
        except BadName as err:
            raise ValueError(str(err)) from None
        return self


class Scaleout(BaseModel):
    model_config = ConfigDict(extra="forbid")
    remote: Remote | None = None
    images: Images | None = None
    pools: dict[str, str] = {}
    """Stage name (without `@k`) -> the Prefect work pool it runs on; a stage not named runs in the flow."""

    @model_validator(mode="after")
    def _pools_need_a_remote(self) -> Scaleout:
        if self.pools and self.remote is None:
            raise ValueError(
                "pools: a stage on a work pool hands its artifacts over through a DVC remote; set remote.url"
            )
        return self


def settings_path(root: Path) -> Path:
    return Path(os.environ.get("QEVOLVE_SCALEOUT") or Path(root) / FILE)


def load_settings(root: Path, stages: list[str] | None = None) -> Scaleout:
    """The workspace's scale-out settings (none: everything runs here, no remote); `stages`, when given,
    are the names a pool may be set for."""
    path = settings_path(root)
    if not path.exists():
        if "QEVOLVE_SCALEOUT" in os.environ:
            raise ConfigError(f"{path}: not found (QEVOLVE_SCALEOUT names it)")
        return Scaleout()
    try:
        settings = Scaleout.model_validate(yaml.safe_load(path.read_text()) or {})
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    except ValidationError as err:
        problems = [
            (".".join(map(str, e["loc"])) + ": " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
            for e in err.errors()
        ]
        raise ConfigError(f"{path}: {'; '.join(problems)}") from None
    unknown = sorted(set(settings.pools) - set(stages or settings.pools))
    if unknown:
        raise ConfigError(f"{path}: pools: no stage {unknown} in this method; expected some of {sorted(stages)}")
    return settings


def use_remote(root: Path, remote: Remote) -> None:
    """Make `remote` the workspace's default DVC remote (in `.dvc/config.local`, which no clone shares)."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo, repo.config.edit("local") as conf:
        conf["remote"]["qevolve"] = {
            "url": remote.url,
            **({"endpointurl": remote.endpointurl} if remote.endpointurl else {}),
        }
        conf["core"]["remote"] = "qevolve"


def code_digest(src: Path) -> str:
    """sha256 over the source files under `src` (names and contents): the code DVC keys a stage's run by."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(src).rglob("*.py") if "__pycache__" not in p.parts):
        h.update(f"{f.relative_to(src).as_posix()}\0".encode() + f.read_bytes())
    return h.hexdigest()


def stage_inputs(repo, name: str) -> tuple[list[str], list[str]]:
    """The stage's inputs that earlier stages wrote: (those DVC caches, which a worker pulls from the remote;
    those it does not, earlier stages' metrics files, which travel with the request)."""
    outs = {o.def_path: o.use_cache for s in repo.index.stages for o in s.outs}
    deps = [d.def_path for d in repo.stage.collect(name)[0].deps if d.def_path in outs]
    return [d for d in deps if outs[d]], [d for d in deps if not outs[d]]


def carried_files(root: Path, name: str) -> dict[str, str]:
    """What a worker needs beside the remote's data, as text: the workspace's params.yaml, dvc.yaml and
    dvc.lock, and the stage's uncached inputs."""
    with dvc_repo(root) as repo:
        uncached = stage_inputs(repo, name)[1]
    return {
        f: (root / f).read_text() for f in ("params.yaml", "dvc.yaml", "dvc.lock", *uncached) if (root / f).exists()
    }


CARRIED = re.compile(r"params\.yaml|dvc\.yaml|dvc\.lock|metrics/[A-Za-z0-9][A-Za-z0-9@._-]{0,99}\.json")
"""The files a worker accepts from a flow run's parameters (`carried_files`): nothing else is written."""


def worker_root(workspace: str) -> Path:
    """A worker's folder for the orchestrator's workspace `workspace`, which must be the 16 hex digits
    `dispatch` sends: a flow-run parameter, so anything else is refused before anything is written."""
    if not isinstance(workspace, str) or not re.fullmatch(r"[0-9a-f]{16}", workspace):
        raise BadName(f"remote_stage: workspace {workspace!r} is not a workspace id (16 hexadecimal digits)")
    return inside(
        Path(os.environ.get("QEVOLVE_WORKER_DIR") or Path.home() / ".qevolve" / "workers"),
        workspace,
        "remote_stage: workspace",
    )


def carried_path(root: Path, rel: str) -> Path:
    """Where a carried file goes in the worker's folder `root`: only the names `CARRIED` allows."""
    if not isinstance(rel, str) or not CARRIED.fullmatch(rel) or ".." in rel:
        raise BadName(
            f"remote_stage: files: {rel!r} is not a file a stage carries (params.yaml, dvc.yaml, dvc.lock, "
            f"metrics/*.json)"
        )
    return root / rel


def dispatch(root: Path, stage: str, iteration: int | None, pool: str, remote: Remote, registry: str = "") -> str:
    """Run the stage on `pool`'s worker (a sub-flow of the calling flow) after pushing its inputs, and
    wait for it; the flow run's id, or an error unless it completed. Each call is a new flow run, so a
    rerun after a crashed worker is a new attempt."""
    from prefect.deployments import run_deployment

    from qevolve.stages import stage_name

    name = stage_name(stage, iteration)
    with dvc_repo(root) as repo, remote_errors(remote.url, f"{name}: pushing its inputs for work pool {pool!r}"):
        repo.push(targets=stage_inputs(repo, name)[0])
    run = run_deployment(
        f"{DEPLOYMENT}/{pool}",
        as_subflow=True,
        timeout=None,
        parameters={
            "stage": stage,
            "iteration": iteration,
            "files": carried_files(root, name),
            "code": code_digest(root / SRC),
            "remote": remote.model_dump(),
            "workspace": hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16],
            "registry": registry,
        },
    )
    if not run.state.is_completed():
        raise RuntimeError(
            f"{name}: its run on work pool {pool!r} ended {run.state.name} (flow run {run.id}: "
            f"{run.state.message or 'no message'}); rerun the evolution to start a new attempt"
        )
    return str(run.id)
