"""Pure torch maths shared by the trainers: no I/O, no models."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token: logits (B, T, V), ids (B, T) -> (B, T-1), entry t is log p(ids[t+1])."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def masked_nll(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood over positions where `mask` (B, T) is 1.

    `mask[b, t]` marks whether token `ids[b, t]` is a target (an action token); the first token of a
    sequence is never a target because nothing predicts it.
    """
    target = mask[:, 1:].float()
    return -(token_logprobs(logits, ids) * target).sum() / target.sum().clamp(min=1.0)


def sequence_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per sequence, the mean log-prob of its target tokens (`mask` as in `masked_nll`): (B,). An
    output's log-likelihood normalised by its length, as STEP-HRL's losses use it."""
    target = mask[:, 1:].float()
    return (token_logprobs(logits, ids) * target).sum(-1) / target.sum(-1).clamp(min=1.0)
