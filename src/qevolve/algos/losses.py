"""Pure torch maths shared by the trainers: no I/O, no models."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token: logits (B, T, V), ids (B, T) -> (B, T-1), entry t is log p(ids[t+1])."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def head_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    chunk_elements: int = 2**26,
) -> torch.Tensor:
    """log p(targets[n]) under the logits `head(hidden[n])`: hidden (N, H), targets (N,) -> (N,), float32.

    The logits are made for at most `chunk_elements` (positions x vocabulary) at a time and, when a gradient
    is taken, made again in the backward pass rather than kept (activation checkpointing): the float32
    logits of all N positions never exist at once. The values and gradients are those of
    `log_softmax(head(hidden).float())` gathered at the targets."""

    def chunk_logp(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = head(h).float()
        return logits.gather(-1, t[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)

    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32)
    with torch.no_grad():  # the vocabulary's size, from one row
        size = max(1, chunk_elements // head(hidden[:1]).shape[-1])
    parts = []
    for i in range(0, hidden.shape[0], size):
        h, t = hidden[i : i + size], targets[i : i + size]
        parts.append(checkpoint(chunk_logp, h, t, use_reentrant=False) if torch.is_grad_enabled() else chunk_logp(h, t))
    return torch.cat(parts)


def masked_nll(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood over positions where `mask` (B, T) is 1, from the next-token log-probs
    `logp` (B, T - 1) (`token_logprobs`).

    `mask[b, t]` marks whether token `ids[b, t]` is a target (an action token); the first token of a
    sequence is never a target because nothing predicts it.
    """
    target = mask[:, 1:].float()
    return -(logp * target).sum() / target.sum().clamp(min=1.0)


def sequence_logprobs(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per sequence, the mean log-prob of its target tokens (`logp` and `mask` as in `masked_nll`): (B,). An
    output's log-likelihood normalised by its length, as STEP-HRL's losses use it."""
    target = mask[:, 1:].float()
    return (logp * target).sum(-1) / target.sum(-1).clamp(min=1.0)
