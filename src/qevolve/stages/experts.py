"""`experts`: demonstrations from the environment's expert on a subset of train tasks."""

from __future__ import annotations

import multiprocessing as mp
import random
import uuid
from pathlib import Path

from tqdm import tqdm

from qevolve.config import Params
from qevolve.data.atomic import write_json
from qevolve.data.store import StepRecord, Trajectory, write_store
from qevolve.envs import Task, make_env, select_tasks
from qevolve.envs.base import check_env_failures, env_error
from qevolve.models.prompt import format_action

_worker_params: Params | None = None
_worker_envs: dict[str, object] = {}


def _init_worker(params: Params) -> None:
    global _worker_params
    _worker_params = params


def demonstrate(env, task: Task, max_steps: int, seed: int = 0) -> Trajectory:
    """Play the expert on one task; the trajectory records whether it won.

    ALFWorld's handcoded expert breaks ties with Python's global `random`; it is seeded per task, so a
    demonstration does not depend on which worker played it or what it played before."""
    random.seed(f"{seed}:{task.split}/{task.id}")
    first = env.reset(task)
    traj = Trajectory(uuid.uuid4().hex, task.id, task.type, task.split, "expert", first.instruction)
    obs = first.text
    for t in range(max_steps):
        action = env.expert_action()
        if action is None:
            traj.failure = "expert has no action"
            return traj
        r = env.step(action)
        traj.steps.append(
            StepRecord(
                step=t, observation=obs, output=format_action(action), action=action, next_observation=r.observation,
                reward=r.reward, done=r.done, won=r.won, valid=r.valid,
            )
        )
        obs = r.observation
        if r.done:
            traj.won = r.won
            traj.failure = "" if r.won else "done"
            return traj
    traj.failure = "max_steps"
    return traj


def _demonstrate_in_worker(args: tuple[str, Task, int]) -> Trajectory:
    kind, task, max_steps = args
    if kind not in _worker_envs:  # one environment per expert kind, reused across tasks
        _worker_envs[kind] = make_env(_worker_params.env, expert=kind)
    try:
        return demonstrate(_worker_envs[kind], task, max_steps, _worker_params.experts.seed)
    except Exception as err:  # noqa: BLE001 - a crashed simulator fails this demonstration only
        _worker_envs.pop(kind).close()
        traj = Trajectory(uuid.uuid4().hex, task.id, task.type, task.split, "expert", "")
        traj.failure = env_error(err)
        return traj


def experts(params: Params, out: Path, metrics_path: Path) -> dict:
    """Write the won expert demonstrations to the store at `out`; return and write metrics."""
    cfg = params.experts
    tasks = select_tasks(make_env(params.env), cfg.split, params.env, 0, cfg.seed)
    tasks = random.Random(cfg.seed).sample(tasks, min(max(cfg.demos.values()), len(tasks)))
    jobs = [(kind, t, cfg.max_steps) for kind, n in cfg.demos.items() for t in tasks[:n]]
    with mp.get_context("spawn").Pool(min(cfg.workers, len(jobs)), _init_worker, (params,)) as pool:
        trajs = list(tqdm(pool.imap(_demonstrate_in_worker, jobs), total=len(jobs), desc="experts", unit="ep"))
    won = [t for t in trajs if t.won]
    _, failed = check_env_failures(trajs, params.env.max_failure_ratio, "experts")
    write_store(out, won)
    metrics = {
        "episodes": len(trajs),
        "won": len(won),
        "success_rate": len(won) / max(len(trajs), 1),
        "mean_steps": sum(len(t.steps) for t in won) / max(len(won), 1),
        # every step the experts took, failed episodes included: sample efficiency counts from here
        "cumulative_env_steps": sum(len(t.steps) for t in trajs),
        "env_failures": failed,
        "failures": {f"{kind}:{t.task_id}": t.failure for (kind, *_), t in zip(jobs, trajs) if not t.won},
    }
    write_json(metrics_path, metrics)
    return metrics
