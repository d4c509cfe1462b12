"""`collect@k` (hierarchical methods): the previous policy's own hierarchical episodes on train tasks, sampled, kept as
episodes and as the three transition sets its decisions make (the same sets `annotate` makes of experts)."""

from __future__ import annotations

from pathlib import Path

import torch

from qevolve.data.atomic import atomic_dir, write_json
from qevolve.data.store import write_store
from qevolve.hierarchy.config import section
from qevolve.hierarchy.roles import ROLES, transitions
from qevolve.hierarchy.shared import COLLECTED, make_agent
from qevolve.hierarchy.transitions import write_transitions
from qevolve.params import Params
from qevolve.rollout import collection_metrics, play_collection

EPISODES = "episodes"
"""The step store in a `collect@k` folder, beside its transitions (`COLLECTED`)."""


def collect(
    params: Params,
    base_dir: Path,
    policy_dir: Path,
    out: Path,
    metrics_path: Path,
    iteration: int,
    previous_metrics: Path,
) -> dict:
    cfg = params.collect
    torch.manual_seed(cfg.seed + iteration)
    agent = make_agent(params, base_dir, policy_dir, temperature=params.policy.temperature)
    trajs, failures, tasks = play_collection(params, agent, iteration)
    sets: dict[str, list] = {role: [] for role in ROLES}
    hrl = section(params)
    for t in trajs:
        if t.steps:
            for role, rows in transitions(
                t, agent.labels[t.trajectory_id], agent.prompts, hrl.compat_converters, hrl.rejected_penalty
            ).items():
                sets[role] += rows
    with atomic_dir(out) as tmp:
        write_store(tmp / EPISODES, trajs)
        write_transitions(tmp / COLLECTED, sets, lambda text: len(agent.tok.encode(text, add_special_tokens=False)))
    metrics = {
        **agent.backend.placement(),
        "truncated_observations": len(agent.builder.truncated),
        **collection_metrics(trajs, tasks, failures, previous_metrics),
        **{f"{role}_transitions": len(rows) for role, rows in sets.items()},
    }
    write_json(metrics_path, metrics)
    return metrics
