"""Multi²'s own section of params.yaml, `multi2` (arXiv 2606.03698; ../shared/research/multi2.md).

System 1 is the hierarchy's high role (the planner: task + observation -> the next subgoal), System 2 its
low role (the executor: subgoal + the subgoal's observation/action turns -> `<action>; True|False`), each on
its own adapter. The keys it shares with STEP-HRL are documented in `qevolve.hierarchy.config`; their
defaults here are Multi²'s (docs/multi2.md sets each beside the paper and the public code)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qevolve.config import Section, TrainConfig
from qevolve.hierarchy.config import HierarchyConfig, LevelCriticConfig, check_hierarchy


class Multi2CriticConfig(LevelCriticConfig):
    """`critic@k`: System 2's critic, Q toward r + gamma V(s') and V by expectile toward the target Q."""

    lr: float = Field(1e-5, gt=0)
    """The public code's offline critic learning rate (its actor's is ten times larger)."""
    expectile: float = Field(0.7, gt=0, lt=1)
    """The paper's IQL expectile (the public code's offline config ships 0.5, plain MSE; its online one 0.7)."""


class AnchoredActorConfig(TrainConfig):
    """`policy@k`: System 2's offline actor, -mean(min(exp(beta A), max_weight) log pi(a)) on the data's actions
    minus lam * mean(A(o, â) log pi(â)) on actions â the current policy samples, scored by `critic@k`."""

    epochs: int = Field(3, gt=0)
    lr: float = Field(1e-4, gt=0)
    """The public code's offline actor learning rate."""
    batch_size: int = Field(16, gt=0)
    beta: float = Field(10.0, gt=0)
    """Weights exp(beta * A) (the public code's 10: a temperature of 0.1)."""
    max_weight: float = Field(20.0, gt=0)
    lam: float = Field(7.0, ge=0)
    """Weight of the policy-anchored term (0: the paper's "Vanilla-IQL" ablation, what the public code runs)."""
    relu: bool = False
    """Count only positive A(o, â) in the anchored term (the public code's form of it, which its release never runs)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the actions â the anchored term scores."""


class Multi2OnlineConfig(Section):
    """`online@k` (iterations k >= 2): System 2's online refinement, System 1 frozen. Rounds of
    `episodes_per_round` sampled hierarchical episodes on train tasks, then `updates_per_round` updates (a
    critic step and an actor step) on batches of `batch_size` transitions drawn from the replay buffer,
    until `env_steps` (to the nearest round). The public code's values but `env_steps` (its 190 epochs of
    10 episodes), which a benchmark sets to the GRPO baseline's budget."""

    env_steps: int = Field(1000, gt=0)
    episodes_per_round: int = Field(10, gt=0)
    updates_per_round: int = Field(50, gt=0)
    batch_size: int = Field(16, gt=0)
    """Transitions per update (the public code: 4 segments)."""
    buffer_size: int = Field(2000, gt=0)
    """Segments the replay buffer holds (first in, first out); iteration 2 seeds it with up to this many
    expert segments of won trajectories."""
    keep_fail_ratio: float = Field(0.1, ge=0, le=1)
    """Probability of keeping a failed segment (return <= 0); every segment with a positive return is kept."""
    eta: float = Field(0.02, ge=0)
    """Weight of KL(pi_on || pi_off) to the offline policy (`policy@1`); 0 is the paper's "Vanilla-AWAC"."""
    alpha: float = Field(0.1, gt=0)
    """Weights exp(A / alpha), the offline actor's temperature (1 / `policy.beta`)."""
    max_weight: float = Field(20.0, gt=0)
    lr: float = Field(1e-5, gt=0)
    """Actor learning rate (the public code's online value, as its critic's)."""
    critic_lr: float = Field(1e-5, gt=0)
    seed: int = 1


class Multi2Config(HierarchyConfig):
    """`adapters: separate` (System 1 and System 2 each on its own; `shared` is the paper's ablation);
    `progress: false` (Multi² keeps no progress text); `history: true` (the executor reads the subgoal's
    turns); `max_subtask_steps` is the public code's `max_low_turns`, 32; `high_mode: free` (System 1 writes
    its subgoal, as in the paper); `rejected_penalty: 0` and `high_interval: 1` (GLIDER's rewards, 1 at a
    subgoal's end and 0 elsewhere; System 1's loss unweighted); `collected_per_expert: 0` (the expert
    segments plus every collected one)."""

    progress: bool = False
    history: bool = True
    adapters: Literal["shared", "separate"] = "separate"
    high_mode: Literal["admissible", "observed", "free"] = "free"
    high_interval: int = Field(1, gt=0)
    max_subtask_steps: int = Field(32, gt=0)
    rejected_penalty: float = Field(0.0, ge=0)
    collected_per_expert: float = Field(0.0, ge=0)
    critic: Multi2CriticConfig = Multi2CriticConfig()
    policy: AnchoredActorConfig = AnchoredActorConfig()
    online: Multi2OnlineConfig = Multi2OnlineConfig()
    repo_compat: bool = False
    """The public code's effective update instead of the paper's (docs/multi2.md, side by side): offline, one
    loop trains System 2 with critic heads on its own hidden states (critic gradients reaching its adapter),
    V at the action's end, tau 0.5, plain AWR (no anchored term), replacing `critic@1`; online, A = Q_target
    minus its segment's mean, a first-order "KL", whole segments per batch."""
    rl_roles: tuple[Literal["high", "low"], ...] = Field(("low",), min_length=1)
    """The roles trained by RL after their SFT: `[low]`, System 2 (the method); `[high]` swaps the roles (System 1
    gets the critic and the anchored actor, System 2 stays as cloned; no online phase); `[high, low]` both
    (the online phase refines System 2). Both by SFT is the `evaluate@0` of any of them."""

    @property
    def levels_with_critic(self) -> tuple[str, ...]:
        return self.rl_roles


SECTIONS = {"multi2": Multi2Config}


def check(params) -> None:
    check_hierarchy(params, "multi2")
    if params.multi2.repo_compat and params.multi2.rl_roles != ("low",):
        raise ValueError(
            f"multi2.rl_roles: repo_compat reproduces the public code, which trains System 2 only (`[low]`), got "
            f"{list(params.multi2.rl_roles)}; set repo_compat: false for the role ablations"
        )
    if params.method != "multi2" or params.evolve.iterations < 2:
        return
    if "low" not in params.multi2.rl_roles:
        raise ValueError(
            "multi2.rl_roles: the online phase (iterations >= 2) refines System 2, which these roles leave as cloned; "
            "add `low`, or set evolve.iterations: 1"
        )
    if params.multi2.adapters == "shared":
        raise ValueError(
            "multi2.adapters: the online phase (iterations >= 2) trains System 2's own adapter against its frozen "
            "offline "
            "copy; `shared` gives it none of its own. Use `separate`, or evolve.iterations: 1"
        )
