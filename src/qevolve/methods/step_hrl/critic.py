"""`critic@k` (STEP-HRL): step-level IQL, one critic per level, on expert + collected transitions; then the
advantage A = Q(s, a) - V(s) of every transition, which `policy@k` weights its outputs by.

Per level: Q(s, a) by TD regression toward r + gamma (1 - done) V(s'), V(s) by expectile regression toward
the target Q (a Polyak copy of the Q head). V(s) is read at the last token of the state's prompt, Q(s, a)
at the last token of the output, V(s') at the last token of the next state's prompt, from one forward pass
over the batch's (s + a) and s' sequences. The backbone is the critic's own LoRA adapter (started from the
BC policy's; from its low role's with separate adapters), or with `step_hrl.repo_compat` the policy's
frozen features, as in the public code.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from qevolve.algos.rl import iql_losses
from qevolve.config import Params
from qevolve.data.atomic import atomic_dir, write_json
from qevolve.hierarchy.roles import ROLES
from qevolve.methods.step_hrl.shared import ADVANTAGE_SCHEMA, ADVANTAGES, encode, read_roles, role_builder, training_sets
from qevolve.models.base import causal_lm
from qevolve.models.device import model_device, placement
from qevolve.models.policy import load_policy
from qevolve.training import checkpoint_path, input_digest, last_epoch_mean, pad_ids, train

class LevelCritic(nn.Module):
    """A backbone and, per level, V and Q heads and a target Q head (Polyak-averaged, no gradient)."""

    def __init__(self, lm, frozen: bool):
        super().__init__()
        self.lm, self.frozen = lm, frozen
        hidden = causal_lm(lm).config.hidden_size
        self.v = nn.ModuleDict({role: nn.Linear(hidden, 1) for role in ROLES})
        self.q = nn.ModuleDict({role: nn.Linear(hidden, 1) for role in ROLES})
        for head in [*self.v.values(), *self.q.values()]:
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        self.q_target = copy.deepcopy(self.q).requires_grad_(False)
        self.checkpoint_extra = tuple(n for n, _ in self.named_parameters() if n.startswith("q_target."))
        if frozen:
            lm.requires_grad_(False)
        self.to(next(lm.parameters()).device)

    def features(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        backbone = causal_lm(self.lm).base_model
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            return backbone(input_ids=ids, attention_mask=attn).last_hidden_state.float()

    @torch.no_grad()
    def update_target(self, rate: float) -> None:
        for role in ROLES:
            for t, p in zip(self.q_target[role].parameters(), self.q[role].parameters()):
                t.lerp_(p, rate)


@dataclass
class Item:
    role: str
    key: tuple[str, str, int]
    """(trajectory_id, role, step): which transition."""
    ids: list[int]
    """The state's prompt followed by the output."""
    state_end: int
    next_ids: list[int]
    reward: float
    done: bool


def critic_items(builder, sets: dict[str, list[dict]]) -> list[Item]:
    items = []
    for role in ROLES:
        for r in sets[role]:
            ids, mask = encode(builder, r["state_text"], r["output_text"])
            next_ids = builder.head_ids + builder.user_turn(r["next_state_text"])
            items.append(Item(role, (r["trajectory_id"], role, r["step"]), ids, mask.index(1) - 1, next_ids, r["reward"], r["done"]))
    return items


def values(critic: LevelCritic, mb: list[Item], pad_id: int) -> dict[str, torch.Tensor]:
    """V(s), Q(s, a), target Q(s, a) and V(s') of every item, from one pass over its two sequences."""
    device = model_device(critic)
    ids, attn = pad_ids([it.ids for it in mb] + [it.next_ids for it in mb], pad_id, device)
    h = critic.features(ids, attn)
    n = len(mb)
    rows = torch.arange(n, device=device)
    h_s = h[rows, torch.tensor([it.state_end for it in mb], device=device)]
    h_sa = h[rows, torch.tensor([len(it.ids) - 1 for it in mb], device=device)]
    h_next = h[rows + n, torch.tensor([len(it.next_ids) - 1 for it in mb], device=device)]
    out: dict[str, list] = {"v": [], "q": [], "q_target": [], "v_next": []}
    for b, it in enumerate(mb):
        out["v"].append(critic.v[it.role](h_s[b]))
        out["q"].append(critic.q[it.role](h_sa[b]))
        out["q_target"].append(critic.q_target[it.role](h_sa[b]))
        out["v_next"].append(critic.v[it.role](h_next[b]))
    return {k: torch.cat(v) for k, v in out.items()}


