"""The evolution as a Prefect flow: the method's setup (experts -> base -> bc -> evaluate@0 for most; its own
for STEP-HRL, Multi² and TerminalTraj), then `evolve.iterations` iterations of the method's recipe
(`qevolve.recipe`), each a run of the method's sub-flow (`<method>-iteration`; Q-Evolve's: collect@k -> relabel@k
-> critic@k -> advantage@k -> policy@k -> diagnose@k -> evaluate@k).

Each stage is a task that DVC skips when its inputs are unchanged, so a second run does no work and a
killed run resumes at the first unfinished stage. MLflow gets one parent run per evolution and one child
run per iteration. Run it from the workspace root:

    python -m flows.evolve                            # this checkout's params.yaml, in this checkout
    python -m flows.evolve --workspace quickstart     # params.yaml, in runs/quickstart/ (`make quickstart`)
    python -m flows.evolve --profile smollm2          # profiles/smollm2.yaml, in runs/smollm2/
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Literal

from prefect import flow

from flows.provenance import machine, machine_line
from flows.tracking import (
    ML_VIEW,
    log_evolution_views,
    log_iteration_views,
    log_stage,
    log_timing,
    runs_link,
    start_evolution,
    start_iteration,
)
from qevolve import dvcfile, paths
from qevolve.data.atomic import write_json
from qevolve.envs import check_data
from qevolve.errors import UserError, debugging, inside, report
from qevolve.lock import workspace_lock
from qevolve.params import load_params
from qevolve.recipe import load_recipe
from qevolve.stages import iteration_stages, pipeline, stage_name
from qevolve.summary import summary_table
from tasks import run_pipeline_stage
from tasks.scaleout import load_settings, use_remote

ROOT = Path(__file__).resolve().parent.parent
Profile = Literal[("", *sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml")))]
"""The profiles the `experiment` flow offers (a menu in the Prefect UI's run form)."""


@flow(name="iteration", flow_run_name="iteration-{k}")
def iteration(k: int, root: str, parent_run_id: str) -> dict:
    """One iteration of the method's recipe; its stages are tasks, its metrics go to a child MLflow run."""
    results = {}
    start = time.perf_counter()
    params = load_params(Path(root) / "params.yaml")
    recipe = load_recipe(params.method)
    with start_iteration(k, parent_run_id):
        for stage in iteration_stages(params, k):
            result = run_pipeline_stage(stage, k, root)
            log_stage(result, recipe.stage(stage, params))
            results[stage_name(stage, k)] = result
        log_iteration_views(k)
        timing = iteration_timing(k, results, time.perf_counter() - start)
        if timing:
            log_timing(timing)
    return results


def method_iteration(params):
    """The iteration sub-flow under the method's name (`qevolve-iteration`, `grpo-iteration`), described in
    the Prefect UI by its package's docstring: the method's algorithm, as its paper states it."""
    import importlib

    package = importlib.import_module(f"qevolve.methods.{params.method}")
    return iteration.with_options(name=f"{params.method}-iteration", description=package.__doc__)


def iteration_timing(k: int, results: dict, wall: float) -> dict | None:
    """Wall time of iteration k against the time its stage functions computed; the rest is Prefect, DVC
    and MLflow. Written to `metrics/timing@k.json` when every stage ran (a resumed iteration mixes runs)."""
    if not all(r.get("ran") for r in results.values()):
        return None
    compute = {name: r["compute_s"] for name, r in results.items()}
    timing = {"iteration": k, "wall_s": wall, "compute_s": sum(compute.values()), "stages": compute}
    timing["overhead_s"] = wall - timing["compute_s"]
    timing["overhead_share"] = timing["overhead_s"] / wall
    write_json(paths.metrics(f"timing@{k}"), timing)
    return timing


@flow(name="evolve")
def evolve(root: str = str(ROOT)) -> dict:
    """Expert demonstrations, behaviour cloning and its evaluation, then the iterations of the method of params.yaml."""
    os.chdir(root)
    with workspace_lock(root, "evolution"):
        return _evolve(root)


def _evolve(root: str) -> dict:
    params = load_params("params.yaml")
    if dvcfile.write(params, Path("dvc.yaml")):
        print(f"dvc.yaml regenerated for evolve.iterations = {params.evolve.iterations}")
    check_data(params.env, generated=dvcfile.env_data_generated(params))
    scaleout = load_settings(Path(root), sorted({stage for stage, _ in pipeline(params, params.evolve.iterations)}))
    if scaleout.remote:
        use_remote(Path(root), scaleout.remote)
    results = {}
    with start_evolution(params, run_name=f"{params.method}-{time.strftime('%Y%m%d-%H%M%S')}") as run:
        for stage, k in pipeline(params, 0):
            result = run_pipeline_stage(stage, k, root)
            log_stage(result, load_recipe(params.method).stage(stage, params))
            results[stage_name(stage, k)] = result
        run_iteration = method_iteration(params)
        for k in range(1, params.evolve.iterations + 1):
            results.update(run_iteration(k, root, run.info.run_id))
        log_evolution_views(params.evolve.iterations)
        results["mlflow_run_id"] = run.info.run_id
        publish_table(params.evolve.iterations, run)
    return results


@flow(name="experiment")
def experiment(
    profile: Profile = "", iterations: int | None = None, overrides: dict[str, Any] | None = None, name: str = ""
) -> dict:
    """An evolution in a workspace of its own under runs/ (its own params.yaml, DVC lineage and MLflow store).

    Args:
        profile: the parameters: profiles/PROFILE.yaml; empty: this checkout's params.yaml.
        iterations: iterations after BC; empty: the parameters' own `evolve.iterations`.
        overrides: parameter changes as dotted keys, e.g. {"bc.lr": 0.0005, "evaluate.splits.valid_seen": 12},
            validated like params.yaml before anything runs.
        name: the workspace: runs/NAME/; empty: the profile's name, plus a digest of the changes.
    """
    return evolve(str(experiment_workspace(profile, iterations, overrides, name)))


def publish_table(iterations: int, run) -> None:
    """The evaluation table as a markdown artifact of this flow run (the Prefect UI's Artifacts tab),
    with where to find the evolution in MLflow."""
    import mlflow
    from prefect.artifacts import create_markdown_artifact

    link = f"http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?{ML_VIEW}"
    create_markdown_artifact(
        key="evaluation",
        markdown=f"# Evaluation\n\n```\n{summary_table(list(range(iterations + 1)))}\n```\n\nMLflow run "
        f"`{run.info.run_id}` "
        f"(tracking store `{mlflow.get_tracking_uri()}`): [{link}]({link}) once `mlflow ui` serves that store.\n",
        description="BC and each iteration's success per split, with standard errors",
    )


def peak_rss_gb() -> float:
    """Peak resident memory of this process or any finished child (Linux reports KiB)."""
    return max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 2**20


def experiment_workspace(
    profile: str = "", iterations: int | None = None, overrides: dict | None = None, name: str = ""
) -> Path:
    """`runs/<name>/`, a workspace of its own (the code copied, its own DVC repository and MLflow store)
    for `profiles/<profile>.yaml` (or this checkout's params.yaml) with `overrides` (dotted keys, as
    `dvc exp run -S` takes them) and `iterations`, so that a run leaves the checkout's params.yaml and
    dvc.lock alone and records its own lineage. The name defaults to the profile, plus a digest of the
    changes when there are any. The parameters are validated before anything is written. A synthetic
    WebShop catalogue is written there if they ask for one."""
    import hashlib

    from flows.workspace import prepare, set_dotted
    from qevolve.params import find_profile, parse_params, resolve_params

    source = find_profile(ROOT, profile) if profile else ROOT / "params.yaml"
    raw = resolve_params(source)
    changes = {**(overrides or {}), **({"evolve.iterations": iterations} if iterations is not None else {})}
    for key, value in changes.items():
        set_dotted(raw, key, value)
    params = parse_params(raw, f"{source.name} with {changes}" if changes else source)
    digest = hashlib.sha256(json.dumps(changes, sort_keys=True).encode()).hexdigest()[:8]
    root = inside(ROOT / "runs", name or (profile or "params") + (f"-{digest}" if changes else ""), "workspace")
    prepare(root, raw)
    shop = params.env.data_dir
    if (
        params.env.name == "webshop"
        and shop == "data/webshop-synthetic"
        and not (root / shop / "items_human_ins.json").exists()
    ):
        from qevolve.envs.webshop_data import write_synthetic

        write_synthetic(root / shop, 200, 0)
    return root


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the evolution of a workspace as a Prefect flow.")
    ap.add_argument(
        "--profile",
        help="run profiles/NAME.yaml in its own workspace, runs/NAME/ (this checkout's files are left alone)",
    )
    ap.add_argument(
        "--workspace", help="run in runs/NAME/, a workspace of its own (params.yaml's, or --profile's, parameters)"
    )
    ap.add_argument("--root", type=Path, default=ROOT, help="an existing workspace to run in (default: this checkout)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a known error")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    try:
        root = (
            experiment_workspace(args.profile or "", name=args.workspace or "")
            if args.profile or args.workspace
            else args.root.resolve()
        )
        results = evolve(str(root))
    except UserError as err:  # bad parameters or data, a busy workspace: the message and a hint, no traceback
        if args.debug or debugging([]):
            raise
        return report(err)
    params = load_params(root / "params.yaml")
    ran = [name for name, r in results.items() if isinstance(r, dict) and r.get("ran")]
    print()
    print(summary_table(list(range(params.evolve.iterations + 1))))
    print()
    print(
        f"stages run: {', '.join(ran) or 'none (all up to date)'}; wall time {time.perf_counter() - start:.0f}s; "
        f"peak RSS {peak_rss_gb():.2f} GB"
    )
    print(f"machine: {machine_line(machine())} (what reproduces where: docs/reproducibility.md)")
    for k in range(1, params.evolve.iterations + 1):
        timing = root / paths.metrics(f"timing@{k}")
        if timing.exists() and any(name.endswith(f"@{k}") for name in ran):
            t = json.loads(timing.read_text())
            print(f"iteration {k}: {t['wall_s']:.0f}s, of which {t['overhead_share']:.1%} in Prefect, DVC and MLflow")
    where = "" if root == ROOT else f" (in {root.relative_to(ROOT) if root.is_relative_to(ROOT) else root}/)"
    print(f"Where to look next{where}:")
    print("  mlflow ui --backend-store-uri sqlite:///mlflow.db   # runs, metrics, adapter, trajectories, at")
    print(f"    {runs_link(root, params.mlflow.experiment)}")
    print("  dvc dag && dvc metrics show && dvc plots show        # lineage and results")
    print("  prefect server start                                 # flow runs in the Prefect UI")
    return 0


if __name__ == "__main__":
    sys.exit(main())
