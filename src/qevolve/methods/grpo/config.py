"""The GRPO baseline's own section of params.yaml (`online`) and its rule across sections."""

from __future__ import annotations

from pydantic import Field

from qevolve.config import TrainConfig


class OnlineConfig(TrainConfig):
    """The online RL baseline (`method: grpo`): GRPO with the outcome reward only, from the BC
    policy, each iteration `online@k` spending `env_steps` environment steps on train tasks. Each round
    plays `group_size` sampled episodes of `tasks_per_round` tasks; an episode's advantage is its return
    less its group's mean, over the group's standard deviation, given to every action it took; one
    clipped-surrogate update (policy.clip_low/clip_high, policy.kl_coef to the round's behaviour policy)
    follows each round."""

    env_steps: int = Field(1000, gt=0)
    """Environment steps per iteration (the benchmark sets it to Q-Evolve's own), to the nearest round."""
    tasks_per_round: int = Field(4, gt=0)
    group_size: int = Field(4, ge=2)
    epochs: int = Field(1, gt=0)
    """Passes over each round's episodes."""
    lr: float = Field(2e-4, gt=0)
    seed: int = 1


SECTIONS = {"online": OnlineConfig}


def check(params) -> None:
    if params.method == "grpo" and params.policy.algo != "bppo":
        raise ValueError(
            f"policy.algo: the GRPO baseline (method `grpo`) takes its clipped surrogate, clip range and KL "
            f"from the policy section; `{params.policy.algo}` would silently turn it into "
            f"{params.policy.algo.upper()}. "
            "Use policy.algo `bppo` with GRPO"
        )
