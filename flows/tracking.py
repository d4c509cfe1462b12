"""MLflow logging for an evolution, read from the stages' metrics files.

Stages never log themselves: a stage that DVC skips does not run, so the flow logs what each stage
recorded, whether it ran now or earlier.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlflow

from qevolve import paths
from qevolve.data.advantages import read_advantages
from qevolve.data.atomic import write_json
from qevolve.data.store import read_store
from qevolve.errors import UserError
from qevolve.lineage import lineage_dump
from qevolve.lock import STATE_DIR
from qevolve.params import Params
from qevolve.recipe import Stage

SAMPLE_TRAJECTORIES = 4
PLACEMENT = ("device", "dtype", "processes", "sharded", "cpu_capability")
"""Metrics keys that say where a stage computed (`qevolve.models.device.placement`): tags, not metrics."""


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


EVOLUTION_FILE = Path(STATE_DIR) / "evolution.json"
"""The workspace's current evolution: its MLflow parent run and the parameters it was started with."""


def use_experiment(name: str) -> None:
    """Make `name` the active experiment, marked as model training: MLflow 3's UI then opens it in its
    training view (runs with their metric charts), not the GenAI view it infers for experiments whose
    runs log no model."""
    experiment = mlflow.set_experiment(name)
    if experiment.tags.get("mlflow.experimentKind") != "custom_model_development":
        mlflow.MlflowClient().set_experiment_tag(
            experiment.experiment_id, "mlflow.experimentKind", "custom_model_development"
        )


ML_VIEW = "workflowType=machine_learning"
"""MLflow 3.17's UI keeps a GenAI / machine-learning switch per browser (`mlflow.workflowType`, GenAI in a fresh
one, whose experiment page opens on traces); this URL parameter opens the runs instead."""


