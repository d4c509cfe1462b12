"""What the trainers (`bc`, `critic`, `policy`) share: batching of token windows, the LR schedule, the loop."""

from __future__ import annotations

import random
from typing import Callable, Iterator, Sequence, TypeVar

import torch
from tqdm import tqdm

from qevolve.config import TrainConfig

T = TypeVar("T")


def pad_ids(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists to the longest: (ids, attention_mask), each (B, T)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s))
        attn[i, : len(s)] = 1
    return ids, attn


def pack(lengths: Sequence[int], limit: int) -> list[list[int]]:
    """Indices grouped into rows of at most `limit` tokens, first fit by decreasing length (a sequence
    longer than `limit` gets a row of its own)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r in range(len(rows)) if room[r] >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(limit)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    return rows


def packed_rows(seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], limit: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate sequences into rows of <= `limit` tokens: (ids, mask, position_ids), each (R, T).

    Positions restart at 0 at each sequence, which is how transformers recognises packed sequences
    (given no attention mask) and keeps each one attending to itself only; padding is position 0 too,
    so it forms sequences of its own. The mask (e.g. over action tokens) is 0 on padding."""
    groups = pack([len(s) for s in seqs], limit)
    width = max(sum(len(seqs[i]) for i in g) for g in groups)
    ids = torch.full((len(groups), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    pos = torch.zeros_like(ids)
    for r, g in enumerate(groups):
        at = 0
        for i in g:
            n = len(seqs[i])
            ids[r, at : at + n] = torch.tensor(list(seqs[i]))
            mask[r, at : at + n] = torch.tensor(list(masks[i]))
            pos[r, at : at + n] = torch.arange(n)
            at += n
    return ids, mask, pos


def batches(items: list[T], cfg: TrainConfig, rng: random.Random, length: Callable[[T], int]) -> Iterator[list[list[T]]]:
    """One epoch: shuffled optimiser batches, each sorted by length and cut into micro-batches."""
    order = rng.sample(range(len(items)), len(items))
    for i in range(0, len(order), cfg.batch_size):
        batch = sorted((items[j] for j in order[i : i + cfg.batch_size]), key=length)
        yield [batch[k : k + cfg.micro_batch_size] for k in range(0, len(batch), cfg.micro_batch_size)]


def train(
    model: torch.nn.Module,
    items: list[T],
    cfg: TrainConfig,
    length: Callable[[T], int],
    step: Callable[[list[list[T]]], dict],
    desc: str,
    after_step: Callable[[], None] | None = None,
) -> list[dict]:
    """AdamW with linear warm-up and decay over `cfg.epochs` epochs; `step(micro_batches)` runs the
    forward and backward passes of one optimiser step and returns its metrics (with `loss`); `after_step`
    runs after each optimiser step (e.g. a target-network update).
    Returns the curve: one dict of metrics per optimiser step."""
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = -(-len(items) // cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    warmup = max(1, int(cfg.warmup_ratio * total))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / max(1, total - warmup)))
    )
    model.train()
    curve = []
    with tqdm(total=total, desc=desc, unit="step") as bar:
        for epoch in range(cfg.epochs):
            for micro in batches(items, cfg, rng, length):
                optimizer.zero_grad(set_to_none=True)
                metrics = step(micro)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                schedule.step()
                if after_step is not None:
                    after_step()
                curve.append({"step": len(curve) + 1, "epoch": epoch + 1, **metrics})
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, loss=f"{metrics['loss']:.3f}")
    model.eval()
    return curve


def last_epoch_mean(curve: list[dict], key: str) -> float:
    last = [c[key] for c in curve if c["epoch"] == curve[-1]["epoch"]]
    return sum(last) / len(last)
