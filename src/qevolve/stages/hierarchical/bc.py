"""`bc` (hierarchical methods): behaviour cloning of the roles on the annotated expert transitions, one adapter
for all three (the roles are told apart by their prompts), or one per role (`step_hrl.adapters: separate`,
each trained on its own role's outputs). The loss of each output is its length-normalised
negative log-likelihood, averaged over the batch (the public code's); the three levels share every
optimiser step, the high level's outputs weighted 1 / `step_hrl.high_interval`."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from qevolve.algos.losses import sequence_logprobs
from qevolve.data.atomic import atomic_dir
from qevolve.hierarchy.config import section
from qevolve.hierarchy.roles import ROLES, encode
from qevolve.hierarchy.shared import role_builder, role_groups, role_names, role_prompts, write_roles
from qevolve.hierarchy.transitions import read_transitions
from qevolve.models.base import target_logprobs
from qevolve.models.device import model_device, pad_ids
from qevolve.models.policy import load_policy, save_adapters
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

Item = tuple[str, list[int], list[int], float]
"""(role, ids, mask over the output's tokens, weight of the output's loss)."""


def weighted_nll_step(model, micro: list[list[Item]], pad_id: int, separate: bool = False) -> dict:
    """Forward and backward over micro-batches: the weighted mean over outputs of each output's mean
    token negative log-likelihood (the weights' sum over the optimiser batch normalises), each output
    through its role's adapter when they are `separate`."""
    total = sum(w for mb in micro for *_, w in mb)
    device = model_device(model)
    loss_sum = 0.0
    for mb, scale in local_share(micro, even=is_sharded(model)):
        for group in role_groups(model, mb, separate):
            ids, attn = pad_ids([x for _, x, _, _ in group], pad_id, device)
            mask, _ = pad_ids([m for _, _, m, _ in group], 0, device)
            weights = torch.tensor([w for *_, w in group], device=device)
            logp = sequence_logprobs(target_logprobs(model, ids, mask, attention_mask=attn), mask)
            loss = -(weights * logp).sum() / total * scale
            loss.backward()
            loss_sum += float(loss.detach())
    return {"loss": loss_sum}


def bc(params: Params, base_dir: Path, data_dir: Path, out: Path, metrics_path: Path, curve_path: Path) -> dict:
    cfg = params.bc
    sets = read_transitions(data_dir)
    if not sets["low"]:
        raise ValueError(f"{data_dir}: no annotated transitions to clone")
    hrl = section(params)
    adapters, progress = hrl.adapters, bool(sets["progress"])
    model, tok = load_policy(
        base_dir, loading_config(params.model, params.train), names=role_names(adapters, progress), seed=cfg.seed
    )
    model = shard(model, params.train, params.model.device)
    builder = role_builder(params, tok)
    weight = {"high": 1.0 / hrl.high_interval, "low": 1.0, "progress": 1.0}
    items = [
        (role, *encode(builder, r["state_text"], r["output_text"]), weight[role]) for role in ROLES for r in sets[role]
    ]
    start = time.perf_counter()
    curve = train(
        model,
        items,
        cfg,
        lambda it: len(it[1]),
        lambda micro: weighted_nll_step(model, micro, tok.pad_token_id, adapters == "separate"),
        "bc",
        checkpoint=checkpoint_path(out),
        inputs=input_digest(data_dir),
        run=params.train,
    )
    elapsed = time.perf_counter() - start
    state = full_state(model)

    def save() -> None:
        with atomic_dir(out) as tmp:
            save_adapters(model, tmp, state_dict=state)
            write_roles(
                tmp, role_prompts(params, builder, progress), sorted({r["output_text"] for r in sets["high"]}), adapters
            )

    metrics = {
        "loss": last_epoch_mean(curve, "loss"),
        "first_loss": curve[0]["loss"],
        "examples": len(items),
        **{f"{role}_examples": len(sets[role]) for role in ROLES},
        "progress": progress,
        "steps": len(curve),
        "adapters": adapters,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    return save_and_report(save, metrics, model, curve, elapsed, params.train, out, metrics_path, curve_path)
