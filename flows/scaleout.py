"""Scale-out: stages routed to Prefect work pools, their artifacts handed over through a DVC remote.

`scaleout.yaml` (in the workspace, or the file `QEVOLVE_SCALEOUT` names) says where things go:

    remote: {url: s3://qevolve/dvc, endpointurl: http://minio:9000}   # a DVC remote (S3, or a directory)
    pools: {bc: gpu, critic: gpu, policy: gpu, collect: gpu, evaluate: gpu}   # stage -> Prefect work pool

No stage reads this file, so moving a stage to another pool (or back) never makes DVC run it again.
With a remote, every stage's outputs and DVC run-cache entry are pushed there once it is done, and a stage
that some other clone of the evolution already computed (same code, params and inputs) is restored from
the remote instead of run.

A stage routed to a pool runs as a flow run of the deployment `qevolve-stage/<pool>` (a sub-flow of the
evolution in the Prefect UI), on that pool's worker: in a workspace of its own it writes the
orchestrator's params.yaml, dvc.yaml and dvc.lock, pulls the stage's inputs from the remote, runs the stage
(unless the remote's run cache holds it already) and pushes its outputs and run-cache entry. The
orchestrator, the only writer of its dvc.lock, then restores the stage from the remote's run cache: no
command runs, and its dvc.lock entry is the one a local run writes. The worker's code must be the
orchestrator's (checked before anything runs): DVC keys the run cache by it.

A worker's machine can die mid-stage, leaving its flow run Running with nobody to end it. Its runs send a
heartbeat every `--heartbeat` seconds, and `deploy` installs a Prefect automation that marks a stage run
Crashed once its heartbeats have stopped for `--silence` seconds; the orchestrator waiting on it then stops
with that state, and a rerun of the evolution starts a new attempt.

    python -m flows.scaleout deploy gpu        # the `qevolve-stage/gpu` deployment, on work pool `gpu`
    prefect worker start --pool gpu            # on each machine of the pool, in this project's environment
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from pathlib import Path

import yaml
from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from qevolve.config import ConfigError
from qevolve.data.atomic import atomic_path
from qevolve.errors import BadName, inside

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


class Scaleout(BaseModel):
    model_config = ConfigDict(extra="forbid")
    remote: Remote | None = None
    pools: dict[str, str] = {}
    """Stage name (without `@k`) -> the Prefect work pool it runs on; a stage not named runs in the flow."""

    @model_validator(mode="after")
    def _pools_need_a_remote(self) -> "Scaleout":
        if self.pools and self.remote is None:
            raise ValueError("pools: a stage on a work pool hands its artifacts over through a DVC remote; set remote.url")
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
        problems = [(".".join(map(str, e["loc"])) + ": " if e["loc"] else "") + e["msg"].removeprefix("Value error, ") for e in err.errors()]
        raise ConfigError(f"{path}: {'; '.join(problems)}") from None
    unknown = sorted(set(settings.pools) - set(stages or settings.pools))
    if unknown:
        raise ConfigError(f"{path}: pools: no stage {unknown} in this method; expected some of {sorted(stages)}")
    return settings


def use_remote(root: Path, remote: Remote) -> None:
    """Make `remote` the workspace's default DVC remote (in `.dvc/config.local`, which no clone shares)."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo, repo.config.edit("local") as conf:
        conf["remote"]["qevolve"] = {"url": remote.url, **({"endpointurl": remote.endpointurl} if remote.endpointurl else {})}
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
    from tasks import dvc_repo

    with dvc_repo(root) as repo:
        uncached = stage_inputs(repo, name)[1]
    return {f: (root / f).read_text() for f in ("params.yaml", "dvc.yaml", "dvc.lock", *uncached) if (root / f).exists()}


CARRIED = re.compile(r"params\.yaml|dvc\.yaml|dvc\.lock|metrics/[A-Za-z0-9][A-Za-z0-9@._-]{0,99}\.json")
"""The files a worker accepts from a flow run's parameters (`carried_files`): nothing else is written."""


def worker_root(workspace: str) -> Path:
    """A worker's folder for the orchestrator's workspace `workspace`, which must be the 16 hex digits
    `dispatch` sends: a flow-run parameter, so anything else is refused before anything is written."""
    if not isinstance(workspace, str) or not re.fullmatch(r"[0-9a-f]{16}", workspace):
        raise BadName(f"remote_stage: workspace {workspace!r} is not a workspace id (16 hexadecimal digits)")
    return inside(Path(os.environ.get("QEVOLVE_WORKER_DIR") or Path.home() / ".qevolve" / "workers"), workspace, "remote_stage: workspace")


def carried_path(root: Path, rel: str) -> Path:
    """Where a carried file goes in the worker's folder `root`: only the names `CARRIED` allows."""
    if not isinstance(rel, str) or not CARRIED.fullmatch(rel) or ".." in rel:
        raise BadName(f"remote_stage: files: {rel!r} is not a file a stage carries (params.yaml, dvc.yaml, dvc.lock, metrics/*.json)")
    return root / rel


