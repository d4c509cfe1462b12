"""Play a policy on many tasks at once: one environment per slot, the policy batched across slots.

A slot whose episode ends is refilled with the next task straight away, so the batch stays full. An
environment that raises (a crashed simulator, a worker past its timeout) is replaced by a fresh one and
its episode restarted, up to `retries` times; after that the episode is recorded as failed with reason
`env_error: ...`. The run goes on, and fails loudly only when more than `max_failure_ratio` of the
episodes failed that way.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from qevolve.config import EnvConfig
from qevolve.data.atomic import write_json
from qevolve.data.store import StepRecord, Trajectory, write_store
from qevolve.envs import make_env as make_configured_env
from qevolve.envs import select_tasks
from qevolve.envs.base import Task, TextEnv, check_env_failures, env_error, env_failures
from qevolve.models.policy import Actor
from qevolve.models.prompt import clean_text
from qevolve.params import Params


@dataclass
class _Episode:
    task: Task
    traj: Trajectory
    observations: list[str]
    admissible: list[str]
    outputs: list[str] = field(default_factory=list)
    state: dict = field(default_factory=dict)
    """What a stateful actor keeps about the episode (a hierarchical agent: its subtask and progress)."""
    generator: torch.Generator | None = None
    """The episode's own sampling stream (`episode_seed`)."""


