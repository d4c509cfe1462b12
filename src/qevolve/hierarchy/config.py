"""What every hierarchical method's section of params.yaml shares (`HierarchyConfig`: STEP-HRL's `step_hrl`
and Multi²'s `multi2` extend it), and which section a hierarchical stage reads (`section`): the one named
after the running method."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qevolve.config import Section, TrainConfig


class LevelCriticConfig(TrainConfig):
    """`critic@k`: a critic per level with one (V and Q heads, a Polyak target Q), on the critic's own adapter."""

    epochs: int = Field(3, gt=0)
    lr: float = Field(1e-4, gt=0)
    """STEP-HRL's critic learning rate."""
    batch_size: int = Field(16, gt=0)
    gamma: float = Field(0.99, gt=0, le=1)
    expectile: float = Field(0.7, gt=0, lt=1)
    """tau of V's expectile regression toward the target Q (IQL's convention: > 0.5 is an upper expectile)."""
    target_rate: float = Field(0.2, gt=0, le=1)
    """Polyak rate of each target Q head after every optimiser step."""
    init_from_policy: bool = True
    """Start the critic's adapter as a copy of the BC policy's."""


class HierarchyConfig(Section):
    progress: bool = True
    """Keep local progress: the low level reads it and the progress role writes it after each step."""
    history: bool = False
    """The low level also reads the current subtask's earlier observation/action turns (Multi²'s executor
    context); off, it sees the current observation only (STEP-HRL's bounded prompt)."""
    adapters: Literal["shared", "separate"] = "shared"
    """`shared`: one LoRA adapter acts for every role, told apart by their prompts. `separate`: one adapter
    per role on the same base, each trained on its own role's outputs only; acting switches between them
    unmerged."""
    annotator: Literal["rule", "llm"] = "rule"
    """Who cuts the expert trajectories into subtasks and writes each step's progress: this environment's
    rules (`qevolve.hierarchy.annotators`, deterministic) or a chat model at `llm_url`."""
    llm_url: str = ""
    """Base URL of an OpenAI-compatible server (`http://host:port/v1`) for `annotator: llm`."""
    llm_model: str = "deepseek-chat"
    """The model name sent to `llm_url`."""
    high_mode: Literal["admissible", "observed", "free"] = "admissible"
    """`admissible`: the high level chooses among the annotated subtasks; `observed`: among those the
    observation's valid actions name (TextCraft: one per listed craft; elsewhere the annotated ones);
    `free`: it writes one."""
    high_interval: int = Field(4, gt=0)
    """The high level's BC loss is weighted 1 / high_interval (STEP-HRL's public code adds it every
    `high_interval`-th step; this is the same share in expectation)."""
    max_subtask_steps: int = Field(50, gt=0)
    """A subtask the low level has not ended after this many steps ends anyway."""
    progress_tokens: int = Field(48, gt=0)
    """Most tokens the progress role writes per step."""
    rejected_penalty: float = Field(1.0, ge=0)
    """The low and progress levels' reward is -rejected_penalty at a step whose action the environment
    rejected (and +1 at a subtask's last step)."""
    reward: Literal["subgoal", "outcome"] = "subgoal"
    """The low and progress levels' reward in the offline-RL data (and Multi²'s replay buffer). `subgoal`, the
    papers': +1 at a subtask's last step, where the policy itself declared it done, and done there. `outcome`:
    the episode's, 1 at a won episode's last step and 0 elsewhere (the rejection penalty kept), done only where
    the episode ends, so V(s) estimates the episode's success from s and the critic can tell won from lost;
    a subgoal declared done is rewarded the same whether or not it was done, which left the miniatures'
    critics without contrast (the high level's reward is the environment's in both)."""
    collected_per_expert: float = Field(2.0, ge=0)
    """At most this many collected transitions per expert one in the offline-RL data, per level: collected ones
    beyond it are subsampled, experts never (reach the ratio by collecting more). 0 = every transition of both."""
    collected: bool = True
    """Train the offline-RL stages on `collect@k`'s transitions too. False: on the annotated experts' store alone
    (with `experts.corrupt`'s failed episodes, the positive control of the critic and the actor)."""
    critic: LevelCriticConfig = LevelCriticConfig()

    @property
    def levels_with_critic(self) -> tuple[str, ...]:
        """The levels `critic@k` trains a critic for (STEP-HRL: every level with transitions)."""
        return ("high", "low", "progress")

    @property
    def compat_converters(self) -> bool:
        """STEP-HRL's public converters: a step counts as rejected only on ScienceWorld's rejection text, and an
        episode's end string is done only where the environment said so (`qevolve.hierarchy.roles.transitions`)."""
        return False

    @property
    def compat_critic(self) -> bool:
        """Critic heads on the policy's frozen features with V a lower expectile, tau 0.05 (STEP-HRL's public code)."""
        return False

    @property
    def critic_time_aware(self) -> bool:
        """The critics read the steps taken before each state (STEP-HRL's `critic.time_aware`, a departure)."""
        return False


def section_name(params) -> str:
    """The running method, whose section a hierarchical stage reads. Not a recorded read: a stage belongs to
    one method's recipe, so its dvc.yaml already stands for the method."""
    return object.__getattribute__(params, "method")


def section(params) -> HierarchyConfig:
    """The running hierarchical method's own section (`params.step_hrl`, `params.multi2`)."""
    return getattr(params, section_name(params))


def check_hierarchy(params, name: str) -> None:
    """Section `name`'s own rules, and its rules across sections when its method is the one running."""
    cfg = getattr(params, name)
    if cfg.annotator == "llm" and not cfg.llm_url.startswith(("http://", "https://")):
        raise ValueError(
            f"{name}.llm_url: annotator `llm` needs the http(s) URL of an OpenAI-compatible server, got {cfg.llm_url!r}"
        )
    if params.method != name:
        return
    if cfg.adapters == "separate" and params.train.shard:
        raise ValueError(
            f"{name}.adapters: `separate` runs each role's outputs through its own adapter, a different number of "
            "passes per process, which sharded training (train.shard) cannot do; use `shared` or train.shard: false"
        )
    if params.policy.backend != "hf" or params.policy.replicas:
        raise ValueError(
            f"policy.backend / policy.replicas: {name}'s hierarchical agent plays its roles in the stage's "
            "process on the HF backend; use policy.backend: hf and policy.replicas: 0"
        )
