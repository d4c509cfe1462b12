"""Play a policy on many tasks at once: one environment per slot, the policy batched across slots.

A slot whose episode ends is refilled with the next task straight away, so the batch stays full. An
environment that raises (a crashed simulator) ends its episode as failed with reason `env_error: ...`
and is replaced by a fresh one; the run goes on, and fails loudly only when more than
`max_failure_ratio` of the episodes failed that way.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from qevolve.data.store import StepRecord, Trajectory
from qevolve.envs.base import Task, TextEnv, check_env_failures, env_error
from qevolve.models.policy import Actor
from qevolve.models.prompt import clean_text, parse_action


@dataclass
class _Episode:
    task: Task
    traj: Trajectory
    observations: list[str]
    admissible: list[str]
    outputs: list[str] = field(default_factory=list)


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
) -> list[Trajectory]:
    """Roll `actor` out on every task; trajectories come back in the order of `tasks`, those the
    environment failed marked with `failure` = `env_error: <exception>` (see `env_failures`)."""
    generator = torch.Generator().manual_seed(seed)
    envs = [make_env() for _ in range(min(batch_size, len(tasks)))]
    queue = list(enumerate(tasks))
    slots: list[tuple[int, _Episode] | None] = [None] * len(envs)
    results: dict[int, Trajectory] = {}
    bar = tqdm(total=len(tasks), desc=desc, unit="ep")

    def fail(slot: int, index: int, traj: Trajectory, err: Exception) -> None:
        traj.won, traj.failure = False, env_error(err)
        results[index] = traj
        bar.update(1)
        try:
            envs[slot].close()
        except Exception:  # noqa: BLE001 - a crashed environment may not close cleanly either
            pass
        envs[slot] = make_env()

    def start(slot: int) -> None:
        while queue:
            index, task = queue.pop(0)
            traj = Trajectory(uuid.uuid4().hex, task.id, task.type, task.split, source, "")
            try:
                first = envs[slot].reset(task)
            except Exception as err:  # noqa: BLE001 - any simulator fault ends only this episode
                fail(slot, index, traj, err)
                continue
            traj.instruction = first.instruction
            slots[slot] = (index, _Episode(task, traj, [first.text], first.admissible))
            return
        slots[slot] = None

    try:
        for s in range(len(envs)):
            start(s)
        while any(slots):
            active = [s for s, e in enumerate(slots) if e is not None]
            episodes = [slots[s][1] for s in active]
            reserve = actor.max_new_tokens if actor.mode == "free" else 0  # room for the generated turn
            prompts = [actor.builder.prompt(e.traj.instruction, e.observations, e.outputs, reserve) for e in episodes]
            decisions = actor.act(prompts, [e.admissible for e in episodes], greedy, generator, slots=active)
            for s, ep, prompt, d in zip(active, episodes, prompts, decisions):
                output = clean_text(d.output)  # whatever the backend decoded, the store holds valid UTF-8
                action, _ = parse_action(output)
                if action is None:
                    obs, reward, done, won, valid, admissible = ep.observations[-1], 0.0, False, False, False, ep.admissible
                else:
                    try:
                        r = envs[s].step(action)
                    except Exception as err:  # noqa: BLE001 - any simulator fault ends only this episode
                        fail(s, slots[s][0], ep.traj, err)
                        start(s)
                        continue
                    obs, reward, done, won, valid, admissible = r.observation, r.reward, r.done, r.won, r.valid, r.admissible
                ep.traj.steps.append(
                    StepRecord(
                        step=len(ep.outputs), observation=ep.observations[-1], output=output, action=action,
                        next_observation=obs, reward=reward, done=done, won=won, valid=valid,
                        logp=d.logp, prompt_tokens=len(prompt), output_tokens=d.output_tokens,
                    )
                )
                ep.outputs.append(output)
                ep.observations.append(obs)
                ep.admissible = admissible
                if done or len(ep.outputs) >= max_steps:
                    ep.traj.won = won
                    ep.traj.failure = "" if won else ("done" if done else "max_steps")
                    results[slots[s][0]] = ep.traj
                    bar.update(1)
                    bar.set_postfix(success=f"{sum(t.won for t in results.values())}/{len(results)}")
                    start(s)
    finally:
        bar.close()
        for env in envs:
            env.close()
    trajs = [results[i] for i in range(len(tasks))]
    check_env_failures(trajs, max_failure_ratio, desc)
    return trajs
