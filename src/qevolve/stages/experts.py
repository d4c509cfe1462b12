"""`experts`: demonstrations from the environment's expert on a subset of train tasks, and, for the positive
control (`experts.corrupt`), the same expert's failed episodes with a share of its actions replaced by random valid
ones or by one fixed mistake."""

from __future__ import annotations

import random
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from qevolve.config import ConfigError
from qevolve.data.atomic import write_json
from qevolve.data.store import StepRecord, Trajectory, write_store
from qevolve.environments import ENVIRONMENTS
from qevolve.envs import Task, make_env, select_tasks
from qevolve.envs.base import ENV_ERROR, check_env_failures, env_error
from qevolve.models.prompt import format_action
from qevolve.params import Params

CORRUPTED = "corrupted"
"""The source of a corrupted episode (`experts.corrupt`)."""


def demonstrate(env, task: Task, max_steps: int, seed: int = 0, corrupt: float = 0.0, wrong: str = "") -> Trajectory:
    """Play the expert on one task; the trajectory records whether it won. With `corrupt` > 0, each step's action is,
    with that chance, `wrong` where it is valid, else one of the valid actions drawn at random (source `corrupted`;
    the draws are seeded by the task, so the episode does not depend on the worker).

    ALFWorld's handcoded expert breaks ties at random; its generator is seeded per task (`seed_random`, else the
    global `random`), so a demonstration does not depend on which worker played it or what it played before."""
    getattr(env, "seed_random", random.seed)(f"{seed}:{task.split}/{task.id}")  # in the env's process
    draw = random.Random(f"corrupt:{seed}:{task.split}/{task.id}")
    first = env.reset(task)
    traj = Trajectory(
        uuid.uuid4().hex, task.id, task.type, task.split, CORRUPTED if corrupt else "expert", first.instruction
    )
    obs, valid = first.text, first.admissible
    for t in range(max_steps):
        if corrupt and draw.random() < corrupt and valid:
            action = wrong if wrong in valid else draw.choice(valid)
        else:
            action = env.expert_action()
        if action is None:
            traj.failure = "expert has no action"
            return traj
        r = env.step(action)
        valid = r.admissible
        traj.steps.append(
            StepRecord(
                step=t,
                observation=obs,
                output=format_action(action),
                action=action,
                next_observation=r.observation,
                reward=r.reward,
                done=r.done,
                won=r.won,
                valid=r.valid,
            )
        )
        obs = r.observation
        if r.done:
            traj.won = r.won
            traj.failure = "" if r.won else "done"
            return traj
    traj.failure = "max_steps"
    return traj


def _demonstrate_all(params: Params, kind: str, tasks: list[Task], bar, corrupt: float = 0.0) -> list[Trajectory]:
    """One expert's demonstrations (corrupted ones with `corrupt` > 0), on one environment that is replaced (and
    its episode restarted, up to `env.retries` times) whenever it fails."""
    cfg = params.env
    env = make_env(cfg, expert=kind, worker=cfg.processes)
    out = []
    try:
        for task in tasks:
            for attempt in range(cfg.retries + 1):
                try:
                    max_steps = (
                        (params.experts.corrupt.max_steps or params.env.max_steps)
                        if corrupt
                        else params.experts.max_steps
                    )
                    traj = demonstrate(
                        env, task, max_steps, params.experts.seed, corrupt, params.experts.corrupt.action
                    )
                    break
                except Exception as err:  # noqa: BLE001 - a crashed simulator fails this demonstration only
                    env.close()
                    env = make_env(cfg, expert=kind, worker=cfg.processes)
                    traj = Trajectory(
                        uuid.uuid4().hex, task.id, task.type, task.split, CORRUPTED if corrupt else "expert", ""
                    )
                    traj.failure = env_error(err)
                    bar.write(
                        f"experts: {task.id}: environment failed ({err}); attempt {attempt + 1}/{cfg.retries + 1}"
                    )
            out.append(traj)
            bar.update(1)
    finally:
        env.close()
    return out


def experts(params: Params, out: Path, metrics_path: Path, details_path: Path) -> dict:
    """Write the won expert demonstrations to the store at `out`; return and write metrics, and each
    failed demonstration (expert, task, reason) to `details_path`."""
    cfg = params.experts
    if cfg.corrupt.episodes and not ENVIRONMENTS[params.env.name].lists_actions:
        raise ConfigError(
            f"experts.corrupt.episodes: {params.env.name} does not list its valid actions, which corrupted "
            f"episodes draw from"
        )
    tasks = select_tasks(make_env(params.env), cfg.split, params.env, 0, cfg.seed)
    tasks = random.Random(cfg.seed).sample(tasks, min(max(cfg.demos.values()), len(tasks)))
    corrupt = cfg.corrupt
    plays = [(kind, n, 0.0) for kind, n in cfg.demos.items()]
    plays += [(corrupt.expert or next(iter(cfg.demos)), corrupt.episodes, corrupt.share)] if corrupt.episodes else []
    jobs = [(kind, share, t) for kind, n, share in plays for t in tasks[:n]]
    # each expert's tasks dealt to `workers` environments, `workers` of them playing at a time
    shards = [(kind, tasks[:n][w :: cfg.workers], share) for kind, n, share in plays for w in range(cfg.workers)]
    shards = [(kind, ts, share) for kind, ts, share in shards if ts]
    threads = cfg.workers if params.env.processes else 1  # in-process simulators are not thread-safe
    with tqdm(total=len(jobs), desc="experts", unit="ep") as bar, ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(lambda shard: _demonstrate_all(params, shard[0], shard[1], bar, shard[2]), shards))
    by_job = {(kind, share, t.task_id): t for (kind, _, share), trajs in zip(shards, done) for t in trajs}
    every = [by_job[(kind, share, t.id)] for kind, share, t in jobs]
    trajs = [t for t in every if t.source != CORRUPTED]
    corrupted = [t for t in every if t.source == CORRUPTED]
    won = [t for t in trajs if t.won]
    lost = [t for t in corrupted if not t.won and not t.failure.startswith(ENV_ERROR)]
    _, failed = check_env_failures(every, params.env.max_failure_ratio, "experts")
    write_store(out, won + lost)
    metrics = {
        "episodes": len(trajs),
        "won": len(won),
        "success_rate": len(won) / max(len(trajs), 1),
        "mean_steps": sum(len(t.steps) for t in won) / max(len(won), 1),
        # every step the experts took, failed (and corrupted) episodes included: sample efficiency counts from here
        "cumulative_env_steps": sum(len(t.steps) for t in every),
        "env_failures": failed,
        # by kind of reason (`max_steps`, `done`, `env_error`): a few columns, whatever the tasks
        "failures": dict(Counter(t.failure.split(":")[0] for t in trajs if not t.won)),
        **({"corrupted_episodes": len(corrupted), "corrupted_kept": len(lost)} if corrupt.episodes else {}),
    }
    write_json(
        details_path,
        [
            {"expert": kind, "task_id": t.task_id, "reason": t.failure}
            for (kind, share, _), t in zip(jobs, every)
            if not t.won and not share
        ],
    )
    write_json(metrics_path, metrics)
    return metrics
