"""Scale-out: stages routed to Prefect work pools, their artifacts handed over through a DVC remote.

`scaleout.yaml` (in the workspace, or the file `QEVOLVE_SCALEOUT` names) says where things go:

    remote: {url: s3://qevolve/dvc, endpointurl: http://minio:9000}   # a DVC remote (S3, or a directory)
    pools: {bc: gpu, critic: gpu, policy: gpu, collect: gpu, evaluate: gpu}   # stage -> Prefect work pool
    images: {registry: registry.lab:5000/qevolve}   # optional: terminal tasks' images, built once between the workers

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
import os
import sys

from prefect import flow, get_run_logger

from qevolve.data.atomic import atomic_path
from qevolve.envs.task_images import REGISTRY_ENV
from tasks.scaleout import (
    DEPLOYMENT,
    ROOT,
    SRC,
    Remote,
    carried_path,
    code_digest,
    registry_name,
    stage_inputs,
    use_remote,
    worker_root,
)


def _run_name() -> str:
    from prefect.runtime import flow_run

    from qevolve.stages import stage_name

    return stage_name(flow_run.parameters["stage"], flow_run.parameters.get("iteration"))


@flow(name=DEPLOYMENT, flow_run_name=_run_name)
def remote_stage(
    stage: str,
    iteration: int | None,
    files: dict[str, str],
    code: str,
    remote: dict,
    workspace: str,
    registry: str = "",
) -> dict:
    """A stage of an evolution run on this worker: in a workspace of its own (under `QEVOLVE_WORKER_DIR`,
    default ~/.qevolve/workers), from the orchestrator's files and the remote's data; its outputs and
    run-cache entry are pushed to the remote. `registry`: where terminal tasks' images are shared (scaleout.yaml's
    `images`)."""
    import shutil

    from qevolve.stages import stage_name
    from tasks import compute_stage
    from tasks.dvc import dvc_repo, push_stage, remote_errors, restore_from_run_cache

    root = worker_root(workspace)  # flow-run parameters: checked before anything is written
    registry = registry and registry_name(registry, "remote_stage: registry")
    files = {carried_path(root, rel): text for rel, text in files.items()}
    log = get_run_logger()
    name = stage_name(stage, iteration)
    mine = code_digest(ROOT / SRC)
    if mine != code:
        raise RuntimeError(
            f"{name}: this worker's code (src digest {mine[:12]}) is not the orchestrator's ({code[:12]}); "
            f"run the worker from the same commit: DVC keys the stage's run by its code"
        )
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
    if registry:
        os.environ[REGISTRY_ENV] = registry
    os.chdir(root)
    with dvc_repo(root) as repo, remote_errors(remote["url"], f"{name}: pulling its inputs"):
        repo.pull(targets=stage_inputs(repo, name)[0])
    if restore_from_run_cache(root, name, remote["url"]):
        log.info(
            "%s: restored from the remote's run cache (computed before with the same code, params and inputs)", name
        )
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
            expect={
                "prefect.flow-run.heartbeat",
                *(f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")),
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.role": "flow", "prefect.resource.name": DEPLOYMENT}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=silence_s),
        ),
        actions=[
            ChangeFlowRunState(state=StateType.CRASHED, message=f"no heartbeat for {silence_s} s: its worker is gone")
        ],
    ).create()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Deploy the stage flow on a Prefect work pool (see this module's docstring)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    deploy = sub.add_parser("deploy", help=f"create or update the deployment {DEPLOYMENT}/POOL")
    deploy.add_argument("pool", help="the work pool (created as a process pool if missing)")
    deploy.add_argument(
        "--heartbeat", type=int, default=30, help="seconds between a stage run's heartbeats (at least 30; default 30)"
    )
    deploy.add_argument(
        "--silence",
        type=int,
        default=120,
        help="seconds without a heartbeat after which a stage run is marked Crashed (default 120)",
    )
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
        name=args.pool,
        work_pool_name=args.pool,
        print_next_steps=False,
        job_variables={"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(args.heartbeat)}},
    )
    crash_silent_runs(args.silence)
    print(f"deployed {DEPLOYMENT}/{args.pool}; start its worker with: prefect worker start --pool {args.pool}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
