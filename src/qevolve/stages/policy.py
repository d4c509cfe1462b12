"""`policy@k`: BPPO (or the AWR ablation) over the hybrid dataset, starting from the previous policy.

The behaviour log-prob of a step is the log-likelihood of its action tokens under the policy that acted:
the previous policy for its own rollouts, the BC policy for expert steps. Both are recomputed here on the
same token windows the update trains on, so the ratio is exactly 1 before the first update (the log-prob
recorded while acting saw a differently truncated history, and, in admissible mode, a distribution
restricted to the valid actions). The KL penalty is to the previous policy, per action token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qevolve.algos.losses import token_logprobs
from qevolve.algos.rl import awr_loss, bppo_loss, clip_fraction, kl_to_reference
from qevolve.config import Params
from qevolve.data.atomic import atomic_dir, write_json
from qevolve.data.store import Trajectory, read_store
from qevolve.models.policy import load_policy
from qevolve.models.prompt import Window
from qevolve.stages.advantage import read_advantages
from qevolve.stages.bc import PROMPT_FILE, make_builder
from qevolve.models.device import model_device, placement
from qevolve.stages.training import checkpoint_path, input_digest, is_main, last_epoch_mean, local_share, pad_ids, train


@dataclass
class PolicyItem:
    window: Window
    expert: bool
    advantages: torch.Tensor
    """One per action step of the window, in window order."""
    behavior: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    """Behaviour log-prob of each action step."""
    reference: list[torch.Tensor] = field(default_factory=list)
    """Per action step: the previous policy's log-prob of each action token (for the KL penalty)."""

    @property
    def spans(self) -> list[tuple[int, int]]:
        return [(a, b) for _, _, a, b in self.window.steps if b > a]


def step_token_logps(model, items: list[PolicyItem], pad_id: int) -> list[list[torch.Tensor]]:
    """Per item, per action step: the log-probs of the action's tokens under `model`."""
    ids, attn = pad_ids([it.window.ids for it in items], pad_id, model_device(model))
    logp = token_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids)  # entry t predicts ids[t+1]
    return [[logp[b, a - 1 : e - 1] for a, e in it.spans] for b, it in enumerate(items)]


@torch.no_grad()
def reference_pass(model, items: list[PolicyItem], pad_id: int, batch_size: int) -> list[list[torch.Tensor]]:
    model.eval()
    out = []
    for i in range(0, len(items), batch_size):
        out += [[lp.cpu() for lp in per] for per in step_token_logps(model, items[i : i + batch_size], pad_id)]
    return out


def policy_items(builder, trajs: list[Trajectory], advantages: dict[tuple[str, int], float], data_dir: Path) -> list[PolicyItem]:
    items = []
    for t in trajs:
        windows = builder.windows(t.instruction, [s.observation for s in t.steps], [s.output for s in t.steps])
        for w in windows:
            steps = [step for step, _, a, b in w.steps if b > a]
            missing = [s for s in steps if (t.trajectory_id, s) not in advantages]
            if missing:
                raise ValueError(f"{data_dir}: trajectory {t.trajectory_id} step {missing[0]} has no advantage")
            adv = torch.tensor([advantages[(t.trajectory_id, s)] for s in steps])
            items.append(PolicyItem(w, t.source == "expert", adv))
    return items


def policy_step(model, micro: list[list[PolicyItem]], params: Params, pad_id: int) -> dict:
    cfg = params.policy
    n_steps = sum(len(it.spans) for mb in micro for it in mb)
    n_tokens = sum(b - a for mb in micro for it in mb for a, b in it.spans)
    sums = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "ratio": 0.0}
    device = model_device(model)
    for mb in local_share(micro):
        new_tokens = step_token_logps(model, mb, pad_id)
        logp_new = torch.stack([lp.sum() for per in new_tokens for lp in per])
        logp_b = torch.cat([it.behavior for it in mb]).to(device)
        adv = torch.cat([it.advantages for it in mb]).to(device)
        share = len(logp_new) / n_steps
        if cfg.algo == "bppo":
            pg = bppo_loss(logp_new, logp_b, adv, cfg.clip_low, cfg.clip_high)
        else:
            pg = awr_loss(logp_new, adv, cfg.awr_beta, cfg.awr_max_weight)
        tok_new = torch.cat([lp for per in new_tokens for lp in per])
        tok_ref = torch.cat([r for it in mb for r in it.reference]).to(device)
        kl = kl_to_reference(tok_new, tok_ref)
        loss = pg * share + cfg.kl_coef * kl * (len(tok_new) / n_tokens)
        loss.backward()
        sums["loss"] += loss.item()
        sums["pg_loss"] += pg.item() * share
        sums["kl"] += kl.item() * len(tok_new) / n_tokens
        sums["clip_fraction"] += float(clip_fraction(logp_new.detach(), logp_b, cfg.clip_low, cfg.clip_high)) * share
        sums["ratio"] += float(torch.exp(logp_new.detach() - logp_b).mean()) * share
    return sums


def policy(
    params: Params, base_dir: Path, previous_dir: Path, bc_dir: Path, data_dir: Path, advantage_dir: Path,
    out: Path, metrics_path: Path, curve_path: Path,
) -> dict:
    cfg = params.policy
    trajs = read_store(data_dir)
    model, tok = load_policy(base_dir, params.model, adapter=previous_dir, trainable=True)
    builder = make_builder(params, tok, previous_dir)
    items = policy_items(builder, trajs, read_advantages(advantage_dir), data_dir)
    previous = reference_pass(model, items, tok.pad_token_id, cfg.micro_batch_size)
    for it, ref in zip(items, previous):
        it.reference = ref
        it.behavior = torch.stack([lp.sum() for lp in ref]) if ref else torch.empty(0)
    expert_items = [it for it in items if it.expert]
    if expert_items and Path(previous_dir).resolve() != Path(bc_dir).resolve():
        bc_model, _ = load_policy(base_dir, params.model, adapter=bc_dir)
        for it, ref in zip(expert_items, reference_pass(bc_model, expert_items, tok.pad_token_id, cfg.micro_batch_size)):
            it.behavior = torch.stack([lp.sum() for lp in ref])
        del bc_model
    start = time.perf_counter()
    curve = train(model, items, cfg, lambda it: len(it.window.ids), lambda micro: policy_step(model, micro, params, tok.pad_token_id), "policy",
                  checkpoint=checkpoint_path(out), inputs=input_digest(previous_dir, bc_dir, data_dir, advantage_dir))
    elapsed = time.perf_counter() - start
    if not is_main():
        return {}
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
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
        "train_seconds": elapsed,
        **placement(model),
    }
    write_json(metrics_path, metrics)
    write_json(curve_path, curve)
    checkpoint_path(out).unlink(missing_ok=True)  # the artifact is complete
    return metrics
