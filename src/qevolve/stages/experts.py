"""`experts`: demonstrations from the environment's expert on a subset of train tasks."""

from __future__ import annotations

import random
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from qevolve.config import Params
from qevolve.data.atomic import write_json
from qevolve.data.store import StepRecord, Trajectory, write_store
from qevolve.envs import Task, make_env, select_tasks
from qevolve.envs.base import check_env_failures, env_error
from qevolve.models.prompt import format_action

def demonstrate(env, task: Task, max_steps: int, seed: int = 0) -> Trajectory:
    """Play the expert on one task; the trajectory records whether it won.

    ALFWorld's handcoded expert breaks ties with Python's global `random`; it is seeded per task, so a
    demonstration does not depend on which worker played it or what it played before."""
    getattr(env, "seed_random", random.seed)(f"{seed}:{task.split}/{task.id}")  # in the env's process
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


def _demonstrate_all(params: Params, kind: str, tasks: list[Task], bar) -> list[Trajectory]:
    """One expert's demonstrations, on one environment that is replaced (and its episode restarted, up to
    `env.retries` times) whenever it fails."""
    cfg = params.env
    env = make_env(cfg, expert=kind, worker=cfg.processes)
    out = []
    try:
        for task in tasks:
            for attempt in range(cfg.retries + 1):
                try:
                    traj = demonstrate(env, task, params.experts.max_steps, params.experts.seed)
                    break
                except Exception as err:  # noqa: BLE001 - a crashed simulator fails this demonstration only
                    env.close()
                    env = make_env(cfg, expert=kind, worker=cfg.processes)
                    traj = Trajectory(uuid.uuid4().hex, task.id, task.type, task.split, "expert", "")
                    traj.failure = env_error(err)
                    bar.write(f"experts: {task.id}: environment failed ({err}); attempt {attempt + 1}/{cfg.retries + 1}")
            out.append(traj)
            bar.update(1)
    finally:
        env.close()
    return out


def experts(params: Params, out: Path, metrics_path: Path, details_path: Path) -> dict:
    """Write the won expert demonstrations to the store at `out`; return and write metrics, and each
    failed demonstration (expert, task, reason) to `details_path`."""
    cfg = params.experts
    tasks = select_tasks(make_env(params.env), cfg.split, params.env, 0, cfg.seed)
    tasks = random.Random(cfg.seed).sample(tasks, min(max(cfg.demos.values()), len(tasks)))
    jobs = [(kind, t) for kind, n in cfg.demos.items() for t in tasks[:n]]
    # each expert's tasks dealt to `workers` environments, `workers` of them playing at a time
    shards = [(kind, tasks[:n][w::cfg.workers]) for kind, n in cfg.demos.items() for w in range(cfg.workers)]
    shards = [(kind, ts) for kind, ts in shards if ts]
    threads = cfg.workers if params.env.processes else 1  # in-process simulators are not thread-safe
    with tqdm(total=len(jobs), desc="experts", unit="ep") as bar, ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(lambda shard: _demonstrate_all(params, *shard, bar), shards))
    by_job = {(kind, t.task_id): t for (kind, _), trajs in zip(shards, done) for t in trajs}
    trajs = [by_job[(kind, t.id)] for kind, t in jobs]
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
        # by kind of reason (`max_steps`, `done`, `env_error`): a few columns, whatever the tasks
        "failures": dict(Counter(t.failure.split(":")[0] for t in trajs if not t.won)),
    }
    write_json(details_path, [{"expert": kind, "task_id": t.task_id, "reason": t.failure} for (kind, _), t in zip(jobs, trajs) if not t.won])
    write_json(metrics_path, metrics)
    return metrics
