"""`policy@k` (Multi²): the offline actor with the policy-anchored term (arXiv 2606.03698, Phase 2), for each
role in `multi2.rl_roles` (System 2, `low`, in the method; System 1, `high`, in the role ablations).

Per transition of such a role (expert and collected, mixed as for `critic@k`): the data's output a with its
advantage A(o, a) from `critic@k`, and an output â the current policy samples for the same prompt in the
same optimiser step, scored by the critic as A(o, â) = Q(o, â) - V(o). The loss is
`qevolve.algos.rl.anchored_awr_loss`: -mean(min(exp(beta A(o, a)), max_weight) log pi(a | o)) -
lam * mean(A(o, â) log pi(â | o)), log-likelihoods length-normalised per output. â is written by the
policy (free text) in either action mode: the transition store keeps the prompt, not the admissible
list. The other roles are not updated; with separate adapters only the RL roles' adapters change."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from qevolve.algos.losses import sequence_logprobs
from qevolve.algos.rl import anchored_awr_loss
from qevolve.hierarchy.agent import RoleStop
from qevolve.hierarchy.critic import advantages_of, load_critic
from qevolve.hierarchy.roles import encode, parse_low
from qevolve.hierarchy.shared import (
    advantage_of,
    load_roles_policy,
    read_advantages,
    role_builder,
    save_roles_policy,
    training_sets,
)
from qevolve.models.backend import HFBackend
from qevolve.models.base import target_logprobs
from qevolve.models.device import model_device, pad_ids
from qevolve.models.policy import use_adapter
from qevolve.params import Params
from qevolve.training import checkpoint_path, input_digest, last_epoch_mean, save_and_report, train

Item = tuple[str, list[int], list[int], float]
"""(role, the state's prompt ids, the data's output ids, its advantage)."""


class Sampler:
    """Outputs the current policy writes for prompts: each prompt's own seed, drawn from torch's RNG (which
    `train` checkpoints), so a resumed run samples what the uninterrupted one did."""

    def __init__(self, model, tokenizer, builder, max_new_tokens: int, temperature: float):
        self.model, self.tok, self.builder = model, tokenizer, builder
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.stop = RoleStop(tokenizer, builder.end_ids or [tokenizer.eos_token_id])

    def __call__(self, prompts: list[list[int]]) -> list[str]:
        seeds = torch.randint(2**31 - 1, (len(prompts),)).tolist()
        was_training = self.model.training
        self.model.eval()
        try:
            out = HFBackend(self.model, self.tok.pad_token_id, reuse=False).generate(
                list(range(len(prompts))),
                prompts,
                max_new_tokens=self.max_new_tokens,
                stop=self.stop,
                greedy=False,
                temperature=self.temperature,
                seeds=seeds,
            )
        finally:
            self.model.train(was_training)
        return [(self.tok.decode(t, skip_special_tokens=True).strip().splitlines() or [""])[0].strip() for t, _ in out]


def anchored_step(model, critic, sampler: Sampler, micro: list[list[Item]], cfg, pad_id: int, separate: bool) -> dict:
    """Forward and backward of one optimiser step; each micro-batch (per role, through its adapter when they
    are `separate`) samples its â and weighs its share."""
    total = sum(len(mb) for mb in micro)
    device = model_device(model)
    sums = {"loss": 0.0, "awr": 0.0, "anchored": 0.0, "logp": 0.0, "sampled_advantage": 0.0, "sampled_parsed": 0.0}
    for mb in (group for m in micro for group in _by_role(model, m, separate)):
        role = mb[0][0]
        prompts = [p for _, p, _, _ in mb]
        sampled = sampler(prompts)
        sampled_ids = [sampler.builder.action_ids(text) for text in sampled]
        with torch.no_grad():
            adv_pi = advantages_of(critic, role, prompts, sampled_ids, pad_id).to(device)
        seqs = [p + o for _, p, o, _ in mb] + [p + o for p, o in zip(prompts, sampled_ids)]
        ids, attn = pad_ids(seqs, pad_id, device)
        mask, _ = pad_ids(
            [[0] * len(p) + [1] * len(o) for _, p, o, _ in mb]
            + [[0] * len(p) + [1] * len(o) for p, o in zip(prompts, sampled_ids)],
            0,
            device,
        )
        logp = sequence_logprobs(target_logprobs(model, ids, mask, attention_mask=attn), mask)
        n = len(mb)
        adv = torch.tensor([a for *_, a in mb], device=device)
        loss, awr, anchored = anchored_awr_loss(
            logp[:n], adv, logp[n:], adv_pi, beta=cfg.beta, max_weight=cfg.max_weight, lam=cfg.lam, relu=cfg.relu
        )
        share = n / total
        (loss * share).backward()
        sums["loss"] += loss.item() * share
        sums["awr"] += awr.item() * share
        sums["anchored"] += anchored.item() * share
        sums["logp"] += logp[:n].detach().sum().item() / total
        sums["sampled_advantage"] += adv_pi.sum().item() / total
        sums["sampled_parsed"] += sum(role != "low" or parse_low(text)[0] is not None for text in sampled) / total
    return sums


def _by_role(model, mb: list[Item], separate: bool):
    """A micro-batch's items one role at a time (a role's advantages come from its own critic head), with
    that role's adapter made active when they are separate."""
    for role in dict.fromkeys(it[0] for it in mb):
        if separate:
            use_adapter(model, role)
        yield [it for it in mb if it[0] == role]


