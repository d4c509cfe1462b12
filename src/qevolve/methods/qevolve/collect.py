"""`collect@k`: the previous policy's own rollouts on train tasks, K sampled episodes per task."""

from __future__ import annotations

from pathlib import Path

import torch

from qevolve.data.atomic import write_json
from qevolve.data.store import write_store
from qevolve.models.policy import Actor
from qevolve.models.prompt import make_builder
from qevolve.models.ray_policy import rollout_backend
from qevolve.params import Params
from qevolve.rollout import collection_metrics, play_collection


def collect(
    params: Params,
    base_dir: Path,
    policy_dir: Path,
    out: Path,
    metrics_path: Path,
    iteration: int,
    previous_metrics: Path,
) -> dict:
    """Sample episodes with temperature `policy.temperature`, recording each action's behaviour log-prob.

    `previous_metrics` (the experts' metrics for k = 1, else collect@k-1's) carries the cumulative env-step
    count so far."""
    cfg = params.collect
    torch.manual_seed(cfg.seed + iteration)
    backend, tok = rollout_backend(params, base_dir, policy_dir, params.collect.batch_size)
    actor = Actor(
        None,
        tok,
        make_builder(params, tok, policy_dir),
        params.policy.action_mode,
        params.policy.temperature,
        params.policy.max_new_tokens,
        backend=backend,
    )
    trajs, failures, tasks = play_collection(params, actor, iteration)
    write_store(out, trajs)
    metrics = {
        **backend.placement(),
        "truncated_observations": len(actor.builder.truncated),
        **collection_metrics(trajs, tasks, failures, previous_metrics),
    }
    write_json(metrics_path, metrics)
    return metrics
