"""What makes a training step cheaper or measures it: activation checkpointing, compiled decoder layers, tokens per
second and model FLOPs utilisation."""

from __future__ import annotations

import torch

from qevolve.config import TrainRunConfig
from qevolve.models.base import causal_lm
from qevolve.models.device import (
    model_device,
    peak_tflops,
    rank_and_world,
)


def checkpoint_activations(model: torch.nn.Module) -> None:
    """Have every transformers model inside `model` recompute its decoder layers' activations in the backward
    pass (non-reentrant checkpointing, which needs no input that requires a gradient)."""
    for module in model.modules():
        if getattr(module, "supports_gradient_checkpointing", False) and hasattr(
            module, "gradient_checkpointing_enable"
        ):
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return


def compile_layers(model: torch.nn.Module) -> None:
    """`torch.compile` each decoder layer of `model` in place (the module stays itself: peft, FSDP and the
    checkpoints see no wrapper), for dynamic sequence lengths."""
    names = {name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or ()}
    for module in [m for m in model.modules() if type(m).__name__ in names]:
        module.compile(dynamic=True)


def train_speed(model: torch.nn.Module, curve: list[dict], run: TrainRunConfig | None = None) -> dict:
    """What a trainer's metrics report of its budget and speed: `train_tokens`, the tokens its optimiser steps
    trained on (what two trainers' budgets are matched by), and tokens per second of them (all processes; tokens
    as the trainer's `length` counts an item, which for Multi²'s joint passes counts a sequence each time it
    is run through), and where the device's peak is known (`train.peak_tflops`, or the GPU's name), the model FLOPs
    utilisation at 4 FLOPs per parameter per token (forward 2, backward through the activations 2: LoRA
    makes no gradient for the frozen weights), counting the parameters that run at every token: not the token
    embedding (a lookup) nor the LM head, which the losses run at the target tokens alone (`target_logprobs`),
    so the figure leaves out the head's share at the targets rather than counting it at every token."""
    seconds, tokens = sum(c["seconds"] for c in curve), sum(c["tokens"] for c in curve)
    out = {"train_tokens": tokens, "tokens_per_s": tokens / seconds if seconds else 0.0}
    peak = (run.peak_tflops if run else 0.0) or peak_tflops(model_device(model))
    if peak:
        out["mfu"] = 4 * per_token_parameters(model) * out["tokens_per_s"] / (peak * 1e12 * rank_and_world()[1])
    return out


def per_token_parameters(model: torch.nn.Module) -> int:
    """Parameters whose matmuls run at every token: all but the token embedding and the LM head (one tensor
    when tied). A sharded parameter counts whole."""
    skip = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = getattr(causal_lm(model), "get_output_embeddings", lambda: None)()
    if head is not None:  # with its trained copy, where peft keeps one (`model.lora.train_embeddings`)
        skip |= {id(p) for p in head.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)
