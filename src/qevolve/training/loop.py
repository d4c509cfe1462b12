"""The trainer loop every trainer (`bc`, `critic`, `policy`) runs: AdamW with warm-up and decay, gradient
accumulation, in-stage checkpoints it resumes from, the training curve."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from tqdm import tqdm

from qevolve.config import TrainConfig, TrainRunConfig
from qevolve.data.atomic import atomic_path
from qevolve.models.device import (
    is_main,
    model_device,
    rank_and_world,
)
from qevolve.training.batching import batches
from qevolve.training.checkpoint import changing_tensors, fingerprint
from qevolve.training.distributed import full_state, is_sharded, sum_across_ranks
from qevolve.training.speed import checkpoint_activations, compile_layers

log = logging.getLogger(__name__)

T = TypeVar("T")


def train(
    model: torch.nn.Module,
    items: list[T],
    cfg: TrainConfig,
    length: Callable[[T], int],
    step: Callable[[list[list[T]]], dict],
    desc: str,
    after_step: Callable[[], None] | None = None,
    checkpoint: Path | None = None,
    inputs: str = "",
    run: TrainRunConfig | None = None,
) -> list[dict]:
    """AdamW with linear warm-up and decay over `cfg.epochs` epochs; `step(micro_batches)` runs the
    forward and backward passes of one optimiser step (of its `local_share` under several processes) and
    returns its metrics (with `loss`), each a sum of shares; `after_step` runs after each optimiser step
    (e.g. a target-network update).

    With `checkpoint` (a file path), the whole training state (the model's changing tensors, optimiser,
    schedule, RNGs, position in the epoch and the curve so far) is saved there atomically every
    `cfg.checkpoint_every` steps and at the end, and a run that finds a checkpoint of the same training
    (same config, data lengths and `inputs`, the stage's `input_digest`) resumes from it instead of
    starting over; the result is the same as an uninterrupted run's. The caller deletes the checkpoint
    once its artifact is written.
    `run` (the `train` section): micro-batches by token budget, activation checkpointing, compiled decoder layers.
    Returns the curve: one dict of metrics per optimiser step, with its real tokens and seconds."""
    run = run or TrainRunConfig()
    if run.checkpoint_activations:
        checkpoint_activations(model)
    if run.compile:
        compile_layers(model)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    sharded = is_sharded(model)
    if sharded:
        _reshard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(by_rate(model, cfg.lr), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = -(-len(items) // cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    warmup = max(1, int(cfg.warmup_ratio * total))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / max(1, total - warmup)))
    )
    # A sharded run's checkpoint keys its optimiser state by parameter name, an unsharded one's by index.
    key = fingerprint(
        desc, cfg.model_dump(exclude={"checkpoint_every"}), [length(it) for it in items], inputs, *["sharded"] * sharded
    )
    saved = changing_tensors(model)
    curve: list[dict] = []
    epoch, skip, epoch_rng = 0, 0, rng.getstate()
    if checkpoint is not None and checkpoint.exists():
        state = _resume(checkpoint, key, model, optimizer, schedule, sharded)
        if state is not None:
            epoch, skip, epoch_rng, curve = state["epoch"], state["batch"], state["epoch_rng"], state["curve"]
            log.warning("%s: resuming from the checkpoint at step %d of %d (%s)", desc, len(curve), total, checkpoint)
        else:
            log.warning("%s: ignoring checkpoint %s, written for another configuration or dataset", desc, checkpoint)
    world = rank_and_world()[1]

    def save(epoch: int, batch: int, epoch_rng) -> None:
        position = {"epoch": epoch, "batch": batch, "epoch_rng": epoch_rng, "curve": curve}
        _save_training(checkpoint, key, model, optimizer, schedule, saved, sharded, position)

    model.train()
    with tqdm(total=total, initial=len(curve), desc=desc, unit="step", disable=not is_main()) as bar:
        while epoch < cfg.epochs:
            rng.setstate(epoch_rng)
            for i, micro in enumerate(batches(items, cfg, rng, length, run.micro_batch_tokens)):
                if i < skip:
                    continue
                started = time.perf_counter()
                metrics = _optimiser_step(model, optimizer, schedule, params, lambda: step(micro), sharded, world)
                if after_step is not None:
                    after_step()
                if model_device(model).type == "cuda":
                    torch.cuda.synchronize(model_device(model))
                tokens = sum(length(it) for mb in micro for it in mb)
                curve.append(
                    {
                        "step": len(curve) + 1,
                        "epoch": epoch + 1,
                        **metrics,
                        "tokens": tokens,
                        "seconds": time.perf_counter() - started,
                    }
                )
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, loss=f"{metrics['loss']:.3f}")
                if checkpoint is not None and len(curve) % cfg.checkpoint_every == 0 and i + 1 < steps_per_epoch:
                    save(epoch, i + 1, epoch_rng)
            epoch, skip, epoch_rng = epoch + 1, 0, rng.getstate()
            if checkpoint is not None:
                save(epoch, 0, epoch_rng)
    model.eval()
    return curve


def _reshard(model: torch.nn.Module) -> None:
    """A forward pass without backward (the policy's reference pass) leaves the root unit's weights
    gathered; the optimiser must hold the sharded ones."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _optimiser_step(
    model, optimizer, schedule, params: list, passes: Callable[[], dict], sharded: bool, world: int
) -> dict:
    """One optimiser step: zeroed gradients, `passes()` (the forward and backward passes, returning their
    metrics), the gradients and metrics summed across ranks, clipping at norm 1, the step and the schedule."""
    optimizer.zero_grad(set_to_none=True)
    metrics = passes()
    if sharded:  # FSDP averaged the gradients: back to their sum
        for p in params:
            if p.grad is not None:  # None: unused by this loss (the critic never reads the LM head)
                p.grad.mul_(world)
    if world > 1:
        metrics = sum_across_ranks([] if sharded else params, metrics, model_device(model))
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    schedule.step()
    return metrics


def _resume(checkpoint: Path, key: str, model, optimizer, schedule, sharded: bool) -> dict | None:
    """Load the training state saved at `checkpoint` into the model, optimiser, schedule and torch's RNG, and
    return it (its position: epoch, batch, epoch_rng, curve); None, loading nothing, when it was written
    for another training (`key`)."""
    state = torch.load(checkpoint, weights_only=False, map_location="cpu")
    if state["fingerprint"] != key:
        return None
    if sharded:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True, strict=False))
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    torch.set_rng_state(state["torch_rng"])
    return state


