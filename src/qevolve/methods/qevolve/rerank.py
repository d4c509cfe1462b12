"""`rerank@k`: Best-of-N at test time with iteration k's critic, the paper's critic-rerank ablation.

The policy is the one iteration k started from (the BC policy for k = 1); it is not updated. At each step
N actions are drawn from it and the critic's Q(s, a) picks one (`qevolve.models.policy.BestOfN`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from qevolve.models.critic import load_critic
from qevolve.models.policy import BestOfN, load_policy
from qevolve.models.prompt import make_builder
from qevolve.params import Params
from qevolve.rollout import play_splits


def rerank(
    params: Params,
    base_dir: Path,
    policy_dir: Path,
    critic_dir: Path,
    out: Path,
    metrics_path: Path,
    iteration: int,
    env_steps_path: Path,
) -> dict:
    """`rerank@k`: the evaluation episodes played by policy k-1 with Best-of-N under critic k (no update)."""
    torch.manual_seed(params.evaluate.seed)
    model, tok = load_policy(base_dir, params.model, adapter=policy_dir)
    critic, _ = load_critic(base_dir, params.model, critic_dir)
    actor = BestOfN(
        model,
        tok,
        make_builder(params, tok, policy_dir),
        critic.eval(),
        params.rerank.best_of,
        params.rerank.temperature,
        params.critic.micro_batch_size,
        torch.Generator().manual_seed(params.evaluate.seed),
    )
    return play_splits(params, actor, out, metrics_path, f"rerank@{iteration}", env_steps_path)
