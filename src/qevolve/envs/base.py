"""The small protocol every text environment implements (DESIGN.md, "Environments")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Task:
    id: str
    """Stable identifier, unique within the environment (ALFWorld: path of the game under its split)."""
    split: str
    type: str
    """Task family, e.g. ALFWorld's `pick_and_place_simple`."""


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


class EnvironmentFailures(RuntimeError):
    """More episodes failed in the environment itself than `env.max_failure_ratio` allows."""


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
        raise EnvironmentFailures(f"{what}: the environment failed {failed} of {len(trajs)} episodes, more than "
                                  f"env.max_failure_ratio = {max_ratio}: {failures}")
    return [t for t in trajs if not t.failure.startswith(ENV_ERROR)], failed