def _save_training(
    checkpoint: Path, key: str, model, optimizer, schedule, saved: set[str], sharded: bool, position: dict
) -> None:
    """Write the whole training state to `checkpoint` atomically on rank 0 (a sharded model's is gathered
    there: every rank takes part); the other ranks wait until it is written."""
    rank, world = rank_and_world()
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        weights = full_state(model)
        moments = get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    elif rank == 0:
        weights = {n: t.detach().clone() for n, t in model.state_dict().items() if n in saved}
        moments = optimizer.state_dict()
    if rank == 0:
        state = {
            "fingerprint": key,
            "model": weights,
            "optimizer": moments,
            "schedule": schedule.state_dict(),
            "torch_rng": torch.get_rng_state(),
            **position,
        }
        with atomic_path(checkpoint) as tmp:
            torch.save(state, tmp)
    if world > 1:
        torch.distributed.barrier()  # the others wait until rank 0 has written it


def by_rate(model: torch.nn.Module, lr: float) -> list[dict]:
    """The trainable parameters in optimiser groups by learning rate: `lr`, or for a name starting with a
    prefix in the model's `lr_by_prefix` ({prefix: rate}) that rate (a joint actor-critic's heads)."""
    rates = getattr(model, "lr_by_prefix", {})
    groups: dict[float, list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(next((r for prefix, r in rates.items() if name.startswith(prefix)), lr), []).append(p)
    return [{"params": ps, "lr": rate} for rate, ps in groups.items()]
