"""`teacher`: `terminaltraj.teacher.rollouts` episodes on every train task, all of them kept, won or lost,
with the validators' per-test results beside the store (`validator.json`). The teacher is the noisy
scripted one (`kind: scripted`, `qevolve.envs.terminal_tasks.teacher_plan`: the task's oracle with its
mistakes at `p_err` and recoveries at `p_fix`; a task without `solution/mistakes.json` gets the plain
oracle) or a chat model behind an OpenAI-compatible URL (`kind: llm`), one command per turn."""

from __future__ import annotations

import json
import random
import re
import uuid
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from qevolve.data.atomic import atomic_dir, write_json
from qevolve.data.store import StepRecord, Trajectory, write_store
from qevolve.envs.terminal import ORACLE, SUBMIT, TaskError, TerminalEnv, has_oracle, oracle_steps
from qevolve.envs.terminal_tasks import teacher_plan
from qevolve.llm import chat
from qevolve.models.prompt import format_action
from qevolve.params import Params

VALIDATOR = "validator.json"
SYSTEM = (
    "You operate a bash shell in a Linux sandbox, in its working directory /app, to complete the user's task. "
    "Each turn, reply with exactly one shell command in a ```bash code block; you will see its output and exit status. "
    f"When the task is complete, reply with the single word `{SUBMIT}`."
)
FENCE = re.compile(r"```(?:bash|sh|shell)?[ \t]*\n(.*?)```", re.S)


def command_of(reply: str) -> str:
    """The command in an LLM teacher's reply: its first code block, else its first non-empty line (`submit` as is)."""
    block = FENCE.search(reply)
    text = block.group(1) if block else next((ln for ln in reply.splitlines() if ln.strip()), "")
    text = text.strip().strip("`").strip()
    return SUBMIT if text.lower() == SUBMIT else text


class LLMTeacher:
    """A chat model playing one episode: the system prompt, the task and the first screen, then each command's
    output."""

    def __init__(self, cfg):
        self.cfg, self.messages = cfg, []

    def __call__(self, observation: str, instruction: str | None = None) -> str:
        if instruction is not None:
            self.messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Task:\n{instruction}\n\n{observation}"},
            ]
        else:
            self.messages.append({"role": "user", "content": observation})
        reply = chat(
            self.cfg.url,
            self.cfg.model,
            self.messages,
            key="terminaltraj.teacher.url",
            temperature=self.cfg.temperature,
            max_tokens=512,
        )
        self.messages.append({"role": "assistant", "content": reply})
        return command_of(reply)


def play(env: TerminalEnv, task, teacher) -> Trajectory:
    """One episode: `teacher` is a list of commands (a plan) or a callable (observation, instruction) -> command."""
    first = env.reset(task)
    traj = Trajectory(uuid.uuid4().hex, task.id, task.type, task.split, "teacher", first.instruction)
    obs = first.text
    plan = teacher if isinstance(teacher, list) else None
    for t in range(len(plan) if plan is not None else env.max_steps):
        action = plan[t] if plan is not None else teacher(obs, first.instruction if t == 0 else None)
        r = env.step(action)
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
            traj.won, traj.failure = r.won, "" if r.won else "done"
            return traj
    traj.failure = "max_steps"
    return traj


def teacher(params: Params, instances_dir: Path, out: Path, metrics_path: Path) -> dict:
    cfg = params.terminaltraj.teacher
    env = TerminalEnv(str(instances_dir), params.env.terminal, params.env.max_steps)
    tasks = env.tasks("train")
    without = (
        [t.id for t in tasks if not has_oracle(Path(instances_dir) / t.split / t.id)] if cfg.kind == "scripted" else []
    )
    if without:
        raise TaskError(
            f"{instances_dir}/train: {len(without)} validator-only tasks (no {ORACLE}: {', '.join(without[:3])}); "
            f"the scripted "
            "teacher (terminaltraj.teacher.kind: scripted) plays a task's oracle: use kind `llm` for them"
        )
    trajs, tests = [], {}
    try:
        for task, r in tqdm([(t, r) for t in tasks for r in range(cfg.rollouts)], desc="teacher", unit="ep"):
            if cfg.kind == "llm":
                traj = play(env, task, LLMTeacher(cfg))
            else:
                folder = Path(instances_dir) / task.split / task.id / "solution"
                mistakes = (
                    json.loads((folder / "mistakes.json").read_text()) if (folder / "mistakes.json").is_file() else []
                )
                plan = teacher_plan(
                    oracle_steps((folder / "solve.sh").read_text()),
                    mistakes,
                    random.Random(f"{cfg.seed}:{task.id}:{r}"),
                    cfg.p_err,
                    cfg.p_fix,
                )
                traj = play(env, task, plan)
            trajs.append(traj)
            tests[traj.trajectory_id] = {
                "tests_passed": env.info.get("tests_passed", 0),
                "tests_total": env.info.get("tests_total", 0),
            }
    finally:
        env.close()
    with atomic_dir(out) as tmp:
        write_store(tmp, trajs)
        write_json(tmp / VALIDATOR, tests)
    by_family = Counter(t.task_type for t in trajs)
    won = Counter(t.task_type for t in trajs if t.won)
    metrics = {
        "rollouts": len(trajs),
        "tasks": len(tasks),
        "verified": sum(won.values()),
        "verified_rate": sum(won.values()) / max(len(trajs), 1),
        "mean_steps": sum(len(t.steps) for t in trajs) / max(len(trajs), 1),
        "cumulative_env_steps": sum(len(t.steps) for t in trajs),
        "verified_rate_by_family": {f: won[f] / n for f, n in sorted(by_family.items())},
    }
    write_json(metrics_path, metrics)
    return metrics
