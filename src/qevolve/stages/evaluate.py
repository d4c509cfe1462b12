"""`evaluate`: greedy episodes of a policy on the configured evaluation splits."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qevolve.config import Params
from qevolve.data.atomic import write_json
from qevolve.data.store import Trajectory, write_store
from qevolve.envs import make_env, select_tasks
from qevolve.envs.base import check_env_failures
from qevolve.models.device import placement
from qevolve.models.policy import Actor, load_policy
from qevolve.stages.bc import make_builder
from qevolve.stages.rollout import play_in


def episode_metrics(trajs: list[Trajectory]) -> dict:
    """Success rate, average reward, steps, invalid-action rate and tokens per episode."""
    n = max(len(trajs), 1)
    steps = [s for t in trajs for s in t.steps]
    return {
        "episodes": len(trajs),
        "success_rate": sum(t.won for t in trajs) / n,
        "avg_reward": sum(t.reward for t in trajs) / n,
        "avg_steps": len(steps) / n,
        "invalid_rate": sum(not s.valid for s in steps) / max(len(steps), 1),
        "output_tokens_per_episode": sum(s.output_tokens for s in steps) / n,
        "prompt_tokens_per_episode": sum(s.prompt_tokens for s in steps) / n,
    }


def evaluate(params: Params, base_dir: Path, policy_dir: Path, out: Path, metrics_path: Path, iteration: int, env_steps_path: Path) -> dict:
    """Greedy episodes on each configured split. `env_steps_path` is the metrics file with the cumulative
    env steps spent to train this policy (experts, then every collect), reported beside each split."""
    torch.manual_seed(params.evaluate.seed)
    model, tok = load_policy(base_dir, params.model, adapter=policy_dir)
    actor = Actor(model, tok, make_builder(params, tok, policy_dir), params.policy.action_mode, params.policy.temperature, params.policy.max_new_tokens)
    return play_splits(params, actor, out, metrics_path, f"policy@{iteration}", env_steps_path)


def play_splits(params: Params, actor: Actor, out: Path, metrics_path: Path, source: str, env_steps_path: Path) -> dict:
    """Greedy episodes of `actor` on every configured split; metrics per split, episodes in `out`."""
    cfg = params.evaluate
    lister = make_env(params.env)
    all_trajs, metrics = [], {}
    spent = json.loads(Path(env_steps_path).read_text())
    for split, count in cfg.splits.items():
        cut = len(actor.builder.truncated)
        tasks = select_tasks(lister, split, params.env, count, cfg.seed)
        trajs = play_in(params.env, tasks, actor, greedy=True, source=source, batch_size=cfg.batch_size, seed=cfg.seed, desc=f"{source} {split}")
        trajs, failures = check_env_failures(trajs, params.env.max_failure_ratio, f"{source} {split}")
        metrics[split] = {
            **episode_metrics(trajs), "cumulative_env_steps": spent["cumulative_env_steps"],
            "cumulative_generated_tokens": spent.get("cumulative_generated_tokens", 0),
            "truncated_observations": len(actor.builder.truncated) - cut, "env_failures": failures,
            **placement(actor.backend.model),
        }
        all_trajs += trajs
    write_store(out, all_trajs)
    write_json(metrics_path, metrics)
    return metrics
