"""`evaluate` (hierarchical methods): greedy hierarchical episodes of a policy on the evaluation splits, with the
tokens each role read and wrote per episode, subtasks per episode and how subtasks ended; beside the episodes,
the three transition sets their decisions make (as `collect@k` keeps them), which `diagnose@{k+1}` scores the
next critic on."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qevolve.data.atomic import write_json
from qevolve.data.store import read_store
from qevolve.hierarchy.config import section
from qevolve.hierarchy.roles import ROLES, parse_low, transitions
from qevolve.hierarchy.shared import COLLECTED, make_agent
from qevolve.hierarchy.transitions import write_transitions
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
    torch.manual_seed(params.evaluate.seed)
    agent = make_agent(params, base_dir, policy_dir, temperature=1.0)
    metrics = play_splits(params, agent, out, metrics_path, f"policy@{iteration}", env_steps_path)
    played = read_store(out)
    hrl, sets = section(params), {role: [] for role in ROLES}
    for t in played:
        if t.steps:
            for role, rows in transitions(
                t, agent.labels[t.trajectory_id], agent.prompts, hrl.compat_converters, hrl.rejected_penalty
            ).items():
                sets[role] += rows
    write_transitions(out / COLLECTED, sets, lambda text: len(agent.tok.encode(text, add_special_tokens=False)))
    for split, trajs in _by_split(played).items():
        n = max(len(trajs), 1)
        tokens = [agent.role_tokens[t.trajectory_id] for t in trajs]
        calls = [agent.role_calls[t.trajectory_id] for t in trajs]
        metrics[split] |= {
            **{f"{role}_tokens_per_episode": sum(t[role] for t in tokens) / n for role in ROLES},
            **{
                f"{role}_prompt_tokens_per_call": sum(t[role] for t in tokens) / max(sum(c[role] for c in calls), 1)
                for role in ROLES
            },
            "max_prompt_tokens_per_step": max((s.prompt_tokens for t in trajs for s in t.steps), default=0),
            "subtasks_per_episode": sum(c["high"] for c in calls) / n,
            "subtasks_ended_by_flag": sum(parse_low(s.output)[1] for t in trajs for s in t.steps)
            / max(sum(c["high"] for c in calls), 1),
        }
    write_json(metrics_path, metrics)
    return json.loads(Path(metrics_path).read_text())


def _by_split(trajs: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for t in trajs:
        out.setdefault(t.split, []).append(t)
    return out
