"""STEP-HRL (arXiv 2604.05808): three policies on one model (high: the next subtask; low: the action and
whether the subtask is done; progress: the subtask's local progress), each reading a bounded, single-turn
prompt. The expert trajectories are annotated with subtasks and progress (`annotate`) and cloned (`bc`);
then in each iteration the hierarchical policy collects its own episodes (`collect@k`), a step-level IQL
critic per level is trained on expert + collected transitions (`critic@k`, which also writes each
transition's advantage), and an advantage-weighted actor updates all three roles (`policy@k`)."""

from __future__ import annotations

from pathlib import Path

from qevolve import paths
from qevolve.methods.step_hrl.config import SECTIONS  # its sections: their defaults are a dep of every stage of the method
from qevolve.recipe import ACTING_PARAMS, BUILDER_PARAMS, MODEL_PARAMS, SETUP, Recipe, Stage

HERE = __name__
ANNOTATED = Path("data/annotate")
ACTING = ("step_hrl.high_mode", "step_hrl.max_subtask_steps", "step_hrl.progress_tokens")
"""What the hierarchical agent reads beside `ACTING_PARAMS` (the rest comes from the policy's roles file)."""
DATA = ("step_hrl.collected_per_expert", "step_hrl.critic.seed")
"""What picks the offline-RL data from the expert and collected transitions."""

experts, base = SETUP[0], SETUP[1]
annotate = Stage("annotate", f"{HERE}.annotate", lambda k: {"experts_dir": paths.EXPERTS, "base_dir": paths.BASE},
                 lambda k: {"out": ANNOTATED}, ("env", *BUILDER_PARAMS, "model.context_tokens", "step_hrl.progress", "step_hrl.annotator",
                                                "step_hrl.llm_url", "step_hrl.llm_model", "step_hrl.repo_compat"), once=True)
bc = Stage("bc", f"{HERE}.bc", lambda k: {"base_dir": paths.BASE, "data_dir": ANNOTATED}, lambda k: {"out": paths.BC},
           ("env.name", *MODEL_PARAMS, *BUILDER_PARAMS, "bc", "step_hrl.high_interval", "step_hrl.adapters"), once=True, curve=("step", "loss"), trainer=True)


def _iteration(params) -> tuple[Stage, ...]:
    return (
        Stage("collect", f"{HERE}.collect",
              lambda k: {"base_dir": paths.BASE, "policy_dir": paths.policy(k - 1), "previous_metrics": RECIPE.steps_before(k - 1)},
              lambda k: {"out": paths.collected(k)}, (*ACTING_PARAMS, *ACTING, "policy.temperature", "collect", "step_hrl.repo_compat"),
              takes_iteration=True),
        Stage("critic", f"{HERE}.critic",
              lambda k: {"base_dir": paths.BASE, "policy_dir": paths.policy(k - 1), "data_dir": ANNOTATED, "collected_dir": paths.collected(k)},
              lambda k: {"out": paths.critic(k), "advantages_out": paths.advantages(k)},
              (*MODEL_PARAMS, *BUILDER_PARAMS, *DATA, "step_hrl.critic", "step_hrl.repo_compat"), curve=("step", "loss")),
        Stage("policy", f"{HERE}.policy",
              lambda k: {"base_dir": paths.BASE, "previous_dir": paths.policy(k - 1), "data_dir": ANNOTATED, "collected_dir": paths.collected(k),
                         "advantage_dir": paths.advantages(k)},
              lambda k: {"out": paths.policy(k)}, (*MODEL_PARAMS, *BUILDER_PARAMS, *DATA, "step_hrl.policy", "step_hrl.repo_compat"),
              curve=("step", "loss")),
    )


RECIPE = Recipe("step_hrl", _iteration, plays="collect", setup=(experts, base, annotate, bc),
                evaluate_module=f"{HERE}.evaluate", evaluate_params=ACTING)
__all__ = ["RECIPE", "SECTIONS"]
