"""STEP-HRL (arXiv 2604.05808): three policies on one model (high: the next subtask; low: the action and
whether the subtask is done; progress: the subtask's local progress), each reading a bounded, single-turn
prompt. The expert trajectories are annotated with subtasks and progress (`annotate`) and cloned (`bc`);
then in each iteration the hierarchical policy collects its own episodes (`collect@k`), a step-level IQL
critic per level is trained on expert + collected transitions (`critic@k`, which also writes each
transition's advantage), and an advantage-weighted actor updates all three roles (`policy@k`).

The hierarchical stages here (annotate, bc, collect, critic, evaluate) serve every hierarchical method:
`hierarchical_stages(name)` gives them reading section `name` (Multi² runs them with `multi2`)."""

from __future__ import annotations

from pathlib import Path

from qevolve import paths
from qevolve.methods.step_hrl.config import SECTIONS  # its sections: their defaults are a dep of every stage of the method
from qevolve.recipe import ACTING_PARAMS, BUILDER_PARAMS, MODEL_PARAMS, SETUP, Recipe, Stage

HERE = __name__
ANNOTATED = Path("data/annotate")
experts, base = SETUP[0], SETUP[1]


def acting(name: str) -> tuple[str, ...]:
    """What the hierarchical agent reads beside `ACTING_PARAMS` (the rest comes from the policy's roles file)."""
    return (f"{name}.high_mode", f"{name}.max_subtask_steps", f"{name}.progress_tokens")


def offline_data(name: str) -> tuple[str, ...]:
    """What picks the offline-RL data from the expert and collected transitions."""
    return (f"{name}.collected_per_expert", f"{name}.critic.seed")


def hierarchical_stages(name: str, compat: tuple[str, ...] = ()) -> dict[str, Stage]:
    """annotate, bc, collect, critic (iteration k) reading section `name`; `compat`, the keys behind the
    section's `compat_rejections` and `compat_critic`."""
    rewards = (f"{name}.rejected_penalty", *compat)
    return {
        "annotate": Stage("annotate", f"{HERE}.annotate", lambda k: {"experts_dir": paths.EXPERTS, "base_dir": paths.BASE},
                          lambda k: {"out": ANNOTATED},
                          ("env", *BUILDER_PARAMS, "model.context_tokens", f"{name}.progress", f"{name}.history", f"{name}.annotator",
                           f"{name}.llm_url", f"{name}.llm_model", *rewards), once=True),
        "bc": Stage("bc", f"{HERE}.bc", lambda k: {"base_dir": paths.BASE, "data_dir": ANNOTATED}, lambda k: {"out": paths.BC},
                    ("env.name", *MODEL_PARAMS, *BUILDER_PARAMS, "bc", f"{name}.high_interval", f"{name}.adapters", f"{name}.history"),
                    once=True,
                    curve=("step", "loss"), trainer=True),
        "collect": Stage("collect", f"{HERE}.collect",
                         lambda k: {"base_dir": paths.BASE, "policy_dir": paths.policy(k - 1),
                                    "previous_metrics": paths.metrics("experts" if k == 1 else f"collect@{k - 1}")},
                         lambda k: {"out": paths.collected(k)}, (*ACTING_PARAMS, *acting(name), "policy.temperature", "collect", *rewards),
                         takes_iteration=True),
        "critic": Stage("critic", f"{HERE}.critic",
                        lambda k: {"base_dir": paths.BASE, "policy_dir": paths.policy(k - 1), "data_dir": ANNOTATED,
                                   "collected_dir": paths.collected(k)},
                        lambda k: {"out": paths.critic(k), "advantages_out": paths.advantages(k)},
                        (*MODEL_PARAMS, *BUILDER_PARAMS, *offline_data(name), f"{name}.critic", *compat), curve=("step", "loss")),
    }


STAGES = hierarchical_stages("step_hrl", ("step_hrl.repo_compat",))


def _iteration(params) -> tuple[Stage, ...]:
    return (
        STAGES["collect"], STAGES["critic"],
        Stage("policy", f"{HERE}.policy",
              lambda k: {"base_dir": paths.BASE, "previous_dir": paths.policy(k - 1), "data_dir": ANNOTATED, "collected_dir": paths.collected(k),
                         "advantage_dir": paths.advantages(k)},
              lambda k: {"out": paths.policy(k)}, (*MODEL_PARAMS, *BUILDER_PARAMS, *offline_data("step_hrl"), "step_hrl.policy", "step_hrl.repo_compat"),
              curve=("step", "loss")),
    )


RECIPE = Recipe("step_hrl", _iteration, plays="collect", setup=(experts, base, STAGES["annotate"], STAGES["bc"]),
                evaluate_module=f"{HERE}.evaluate", evaluate_params=acting("step_hrl"))
__all__ = ["RECIPE", "SECTIONS"]