def policy(
    params: Params,
    base_dir: Path,
    previous_dir: Path,
    critic_dir: Path,
    data_dir: Path,
    collected_dir: Path,
    advantage_dir: Path,
    out: Path,
    metrics_path: Path,
    curve_path: Path,
) -> dict:
    cfg, roles = params.multi2.policy, params.multi2.rl_roles
    sets = training_sets(params, data_dir, collected_dir)
    if not any(sets[role] for role in roles):
        raise ValueError(f"{data_dir}, {collected_dir}: no transitions of roles {list(roles)} to train on")
    advantages = read_advantages(advantage_dir)
    model, tok, separate = load_roles_policy(params, base_dir, previous_dir, trainable=True)
    critic = load_critic(params, base_dir, critic_dir, roles)
    builder = role_builder(params, tok)
    items = []
    for role in roles:
        for r in sets[role]:
            ids, mask = encode(builder, r["state_text"], r["output_text"])
            start = mask.index(1)
            items.append((role, ids[:start], ids[start:], advantage_of(advantages, advantage_dir, role, r)))
    sampler = Sampler(model, tok, builder, params.policy.max_new_tokens, cfg.temperature)
    weights = torch.exp(cfg.beta * torch.tensor([a for *_, a in items])).clamp(max=cfg.max_weight)
    start = time.perf_counter()
    curve = train(
        model,
        items,
        cfg,
        lambda it: 2 * len(it[1]) + len(it[2]) + params.policy.max_new_tokens,
        lambda micro: anchored_step(model, critic, sampler, micro, cfg, tok.pad_token_id, separate),
        "policy",
        checkpoint=checkpoint_path(out),
        inputs=input_digest(previous_dir, critic_dir, data_dir, collected_dir, advantage_dir),
        run=params.train,
    )
    elapsed = time.perf_counter() - start
    metrics = {
        "loss": last_epoch_mean(curve, "loss"),
        "first_loss": curve[0]["loss"],
        **{
            key: last_epoch_mean(curve, key)
            for key in ("awr", "anchored", "logp", "sampled_advantage", "sampled_parsed")
        },
        "first_logp": curve[0]["logp"],
        "examples": len(items),
        **{f"{role}_examples": sum(it[0] == role for it in items) for role in roles},
        "weight_mean": float(weights.mean()),
        "weight_clipped": float((weights >= cfg.max_weight).float().mean()),
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
