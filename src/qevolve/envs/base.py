"""The small protocol every text environment implements (DESIGN.md, "Environments")."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from qevolve.errors import UserError


@dataclass(frozen=True)
class Task:
    id: str
    """Stable identifier, unique within the environment (ALFWorld: path of the game under its split)."""
    split: str
    type: str
    """Task family, e.g. ALFWorld's `pick_and_place_simple`."""
    max_steps: int = 0
    """The environment's own step limit for this task (ScienceWorld's `max_steps.json`); 0 = none."""
    home: str = ""
    """The split whose data holds the task, where it differs from `split` (a train task set aside as the `heldout`
    split by `env.heldout`); adapters read their files from `task.home or task.split`."""


@dataclass
class Observation:
    instruction: str
    """What the agent is asked to do."""
    text: str
    """The first observation."""
    admissible: list[str] = field(default_factory=list)
    """Valid actions, where the environment lists them."""


@dataclass
class Step:
    observation: str
    reward: float
    done: bool
    won: bool
    valid: bool
    """False when the environment rejected the action (ALFWorld: "Nothing happens.")."""
    admissible: list[str] = field(default_factory=list)


class TextEnv(Protocol):
    def reset(self, task: Task) -> Observation: ...

    def step(self, action: str) -> Step: ...

    def tasks(self, split: str) -> list[Task]: ...

    def expert_action(self) -> str | None:
        """The expert's next action in the current episode, or None when it has none.

        DESIGN.md sketches `expert(task) -> list[str]`; ALFWorld's handcoded expert reacts to what it
        observes (it opens receptacles until it finds the object), so it is asked step by step instead.
        An environment with a fixed gold path simply returns the path's next action.
        """
        ...

    def close(self) -> None: ...


ENV_ERROR = "env_error"


class EnvironmentFailures(UserError, RuntimeError):
    """More episodes failed in the environment itself than `env.max_failure_ratio` allows."""

    hint = (
        "the reasons above say why the environment failed; env.max_failure_ratio sets the share of episodes allowed to"
    )


def env_error(err: Exception) -> str:
    """The `failure` of an episode the environment failed by raising `err`."""
    return f"{ENV_ERROR}: {type(err).__name__}: {err}"[:300]


def env_failures(trajs: list) -> dict[str, int]:
    """Failure reason -> episodes the environment failed (not the policy)."""
    out: dict[str, int] = {}
    for t in trajs:
        if t.failure.startswith(ENV_ERROR):
            out[t.failure] = out.get(t.failure, 0) + 1
    return out


def check_env_failures(trajs: list, max_ratio: float, what: str) -> tuple[list, int]:
    """(the episodes the environment did not fail, how many it failed); raise `EnvironmentFailures`
    when that is more than `max_ratio` of them."""
    failures = env_failures(trajs)
    failed = sum(failures.values())
    if failed > max_ratio * len(trajs):
        raise EnvironmentFailures(
            f"{what}: the environment failed {failed} of {len(trajs)} episodes, more than "
            f"env.max_failure_ratio = {max_ratio}: {failures}"
        )
    return [t for t in trajs if not t.failure.startswith(ENV_ERROR)], failed


def splits_dir(env: str) -> Path:
    """The folder with `env`'s standard split files (ScienceWorld's `*_indices.json` and `max_steps.json`,
    WebShop's goal indices): `$QEVOLVE_SPLITS/<env>`, by default `../shared/data/splits/<env>` beside the
    repository (`docs/environments.md` says where to get them)."""
    root = os.environ.get("QEVOLVE_SPLITS") or Path(__file__).resolve().parents[3].parent / "shared" / "data" / "splits"
    folder = Path(root) / env
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder}: no {env} split files here; set QEVOLVE_SPLITS to the folder that holds {env}/ "
            f"(see docs/environments.md)"
        )
    return folder


def read_split_file(path: Path):
    """A JSON split file, or an error naming the file."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: split file missing") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None


def check_types(cfg, tasks) -> None:
    """`env.task_types` against the types the data defines (ScienceWorld's task names, WebShop's categories)."""
    known = sorted({t.type for t in tasks})
    unknown = [t for t in cfg.task_types if t not in known]
    if unknown:
        raise ValueError(
            f"env.task_types: {cfg.name} has no task type(s) {unknown} in its train split; expected some of {known}"
        )
