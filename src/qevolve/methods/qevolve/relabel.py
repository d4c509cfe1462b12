"""`relabel@k`: the hybrid dataset, expert demonstrations plus the policy's own rollouts, with every step
given its auxiliary reward and reason by the retrospective rules (`qevolve.algos.relabel`)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

from qevolve.algos.relabel import relabel_step
from qevolve.data.atomic import write_json
from qevolve.data.store import Trajectory, read_store, write_store
from qevolve.envs import check_tasks, make_env
from qevolve.params import Params


def relabel(params: Params, experts_dir: Path, collected_dir: Path, out: Path, metrics_path: Path) -> dict:
    cfg = params.relabel
    experts = read_store(experts_dir)
    check_tasks(make_env(params.env), experts, str(experts_dir))
    if cfg.max_expert and len(experts) > cfg.max_expert:
        experts = random.Random(cfg.seed).sample(experts, cfg.max_expert)
    own = read_store(collected_dir) if cfg.collected else []
    reasons: Counter[str] = Counter()
    hybrid: list[Trajectory] = []
    for t in experts + own:
        steps = []
        for s in t.steps:
            aux, reason = relabel_step(s.action, s.valid, s.observation, s.next_observation, cfg)
            steps.append(replace(s, aux_reward=aux, aux_reason=reason))
            reasons[reason or "none"] += 1
        hybrid.append(replace(t, steps=steps))
    write_store(out, hybrid)
    n_steps = max(sum(reasons.values()), 1)
    metrics = {
        "expert_trajectories": len(experts),
        "self_trajectories": len(own),
        "self_success_rate": sum(t.won for t in own) / max(len(own), 1),
        "steps": sum(reasons.values()),
        "aux_reward_mean": sum(s.aux_reward for t in hybrid for s in t.steps) / n_steps,
        **{f"share_{r}": reasons[r] / n_steps for r in ("format", "rejected", "unchanged")},
    }
    write_json(metrics_path, metrics)
    return metrics
