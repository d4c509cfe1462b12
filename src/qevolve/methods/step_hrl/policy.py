"""`policy@k` (STEP-HRL): the advantage-weighted actor. Every output of every level (expert and collected,
mixed as for `critic@k`) is weighted by min(exp(A / beta), max_weight), A from `critic@k`, and the loss is
the mean over outputs of -weight * (the output's length-normalised log-likelihood): the paper's AWR. With
`step_hrl.repo_compat` the loss is -mean(A * log-likelihood), the public code's effective update. With
separate adapters (`step_hrl.adapters`), each role's outputs train its own. `step_hrl.policy.standardize` (a
departure) standardises each role's advantages first. `step_hrl.policy.constant_advantage` is the control: every
weight 1."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from qevolve.algos.losses import sequence_logprobs
from qevolve.algos.rl import advantage_pg_loss, awr_loss, off_one_share
from qevolve.hierarchy.roles import ROLES, encode
from qevolve.hierarchy.shared import (
    advantage_of,
    load_roles_policy,
    read_advantages,
    role_builder,
    role_groups,
    save_roles_policy,
    training_sets,
)
from qevolve.models.base import target_logprobs
from qevolve.models.device import model_device, pad_ids
from qevolve.params import Params
from qevolve.training import checkpoint_path, input_digest, last_epoch_mean, save_and_report, train

Item = tuple[str, list[int], list[int], float]
"""(role, ids, mask over the output, advantage)."""


def actor_step(
    model,
    micro: list[list[Item]],
    beta: float,
    max_weight: float,
    repo_compat: bool,
    pad_id: int,
    separate: bool = False,
) -> dict:
    total = sum(len(mb) for mb in micro)
    device = model_device(model)
    sums = {"loss": 0.0, "logp": 0.0}
    for mb in micro:
        for group in role_groups(model, mb, separate):
            ids, attn = pad_ids([x for _, x, _, _ in group], pad_id, device)
            mask, _ = pad_ids([m for _, _, m, _ in group], 0, device)
            adv = torch.tensor([a for *_, a in group], device=device)
            logp = sequence_logprobs(target_logprobs(model, ids, mask, attention_mask=attn), mask)
            loss = (
                (advantage_pg_loss(logp, adv) if repo_compat else awr_loss(logp, adv, beta, max_weight))
                * len(group)
                / total
            )
            loss.backward()
            sums["loss"] += loss.item()
            sums["logp"] += logp.detach().sum().item() / total
    return sums


def weighed_by(items: list[Item], cfg, repo_compat: bool) -> list[Item]:
    """The items with the advantages the actor weighs their outputs by: the critic's (`items`), each role's
    standardised (`standardize`), or, for the control (`constant_advantage`), the one at which the weight is 1."""
    if cfg.constant_advantage:
        return [(*it[:3], 1.0 if repo_compat else 0.0) for it in items]
    return standardized(items) if cfg.standardize else items


def standardized(items: list[Item]) -> list[Item]:
    """`step_hrl.policy.standardize`: each role's advantages shifted and scaled to mean 0 and standard deviation 1
    (a role whose advantages are all equal gets 0)."""
    stats = {}
    for role in {it[0] for it in items}:
        a = torch.tensor([it[3] for it in items if it[0] == role], dtype=torch.float64)
        spread = float(a.std()) if len(a) > 1 else 0.0
        stats[role] = (float(a.mean()), spread if spread > 0 else float("inf"))
    return [(role, ids, mask, (a - stats[role][0]) / stats[role][1]) for role, ids, mask, a in items]


def policy(
    params: Params,
    base_dir: Path,
    previous_dir: Path,
    data_dir: Path,
    collected_dir: Path,
    advantage_dir: Path,
    out: Path,
    metrics_path: Path,
    curve_path: Path,
) -> dict:
    cfg, hrl = params.step_hrl.policy, params.step_hrl
    sets = training_sets(params, data_dir, collected_dir)
    advantages = read_advantages(advantage_dir)
    model, tok, separate = load_roles_policy(params, base_dir, previous_dir, trainable=True)
    builder = role_builder(params, tok)
    items = []
    for role in ROLES:
        for r in sets[role]:
            a = advantage_of(advantages, advantage_dir, role, r)
            items.append((role, *encode(builder, r["state_text"], r["output_text"]), a))
    items = weighed_by(items, cfg, hrl.repo_compat)
    weights = torch.exp(torch.tensor([a for *_, a in items]) / cfg.beta).clamp(max=cfg.max_weight)
    start = time.perf_counter()
    curve = train(
        model,
        items,
        cfg,
        lambda it: len(it[1]),
        lambda micro: actor_step(model, micro, cfg.beta, cfg.max_weight, hrl.repo_compat, tok.pad_token_id, separate),
        "policy",
        checkpoint=checkpoint_path(out),
        inputs=input_digest(previous_dir, data_dir, collected_dir, advantage_dir),
        run=params.train,
    )
    elapsed = time.perf_counter() - start
    metrics = {
        "loss": last_epoch_mean(curve, "loss"),
        "first_loss": curve[0]["loss"],
        "logp": last_epoch_mean(curve, "logp"),
        "first_logp": curve[0]["logp"],
        "examples": len(items),
        "weight_mean": float(weights.mean()),
        "weight_clipped": float((weights >= cfg.max_weight).float().mean()),
        "weight_off_one_share": off_one_share(
            weights, torch.tensor([r["output_tokens"] for role in ROLES for r in sets[role]])
        ),
        "repo_compat": hrl.repo_compat,
        "constant_advantage": cfg.constant_advantage,
        "standardize": cfg.standardize,
    }
    return save_and_report(
        lambda: save_roles_policy(model, out, previous_dir),
        metrics,
        model,
        curve,
        elapsed,
        params.train,
        out,
        metrics_path,
        curve_path,
    )
