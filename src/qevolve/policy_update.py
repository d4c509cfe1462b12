"""What the policy updates (`policy@k`, GRPO's `online@k`) share: items over token windows with their
advantages and behaviour log-probs, the reference pass, and one optimiser step's loss (BPPO or AWR
plus the KL penalty)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from qevolve.algos.rl import clip_fraction, policy_loss
from qevolve.data.store import Trajectory
from qevolve.models.base import next_token_logprobs, target_logprobs
from qevolve.models.device import model_device, pad_ids
from qevolve.models.prompt import Window
from qevolve.params import Params
from qevolve.training import is_sharded, local_share


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
    actions = torch.zeros_like(ids)
    for b, it in enumerate(items):
        for a, e in it.spans:
            actions[b, a:e] = 1
    logp = target_logprobs(model, ids, actions, attention_mask=attn)  # entry t predicts ids[t+1]
    return [[logp[b, a - 1 : e - 1] for a, e in it.spans] for b, it in enumerate(items)]


@torch.no_grad()
def reference_pass(model, items: list[PolicyItem], pad_id: int, batch_size: int) -> list[list[torch.Tensor]]:
    model.eval()
    out = []
    for i in range(0, len(items), batch_size):
        out += [[lp.cpu() for lp in per] for per in step_token_logps(model, items[i : i + batch_size], pad_id)]
    return out


def policy_items(
    builder, trajs: list[Trajectory], advantages: dict[tuple[str, int], float], data_dir: Path
) -> list[PolicyItem]:
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
    for mb, scale in local_share(micro, even=is_sharded(model)):
        new_tokens = step_token_logps(model, mb, pad_id)
        logp_new = torch.stack([lp.sum() for per in new_tokens for lp in per])
        logp_b = torch.cat([it.behavior for it in mb]).to(device)
        adv = torch.cat([it.advantages for it in mb]).to(device)
        share = len(logp_new) / n_steps
        tok_new = torch.cat([lp for per in new_tokens for lp in per])
        tok_ref = torch.cat([r for it in mb for r in it.reference]).to(device)
        loss, pg, kl = policy_loss(
            logp_new,
            logp_b,
            adv,
            tok_new,
            tok_ref,
            algo=cfg.algo,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            kl_coef=cfg.kl_coef,
            awr_beta=cfg.awr_beta,
            awr_max_weight=cfg.awr_max_weight,
            step_share=share,
            token_share=len(tok_new) / n_tokens,
        )
        (loss * scale).backward()
        share *= scale
        sums["loss"] += loss.item() * scale
        sums["pg_loss"] += pg.item() * share
        sums["kl"] += kl.item() * len(tok_new) / n_tokens * scale
        sums["clip_fraction"] += float(clip_fraction(logp_new.detach(), logp_b, cfg.clip_low, cfg.clip_high)) * share
        sums["ratio"] += float(torch.exp(logp_new.detach() - logp_b).mean()) * share
    return sums


@torch.no_grad()
def policy_kl(old, new, windows: list, pad_id: int, batch_size: int) -> tuple[float, int]:
    """KL(old ‖ new) between two policies' next-token distributions, exact over the vocabulary, at the action tokens
    of `windows` (teacher-forced on the tokens they hold): (the mean per action token, the tokens)."""
    old.eval()
    new.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        ids, attn = pad_ids([w.ids for w in windows[i : i + batch_size]], pad_id, model_device(old))
        mask = torch.zeros_like(ids)
        for b, w in enumerate(windows[i : i + batch_size]):
            mask[b, : len(w.mask)] = torch.tensor(w.mask)
        p = next_token_logprobs(old, ids, mask, attention_mask=attn)
        q = next_token_logprobs(
            new, ids.to(model_device(new)), mask.to(model_device(new)), attention_mask=attn.to(model_device(new))
        ).to(p.device)
        total += float((p.exp() * (p - q)).sum())
        count += len(p)
    return total / max(count, 1), count
