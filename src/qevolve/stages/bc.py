"""`bc`: behaviour cloning, multi-turn SFT with the loss on action tokens only."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from qevolve.algos.losses import masked_nll
from qevolve.config import Params
from qevolve.data.atomic import atomic_dir, write_json
from qevolve.data.store import Trajectory, read_store
from qevolve.models.policy import load_policy
from qevolve.models.prompt import PromptBuilder, format_action

PROMPT_FILE = "prompt.json"  # saved beside the adapter so acting uses the prompt BC trained with


def one_shot_text(trajs: list[Trajectory]) -> str:
    """A demonstration rendered as plain text, for the optional one-shot prompt."""
    t = min(trajs, key=lambda t: (len(t.steps), t.task_id))
    lines = [f"Your task is to: {t.instruction}", t.steps[0].observation]
    for s in t.steps:
        lines += [s.output, s.next_observation]
    return "\n".join(lines)


def make_builder(params: Params, tokenizer, policy_dir: Path) -> PromptBuilder:
    saved = json.loads((policy_dir / PROMPT_FILE).read_text())
    return PromptBuilder(tokenizer, params.model.context_tokens, saved["one_shot"])


def build_examples(builder: PromptBuilder, trajs: list[Trajectory]) -> list[tuple[list[int], list[int]]]:
    examples = []
    for t in trajs:
        observations = [s.observation for s in t.steps]
        examples += builder.training_examples(t.instruction, observations, [format_action(s.action) for s in t.steps])
    return examples


def pad_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to the longest example: (ids, attention_mask, loss_mask), each (B, T)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for i, (x, m) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        attn[i, : len(x)] = 1
        loss_mask[i, : len(m)] = torch.tensor(m)
    return ids, attn, loss_mask


def train_step(model, optimizer, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> float:
    """One optimiser step over micro-batches, the loss weighted by each micro-batch's action tokens."""
    total = sum(int(m[:, 1:].sum()) for _, _, m in batches)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for ids, attn, mask in batches:
        logits = model(input_ids=ids, attention_mask=attn).logits
        weight = int(mask[:, 1:].sum()) / max(total, 1)
        loss = masked_nll(logits, ids, mask) * weight
        loss.backward()
        loss_sum += float(loss.detach())
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    return loss_sum


def bc(params: Params, base_dir: Path, experts_dir: Path, out: Path, metrics_path: Path, curve_path: Path) -> dict:
    cfg = params.bc
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    trajs = read_store(experts_dir)
    if not trajs:
        raise ValueError(f"{experts_dir}: no expert trajectories to clone")
    model, tok = load_policy(base_dir, params.model)
    one_shot = one_shot_text(trajs) if params.prompt.one_shot else ""
    builder = PromptBuilder(tok, params.model.context_tokens, one_shot)
    examples = build_examples(builder, trajs)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = -(-len(examples) // cfg.batch_size)
    total_steps = steps_per_epoch * cfg.epochs
    warmup = max(1, int(cfg.warmup_ratio * total_steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (total_steps - s) / max(1, total_steps - warmup)))
    )
    model.train()
    curve, tokens, start = [], 0, time.perf_counter()
    bar = tqdm(total=total_steps, desc="bc", unit="step")
    for epoch in range(cfg.epochs):
        order = random.sample(range(len(examples)), len(examples))
        for i in range(0, len(order), cfg.batch_size):
            batch = [examples[j] for j in order[i : i + cfg.batch_size]]
            # Sort by length inside the step so micro-batches pad little.
            batch.sort(key=lambda e: len(e[0]))
            micro = [pad_batch(batch[k : k + cfg.micro_batch_size], tok.pad_token_id) for k in range(0, len(batch), cfg.micro_batch_size)]
            loss = train_step(model, optimizer, micro)
            schedule.step()
            tokens += sum(len(e[0]) for e in batch)
            curve.append({"step": len(curve) + 1, "epoch": epoch + 1, "loss": loss})
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.3f}")
    bar.close()
    elapsed = time.perf_counter() - start
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        (tmp / PROMPT_FILE).write_text(json.dumps({"one_shot": one_shot}) + "\n")
    last = curve[-steps_per_epoch:]
    metrics = {
        "loss": sum(c["loss"] for c in last) / len(last),
        "first_loss": curve[0]["loss"],
        "examples": len(examples),
        "trajectories": len(trajs),
        "steps": total_steps,
        "tokens_per_s": tokens / elapsed,
        "train_seconds": elapsed,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    write_json(metrics_path, metrics)
    write_json(curve_path, curve)
    return metrics
