"""Environment adapters behind the `TextEnv` protocol, and task selection."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace

from qevolve.config import EnvConfig
from qevolve.environments import ENVIRONMENTS, HELDOUT, adapter
from qevolve.envs.base import Observation, Step, Task, TextEnv
from qevolve.errors import UserError

__all__ = ["Observation", "Step", "Task", "TextEnv", "check_data", "check_tasks", "make_env", "select_tasks"]


def make_env(cfg: EnvConfig, expert: str | None = None, *, worker: bool = False) -> TextEnv:
    """An environment; `expert` names the expert whose `expert_action` it answers (None: no expert).
    `worker`: run it in its own process (`EnvWorker`), or Ray actor (`env.worker: ray`). Constructing one
    is cheap everywhere: a simulator starts at the first reset, so listing tasks costs no JVM or game load."""
    if worker and cfg.worker == "ray":
        from qevolve.envs.ray_worker import RayEnvWorker

        return RayEnvWorker(cfg, expert)
    if worker:
        from qevolve.envs.worker import EnvWorker

        return EnvWorker(cfg, expert)
    return adapter(cfg.name).create(cfg, expert)


class MissingData(UserError, FileNotFoundError):
    """An environment's data is not where it is read from; the hint says where that is (`EnvSpec.data`)."""


def check_data(cfg: EnvConfig, generated: bool = False) -> None:
    """Fail before any compute when the environment's data is missing; ALFWorld's is prepared here.
    `generated`: a stage of the pipeline writes `env.data_dir` (TerminalTraj's tasks), so it is not read yet."""
    try:
        adapter(cfg.name).check_data(cfg, generated)
    except FileNotFoundError as err:
        if isinstance(err, UserError):
            raise
        missing = MissingData(f"env.name {cfg.name}: {err}")
        missing.hint = f"{cfg.name} reads {ENVIRONMENTS[cfg.name].data}"
        raise missing from None


def check_tasks(env: TextEnv, trajectories, source: str) -> None:
    """Fail, naming `source` and the `task_id` field, if a trajectory's task is not a task of `env`."""
    known: dict[str, set[str]] = {}
    for t in trajectories:
        if t.split not in known:
            try:
                known[t.split] = {task.id for task in env.tasks(t.split)}
            except ValueError as err:
                raise ValueError(f"{source}: split {t.split!r} of trajectory {t.trajectory_id}: {err}") from None
        if t.task_id not in known[t.split]:
            raise ValueError(f"{source}: task_id {t.task_id!r} (split {t.split!r}) is not a task of this environment")


def _typed(env: TextEnv, split: str, cfg: EnvConfig) -> list[Task]:
    return [t for t in env.tasks(split) if not cfg.task_types or t.type in cfg.task_types]


def heldout_tasks(env: TextEnv, cfg: EnvConfig) -> list[Task]:
    """The `env.heldout` train tasks (of `env.task_types`) set aside as the split `heldout`: the first in the order of
    their ids' SHA-1 (fixed whatever the seeds), relabelled `heldout` and read from the train split's data."""
    if not cfg.heldout:
        return []
    train = sorted(_typed(env, "train", cfg), key=lambda t: hashlib.sha1(t.id.encode()).hexdigest())
    if cfg.heldout >= len(train):
        raise ValueError(
            f"env.heldout: {cfg.heldout} is not fewer than the {len(train)} train tasks of types {cfg.task_types}; "
            "some must stay for the demonstrations and collection"
        )
    return sorted((replace(t, split=HELDOUT, home="train") for t in train[: cfg.heldout]), key=lambda t: t.id)


def select_tasks(env: TextEnv, split: str, cfg: EnvConfig, count: int, seed: int) -> list[Task]:
    """`count` tasks of `split` restricted to `cfg.task_types`, drawn with `seed` (0 = all, in order). The train split
    leaves out the tasks `env.heldout` sets aside, which are the split `heldout`."""
    if split == HELDOUT:
        tasks = heldout_tasks(env, cfg)
    else:
        tasks = _typed(env, split, cfg)
        if split == "train" and cfg.heldout:
            aside = {t.id for t in heldout_tasks(env, cfg)}
            tasks = [t for t in tasks if t.id not in aside]
    if not tasks:
        raise ValueError(f"no {split} tasks of types {cfg.task_types}")
    if count and count < len(tasks):
        tasks = sorted(random.Random(seed).sample(tasks, count), key=lambda t: t.id)
    return tasks
