"""`online@k`: the online RL baseline, GRPO with the outcome reward only (`method: grpo`).

Rounds of: draw `tasks_per_round` train tasks, play each `group_size` times with the current policy
(sampling), give every action of an episode its group-normalised return, and make one clipped-surrogate
update (the same loss as `policy@k`, against the round's own behaviour policy). A round's env steps vary
with its episodes' lengths, so the iteration stops at the round boundary nearest `online.env_steps`
(`another_round`), not past it by up to a round. After each round the adapter and the counters are
checkpointed beside the output, so a killed stage resumes at the round it was in (not when its settings
or previous policy have changed since).
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import torch

from qevolve.data.atomic import atomic_dir, atomic_path, write_json
from qevolve.data.store import Trajectory
from qevolve.envs import make_env, select_tasks
from qevolve.models.device import placement
from qevolve.models.policy import Actor, load_policy, save_adapters
from qevolve.models.prompt import PROMPT_FILE, make_builder
from qevolve.params import Params
from qevolve.policy_update import policy_items, policy_step, reference_pass
from qevolve.rollout import another_round, count_round, online_metrics, play_in
from qevolve.training import (
    changing_tensors,
    checkpoint_path,
    fingerprint,
    input_digest,
    load_round,
    train,
    trained_state,
)


def group_advantages(trajs: list[Trajectory]) -> dict[tuple[str, int], float]:
    """(trajectory id, step) -> (return - group mean) / (group std + 1e-6), episodes grouped by task;
    the population std, so a group that all won or all lost gives zeros."""
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[t.task_id].append(t)
    out = {}
    for group in groups.values():
        returns = torch.tensor([t.reward for t in group], dtype=torch.float64)
        adv = (returns - returns.mean()) / (returns.std(unbiased=False) + 1e-6)
        for t, a in zip(group, adv.tolist()):
            out.update({(t.trajectory_id, s.step): a for s in t.steps})
    return out


def online(
    params: Params,
    base_dir: Path,
    previous_dir: Path,
    out: Path,
    metrics_path: Path,
    curve_path: Path,
    iteration: int,
    previous_metrics: Path,
) -> dict:
    cfg, env_cfg = params.online, params.env
    model, tok = load_policy(base_dir, params.model, adapter=previous_dir, trainable=True)
    builder = make_builder(params, tok, previous_dir)
    lister = make_env(env_cfg)
    ckpt = checkpoint_path(out)
    key = fingerprint(
        iteration, params.model_dump(include={"env", "model", "policy", "online"}), input_digest(previous_dir)
    )
    state = {
        "round": 0,
        "env_steps": 0,
        "tokens": 0,
        "generated_tokens": 0,
        "episodes": 0,
        "won": 0,
        "curve": [],
        "fingerprint": key,
    }
    if saved := load_round(ckpt, key, f"online@{iteration}"):
        model.load_state_dict(saved.pop("model"), strict=False)
        state = saved
    names = changing_tensors(model)
    start = time.perf_counter()
    while another_round(state["env_steps"], cfg.env_steps, state["round"]):
        r = state["round"]
        seed = cfg.seed + 1000 * iteration + r
        tasks = select_tasks(lister, "train", env_cfg, cfg.tasks_per_round, seed)
        actor = Actor(
            model, tok, builder, params.policy.action_mode, params.policy.temperature, params.policy.max_new_tokens
        )
        trajs = play_in(
            env_cfg,
            [t for t in tasks for _ in range(cfg.group_size)],
            actor,
            greedy=False,
            source=f"policy@{iteration - 1}",
            batch_size=len(tasks) * cfg.group_size,
            seed=seed,
            desc=f"online@{iteration} round {r + 1}",
        )
        trajs = count_round(state, trajs, env_cfg, f"online@{iteration}")
        advantages = group_advantages(trajs)
        items = [it for it in policy_items(builder, trajs, advantages, out) if bool(it.advantages.abs().gt(0).any())]
        row = {
            "round": r + 1,
            "env_steps": state["env_steps"],
            "success_rate": sum(t.won for t in trajs) / max(len(trajs), 1),
            "updated_windows": len(items),
        }
        if items:
            for it, ref in zip(items, reference_pass(model, items, tok.pad_token_id, cfg.micro_batch_size)):
                it.reference = ref
                it.behavior = torch.stack([lp.sum() for lp in ref])
            curve = train(
                model,
                items,
                cfg,
                lambda it: len(it.window.ids),
                lambda micro: policy_step(model, micro, params, tok.pad_token_id),
                f"online@{iteration}",
                run=params.train,
            )
            row.update({k: sum(c[k] for c in curve) / len(curve) for k in ("loss", "pg_loss", "kl", "clip_fraction")})
        state["curve"].append(row)
        state["round"] = r + 1
        with atomic_path(ckpt) as tmp:
            torch.save({**state, "model": trained_state(model, names)}, tmp)
    with atomic_dir(out) as tmp:
        save_adapters(model, tmp)
        (tmp / PROMPT_FILE).write_text((Path(previous_dir) / PROMPT_FILE).read_text())
    metrics = {
        **online_metrics(state, previous_metrics),
        "seconds": time.perf_counter() - start,
        **placement(model),
    }
    write_json(metrics_path, metrics)
    write_json(curve_path, state["curve"])
    ckpt.unlink(missing_ok=True)
    return metrics
