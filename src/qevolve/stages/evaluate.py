"""`evaluate`: greedy episodes of a policy on the configured evaluation splits."""

from __future__ import annotations

from pathlib import Path

import torch

from qevolve.models.policy import Actor
from qevolve.models.prompt import make_builder
from qevolve.models.ray_policy import rollout_backend
from qevolve.params import Params
from qevolve.rollout import play_splits


def evaluate(
    params: Params,
    base_dir: Path,
    policy_dir: Path,
    out: Path,
    metrics_path: Path,
    iteration: int,
    env_steps_path: Path,
) -> dict:
    """Greedy episodes on each configured split. `env_steps_path` is the metrics file with the cumulative
    env steps spent to train this policy (experts, then every collect), reported beside each split."""
    torch.manual_seed(params.evaluate.seed)
    backend, tok = rollout_backend(params, base_dir, policy_dir, params.evaluate.batch_size)
    # Greedy: `policy.temperature` (collection's) plays no part; the recorded log-probs are the model's own.
    actor = Actor(
        None,
        tok,
        make_builder(params, tok, policy_dir),
        params.policy.action_mode,
        1.0,
        params.policy.max_new_tokens,
        backend=backend,
    )
    return play_splits(params, actor, out, metrics_path, f"policy@{iteration}", env_steps_path)
