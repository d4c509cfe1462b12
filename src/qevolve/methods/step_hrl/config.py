"""STEP-HRL's own section of params.yaml, `step_hrl`, and its rules across sections. What it shares with
every hierarchical method's section is `qevolve.hierarchy.config.HierarchyConfig`; the hierarchical stages
(`qevolve.stages.hierarchical`) read the section named after `method`. STEP-HRL's paper version is the
default; `repo_compat: true` reproduces its public code's effective update (docs/step-hrl.md sets the two
side by side)."""

from __future__ import annotations

from pydantic import Field

from qevolve.config import TrainConfig
from qevolve.hierarchy.config import HierarchyConfig, LevelCriticConfig, check_hierarchy


class StepCriticConfig(LevelCriticConfig):
    """`critic@k`: one critic per level. `expectile`: the public code's `weight_tau: 0.95`, applied the other
    way round, is tau = 0.05 (`repo_compat`); `target_rate` is the public code's `tau`."""

    time_aware: bool = False
    """A departure from the paper: every state the critics read ends with the environment steps taken before it
    (`qevolve.hierarchy.critic.with_steps`; the actor's prompts stay as they are). The paper's state shows neither
    the steps spent nor those left, so under a step cap a step that changes nothing costs its critics one
    discount: docs/step-hrl.md, "The positive control"."""


class StepPolicyConfig(TrainConfig):
    """`policy@k`: the advantage-weighted actor, all three levels in each optimiser step."""

    epochs: int = Field(3, gt=0)
    lr: float = Field(1e-5, gt=0)
    """The paper's actor learning rate."""
    batch_size: int = Field(16, gt=0)
    beta: float = Field(0.95, gt=0)
    """Advantage temperature: weights exp(A / beta) (the paper's best, 0.95)."""
    max_weight: float = Field(20.0, gt=0)
    """Weights are clipped at this value."""
    standardize: bool = False
    """A departure from the paper: standardise each level's advantages (zero mean, unit spread over the outputs this
    update trains on) before the weights exp(A / beta). The paper's exp(A / beta) on raw advantages moves a weight
    by about A / beta, and a step-level critic's advantages can be far smaller than beta (a wasted step costs one
    discount, (1 - gamma) V): docs/step-hrl.md, "The positive control"."""
    constant_advantage: bool = False
    """The control row of a learning claim: every output's advantage is the one at which its weight is 1 (AWR:
    A = 0; `repo_compat`'s A·log π: A = 1), so the update runs the same optimiser on the same data with no credit
    assignment: what more training alone does."""


class StepHRLConfig(HierarchyConfig):
    """`progress: false` is the paper's "w/o LP" ablation (its worst): the low level sees the subtask and
    observation only. `adapters: shared` is the paper's and the public code's; `max_subtask_steps` is the
    public code's 50 and `progress_tokens` its 150 cut to 48; `collected_per_expert` 2.0 is the paper's best
    mix (1:2)."""

    repo_compat: bool = False
    """Reproduce the public code's effective update instead of the paper's: the actor minimises
    -mean(A * log pi) (its AWR weights are computed and ignored), V is a lower expectile (tau = 0.05), the
    critic heads read the policy's frozen features, a rejected action is penalised only on ScienceWorld's
    rejection text (so never on ALFWorld), and an episode cut off at the step cap is not done at its end
    string (the critics bootstrap a value no transition trains)."""
    critic: StepCriticConfig = StepCriticConfig()
    policy: StepPolicyConfig = StepPolicyConfig()

    @property
    def compat_converters(self) -> bool:
        return self.repo_compat

    @property
    def compat_critic(self) -> bool:
        return self.repo_compat

    @property
    def critic_time_aware(self) -> bool:
        return self.critic.time_aware


SECTIONS = {"step_hrl": StepHRLConfig}


def check(params) -> None:
    check_hierarchy(params, "step_hrl")
