"""Retrospective rule-based relabeling (Q-Evolve): auxiliary rewards from what a step did, no labels.

Three rules, checked in this order; the first that applies gives the step its penalty and reason:
- `format`: the model's output did not parse as an action;
- `rejected`: the environment refused the action (each adapter decides, e.g. ALFWorld's "Nothing happens.");
- `unchanged`: the observation after the action equals the one before it (a repeated, useless action).
"""

from __future__ import annotations

from typing import Protocol


class Penalties(Protocol):
    """The three rules' penalties (Q-Evolve's `relabel` section), each subtracted from the step's reward."""

    format_penalty: float
    rejected_penalty: float
    unchanged_penalty: float


def relabel_step(
    action: str | None, valid: bool, observation: str, next_observation: str, cfg: Penalties
) -> tuple[float, str]:
    """(auxiliary reward, reason) of one step; (0.0, "") when no rule applies."""
    if action is None:
        return -cfg.format_penalty, "format"
    if not valid:
        return -cfg.rejected_penalty, "rejected"
    if _normalise(next_observation) == _normalise(observation):
        return -cfg.unchanged_penalty, "unchanged"
    return 0.0, ""


def _normalise(text: str) -> str:
    return " ".join(text.split())
