"""Environment adapters behind the `TextEnv` protocol, and task selection."""

from __future__ import annotations

import random

from qevolve.config import EnvConfig
from qevolve.envs.base import Observation, Step, Task, TextEnv

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
    if cfg.name == "alfworld":
        from qevolve.envs.alfworld import AlfworldEnv

        return AlfworldEnv(expert=expert)
    if cfg.name == "scienceworld":
        from qevolve.envs.scienceworld import ScienceWorldEnv

        return ScienceWorldEnv(expert=expert)
    if cfg.name == "textcraft":
        from qevolve.envs.textcraft import TextCraftEnv

        return TextCraftEnv()
    if cfg.name == "webshop":
        from qevolve.envs.webshop import WebShopEnv

        return WebShopEnv(cfg.data_dir or None)
    if cfg.name == "terminal":
        from qevolve.envs.terminal import TerminalEnv

        return TerminalEnv(cfg.data_dir, cfg.terminal, cfg.max_steps, expert)
    raise ValueError(f"env.name: unknown environment {cfg.name!r}")


def check_data(cfg: EnvConfig, generated: bool = False) -> None:
    """Fail before any compute when the environment's data is missing; ALFWorld's is prepared here.
    `generated`: a stage of the pipeline writes `env.data_dir` (TerminalTraj's tasks), so it is not read yet."""
    if cfg.name == "alfworld":
        from qevolve.envs.alfworld import ensure_alfworld_data

        ensure_alfworld_data()
    elif cfg.name == "scienceworld":
        from qevolve.envs.scienceworld import list_tasks

        _check_types(cfg, list_tasks("train"))
    elif cfg.name == "webshop":
        from qevolve.envs.webshop import WebShopEnv

        _check_types(cfg, WebShopEnv(cfg.data_dir or None).tasks("train"))
    elif cfg.name == "terminal":
        from qevolve.envs.sandbox import SandboxError, available
        from qevolve.envs.terminal import TerminalEnv

        if why := available(cfg.terminal.sandbox, cfg.terminal.image):
            raise SandboxError(f"env.terminal.sandbox: {why}")
        if not cfg.data_dir:
            raise ValueError("env.data_dir: the terminal environment needs the folder of its <split>/<task id>/ task folders")
        if not generated:
            _check_types(cfg, TerminalEnv(cfg.data_dir, cfg.terminal, cfg.max_steps).tasks("train"))


def _check_types(cfg: EnvConfig, tasks) -> None:
    """`env.task_types` against the types the data defines (ScienceWorld's task names, WebShop's categories)."""
    known = sorted({t.type for t in tasks})
    unknown = [t for t in cfg.task_types if t not in known]
    if unknown:
        raise ValueError(f"env.task_types: {cfg.name} has no task type(s) {unknown} in its train split; expected some of {known}")


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


def select_tasks(env: TextEnv, split: str, cfg: EnvConfig, count: int, seed: int) -> list[Task]:
    """`count` tasks of `split` restricted to `cfg.task_types`, drawn with `seed` (0 = all, in order)."""
    tasks = [t for t in env.tasks(split) if not cfg.task_types or t.type in cfg.task_types]
    if not tasks:
        raise ValueError(f"no {split} tasks of types {cfg.task_types}")
    if count and count < len(tasks):
        tasks = sorted(random.Random(seed).sample(tasks, count), key=lambda t: t.id)
    return tasks
