"""Environment adapters behind the `TextEnv` protocol, and task selection."""

from __future__ import annotations

import random

from qevolve.config import EnvConfig
from qevolve.envs.base import Observation, Step, Task, TextEnv

__all__ = ["Observation", "Step", "Task", "TextEnv", "make_env", "select_tasks"]


def make_env(cfg: EnvConfig, expert: str | None = None) -> TextEnv:
    """An environment; `expert` names the expert whose `expert_action` it answers (None: no expert)."""
    if cfg.name == "alfworld":
        from qevolve.envs.alfworld import AlfworldEnv

        return AlfworldEnv(expert=expert)
    raise ValueError(f"env.name: unknown environment {cfg.name!r}")


def select_tasks(env: TextEnv, split: str, cfg: EnvConfig, count: int, seed: int) -> list[Task]:
    """`count` tasks of `split` restricted to `cfg.task_types`, drawn with `seed` (0 = all, in order)."""
    tasks = [t for t in env.tasks(split) if not cfg.task_types or t.type in cfg.task_types]
    if not tasks:
        raise ValueError(f"no {split} tasks of types {cfg.task_types}")
    if count and count < len(tasks):
        tasks = sorted(random.Random(seed).sample(tasks, count), key=lambda t: t.id)
    return tasks
