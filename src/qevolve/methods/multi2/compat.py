"""`policy@1` under `multi2.repo_compat: true`: the public code's effective offline update
(`park-sangeun/Multi-Square`, ../shared/research/multi2.md section 4), replacing `critic@1` and the
paper's `policy@1`.

One loop trains System 2 and its critic together, as the code's `update_policy` does per batch: the V, Q
and target-Q heads read System 2's own hidden states (not detached, not a critic adapter of their own), so
the critic's loss leaves its gradients in System 2's LoRA, and the same optimiser step applies them with
the actor's. Per transition: Q toward r + gamma (1 - done) V(s'), V toward the target Q with tau 0.5
(plain MSE, the shipped offline config), V read at the action's end token (a function of (s, a)) and V(s')
at the next action's end; then the actor's AWR on the data's actions, -mean(min(exp(beta A), max_weight)
log pi(a)), A = Q - V from the same pass, without the anchored term (dead code in the release). The heads
train at `multi2.critic.lr`, the adapter at `multi2.policy.lr`; the loop runs `multi2.policy`'s epochs and
batches. It writes the policy and the heads (`models/critic@1`, no adapter: the online phase puts them
back on System 2)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from qevolve.algos.losses import sequence_logprobs
from qevolve.algos.rl import awr_loss, iql_losses
from qevolve.hierarchy.critic import Item, LevelCritic, critic_items, save_critic, values
from qevolve.hierarchy.shared import load_roles_policy, role_builder, save_roles_policy, training_sets
from qevolve.models.base import target_logprobs
from qevolve.models.device import model_device, pad_ids
from qevolve.models.policy import use_adapter
from qevolve.params import Params
from qevolve.training import checkpoint_path, input_digest, last_epoch_mean, save_and_report, train

LEVEL = "low"
TAU = 0.5
"""The public code's offline `weight_tau`: V by plain MSE toward the target Q."""


def on_actor(model, levels: tuple[str, ...], critic_lr: float) -> LevelCritic:
    """Critic heads on the actor's own features (its trainable LoRA, gradients not stopped), the heads at
    `critic_lr` when `train` optimises the pair."""
    joint = LevelCritic(model, frozen=False, levels=levels)
    joint.lr_by_prefix = {"v.": critic_lr, "q.": critic_lr}
    return joint


def joint_step(
    joint: LevelCritic, micro: list[list[Item]], beta: float, max_weight: float, gamma: float, pad_id: int
) -> dict:
    """Forward and backward of one optimiser step: the critic's losses, then the actor's, both into System 2's
    adapter."""
    total = sum(len(mb) for mb in micro)
    device = model_device(joint)
    sums = {"loss": 0.0, "v_loss": 0.0, "q_loss": 0.0, "awr": 0.0, "advantage": 0.0, "logp": 0.0}
    for mb in micro:
        x = values(joint, mb, pad_id)
        rewards = torch.tensor([it.reward for it in mb], device=device)
        not_done = torch.tensor([0.0 if it.done else 1.0 for it in mb], device=device)
        v_loss, q_loss = iql_losses(
            x["v"], x["q"], x["q_target"], x["v_next"], rewards, not_done, torch.ones_like(rewards), gamma, TAU, total
        )
        adv = (x["q"] - x["v"]).detach()
        ids, attn = pad_ids([it.ids for it in mb], pad_id, device)
        mask, _ = pad_ids([[0] * it.output_start + [1] * (len(it.ids) - it.output_start) for it in mb], 0, device)
        logp = sequence_logprobs(target_logprobs(joint.lm, ids, mask, attention_mask=attn), mask)
        share = len(mb) / total
        awr = awr_loss(logp, adv, 1.0 / beta, max_weight)
        (v_loss + q_loss + awr * share).backward()
        sums["v_loss"] += v_loss.item()
        sums["q_loss"] += q_loss.item()
        sums["awr"] += awr.item() * share
        sums["loss"] += v_loss.item() + q_loss.item() + awr.item() * share
        sums["advantage"] += adv.sum().item() / total
        sums["logp"] += logp.detach().sum().item() / total
    return sums


def policy(
    params: Params,
    base_dir: Path,
    previous_dir: Path,
    data_dir: Path,
    collected_dir: Path,
    out: Path,
    critic_out: Path,
    metrics_path: Path,
    curve_path: Path,
) -> dict:
    hrl = params.multi2
    cfg = hrl.policy
    rows = training_sets(params, data_dir, collected_dir)[LEVEL]
    if not rows:
        raise ValueError(f"{data_dir}, {collected_dir}: no transitions of System 2 (`low`) to train on")
    model, tok, separate = load_roles_policy(params, base_dir, previous_dir, trainable=True)
    if separate:
        use_adapter(model, LEVEL)
    joint = on_actor(model, (LEVEL,), hrl.critic.lr)
    items = critic_items(role_builder(params, tok), {LEVEL: rows}, action_end=True)
    start = time.perf_counter()
    curve = train(
        joint,
        items,
        cfg,
        lambda it: 2 * len(it.ids) + len(it.next_ids),
        lambda micro: joint_step(joint, micro, cfg.beta, cfg.max_weight, hrl.critic.gamma, tok.pad_token_id),
        "policy",
        after_step=lambda: joint.update_target(hrl.critic.target_rate),
        checkpoint=checkpoint_path(out),
        inputs=input_digest(previous_dir, data_dir, collected_dir),
        run=params.train,
    )
    elapsed = time.perf_counter() - start

    def save() -> None:
        save_roles_policy(model, out, previous_dir)
        save_critic(joint, critic_out, adapter=False)

    metrics = {
        "loss": last_epoch_mean(curve, "loss"),
        "first_loss": curve[0]["loss"],
        **{key: last_epoch_mean(curve, key) for key in ("v_loss", "q_loss", "awr", "advantage", "logp")},
        "first_logp": curve[0]["logp"],
        "examples": len(items),
        "expectile": TAU,
    }
    return save_and_report(
        save, metrics, model, curve, elapsed, params.train, out, metrics_path, curve_path, speed_of=joint
    )
