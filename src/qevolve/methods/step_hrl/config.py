"""STEP-HRL's own section of params.yaml, `step_hrl`, and its rules across sections.

The paper's version is the default; `repo_compat: true` reproduces the public code's effective update
(docs/step-hrl.md sets the two side by side)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from qevolve.config import Section, TrainConfig


class StepCriticConfig(TrainConfig):
    """`critic@k`: one critic per level (V and Q heads, a Polyak target Q), on the critic's own adapter."""

    epochs: int = Field(3, gt=0)
    lr: float = Field(1e-4, gt=0)
    """The paper's critic learning rate."""
    batch_size: int = Field(16, gt=0)
    gamma: float = Field(0.99, gt=0, le=1)
    expectile: float = Field(0.7, gt=0, lt=1)
    """tau of V's expectile regression toward the target Q (IQL's convention: > 0.5 is an upper expectile).
    The public code's `weight_tau: 0.95`, applied the other way round, is tau = 0.05 (`repo_compat`)."""
    target_rate: float = Field(0.2, gt=0, le=1)
    """Polyak rate of each target Q head after every optimiser step (the public code's `tau`)."""
    init_from_policy: bool = True
    """Start the critic's adapter as a copy of the BC policy's."""


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


class StepHRLConfig(Section):
    progress: bool = True
    """Keep local progress: the low level reads it and the progress role writes it after each step. False
    is the paper's "w/o LP" ablation (its worst): the low level sees the subtask and observation only."""
    adapters: Literal["shared", "separate"] = "shared"
    """`shared`: one LoRA adapter acts for the three roles, told apart by their prompts (the paper's and
    the public code's). `separate`: one adapter per role on the same base, each trained on its own role's
    outputs only; acting switches between them unmerged (docs/step-hrl.md)."""
    annotator: Literal["rule", "llm"] = "rule"
    """Who cuts the expert trajectories into subtasks and writes each step's progress: this environment's
    rules (`qevolve.hierarchy.annotators`, deterministic) or a chat model at `llm_url` (as the paper did)."""
    llm_url: str = ""
    """Base URL of an OpenAI-compatible server (`http://host:port/v1`) for `annotator: llm`."""
    llm_model: str = "deepseek-chat"
    """The model name sent to `llm_url`."""
    high_mode: Literal["admissible", "free"] = "admissible"
    """`admissible`: the high level chooses among the annotated subtasks; `free`: it writes one."""
    high_interval: int = Field(4, gt=0)
    """The public code adds the high level's BC loss every `high_interval`-th step; here every high example
    is in every epoch with its loss weighted 1 / high_interval, the same share in expectation."""
    max_subtask_steps: int = Field(50, gt=0)
    """A subtask the low level has not ended after this many steps ends anyway (the public code's 50)."""
    progress_tokens: int = Field(48, gt=0)
    """Most tokens the progress role writes per step (the public code allows 150)."""
    collected_per_expert: float = Field(2.0, ge=0)
    """Collected transitions per expert transition in the offline-RL data (the paper's best mix, 1:2);
    the larger set is subsampled, per level. 0 = every transition of both."""
    repo_compat: bool = False
    """Reproduce the public code's effective update instead of the paper's: the actor minimises
    -mean(A * log pi) (its AWR weights are computed and ignored), V is a lower expectile (tau = 0.05), the
    critic heads read the policy's frozen features, and a rejected action is penalised only on
    ScienceWorld's rejection text (so never on ALFWorld)."""
    critic: StepCriticConfig = StepCriticConfig()
    policy: StepPolicyConfig = StepPolicyConfig()

    @model_validator(mode="after")
    def _llm_url(self) -> "StepHRLConfig":
        if self.annotator == "llm" and not self.llm_url.startswith(("http://", "https://")):
            raise ValueError(f"step_hrl.llm_url: annotator `llm` needs the http(s) URL of an OpenAI-compatible server, got {self.llm_url!r}")
        return self


SECTIONS = {"step_hrl": StepHRLConfig}


def check(params) -> None:
    if params.method == "step_hrl" and params.step_hrl.adapters == "separate" and params.train.shard:
        raise ValueError("step_hrl.adapters: `separate` runs each role's outputs through its own adapter, a different number of "
                         "passes per process, which sharded training (train.shard) cannot do; use `shared` or train.shard: false")
    if params.method == "step_hrl" and (params.policy.backend != "hf" or params.policy.replicas):
        raise ValueError("policy.backend / policy.replicas: STEP-HRL's hierarchical agent plays its three roles in the stage's "
                         "process on the HF backend; use policy.backend: hf and policy.replicas: 0")

