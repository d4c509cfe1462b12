"""Q-Evolve's own sections of params.yaml (`relabel`, `critic`, `advantage`, `rerank`) and its rules across
sections. `policy` (how the policy acts and how `policy@k` updates it) and `collect` are shared."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qevolve.config import Section, TrainConfig


class RelabelConfig(Section):
    """Auxiliary rewards (negative) for the three failure modes of a step; the first that applies counts."""

    format_penalty: float = Field(0.1, ge=0)
    """The output does not parse as an action."""
    rejected_penalty: float = Field(0.1, ge=0)
    """The environment rejected the action (ALFWorld: "Nothing happens.")."""
    unchanged_penalty: float = Field(0.05, ge=0)
    """The observation did not change (repetition)."""
    max_expert: int = Field(0, ge=0)
    """Expert trajectories in the hybrid dataset, drawn at random (0 = all; the experts' store holds the corrupted
    episodes of `experts.corrupt` too)."""
    collected: bool = True
    """Add `collect@k`'s episodes. False: the hybrid dataset is the experts' store alone, the positive control's
    offline update on a fixed data set of mixed quality (benchmarks/positive-control.yaml)."""
    seed: int = 0


class CriticConfig(TrainConfig):
    epochs: int = Field(2, gt=0)
    lr: float = Field(5e-4, gt=0)
    gamma: float = Field(0.95, gt=0, le=1)
    expectile: float = Field(0.7, gt=0, lt=1)
    """tau of the expectile regression for V."""
    target_rate: float = Field(0.05, gt=0, le=1)
    """Polyak rate of the slow-moving target Q head after each optimiser step."""
    weighted: bool = True
    """Q-Evolve's per-step weights (`step_weights`); false = uniform (the ablation)."""
    init_from_policy: bool = True
    """Start the critic's own adapter as a copy of the policy's (its features already know the env)."""


class AdvantageConfig(Section):
    estimator: Literal["gae", "q_minus_v"] = "gae"
    gamma: float = Field(0.95, gt=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    use_aux: bool = False
    """Add the auxiliary rewards to the GAE rewards (the paper found this hurts)."""
    normalize: bool = True
    """Scale advantages to zero mean and unit variance over the dataset."""
    constant: bool = False
    """The control row of a learning claim: every step's advantage is the one at which `policy@k`'s weight on its
    log-likelihood is 1 (BPPO: A = 1, AWR: A = 0), so the update runs the same optimiser on the same data and
    windows with no credit assignment: what more training alone does. The critic is still trained (and diagnosed)."""


class RerankConfig(Section):
    """Best-of-N at test time (the paper's critic-rerank ablation): `rerank@k` plays the evaluation
    episodes with the policy before iteration k's update, drawing N actions from it and taking the one
    the critic of iteration k values most. No policy update is involved."""

    best_of: int = Field(0, ge=0)
    """N actions drawn per step (0 = no `rerank@k` stage). Admissible action mode only."""
    temperature: float = Field(1.0, gt=0)
    """Temperature of the policy distribution the N actions are drawn from."""


SECTIONS = {"relabel": RelabelConfig, "critic": CriticConfig, "advantage": AdvantageConfig, "rerank": RerankConfig}


def check(params) -> None:
    if params.rerank.best_of and params.policy.action_mode != "admissible":
        raise ValueError(
            "rerank.best_of: Best-of-N reranking draws from the valid actions; it needs policy.action_mode `admissible`"
        )
    if params.rerank.best_of and params.method != "qevolve":
        raise ValueError("rerank.best_of: reranking uses Q-Evolve's critic; it needs method `qevolve`")
