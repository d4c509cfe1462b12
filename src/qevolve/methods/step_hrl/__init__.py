"""STEP-HRL (arXiv 2604.05808): three policies on one model (high: the next subtask; low: the action and
whether the subtask is done; progress: the subtask's local progress), each reading a bounded, single-turn
prompt. The expert trajectories are annotated with subtasks and progress (`annotate`) and cloned (`bc`);
then in each iteration the hierarchical policy collects its own episodes (`collect@k`), a step-level IQL
critic per level is trained on expert + collected transitions (`critic@k`, which also writes each
transition's advantage), and an advantage-weighted actor updates all three roles (`policy@k`).

Its annotate, bc, collect and critic stages are the hierarchical methods' (`qevolve.stages.hierarchical`),
reading the `step_hrl` section; `policy@k` is its own."""

from __future__ import annotations

from qevolve import paths
from qevolve.methods.step_hrl.config import (
    SECTIONS,
)  # its sections: their defaults are a dep of every stage of the method
from qevolve.recipe import BUILDER_PARAMS, MODEL_PARAMS, TRAINED_POLICY, Recipe, Stage
from qevolve.stages.hierarchical import (
    ANNOTATED,
    EVALUATE,
    acting_params,
    hierarchical_setup,
    hierarchical_stages,
    offline_data_params,
    reward_params,
)

HERE = __name__
COMPAT = ("step_hrl.repo_compat",)
STAGES = hierarchical_stages("step_hrl", COMPAT)


def _iteration(params, recipe: Recipe) -> tuple[Stage, ...]:
    return (
        STAGES["collect"],
        STAGES["critic"],
        Stage(
            "policy",
            f"{HERE}.policy",
            lambda k: {
                "base_dir": paths.BASE,
                "previous_dir": paths.policy(k - 1),
                "data_dir": ANNOTATED,
                "collected_dir": paths.collected(k),
                "advantage_dir": paths.advantages(k),
            },
            lambda k: {"out": paths.policy(k)},
            (
                *MODEL_PARAMS,
                *BUILDER_PARAMS,
                *offline_data_params("step_hrl"),
                "step_hrl.policy",
                "step_hrl.repo_compat",
            ),
            curve=("step", "loss"),
            logged=TRAINED_POLICY,
        ),
        STAGES["diagnose"],
    )


RECIPE = Recipe(
    "step_hrl",
    _iteration,
    plays="collect",
    setup=hierarchical_setup(STAGES),
    evaluate_module=EVALUATE,
    evaluate_params=(*acting_params("step_hrl"), *reward_params("step_hrl", COMPAT)),
    seed_keys={"step_hrl.critic.seed": 1, "step_hrl.policy.seed": 1},
)
__all__ = ["RECIPE", "SECTIONS"]
