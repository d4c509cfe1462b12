"""`policy@k`: BPPO (or the AWR ablation) over the hybrid dataset, starting from the previous policy.

The behaviour log-prob of a step is the log-likelihood of its action tokens under the policy that acted:
the previous policy for its own rollouts, the BC policy for expert steps. Both are recomputed here on the
same token windows the update trains on, so the ratio is exactly 1 before the first update (the log-prob
recorded while acting saw a differently truncated history, and, in admissible mode, a distribution
restricted to the valid actions). The KL penalty is to the previous policy, per action token.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from qevolve.algos.rl import off_one_share, update_weights
from qevolve.data.advantages import read_advantages
from qevolve.data.atomic import atomic_dir
from qevolve.data.store import read_store
from qevolve.models.policy import load_policy, save_adapters
from qevolve.models.prompt import PROMPT_FILE, make_builder
from qevolve.params import Params
from qevolve.policy_update import policy_items, policy_step, reference_pass
from qevolve.training import (
    checkpoint_path,
    full_state,
    input_digest,
    last_epoch_mean,
    loading_config,
    save_and_report,
    shard,
    train,
)


def policy(
    params: Params,
    base_dir: Path,
    previous_dir: Path,
    bc_dir: Path,
    data_dir: Path,
    advantage_dir: Path,
    out: Path,
    metrics_path: Path,
    curve_path: Path,
) -> dict:
    cfg = params.policy
    trajs = read_store(data_dir)
    load = loading_config(params.model, params.train)
    model, tok = load_policy(base_dir, load, adapter=previous_dir, trainable=True)
    model = shard(model, params.train, params.model.device)
    builder = make_builder(params, tok, previous_dir)
    items = policy_items(builder, trajs, read_advantages(advantage_dir), data_dir)
    previous = reference_pass(model, items, tok.pad_token_id, cfg.micro_batch_size)
    for it, ref in zip(items, previous):
        it.reference = ref
        it.behavior = torch.stack([lp.sum() for lp in ref]) if ref else torch.empty(0)
    expert_items = [it for it in items if it.expert]
    if expert_items and Path(previous_dir).resolve() != Path(bc_dir).resolve():
        bc_model = shard(load_policy(base_dir, load, adapter=bc_dir)[0], params.train, params.model.device)
        for it, ref in zip(
            expert_items, reference_pass(bc_model, expert_items, tok.pad_token_id, cfg.micro_batch_size)
        ):
            it.behavior = torch.stack([lp.sum() for lp in ref])
        del bc_model
    start = time.perf_counter()
    curve = train(
        model,
        items,
        cfg,
        lambda it: len(it.window.ids),
        lambda micro: policy_step(model, micro, params, tok.pad_token_id),
        "policy",
        checkpoint=checkpoint_path(out),
        inputs=input_digest(previous_dir, bc_dir, data_dir, advantage_dir),
        run=params.train,
    )
    elapsed = time.perf_counter() - start
    state = full_state(model)

    def save() -> None:
        with atomic_dir(out) as tmp:
            save_adapters(model, tmp, state_dict=state)
            (tmp / PROMPT_FILE).write_text((Path(previous_dir) / PROMPT_FILE).read_text())

    metrics = {
        "algo": cfg.algo,
        "loss": last_epoch_mean(curve, "loss"),
        "pg_loss": last_epoch_mean(curve, "pg_loss"),
        "kl": last_epoch_mean(curve, "kl"),
        "clip_fraction": last_epoch_mean(curve, "clip_fraction"),
        "ratio": last_epoch_mean(curve, "ratio"),
        "windows": len(items),
        "steps": sum(len(it.spans) for it in items),
        **weight_stats(items, cfg),
    }
    return save_and_report(save, metrics, model, curve, elapsed, params.train, out, metrics_path, curve_path)


def weight_stats(items: list, cfg) -> dict:
    """How far the update is from behaviour cloning: the share of action tokens whose step's weight
    (`update_weights`) is more than 0.1 from BC's 1, and the mean weight per token."""
    weights = torch.cat([update_weights(it.advantages, cfg.algo, cfg.awr_beta, cfg.awr_max_weight) for it in items])
    tokens = torch.tensor([b - a for it in items for a, b in it.spans], dtype=torch.float)
    if not len(tokens):
        return {}
    return {
        "weight_off_one_share": off_one_share(weights, tokens),
        "weight_mean": float((weights * tokens).sum() / tokens.sum()),
    }
