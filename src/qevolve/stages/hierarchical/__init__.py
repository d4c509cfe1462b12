"""The stages every hierarchical method shares (STEP-HRL, Multi²): `annotate` cuts the expert trajectories
into subtasks and progress, `bc` clones the roles, `collect@k` plays the hierarchical policy, `critic@k`
trains a critic per level and writes each transition's advantage, `diagnose@k` scores those critics on
held-out episodes, `evaluate` plays it greedily. Each reads
the section named after the running method (`qevolve.hierarchy.config.section`); `hierarchical_stages(name)`
gives their recipe entries for section `name`."""

from __future__ import annotations

from pathlib import Path

from qevolve import paths
from qevolve.recipe import ACTING_PARAMS, BC_LOGGED, BUILDER_PARAMS, MODEL_PARAMS, SETUP, TRAINED_CRITIC, Stage

HERE = __name__
ANNOTATED = Path("data/annotate")
"""The expert transitions `annotate` writes, per role (`qevolve.hierarchy.transitions`)."""
EVALUATE = f"{HERE}.evaluate"
"""The hierarchical methods' `Recipe.evaluate_module`."""


def acting_params(name: str) -> tuple[str, ...]:
    """What the hierarchical agent reads beside `ACTING_PARAMS` (the rest comes from the policy's roles file)."""
    return (f"{name}.high_mode", f"{name}.max_subtask_steps", f"{name}.progress_tokens")


def offline_data_params(name: str) -> tuple[str, ...]:
    """What picks the offline-RL data from the expert and collected transitions, and sets its rewards."""
    return (f"{name}.collected_per_expert", f"{name}.collected", f"{name}.critic.seed", f"{name}.reward")


def reward_params(name: str, compat: tuple[str, ...] = ()) -> tuple[str, ...]:
    """What makes an episode's transitions (their rewards), for `collect@k` and `evaluate`; `compat`, the keys
    behind the section's `compat_converters`."""
    return (f"{name}.rejected_penalty", *compat)


def hierarchical_stages(name: str, compat: tuple[str, ...] = ()) -> dict[str, Stage]:
    """annotate, bc, collect, critic, diagnose (iteration k) reading section `name`; `compat`, the keys behind
    the section's `compat_converters` and `compat_critic`."""
    rewards = reward_params(name, compat)
    return {
        "annotate": Stage(
            "annotate",
            f"{HERE}.annotate",
            lambda k: {"experts_dir": paths.EXPERTS, "base_dir": paths.BASE},
            lambda k: {"out": ANNOTATED},
            (
                "env",
                *BUILDER_PARAMS,
                "model.context_tokens",
                f"{name}.progress",
                f"{name}.history",
                f"{name}.annotator",
                f"{name}.llm_url",
                f"{name}.llm_model",
                *rewards,
            ),
            once=True,
        ),
        "bc": Stage(
            "bc",
            f"{HERE}.bc",
            lambda k: {"base_dir": paths.BASE, "data_dir": ANNOTATED},
            lambda k: {"out": paths.BC},
            (
                "env.name",
                *MODEL_PARAMS,
                *BUILDER_PARAMS,
                "bc",
                f"{name}.high_interval",
                f"{name}.adapters",
                f"{name}.history",
            ),
            once=True,
            curve=("step", "loss"),
            trainer=True,
            logged=BC_LOGGED,
        ),
        "collect": Stage(
            "collect",
            f"{HERE}.collect",
            lambda k: {
                "base_dir": paths.BASE,
                "policy_dir": paths.policy(k - 1),
                "previous_metrics": paths.metrics("experts" if k == 1 else f"collect@{k - 1}"),
            },
            lambda k: {"out": paths.collected(k)},
            (*ACTING_PARAMS, *acting_params(name), "policy.temperature", "collect", *rewards),
            takes_iteration=True,
        ),
        "diagnose": Stage(
            "diagnose",
            f"{HERE}.diagnose",
            lambda k: {
                "base_dir": paths.BASE,
                "previous_dir": paths.policy(k - 1),
                "policy_dir": paths.policy(k),
                "critic_dir": paths.critic(k),
                "heldout_dir": paths.evaluation(k - 1),
            },
            lambda k: {},
            (*MODEL_PARAMS, *BUILDER_PARAMS, f"{name}.critic"),  # the critic's section: how it reads a state
        ),
        "critic": Stage(
            "critic",
            f"{HERE}.critic",
            lambda k: {
                "base_dir": paths.BASE,
                "policy_dir": paths.policy(k - 1),
                "data_dir": ANNOTATED,
                "collected_dir": paths.collected(k),
            },
            lambda k: {"out": paths.critic(k), "advantages_out": paths.advantages(k)},
            (*MODEL_PARAMS, *BUILDER_PARAMS, *offline_data_params(name), f"{name}.critic", *compat),
            curve=("step", "loss"),
            logged=TRAINED_CRITIC,
        ),
    }


def hierarchical_setup(stages: dict[str, Stage]) -> tuple[Stage, ...]:
    """A hierarchical method's setup: the shared `experts` and `base`, then its `annotate` and `bc`."""
    experts, base = (s for s in SETUP if s.name in ("experts", "base"))
    return experts, base, stages["annotate"], stages["bc"]
