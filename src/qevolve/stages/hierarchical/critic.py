"""`critic@k` (hierarchical methods): step-level IQL, one critic per level (each of the section's
`levels_with_critic`: all three for STEP-HRL, System 2's for Multi²), on expert + collected transitions;
then the advantage A = Q(s, a) - V(s) of every transition, which `policy@k` weights its outputs by.

Per level: Q(s, a) by TD regression toward r + gamma (1 - done) V(s'), V(s) by expectile regression toward
the target Q (a Polyak copy of the Q head). V(s) is read at the last token of the state's prompt, Q(s, a)
at the last token of the output, V(s') at the last token of the next state's prompt, from one forward pass
over the batch's (s + a) and s' sequences. The backbone is the critic's own LoRA adapter (started from the
BC policy's; from its low role's with separate adapters), or with `step_hrl.repo_compat` the policy's
frozen features, as in STEP-HRL's public code.
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from qevolve.algos.rl import iql_losses
from qevolve.algos.stats import auc
from qevolve.data.advantages import MOVING
from qevolve.data.atomic import atomic_dir
from qevolve.hierarchy.config import section
from qevolve.hierarchy.critic import Item, LevelCritic, critic_items, save_critic, values, with_steps
from qevolve.hierarchy.shared import ADVANTAGE_SCHEMA, ADVANTAGES, read_roles, role_builder, training_sets
from qevolve.models.policy import load_policy
from qevolve.params import Params
from qevolve.training import checkpoint_path, input_digest, last_epoch_mean, save_and_report, train


def critic_step(critic: LevelCritic, micro: list[list[Item]], gamma: float, tau: float, pad_id: int) -> dict:
    total = sum(len(mb) for mb in micro)
    sums = {"loss": 0.0, "v_loss": 0.0, "q_loss": 0.0}
    for mb in micro:
        x = values(critic, mb, pad_id)
        device = x["v"].device
        rewards = torch.tensor([it.reward for it in mb], device=device)
        not_done = torch.tensor([0.0 if it.done else 1.0 for it in mb], device=device)
        v_loss, q_loss = iql_losses(
            x["v"], x["q"], x["q_target"], x["v_next"], rewards, not_done, torch.ones_like(rewards), gamma, tau, total
        )
        (v_loss + q_loss).backward()
        sums["v_loss"] += v_loss.item()
        sums["q_loss"] += q_loss.item()
        sums["loss"] += v_loss.item() + q_loss.item()
    return sums


def critic(
    params: Params,
    base_dir: Path,
    policy_dir: Path,
    data_dir: Path,
    collected_dir: Path,
    out: Path,
    advantages_out: Path,
    metrics_path: Path,
    curve_path: Path,
) -> dict:
    hrl = section(params)
    cfg, compat = hrl.critic, hrl.compat_critic
    torch.manual_seed(cfg.seed)
    every = training_sets(params, data_dir, collected_dir)
    if hrl.critic_time_aware:
        every = with_steps(every)
    sets = {role: rows for role, rows in every.items() if role in hrl.levels_with_critic}
    if read_roles(policy_dir)["adapters"] == "separate":
        policy_dir = policy_dir / "low"
    if compat:  # heads on the BC policy's frozen features
        lm, tok = load_policy(base_dir, params.model, adapter=policy_dir)
    elif cfg.init_from_policy:
        lm, tok = load_policy(base_dir, params.model, adapter=policy_dir, trainable=True)
    else:
        lm, tok = load_policy(base_dir, params.model)
    model = LevelCritic(lm, frozen=compat, levels=tuple(sets))
    items = critic_items(role_builder(params, tok), sets)
    tau = 0.05 if compat else cfg.expectile
    start = time.perf_counter()
    curve = train(
        model,
        items,
        cfg,
        lambda it: len(it.ids) + len(it.next_ids),
        lambda micro: critic_step(model, micro, cfg.gamma, tau, tok.pad_token_id),
        "critic",
        after_step=lambda: model.update_target(cfg.target_rate),
        checkpoint=checkpoint_path(out),
        inputs=input_digest(policy_dir, data_dir, collected_dir),
        run=params.train,
    )
    elapsed = time.perf_counter() - start
    model.eval()
    rows = []
    with torch.no_grad():
        for i in range(0, len(items), cfg.micro_batch_size):
            mb = items[i : i + cfg.micro_batch_size]
            x = values(model, mb, tok.pad_token_id)
            rows += [
                {
                    "trajectory_id": it.key[0],
                    "level": it.role,
                    "step": it.key[2],
                    "advantage": float(q - v),
                    "v": float(v),
                    "q": float(q),
                }
                for it, v, q in zip(mb, x["v"], x["q"])
            ]

    def save() -> None:
        save_critic(model, out, adapter=not compat)
        with atomic_dir(advantages_out) as tmp:
            pq.write_table(pa.Table.from_pylist(rows, schema=ADVANTAGE_SCHEMA), tmp / ADVANTAGES)

    metrics = {
        "loss": last_epoch_mean(curve, "loss"),
        "v_loss": last_epoch_mean(curve, "v_loss"),
        "q_loss": last_epoch_mean(curve, "q_loss"),
        "first_loss": curve[0]["loss"],
        "expectile": tau,
        "reward": hrl.reward,
        "time_aware": hrl.critic_time_aware,
        **{f"{role}_transitions": len(sets[role]) for role in sets},
        **{
            f"{role}_rewarded_share": sum(r["reward"] > 0 for r in sets[role]) / max(len(sets[role]), 1)
            for role in sets
        },
        **{
            f"{role}_expert_share": sum(r["source"] == "expert" for r in sets[role]) / max(len(sets[role]), 1)
            for role in sets
        },
        **{f"{role}_advantage_mean": _mean([r["advantage"] for r in rows if r["level"] == role]) for role in sets},
        **{f"{role}_v_mean": _mean([r["v"] for r in rows if r["level"] == role]) for role in sets},
        **contrast(sets, rows),
    }
    return save_and_report(save, metrics, model, curve, elapsed, params.train, out, metrics_path, curve_path)


def contrast(sets: dict[str, list[dict]], rows: list[dict]) -> dict:
    """Per level, on the transitions it trained on: how well V ranks the transitions of won episodes above those
    of lost ones (AUC; held-out episodes are not scored yet), the advantages' spread, and the share of
    transitions whose advantage moves them (|A| >= `MOVING`)."""
    out = {}
    for role, trained in sets.items():
        mine = [r for r in rows if r["level"] == role]
        won = {(r["trajectory_id"], r["step"]) for r in trained if r["won"]}
        ranked = auc(
            [r["v"] for r in mine if (r["trajectory_id"], r["step"]) in won],
            [r["v"] for r in mine if (r["trajectory_id"], r["step"]) not in won],
        )
        a = torch.tensor([r["advantage"] for r in mine])
        out |= {
            f"{role}_auc_train": ranked["auc"],
            f"{role}_advantage_std": float(a.std()) if len(a) > 1 else 0.0,
            f"{role}_moving_share": float((a.abs() >= MOVING).float().mean()) if len(a) else float("nan"),
        }
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
