"""Token windows into optimiser batches: packing, length buckets, micro-batches by count or token budget."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch

from qevolve.config import TrainConfig

T = TypeVar("T")


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


def packed_rows(
    seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], limit: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def batches(
    items: list[T], cfg: TrainConfig, rng: random.Random, length: Callable[[T], int], token_budget: int = 0
) -> Iterator[list[list[T]]]:
    """One epoch: shuffled optimiser batches, each sorted by length and cut into micro-batches of
    `cfg.micro_batch_size` items, or with a `token_budget`, of as many items as fit in that many padded tokens."""
    order = rng.sample(range(len(items)), len(items))
    for i in range(0, len(order), cfg.batch_size):
        batch = sorted((items[j] for j in order[i : i + cfg.batch_size]), key=length)
        if not token_budget:
            yield [batch[k : k + cfg.micro_batch_size] for k in range(0, len(batch), cfg.micro_batch_size)]
            continue
        micro: list[list[T]] = [[]]
        for item in batch:  # ascending: the newest item is the longest, so a micro-batch costs rows x its length
            if micro[-1] and (len(micro[-1]) + 1) * length(item) > token_budget:
                micro.append([])
            micro[-1].append(item)
        yield micro