def episode_seed(seed: int, index: int, task_id: str, attempt: int) -> int:
    """The seed of one episode's sampling, from the stage's `seed` and the episode alone (its place in the
    task list, its task and its restart count), so what an episode draws does not depend on the episodes
    it is batched with, on the batch size, or on how many policy replicas serve the batch."""
    digest = hashlib.sha256(f"{seed}/{index}/{task_id}/{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _attempt(call: Callable, arg):
    """`call(arg)`, or the exception it raised."""
    try:
        return call(arg)
    except Exception as err:  # noqa: BLE001 - any simulator fault is handled per episode by the caller
        return err


def play(
    make_env: Callable[[], TextEnv],
    tasks: list[Task],
    actor: Actor,
    *,
    max_steps: int,
    greedy: bool,
    source: str,
    batch_size: int,
    seed: int = 0,
    desc: str = "rollout",
    max_failure_ratio: float = 0.0,
    retries: int = 0,
    parallel: bool = False,
) -> list[Trajectory]:
    """Roll `actor` out on every task; trajectories come back in the order of `tasks`.

    Each round `actor.decide` picks the next output of every running episode, `actor.parse` reads its
    action (None: a format error, not sent to the environment), the environments step, and
    `actor.observed` sees the episodes that stepped (a flat `Actor` ignores it; a hierarchical agent
    updates its progress there). Each episode samples from its own generator (`episode_seed`).

    An episode ends at `max_steps` or at its task's own limit (`Task.max_steps`), whichever is smaller.
    When its environment raises (for an `EnvWorker`: dies or times out), the episode is restarted from its
    first step on a fresh environment up to `retries` times, then recorded with `failure` =
    `env_error: <exception>` (see `env_failures`). `parallel`: step the environments from one thread
    each, for environments that run in worker processes."""
    run = _Rollout(make_env, tasks, batch_size, source, seed, desc, retries, parallel)
    try:
        run.refill()
        while any(run.slots):
            run.turn(actor, greedy, max_steps)
            run.refill()
    finally:
        run.close()
    trajs = [run.results[i] for i in range(len(tasks))]
    check_env_failures(trajs, max_failure_ratio, desc)
    return trajs


class _Rollout:
    """`play`'s state: an environment per slot, the tasks waiting, each slot's episode, the finished ones."""

    def __init__(
        self,
        make_env: Callable[[], TextEnv],
        tasks: list[Task],
        batch_size: int,
        source: str,
        seed: int,
        desc: str,
        retries: int,
        parallel: bool,
    ):
        self.make_env, self.tasks, self.source, self.seed, self.desc, self.retries = (
            make_env,
            tasks,
            source,
            seed,
            desc,
            retries,
        )
        self.envs = [make_env() for _ in range(min(batch_size, len(tasks)))]
        self.queue = list(enumerate(tasks))
        self.attempts = [0] * len(tasks)
        self.slots: list[tuple[int, _Episode] | None] = [None] * len(self.envs)
        self.results: dict[int, Trajectory] = {}
        self.bar = tqdm(total=len(tasks), desc=desc, unit="ep")
        self.pool = ThreadPoolExecutor(len(self.envs)) if parallel and self.envs else None
        self.map = self.pool.map if self.pool else map

    def fail(self, slot: int, index: int, traj: Trajectory, err: Exception) -> None:
        """The environment of `slot` failed: a fresh one replaces it, and the episode restarts (or is lost)."""
        self.slots[slot] = None
        try:
            self.envs[slot].close()
        except Exception:  # noqa: BLE001 - a crashed environment may not close cleanly either
            pass
        self.envs[slot] = self.make_env()
        if self.attempts[index] < self.retries:
            self.attempts[index] += 1
            self.queue.insert(0, (index, self.tasks[index]))
            self.bar.write(
                f"{self.desc}: {self.tasks[index].id}: environment failed ({err}); restarting the episode "
                f"({self.attempts[index]}/{self.retries})"
            )
            return
        traj.won, traj.failure = False, env_error(err)
        self.finish(index, traj)

    def finish(self, index: int, traj: Trajectory) -> None:
        self.results[index] = traj
        self.bar.update(1)

    def refill(self) -> None:
        """Start the next tasks in every free slot, resetting their environments in parallel."""
        while jobs := [(s, self.queue.pop(0)) for s in range(len(self.envs)) if self.slots[s] is None and self.queue]:
            firsts = list(self.map(lambda job: _attempt(self.envs[job[0]].reset, job[1][1]), jobs))
            for (s, (index, task)), first in zip(jobs, firsts):
                traj = Trajectory(uuid.uuid4().hex, task.id, task.type, task.split, self.source, "")
                if isinstance(first, Exception):
                    self.fail(s, index, traj, first)
                    continue
                traj.instruction = first.instruction
                generator = torch.Generator().manual_seed(episode_seed(self.seed, index, task.id, self.attempts[index]))
                self.slots[s] = (index, _Episode(task, traj, [first.text], first.admissible, generator=generator))

    def turn(self, actor: Actor, greedy: bool, max_steps: int) -> None:
        """One output per running episode (`actor.decide`), parsed and stepped, each step recorded; the
        episodes that end free their slots. `actor.observed` sees the episodes that moved."""
        active = [s for s, e in enumerate(self.slots) if e is not None]
        episodes = [self.slots[s][1] for s in active]
        decisions = actor.decide(episodes, greedy, active)
        outputs = [clean_text(d.output) for d in decisions]  # whatever the backend decoded, the store holds valid UTF-8
        actions = [actor.parse(o) for o in outputs]
        stepping = [(s, a) for s, a in zip(active, actions) if a is not None]
        stepped = dict(
            zip([s for s, _ in stepping], self.map(lambda job: _attempt(self.envs[job[0]].step, job[1]), stepping))
        )
        moved = []
        for s, ep, d, output, action in zip(active, episodes, decisions, outputs, actions):
            if action is None:
                obs, reward, done, won, valid, admissible = ep.observations[-1], 0.0, False, False, False, ep.admissible
            else:
                r = stepped[s]
                if isinstance(r, Exception):
                    self.fail(s, self.slots[s][0], ep.traj, r)
                    continue
                obs, reward, done, won, valid, admissible = (
                    r.observation,
                    r.reward,
                    r.done,
                    r.won,
                    r.valid,
                    r.admissible,
                )
            ep.traj.steps.append(
                StepRecord(
                    step=len(ep.outputs),
                    observation=ep.observations[-1],
                    output=output,
                    action=action,
                    next_observation=obs,
                    reward=reward,
                    done=done,
                    won=won,
                    valid=valid,
                    logp=d.logp,
                    prompt_tokens=d.prompt_tokens,
                    output_tokens=d.output_tokens,
                )
            )
            moved.append(ep)
            ep.outputs.append(output)
            ep.observations.append(obs)
            ep.admissible = admissible
            if done or len(ep.outputs) >= min(max_steps, ep.task.max_steps or max_steps):
                ep.traj.won = won
                ep.traj.failure = "" if won else ("done" if done else "max_steps")
                self.finish(self.slots[s][0], ep.traj)
                self.slots[s] = None
                self.bar.set_postfix(success=f"{sum(t.won for t in self.results.values())}/{len(self.results)}")
        actor.observed(moved)

    def close(self) -> None:
        self.bar.close()
        if self.pool:
            self.pool.shutdown()
        for env in self.envs:
            env.close()


def play_in(cfg: EnvConfig, tasks: list[Task], actor: Actor, **kwargs) -> list[Trajectory]:
    """`play` on environments built from `cfg`: its step cap, failure ratio, retries and worker processes."""
    return play(
        lambda: make_configured_env(cfg, worker=cfg.processes),
        tasks,
        actor,
        max_steps=cfg.max_steps,
        max_failure_ratio=cfg.max_failure_ratio,
        retries=cfg.retries,
        parallel=cfg.processes,
        **kwargs,
    )


def another_round(spent: int, budget: int, rounds: int) -> bool:
    """Whether one more round brings the env steps spent nearer the budget: yes while more than half
    a round (the mean of the rounds so far) of the budget is left."""
    return budget - spent > (spent / rounds / 2 if rounds else 0)


def episode_metrics(trajs: list[Trajectory]) -> dict:
    """Success rate, average reward, steps, invalid-action and repeated-action rates (a step repeating its
    episode's previous action), tokens per episode, and episodes and successes per task type
    (TextCraft's recipe depth, ALFWorld's task type)."""
    n = max(len(trajs), 1)
    steps = [s for t in trajs for s in t.steps]
    repeated = sum(a.action is not None and a.action == b.action for t in trajs for b, a in zip(t.steps, t.steps[1:]))
    types = sorted({t.task_type for t in trajs})
    return {
        "episodes": len(trajs),
        "success_rate": sum(t.won for t in trajs) / n,
        "avg_reward": sum(t.reward for t in trajs) / n,
        "avg_steps": len(steps) / n,
        "invalid_rate": sum(not s.valid for s in steps) / max(len(steps), 1),
        "repeated_rate": repeated / max(len(steps), 1),
        "output_tokens_per_episode": sum(s.output_tokens for s in steps) / n,
        "prompt_tokens_per_episode": sum(s.prompt_tokens for s in steps) / n,
        "by_type": {
            ty: {
                "episodes": sum(t.task_type == ty for t in trajs),
                "won": sum(t.won for t in trajs if t.task_type == ty),
            }
            for ty in types
        },
    }


def count_round(state: dict, trajs: list[Trajectory], env_cfg: EnvConfig, stage: str) -> list[Trajectory]:
    """Add an online round's episodes to its stage's running counts (`state`: env steps, tokens, generated
    tokens, episodes, won); the episodes the environment failed count in the steps but are left out
    (`check_env_failures`). Returns the episodes kept."""
    steps = [s for t in trajs for s in t.steps]
    state["env_steps"] += len(steps)
    state["tokens"] += sum(s.prompt_tokens + s.output_tokens for s in steps)
    state["generated_tokens"] += sum(s.output_tokens for s in steps)
    trajs, _ = check_env_failures(trajs, env_cfg.max_failure_ratio, stage)
    state["episodes"] += len(trajs)
    state["won"] += sum(t.won for t in trajs)
    return trajs


def online_metrics(state: dict, previous_metrics: Path) -> dict:
    """An online stage's rounds, episodes and success rate, and what it spent (`spent`), from its counts."""
    return {
        "rounds": state["round"],
        "episodes": state["episodes"],
        "success_rate": state["won"] / max(state["episodes"], 1),
        **spent(state["env_steps"], state["tokens"], state["generated_tokens"], previous_metrics),
    }


def spent(env_steps: int, tokens: int, generated: int, previous_metrics: Path) -> dict:
    """A playing stage's env steps, tokens and generated tokens, each also added to the running total in
    `previous_metrics` (the experts' metrics for iteration 1, else the previous playing stage's)."""
    before = json.loads(Path(previous_metrics).read_text())
    return {
        "env_steps": env_steps,
        "cumulative_env_steps": before["cumulative_env_steps"] + env_steps,
        "tokens": tokens,
        "cumulative_tokens": before.get("cumulative_tokens", 0) + tokens,
        "generated_tokens": generated,
        "cumulative_generated_tokens": before.get("cumulative_generated_tokens", 0) + generated,
    }


def play_collection(params: Params, actor, iteration: int) -> tuple[list[Trajectory], dict[str, int], int]:
    """`collect@k`'s episodes: `collect.samples_per_task` sampled episodes of each of `collect.num_tasks` tasks
    of `collect.split`, drawn with the iteration's seed. Returns the episodes the environment did not fail,
    the failures by reason (`env_failures`) and the number of tasks."""
    cfg = params.collect
    tasks = select_tasks(make_configured_env(params.env), cfg.split, params.env, cfg.num_tasks, cfg.seed + iteration)
    trajs = play_in(
        params.env,
        [t for t in tasks for _ in range(cfg.samples_per_task)],
        actor,
        greedy=False,
        source=f"policy@{iteration - 1}",
        batch_size=cfg.batch_size,
        seed=cfg.seed + iteration,
        desc=f"collect@{iteration}",
    )
    failures = env_failures(trajs)
    trajs, _ = check_env_failures(trajs, params.env.max_failure_ratio, f"collect@{iteration}")
    return trajs, failures, len(tasks)


def collection_metrics(trajs: list[Trajectory], tasks: int, failures: dict[str, int], previous_metrics: Path) -> dict:
    """A collecting stage's metrics: its episodes' success, env steps and tokens, each also added to the
    running totals in `previous_metrics` (the experts' for iteration 1, else the previous collection's)."""
    env_steps = sum(len(t.steps) for t in trajs)
    tokens = sum(s.prompt_tokens + s.output_tokens for t in trajs for s in t.steps)
    generated = sum(s.output_tokens for t in trajs for s in t.steps)
    return {
        "env_failures": sum(failures.values()),
        "env_failure_reasons": failures,
        "episodes": len(trajs),
        "tasks": tasks,
        "success_rate": sum(t.won for t in trajs) / max(len(trajs), 1),
        **spent(env_steps, tokens, generated, previous_metrics),
        "invalid_rate": sum(not s.valid for t in trajs for s in t.steps) / max(env_steps, 1),
    }


def play_splits(params: Params, actor: Actor, out: Path, metrics_path: Path, source: str, env_steps_path: Path) -> dict:
    """Greedy episodes of `actor` on every configured split; metrics per split, episodes in `out`."""
    cfg = params.evaluate
    lister = make_configured_env(params.env)
    all_trajs, metrics = [], {}
    spent = json.loads(Path(env_steps_path).read_text())
    for split, count in cfg.splits.items():
        cut = len(actor.builder.truncated)
        tasks = select_tasks(lister, split, params.env, count, cfg.seed)
        trajs = play_in(
            params.env,
            tasks,
            actor,
            greedy=True,
            source=source,
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            desc=f"{source} {split}",
        )
        trajs, failures = check_env_failures(trajs, params.env.max_failure_ratio, f"{source} {split}")
        metrics[split] = {
            **episode_metrics(trajs),
            "cumulative_env_steps": spent["cumulative_env_steps"],
            "cumulative_generated_tokens": spent.get("cumulative_generated_tokens", 0),
            "truncated_observations": len(actor.builder.truncated) - cut,
            "env_failures": failures,
            **actor.backend.placement(),
        }
        all_trajs += trajs
    write_store(out, all_trajs)
    write_json(metrics_path, metrics)
    return metrics
