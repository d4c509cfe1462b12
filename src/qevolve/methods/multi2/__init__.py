"""Multi² (arXiv 2606.03698): a System-1 planner and a System-2 executor on one base, each with its own
adapter. The expert trajectories are cut into subgoal segments (`annotate`); System 1 is cloned on
(task, observation) -> subgoal and System 2 on (subgoal, the segment's turns) -> `<action>; done` (`bc`).
Iteration 1 is the offline phase: it collects the hierarchical policy's own episodes (`collect@1`), trains
System 2's critic on expert + collected segments (`critic@1`: Q toward r + gamma V(s'), V by expectile
toward the target Q) and updates System 2 by the policy-anchored actor (`policy@1`). Each later iteration
is the online phase (`online@k`): rounds of hierarchical episodes into a persistent replay buffer, each
followed by critic and actor updates with a KL anchor to the offline policy. System 1 stays as cloned.

The hierarchy's stages are the hierarchical methods' (`qevolve.stages.hierarchical`) reading the
`multi2` section; `policy@1` and `online@k` are Multi²'s own."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from qevolve import paths
from qevolve.methods.multi2.config import (
    SECTIONS,
)  # its sections: their defaults are a dep of every stage of the method
from qevolve.recipe import ACTING_PARAMS, BUILDER_PARAMS, MODEL_PARAMS, ONLINE_LOGGED, TRAINED_POLICY, Recipe, Stage
from qevolve.stages.hierarchical import (
    ANNOTATED,
    EVALUATE,
    acting_params,
    hierarchical_setup,
    hierarchical_stages,
    offline_data_params,
    reward_params,
)

STAGES = hierarchical_stages("multi2")


def offline(k: int) -> bool:
    """Iteration 1 is the offline phase, every later one the online phase."""
    return k == 1


def buffer(k: int) -> Path:
    """The replay buffer after `online@k` (named after its stage)."""
    return Path(f"data/online@{k}")


def _offline(compat: bool) -> tuple[Stage, ...]:
    """Iteration 1 after `collect@1`: `critic@1` then the paper's actor, or (`multi2.repo_compat`) the public
    code's joint critic-actor loop alone, writing both (`qevolve.methods.multi2.compat`)."""
    data = (*MODEL_PARAMS, *BUILDER_PARAMS, *offline_data_params("multi2"))
    if compat:
        return (
            Stage(
                "policy",
                f"{__name__}.compat",
                lambda k: {
                    "base_dir": paths.BASE,
                    "previous_dir": paths.policy(k - 1),
                    "data_dir": ANNOTATED,
                    "collected_dir": paths.collected(k),
                },
                lambda k: {"out": paths.policy(k), "critic_out": paths.critic(k)},
                (*data, "multi2.policy", "multi2.critic", "multi2.repo_compat"),
                curve=("step", "loss"),
                at=offline,
                logged=TRAINED_POLICY,
            ),
        )
    return (
        replace(STAGES["critic"], params=(*STAGES["critic"].params, "multi2.rl_roles"), at=offline),
        Stage(
            "policy",
            f"{__name__}.policy",
            lambda k: {
                "base_dir": paths.BASE,
                "previous_dir": paths.policy(k - 1),
                "critic_dir": paths.critic(k),
                "data_dir": ANNOTATED,
                "collected_dir": paths.collected(k),
                "advantage_dir": paths.advantages(k),
            },
            lambda k: {"out": paths.policy(k)},
            (*data, "policy.max_new_tokens", "multi2.policy", "multi2.rl_roles", "multi2.repo_compat"),
            curve=("step", "loss"),
            at=offline,
            logged=TRAINED_POLICY,
        ),
    )


def _iteration(params, recipe: Recipe) -> tuple[Stage, ...]:
    return (
        replace(STAGES["collect"], at=offline),
        *_offline(params.multi2.repo_compat),
        Stage(
            "online",
            f"{__name__}.online",
            lambda k: {
                "base_dir": paths.BASE,
                "previous_dir": paths.policy(k - 1),
                "anchor_dir": paths.policy(1),
                "critic_dir": paths.critic(k - 1),
                "seed_dir": ANNOTATED if k == 2 else buffer(k - 1),
                "previous_metrics": recipe.steps_before(k - 1),
            },
            lambda k: {"out": paths.policy(k), "critic_out": paths.critic(k), "buffer_out": buffer(k)},
            (
                *ACTING_PARAMS,
                *acting_params("multi2"),
                "policy.temperature",
                "multi2.critic",
                "multi2.online",
                "multi2.repo_compat",
                "multi2.reward",
            ),
            curve=("round", "success_rate"),
            takes_iteration=True,
            at=lambda k: k >= 2,
            logged=ONLINE_LOGGED,
        ),
        STAGES["diagnose"],
    )


RECIPE = Recipe(
    "multi2",
    _iteration,
    plays=lambda k: "collect" if k == 1 else "online",
    setup=hierarchical_setup(STAGES),
    evaluate_module=EVALUATE,
    evaluate_params=(*acting_params("multi2"), *reward_params("multi2")),
    seed_keys={"multi2.critic.seed": 1, "multi2.policy.seed": 1, "multi2.online.seed": 100},
    smoke={"evolve": {"iterations": 2}},
)
__all__ = ["RECIPE", "SECTIONS"]
