"""`critic@k`: weighted IQL on the hybrid dataset (expert + self trajectories, auxiliary rewards included).

V(s) is fitted by expectile regression towards the slow target Q; Q(s, a) by TD regression towards
r + aux + gamma * V(s'); both weighted per step by `step_weights` (Q-Evolve's weighted IQL).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from qevolve.algos.rl import iql_losses
from qevolve.algos.stats import auc
from qevolve.data.atomic import atomic_dir
from qevolve.data.store import Trajectory, read_store
from qevolve.models.critic import Critic, CriticItem, critic_items, critic_values, load_critic, read_positions
from qevolve.models.device import is_main, model_device, pad_ids
from qevolve.models.policy import load_policy
from qevolve.models.prompt import PROMPT_FILE, make_builder
from qevolve.params import Params
from qevolve.training import (
    checkpoint_path,
    full_state,
    input_digest,
    is_sharded,
    last_epoch_mean,
    loading_config,
    local_share,
    save_and_report,
    shard,
    train,
)


def critic_step(critic: Critic, micro: list[list[CriticItem]], gamma: float, tau: float, pad_id: int) -> dict:
    """Weighted expectile loss for V plus weighted TD loss for Q, over every step of the micro-batches."""
    n_weight = sum(
        float(it.weights[s]) for mb in micro for it in mb for s, (_, q) in read_positions(it).items() if q >= 0
    )
    sums = {"loss": 0.0, "v_loss": 0.0, "q_loss": 0.0}
    device = model_device(critic)
    for mb, scale in local_share(micro, even=is_sharded(critic)):
        ids, attn = pad_ids([it.window.ids for it in mb], pad_id, device)
        v, q, q_target = critic(ids, attn)
        rows, v_pos, q_pos, next_pos, r, notdone, w = [], [], [], [], [], [], []
        for b, it in enumerate(mb):
            pos = read_positions(it)
            T = len(it.rewards)
            for step, (vp, qp) in pos.items():
                if qp < 0:
                    continue
                rows.append(b)
                v_pos.append(vp)
                q_pos.append(qp)
                next_pos.append(pos[step + 1][0])
                r.append(float(it.rewards[step]))
                notdone.append(0.0 if (step == T - 1 and it.done) else 1.0)
                w.append(float(it.weights[step]))
        index = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        values = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
        rows_t, q_pos_t = index(rows), index(q_pos)
        v_loss, q_loss = iql_losses(
            v[rows_t, index(v_pos)],
            q[rows_t, q_pos_t],
            q_target[rows_t, q_pos_t],
            v[rows_t, index(next_pos)],
            values(r),
            values(notdone),
            values(w),
            gamma,
            tau,
            n_weight,
        )
        v_loss, q_loss = v_loss * scale, q_loss * scale
        (v_loss + q_loss).backward()
        sums["v_loss"] += v_loss.item()
        sums["q_loss"] += q_loss.item()
        sums["loss"] += v_loss.item() + q_loss.item()
    return sums


def critic(
    params: Params, base_dir: Path, policy_dir: Path, data_dir: Path, out: Path, metrics_path: Path, curve_path: Path
) -> dict:
    cfg = params.critic
    torch.manual_seed(cfg.seed)
    trajs = read_store(data_dir)
    load = loading_config(params.model, params.train)
    if cfg.init_from_policy:
        model, tok = load_critic(base_dir, load, policy_dir, trainable=True)
    else:
        lm, tok = load_policy(base_dir, load)
        model = Critic(lm)
    model = shard(model, params.train, params.model.device)
    builder = make_builder(params, tok, policy_dir)
    items = critic_items(builder, trajs, cfg.weighted)
    start = time.perf_counter()
    curve = train(
        model,
        items,
        cfg,
        lambda it: len(it.window.ids),
        lambda micro: critic_step(model, micro, cfg.gamma, cfg.expectile, tok.pad_token_id),
        "critic",
        after_step=lambda: model.update_target(cfg.target_rate),
        checkpoint=checkpoint_path(out),
        inputs=input_digest(policy_dir, data_dir),
        run=params.train,
    )
    elapsed = time.perf_counter() - start
    state = full_state(model)
    if is_sharded(model) or is_main():  # a sharded model's passes take every rank
        values = critic_values(model, items, tok.pad_token_id, cfg.micro_batch_size)
    if not is_main():
        return {}

    def save() -> None:
        with atomic_dir(out) as tmp:
            model.save(tmp, state)
            (tmp / PROMPT_FILE).write_text((policy_dir / PROMPT_FILE).read_text())

    metrics = {
        "loss": last_epoch_mean(curve, "loss"),
        "v_loss": last_epoch_mean(curve, "v_loss"),
        "q_loss": last_epoch_mean(curve, "q_loss"),
        "first_loss": curve[0]["loss"],
        "windows": len(items),
        "trajectories": len(trajs),
        **value_stats(trajs, values),
    }
    return save_and_report(save, metrics, model, curve, elapsed, params.train, out, metrics_path, curve_path)


def value_stats(trajs: list[Trajectory], values: dict[int, dict[int, tuple[float, float]]]) -> dict:
    """Mean V over the steps of won and of lost trajectories, overall V and Q statistics, and how well an
    episode's mean V ranks won above lost on the data the critic trained on (`auc_train`; held out: `diagnose@k`)."""

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    v_won, v_lost, qs, episodes = [], [], [], {True: [], False: []}
    for i, t in enumerate(trajs):
        vs = [values.get(i, {}).get(step, (float("nan"), float("nan"))) for step in range(len(t.steps))]
        (v_won if t.won else v_lost).extend(v for v, _ in vs)
        qs.extend(q for _, q in vs)
        if vs:
            episodes[t.won].append(mean([v for v, _ in vs]))
    vs = v_won + v_lost
    return {
        "auc_train": auc(episodes[True], episodes[False])["auc"],
        "v_mean": mean(vs),
        "v_std": float(torch.tensor(vs).std()) if len(vs) > 1 else 0.0,
        "v_mean_won": mean(v_won),
        "v_mean_lost": mean(v_lost),
        "q_mean": mean(qs),
    }