def dispatch(root: Path, stage: str, iteration: int | None, pool: str, remote: Remote) -> str:
    """Run the stage on `pool`'s worker (a sub-flow of the calling flow) after pushing its inputs, and
    wait for it; the flow run's id, or an error unless it completed. Each call is a new flow run, so a
    rerun after a crashed worker is a new attempt."""
    from prefect.deployments import run_deployment

    from qevolve.stages import stage_name
    from tasks import dvc_repo, remote_errors

    name = stage_name(stage, iteration)
    with dvc_repo(root) as repo, remote_errors(remote.url, f"{name}: pushing its inputs for work pool {pool!r}"):
        repo.push(targets=stage_inputs(repo, name)[0])
    run = run_deployment(
        f"{DEPLOYMENT}/{pool}", as_subflow=True, timeout=None,
        parameters={"stage": stage, "iteration": iteration, "files": carried_files(root, name), "code": code_digest(root / SRC),
                    "remote": remote.model_dump(), "workspace": hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]},
    )
    if not run.state.is_completed():
        raise RuntimeError(f"{name}: its run on work pool {pool!r} ended {run.state.name} (flow run {run.id}: "
                           f"{run.state.message or 'no message'}); rerun the evolution to start a new attempt")
    return str(run.id)


def _run_name() -> str:
    from prefect.runtime import flow_run

    from qevolve.stages import stage_name

    return stage_name(flow_run.parameters["stage"], flow_run.parameters.get("iteration"))


@flow(name=DEPLOYMENT, flow_run_name=_run_name)
def remote_stage(stage: str, iteration: int | None, files: dict[str, str], code: str, remote: dict, workspace: str) -> dict:
    """A stage of an evolution run on this worker: in a workspace of its own (under `QEVOLVE_WORKER_DIR`,
    default ~/.qevolve/workers), from the orchestrator's files and the remote's data; its outputs and
    run-cache entry are pushed to the remote."""
    import shutil

    from qevolve.stages import stage_name
    from tasks import compute_stage, dvc_repo, push_stage, remote_errors, restore_from_run_cache

    root = worker_root(workspace)  # flow-run parameters: checked before anything is written
    files = {carried_path(root, rel): text for rel, text in files.items()}
    log = get_run_logger()
    name = stage_name(stage, iteration)
    mine = code_digest(ROOT / SRC)
    if mine != code:
        raise RuntimeError(f"{name}: this worker's code (src digest {mine[:12]}) is not the orchestrator's ({code[:12]}); "
                           f"run the worker from the same commit: DVC keys the stage's run by its code")
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root / SRC, ignore_errors=True)
    shutil.copytree(ROOT / SRC, root / SRC, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    if not (root / ".dvc").exists():
        import subprocess

        subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
    use_remote(root, Remote(**remote))
    os.chdir(root)
    with dvc_repo(root) as repo, remote_errors(remote["url"], f"{name}: pulling its inputs"):
        repo.pull(targets=stage_inputs(repo, name)[0])
    if restore_from_run_cache(root, name, remote["url"]):
        log.info("%s: restored from the remote's run cache (computed before with the same code, params and inputs)", name)
        return {"stage": name, "ran": False}
    result = compute_stage(root, stage, iteration)
    push_stage(root, name, remote["url"])
    log.info("%s: computed in %.0f s on this worker and pushed", name, result["compute_s"])
    return {"stage": name, "ran": True, "compute_s": result["compute_s"]}


def crash_silent_runs(silence_s: int) -> None:
    """The automation (one per Prefect server, replaced when deployed again) that marks a `qevolve-stage`
    flow run Crashed when no heartbeat and no final state follows its start or its last heartbeat within
    `silence_s` (Prefect's zombie-flow recipe, scoped to the stage flow and counted from the start too)."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    name = f"{DEPLOYMENT}: crash runs whose heartbeats stopped"
    try:
        Automation.read(name=name).delete()
    except ValueError:  # none yet
        pass
    Automation(
        name=name,
        trigger=EventTrigger(
            # From the run's start too: a worker killed before the run's first heartbeat reached the server.
            after={"prefect.flow-run.Running", "prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed"))},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.role": "flow", "prefect.resource.name": DEPLOYMENT}),
            for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1, within=timedelta(seconds=silence_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=f"no heartbeat for {silence_s} s: its worker is gone")],
    ).create()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Deploy the stage flow on a Prefect work pool (see this module's docstring).")
    sub = parser.add_subparsers(dest="command", required=True)
    deploy = sub.add_parser("deploy", help=f"create or update the deployment {DEPLOYMENT}/POOL")
    deploy.add_argument("pool", help="the work pool (created as a process pool if missing)")
    deploy.add_argument("--heartbeat", type=int, default=30, help="seconds between a stage run's heartbeats (at least 30; default 30)")
    deploy.add_argument("--silence", type=int, default=120,
                        help="seconds without a heartbeat after which a stage run is marked Crashed (default 120)")
    args = parser.parse_args(argv)
    if args.heartbeat < 30 or args.silence <= args.heartbeat:
        parser.error("--heartbeat: at least 30 s (Prefect's minimum), and --silence longer than it")
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=args.pool, type="process"))
        except ObjectAlreadyExists:
            pass
    remote_stage.from_source(source=str(ROOT), entrypoint="flows/scaleout.py:remote_stage").deploy(
        name=args.pool, work_pool_name=args.pool, print_next_steps=False,
        job_variables={"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(args.heartbeat)}})
    crash_silent_runs(args.silence)
    print(f"deployed {DEPLOYMENT}/{args.pool}; start its worker with: prefect worker start --pool {args.pool}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
