"""The online RL baseline: GRPO with the outcome reward only, from the BC policy (`online@k`, one stage
per iteration that plays groups of episodes per task and updates the policy after each round)."""

from __future__ import annotations

from qevolve import paths
from qevolve.methods.grpo.config import SECTIONS  # its sections: their defaults are a dep of every stage of the method
from qevolve.recipe import ACTING_PARAMS, ONLINE_LOGGED, Recipe, Stage


def _iteration(params, recipe: Recipe) -> tuple[Stage, ...]:
    return (
        Stage(
            "online",
            f"{__name__}.online",
            lambda k: {
                "base_dir": paths.BASE,
                "previous_dir": paths.policy(k - 1),
                "previous_metrics": recipe.steps_before(k - 1),
            },
            lambda k: {"out": paths.policy(k)},
            (*ACTING_PARAMS, "policy", "online"),
            curve=("round", "success_rate"),
            takes_iteration=True,
            logged=ONLINE_LOGGED,
        ),
    )


RECIPE = Recipe("grpo", _iteration, plays="online", seed_keys={"online.seed": 100})
__all__ = ["RECIPE", "SECTIONS"]
