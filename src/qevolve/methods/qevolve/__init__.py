"""Q-Evolve (arXiv 2606.07367), Algorithm 1: in each iteration k the previous policy collects its own episodes, which
are mixed with the expert demonstrations and relabeled with auxiliary rewards; a weighted IQL critic is trained on that
hybrid data, GAE over its values gives per-step advantages, and BPPO with a KL anchor updates the policy; `diagnose@k`
then checks, on held-out episodes, that the critic ranks won above lost and that the update moved the policy. With
`rerank.best_of`, the iteration's critic also reranks the policy's candidate actions at test time (`rerank@k`,
Best-of-N)."""

from __future__ import annotations

from qevolve import paths
from qevolve.methods.qevolve.config import (
    SECTIONS,
)  # its sections: their defaults are a dep of every stage of the method
from qevolve.recipe import (
    ACTING_PARAMS,
    BUILDER_PARAMS,
    MODEL_PARAMS,
    PLAYED,
    TRAINED_CRITIC,
    TRAINED_POLICY,
    Logged,
    Recipe,
    Stage,
)

HERE = __name__


def _iteration(params, recipe: Recipe) -> tuple[Stage, ...]:
    """Q-Evolve's iteration, in `recipe` (its own, or TerminalTraj's, which runs it after its own setup)."""
    steps = recipe.steps_before
    stages = (
        Stage(
            "collect",
            f"{HERE}.collect",
            lambda k: {"base_dir": paths.BASE, "policy_dir": paths.policy(k - 1), "previous_metrics": steps(k - 1)},
            lambda k: {"out": paths.collected(k)},
            (*ACTING_PARAMS, "policy.temperature", "collect"),
            takes_iteration=True,
        ),
        Stage(
            "relabel",
            f"{HERE}.relabel",
            lambda k: {"experts_dir": paths.EXPERTS, "collected_dir": paths.collected(k)},
            lambda k: {"out": paths.hybrid(k)},
            ("env", "relabel"),
            accelerated=False,
        ),
        Stage(
            "critic",
            f"{HERE}.critic",
            lambda k: {"base_dir": paths.BASE, "policy_dir": paths.policy(k - 1), "data_dir": paths.hybrid(k)},
            lambda k: {"out": paths.critic(k)},
            (*MODEL_PARAMS, *BUILDER_PARAMS, "critic"),
            curve=("step", "loss"),
            trainer=True,
            logged=TRAINED_CRITIC,
        ),
        Stage(
            "advantage",
            f"{HERE}.advantage",
            lambda k: {"base_dir": paths.BASE, "critic_dir": paths.critic(k), "data_dir": paths.hybrid(k)},
            lambda k: {"out": paths.advantages(k)},
            (*MODEL_PARAMS, *BUILDER_PARAMS, "critic.micro_batch_size", "advantage", "policy.algo"),
            curve=("advantage", "count"),
            logged=Logged(histogram=True),
        ),
        Stage(
            "policy",
            f"{HERE}.policy",
            lambda k: {
                "base_dir": paths.BASE,
                "previous_dir": paths.policy(k - 1),
                "bc_dir": paths.BC,
                "data_dir": paths.hybrid(k),
                "advantage_dir": paths.advantages(k),
            },
            lambda k: {"out": paths.policy(k)},
            (*MODEL_PARAMS, *BUILDER_PARAMS, "policy"),
            curve=("step", "loss"),
            trainer=True,
            logged=TRAINED_POLICY,
        ),
        Stage(
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
            (*MODEL_PARAMS, *BUILDER_PARAMS, "critic.micro_batch_size", "policy.micro_batch_size"),
        ),
    )
    if not params.rerank.best_of:
        return stages
    rerank = Stage(
        "rerank",
        f"{HERE}.rerank",
        lambda k: {
            "base_dir": paths.BASE,
            "policy_dir": paths.policy(k - 1),
            "critic_dir": paths.critic(k),
            "env_steps_path": steps(k),
        },
        lambda k: {"out": paths.reranked(k)},
        (*ACTING_PARAMS, "critic.micro_batch_size", "evaluate", "rerank"),
        takes_iteration=True,
        logged=PLAYED,
    )
    return (*stages, rerank)


RECIPE = Recipe("qevolve", _iteration, plays="collect", seed_keys={"critic.seed": 1}, smoke={"rerank": {"best_of": 2}})
__all__ = ["RECIPE", "SECTIONS"]
