"""`teacher`: `terminaltraj.teacher.rollouts` episodes of the noisy scripted teacher on every train task
(`qevolve.envs.terminal_tasks.teacher_plan`: the task's oracle with its mistakes at `p_err` and recoveries
at `p_fix`; a task without `solution/mistakes.json` gets the plain oracle), all of them kept, won or lost,
with the validators' per-test results beside the store (`validator.json`)."""

from __future__ import annotations

import json
import random
import uuid
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from qevolve.config import Params
from qevolve.data.atomic import atomic_dir, write_json
from qevolve.data.store import StepRecord, Trajectory, write_store
from qevolve.envs.terminal import TerminalEnv, oracle_steps
from qevolve.envs.terminal_tasks import teacher_plan
from qevolve.models.prompt import format_action

VALIDATOR = "validator.json"


def play(env: TerminalEnv, task, plan: list[str]) -> Trajectory:
    first = env.reset(task)
    traj = Trajectory(uuid.uuid4().hex, task.id, task.type, task.split, "teacher", first.instruction)
    obs = first.text
    for t, action in enumerate(plan):
        r = env.step(action)
        traj.steps.append(StepRecord(step=t, observation=obs, output=format_action(action), action=action, next_observation=r.observation,
                                     reward=r.reward, done=r.done, won=r.won, valid=r.valid))
        obs = r.observation
        if r.done:
            traj.won, traj.failure = r.won, "" if r.won else "done"
            return traj
    traj.failure = "max_steps"
    return traj


def teacher(params: Params, instances_dir: Path, out: Path, metrics_path: Path) -> dict:
    cfg = params.terminaltraj.teacher
    env = TerminalEnv(str(instances_dir), params.env.terminal, params.env.max_steps)
    tasks = env.tasks("train")
    trajs, tests = [], {}
    try:
        for task, r in tqdm([(t, r) for t in tasks for r in range(cfg.rollouts)], desc="teacher", unit="ep"):
            folder = Path(instances_dir) / task.split / task.id / "solution"
            mistakes = json.loads((folder / "mistakes.json").read_text()) if (folder / "mistakes.json").is_file() else []
            plan = teacher_plan(oracle_steps((folder / "solve.sh").read_text()), mistakes, random.Random(f"{cfg.seed}:{task.id}:{r}"), cfg.p_err, cfg.p_fix)
            traj = play(env, task, plan)
            trajs.append(traj)
            tests[traj.trajectory_id] = {"tests_passed": env.info.get("tests_passed", 0), "tests_total": env.info.get("tests_total", 0)}
    finally:
        env.close()
    with atomic_dir(out) as tmp:
        write_store(tmp, trajs)
        write_json(tmp / VALIDATOR, tests)
    by_family = Counter(t.task_type for t in trajs)
    won = Counter(t.task_type for t in trajs if t.won)
    metrics = {
        "rollouts": len(trajs), "tasks": len(tasks), "verified": sum(won.values()), "verified_rate": sum(won.values()) / max(len(trajs), 1),
        "mean_steps": sum(len(t.steps) for t in trajs) / max(len(trajs), 1),
        "cumulative_env_steps": sum(len(t.steps) for t in trajs),
        "verified_rate_by_family": {f: won[f] / n for f, n in sorted(by_family.items())},
    }
    write_json(metrics_path, metrics)
    return metrics