def runs_link(root: Path, experiment: str) -> str:
    """Where `mlflow ui` (on its default port) shows the workspace's evolutions: the experiment's runs."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"
    found = mlflow.MlflowClient(uri).get_experiment_by_name(experiment)
    return f"http://127.0.0.1:5000/#/experiments/{found.experiment_id if found else 0}/runs?{ML_VIEW}"


def evolution_identity(params: Params) -> dict:
    """What makes two runs the same evolution: the parameters that decide what is computed, less how far
    it goes (`evolve.iterations`: raising it continues the evolution) and where it runs."""
    identity = lineage_dump(params)
    identity["evolve"].pop("iterations")
    return identity


def log_attempt() -> None:
    """Tags the active run with this attempt's code commit, installed packages' digest, machine and Prefect flow
    run (the latest attempt's, on a resumed run), and logs the package listing and the machine as
    `environment/packages.txt` and `environment/machine.json`."""
    from prefect.runtime import flow_run

    from flows.provenance import git_commit, machine, machine_line, packages, packages_sha256

    listing, here = packages(), machine()
    mlflow.set_tags(
        {
            "qevolve.git_commit": git_commit(),
            "qevolve.packages_sha256": packages_sha256(listing),
            "qevolve.machine": machine_line(here),
            "qevolve.prefect_flow_run": str(flow_run.id or ""),
        }
    )
    mlflow.log_text("\n".join(listing) + "\n", "environment/packages.txt")
    mlflow.log_dict(here, "environment/machine.json")


def start_evolution(params: Params, run_name: str):
    """The evolution's parent run: the same one again when this workspace last ran these parameters,
    however many iterations (a resumed, repeated or continued run), a new one otherwise.

    Runs left RUNNING under a resumed parent belong to an attempt that was killed (the workspace lock
    guarantees no other attempt is alive): they are marked KILLED, and the parent counts its attempts."""
    use_experiment(params.mlflow.experiment)
    fingerprint = hashlib.sha256(
        json.dumps(evolution_identity(params), sort_keys=True, default=str).encode()
    ).hexdigest()
    previous = json.loads(EVOLUTION_FILE.read_text()) if EVOLUTION_FILE.exists() else {}
    client = mlflow.MlflowClient()
    run_id = previous.get("run_id") if previous.get("fingerprint") == fingerprint else None
    if run_id is not None:
        try:
            old = client.get_run(run_id)
        except mlflow.exceptions.MlflowException:
            old = None
        if old is None or old.info.lifecycle_stage != "active":
            run_id = None
    if run_id is None:
        run = mlflow.start_run(
            run_name=run_name,
            tags={
                "qevolve.attempts": "1",
                "qevolve.iterations": str(params.evolve.iterations),
                "qevolve.method": params.method,
            },
        )
        log_attempt()
        # Every parameter but the iteration count, which a continued evolution raises (a tag, updated).
        mlflow.log_params(
            {k: str(v)[:500] for k, v in flatten(params.model_dump()).items() if k != "evolve.iterations"}
        )
        write_json(EVOLUTION_FILE, {"run_id": run.info.run_id, "fingerprint": fingerprint})
        return run
    stale = client.search_runs(
        [old.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}' and attributes.status = 'RUNNING'"
    )
    for child in stale:
        client.set_terminated(child.info.run_id, "KILLED")
    killed = int(old.data.tags.get("qevolve.killed_attempts", "0")) + (old.info.status == "RUNNING")
    run = mlflow.start_run(run_id=run_id)
    mlflow.set_tags(
        {
            "qevolve.attempts": str(int(old.data.tags.get("qevolve.attempts", "1")) + 1),
            "qevolve.killed_attempts": str(killed),
            "qevolve.iterations": str(params.evolve.iterations),
        }
    )
    log_attempt()
    return run


def render_trajectories(store: Path, limit: int = SAMPLE_TRAJECTORIES) -> str:
    """A few trajectories as readable markdown: instruction, then each action and what followed."""
    lines = []
    for t in read_store(store)[:limit]:
        lines += [
            f"## {t.task_id} ({t.split}, {t.source}) — {'won' if t.won else 'lost: ' + t.failure}",
            f"**Task:** {t.instruction}",
            "",
        ]
        lines.append(f"> {t.steps[0].observation}" if t.steps else "")
        for s in t.steps:
            flag = "" if s.valid else "  *(rejected)*"
            lines += [f"{s.step + 1}. `{s.output}`{flag} (logp {s.logp:.2f})", f"   > {s.next_observation}"]
        lines.append("")
    return "\n".join(lines)


def log_timing(timing: dict) -> None:
    """Iteration wall time, compute time and the orchestration overhead, to the active (child) run."""
    mlflow.log_metrics(
        {f"timing/{k}": v for k, v in timing.items() if k in ("wall_s", "compute_s", "overhead_s", "overhead_share")}
    )


def start_iteration(k: int, parent_run_id: str):
    """The child run of iteration k under the evolution's parent run: the finished one again if an
    earlier attempt completed the iteration, else a new one (a killed attempt's run stays KILLED)."""
    client = mlflow.MlflowClient()
    parent = client.get_run(parent_run_id)
    done = client.search_runs(
        [parent.info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent_run_id}' and tags.`qevolve.iteration` = '{k}' and attributes.status = "
        f"'FINISHED'",
    )
    if done:
        return mlflow.start_run(run_id=done[0].info.run_id, nested=True)
    return mlflow.start_run(
        run_name=f"iteration-{k}", nested=True, parent_run_id=parent_run_id, tags={"qevolve.iteration": str(k)}
    )


def render_credit(k: int, limit: int = SAMPLE_TRAJECTORIES) -> str:
    """A few trajectories of iteration k's hybrid dataset with each step's auxiliary reward and advantage:
    where the critic put the credit. Won and lost self rollouts first, then an expert demonstration."""
    trajs = read_store(paths.hybrid(k))
    adv = read_advantages(paths.advantages(k))
    own = [t for t in trajs if t.source != "expert"]
    picks = [t for t in own if t.won][: limit // 2] + [t for t in own if not t.won][: limit // 2]
    picks += [t for t in trajs if t.source == "expert"][:1]
    lines = [
        f"# Credit assignment, iteration {k}",
        "",
        "A = normalised advantage (GAE over the critic's V); aux = relabeling reward.",
        "",
    ]
    for t in picks:
        lines += [
            f"## {t.task_id} ({t.source}) — {'won' if t.won else 'lost: ' + t.failure}",
            f"**Task:** {t.instruction}",
            "",
            "| step | action | aux | reason | A |",
            "|---:|---|---:|---|---:|",
        ]
        for st in t.steps:
            a = adv.get((t.trajectory_id, st.step), float("nan"))
            lines.append(
                f"| {st.step + 1} | `{st.action or st.output}` | {st.aux_reward:+.2f} | {st.aux_reason} | {a:+.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def _curve_metrics(stage: str, name: str, keys: tuple[str, ...], x: str = "step") -> None:
    for point in json.loads(paths.curve(name).read_text()):
        mlflow.log_metrics({f"{stage}/train_{key}": point[key] for key in keys if key in point}, step=point[x])


def _histogram_figure(rows: list[dict], axes: tuple[str, ...], title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    x, y = axes[:2]
    width = rows[1][x] - rows[0][x] if len(rows) > 1 else 1.0
    ax.bar([r[x] for r in rows], [r[y] for r in rows], width=width * 0.9)
    ax.set(xlabel=x, ylabel=y, title=title)
    fig.tight_layout()
    return fig


def log_iteration_views(k: int) -> None:
    if paths.hybrid(k).exists():  # Q-Evolve's iterations (relabelled data and GAE advantages)
        mlflow.log_text(render_credit(k), f"trajectories/credit@{k}.md")


def log_evolution_views(iterations: int) -> None:
    """On the parent run: success rate per split across iterations, as metrics and as a plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for k in range(iterations + 1):
        path = paths.metrics(f"evaluate@{k}")
        if path.exists():
            for split, m in json.loads(path.read_text()).items():
                series.setdefault(split, []).append((k, m["success_rate"]))
    fig, ax = plt.subplots(figsize=(5, 3))
    for split, points in series.items():
        ax.plot([k for k, _ in points], [v for _, v in points], marker="o", label=split)
    ax.set(xlabel="iteration (0 = BC)", ylabel="success rate", ylim=(0, 1), title="Success across iterations")
    ax.set_xticks(range(iterations + 1))
    ax.legend()
    fig.tight_layout()
    mlflow.log_figure(fig, "success_by_iteration.png")
    plt.close(fig)


def lineage_tags(result: dict) -> dict[str, str]:
    """What joins the stage's MLflow metrics to its artifacts and where it ran: the content hash of each of its
    outputs as dvc.lock records them (`qevolve.dvc.policy-1.models/policy-1`), and for a stage run on a work
    pool, the pool and the Prefect flow run that computed it."""
    import yaml

    tag = result["stage"].replace("@", "-")
    lock = yaml.safe_load(Path("dvc.lock").read_text()) if Path("dvc.lock").exists() else {}
    entry = (lock or {}).get("stages", {}).get(result["stage"], {})
    tags = {
        f"qevolve.dvc.{tag}.{out['path'].replace('@', '-')}": out["md5"]
        for out in entry.get("outs", [])
        if "md5" in out
    }
    if result.get("pool"):
        tags |= {f"qevolve.pool.{tag}": result["pool"], f"qevolve.prefect_flow_run.{tag}": result["flow_run_id"]}
    return tags


class TrackingUnavailable(UserError):
    """The MLflow tracking store failed while a stage was logged."""

    hint = (
        "the stage's outputs are computed and recorded in dvc.lock; rerun once the tracking server answers (the rerun "
        "logs it), or unset MLFLOW_TRACKING_URI to track in the workspace's mlflow.db"
    )


def log_stage(result: dict, spec: Stage) -> None:
    """Metrics (numbers only) under the stage's name, plus what its recipe says MLflow gets of it
    (`Stage.logged`); a tracking store that fails is a `TrackingUnavailable` naming it."""
    try:
        _log_stage(result, spec)
    except (mlflow.exceptions.MlflowException, OSError) as err:
        raise TrackingUnavailable(
            f"{result['stage']}: logging to MLflow at {mlflow.get_tracking_uri()} failed "
            f"({type(err).__name__}: {str(err)[:300]}); nothing computed is lost"
        ) from err


def _log_stage(result: dict, spec: Stage) -> None:
    name = result["stage"]
    stage, _, iteration = name.partition("@")
    step = int(iteration or 0)
    flat = flatten(result["metrics"])
    numbers = {
        k: v
        for k, v in flat.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.endswith(PLACEMENT)
    }
    mlflow.log_metrics({f"{stage}/{k}".replace(".", "/"): float(v) for k, v in numbers.items()}, step=step)
    # Where it computed, as tags (`qevolve.device.policy-1`; MLflow refuses `@` in tag keys).
    mlflow.set_tags(
        {
            f"qevolve.{k.rsplit('.', 1)[-1]}.{name.replace('@', '-')}": str(v)
            for k, v in flat.items()
            if k.endswith(PLACEMENT)
        }
    )
    mlflow.set_tags(lineage_tags(result))
    logged = spec.logged
    if logged.curve:
        _curve_metrics(stage, name, logged.curve, x=spec.curve[0])
    if logged.artifact:
        mlflow.log_artifacts(str(spec.writes(step)[logged.artifact[0]]), logged.artifact[1])
    if logged.trajectories:
        mlflow.log_text(render_trajectories(spec.writes(step)[logged.trajectories]), f"trajectories/{name}.md")
    if logged.histogram:
        import matplotlib.pyplot as plt

        fig = _histogram_figure(
            json.loads(paths.curve(name).read_text()), spec.curve, f"{spec.curve[0].capitalize()}s, iteration {step}"
        )
        mlflow.log_figure(fig, f"{stage}_hist@{step}.png")
        plt.close(fig)
    if stage == "evaluate" and step:  # also on the parent run, so its metrics chart the whole evolution
        parent = mlflow.active_run().data.tags.get("mlflow.parentRunId")
        if parent:
            client = mlflow.MlflowClient()
            for k, v in numbers.items():
                client.log_metric(parent, f"evaluate/{k}".replace(".", "/"), float(v), step=step)