def critic_step(critic: LevelCritic, micro: list[list[Item]], gamma: float, tau: float, pad_id: int) -> dict:
    total = sum(len(mb) for mb in micro)
    sums = {"loss": 0.0, "v_loss": 0.0, "q_loss": 0.0}
    for mb in micro:
        x = values(critic, mb, pad_id)
        device = x["v"].device
        rewards = torch.tensor([it.reward for it in mb], device=device)
        not_done = torch.tensor([0.0 if it.done else 1.0 for it in mb], device=device)
        v_loss, q_loss = iql_losses(x["v"], x["q"], x["q_target"], x["v_next"], rewards, not_done, torch.ones_like(rewards), gamma, tau, total)
        (v_loss + q_loss).backward()
        sums["v_loss"] += v_loss.item()
        sums["q_loss"] += q_loss.item()
        sums["loss"] += v_loss.item() + q_loss.item()
    return sums


def critic(params: Params, base_dir: Path, policy_dir: Path, data_dir: Path, collected_dir: Path, out: Path, advantages_out: Path,
           metrics_path: Path, curve_path: Path) -> dict:
    cfg, compat = params.step_hrl.critic, params.step_hrl.repo_compat
    torch.manual_seed(cfg.seed)
    sets = training_sets(params, data_dir, collected_dir)
    if read_roles(policy_dir)["adapters"] == "separate":
        policy_dir = policy_dir / "low"
    if compat:  # heads on the BC policy's frozen features
        lm, tok = load_policy(base_dir, params.model, adapter=policy_dir)
    elif cfg.init_from_policy:
        lm, tok = load_policy(base_dir, params.model, adapter=policy_dir, trainable=True)
    else:
        lm, tok = load_policy(base_dir, params.model)
    model = LevelCritic(lm, frozen=compat)
    items = critic_items(role_builder(params, tok), sets)
    tau = 0.05 if compat else cfg.expectile
    start = time.perf_counter()
    curve = train(model, items, cfg, lambda it: len(it.ids) + len(it.next_ids),
                  lambda micro: critic_step(model, micro, cfg.gamma, tau, tok.pad_token_id), "critic",
                  after_step=lambda: model.update_target(cfg.target_rate), checkpoint=checkpoint_path(out),
                  inputs=input_digest(policy_dir, data_dir, collected_dir))
    elapsed = time.perf_counter() - start
    model.eval()
    rows = []
    with torch.no_grad():
        for i in range(0, len(items), cfg.micro_batch_size):
            mb = items[i : i + cfg.micro_batch_size]
            x = values(model, mb, tok.pad_token_id)
            rows += [{"trajectory_id": it.key[0], "level": it.role, "step": it.key[2], "advantage": float(q - v), "v": float(v), "q": float(q)}
                     for it, v, q in zip(mb, x["v"], x["q"])]
    with atomic_dir(out) as tmp:
        from safetensors.torch import save_file

        if not compat:
            model.lm.save_pretrained(tmp)
        save_file({n: t.detach().contiguous() for n, t in model.state_dict().items() if not n.startswith("lm.")}, str(tmp / "heads.safetensors"))
    with atomic_dir(advantages_out) as tmp:
        pq.write_table(pa.Table.from_pylist(rows, schema=ADVANTAGE_SCHEMA), tmp / ADVANTAGES)
    metrics = {
        "loss": last_epoch_mean(curve, "loss"),
        "v_loss": last_epoch_mean(curve, "v_loss"),
        "q_loss": last_epoch_mean(curve, "q_loss"),
        "first_loss": curve[0]["loss"],
        "expectile": tau,
        **{f"{role}_transitions": len(sets[role]) for role in ROLES},
        **{f"{role}_advantage_mean": _mean([r["advantage"] for r in rows if r["level"] == role]) for role in ROLES},
        **{f"{role}_v_mean": _mean([r["v"] for r in rows if r["level"] == role]) for role in ROLES},
        "train_seconds": elapsed,
        **placement(model),
    }
    write_json(metrics_path, metrics)
    write_json(curve_path, curve)
    checkpoint_path(out).unlink(missing_ok=True)  # the artifact is complete
    return metrics


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
