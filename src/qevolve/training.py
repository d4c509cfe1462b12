"""What the trainers (`bc`, `critic`, `policy`) share: batching of token windows, the LR schedule, the loop.

Data parallelism (`train.processes` > 1, under torch.distributed): every rank draws the same optimiser
batches (same seed), runs only its share of each batch's micro-batches (`local_share`), and the
gradients are summed across ranks before the optimiser step. Each step function normalises its loss
over the whole batch (not its share), so the sum is the one-process gradient: N processes compute the
same update as one, to float rounding. Summing by hand rather than through DDP's wrapper keeps that
exact when ranks run different numbers of micro-batches (DDP averages, and hangs on uneven backward
counts under gradient accumulation). Rank 0 writes checkpoints and artifacts.

Sharded (`train.shard`, FSDP2's `fully_shard`): each process loads the model on the CPU (`loading_config`)
and keeps only its share of every weight, gradient and optimiser state on its device (`shard`); the
weights are gathered layer by layer for each forward and backward pass, and the gradients come back
summed and sharded. Every rank then runs the same number of micro-batches (a rank short of one reruns
the first with weight 0), and every pass over the model (reference log-probs, values) runs on all ranks."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch
from tqdm import tqdm

from qevolve.config import ModelConfig, TrainConfig, TrainRunConfig
from qevolve.data.atomic import atomic_path, write_json
from qevolve.models.base import causal_lm
from qevolve.models.device import (
    is_main,
    model_device,
    peak_tflops,
    placement,
    rank_and_world,
    resolve_device,
    resolve_dtype,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M", bound=torch.nn.Module)


def local_share(micro: list[list[T]], even: bool = False) -> list[tuple[list[T], float]]:
    """The micro-batches of an optimiser batch that this rank runs (all of them in one process), each
    with the weight of its loss: 1, or 0 for the copy of the first that a rank short of micro-batches
    runs when `even` (a sharded model's passes are collective: every rank must make as many)."""
    rank, world = rank_and_world()
    mine = [(mb, 1.0) for mb in micro[rank::world]]
    if even:
        mine += [(micro[0], 0.0)] * (-(-len(micro) // world) - len(mine))
    return mine


def loading_config(cfg: ModelConfig, run: TrainRunConfig) -> ModelConfig:
    """The model settings to load a trainer's model with: as given, or, when it is to be sharded, on the
    CPU in the dtype it will have on its device (`shard` moves each process's share there)."""
    if not (run.shard and rank_and_world()[1] > 1):
        return cfg
    dtype = cfg.dtype
    if dtype == "auto":  # as `load_policy` would choose on the target device
        dtype = (
            "float32"
            if cfg.lora.train_embeddings
            else str(resolve_dtype("auto", resolve_device(cfg.device))).removeprefix("torch.")
        )
    return cfg.model_copy(update={"device": "cpu", "dtype": dtype})


def shard(model: M, run: TrainRunConfig, device_setting: str) -> M:
    """Shard `model` across the processes (FSDP2: one unit per decoder layer, the rest in the root unit)
    onto this rank's device, when `train.shard` is set and there are several processes; else return it
    as it is. FSDP averages the gradients across ranks; `train` multiplies them back into the sum (each
    loss is normalised over the whole batch already). (A divide factor of 1 would sum them directly,
    but through a reduce operation that gloo lacks.)"""
    world = rank_and_world()[1]
    if not (run.shard and world > 1):
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = {name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or ()}
    mesh = init_device_mesh(resolve_device(device_setting).type, (world,))
    for module in [m for m in model.modules() if type(m).__name__ in layers]:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """What training changed in a sharded model (`changing_tensors`), gathered whole onto the CPU: a
    collective, every rank calls it; for `save_pretrained(state_dict=...)`. None for a model that is
    not sharded (its own state is whole)."""
    if not is_sharded(model):
        return None
    names = changing_tensors(model)
    return {n: t.full_tensor().cpu() for n, t in model.state_dict().items() if n in names}


@contextmanager
def process_group(device_setting: str) -> Iterator[None]:
    """Join the torch.distributed group that `torchrun` set up (NCCL on GPUs, gloo on a CPU) for the
    block, when this process is one of several; otherwise do nothing."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        yield
        return
    device = resolve_device(device_setting)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sum_across_ranks(params: list[torch.nn.Parameter], metrics: dict, device: torch.device) -> dict:
    """Sum every parameter's gradient and every numeric metric over the ranks, in one all-reduce."""
    import torch.distributed as dist

    for p in params:
        if p.grad is None:  # a rank with no micro-batch in this step
            p.grad = torch.zeros_like(p)
    keys = [k for k, v in metrics.items() if isinstance(v, (int, float))]
    flat = torch.cat(
        [p.grad.flatten().float() for p in params] + [torch.tensor([float(metrics[k]) for k in keys], device=device)]
    )
    dist.all_reduce(flat)
    at = 0
    for p in params:
        p.grad.copy_(flat[at : at + p.numel()].view_as(p.grad))
        at += p.numel()
    return {**metrics, **dict(zip(keys, flat[at:].tolist()))}


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
    optimizer = torch.optim.AdamW(_by_rate(model, cfg.lr), lr=cfg.lr, weight_decay=cfg.weight_decay)
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
        metrics = _sum_across_ranks([] if sharded else params, metrics, model_device(model))
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


def _by_rate(model: torch.nn.Module, lr: float) -> list[dict]:
    """The trainable parameters in optimiser groups by learning rate: `lr`, or for a name starting with a
    prefix in the model's `lr_by_prefix` ({prefix: rate}) that rate (a joint actor-critic's heads)."""
    rates = getattr(model, "lr_by_prefix", {})
    groups: dict[float, list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(next((r for prefix, r in rates.items() if name.startswith(prefix)), lr), []).append(p)
    return [{"params": ps, "lr": rate} for rate, ps in groups.items()]


def save_and_report(
    save: Callable[[], None],
    metrics: dict,
    model: torch.nn.Module,
    curve: list[dict],
    elapsed: float,
    run: TrainRunConfig,
    out: Path,
    metrics_path: Path,
    curve_path: Path,
    speed_of: torch.nn.Module | None = None,
) -> dict:
    """How every trainer ends, after any pass that takes every rank (`full_state`): on rank 0, `save()` writes
    the artifact(s) atomically; then `metrics`, with the training time, speed (`train_speed` of `speed_of`,
    default `model`) and placement of `model`, go to `metrics_path` and the curve to `curve_path`, and the
    in-stage checkpoint of `out` is removed, the artifact being complete. Other ranks write nothing: {}."""
    if not is_main():
        return {}
    save()
    metrics = {**metrics, "train_seconds": elapsed, **train_speed(speed_of or model, curve, run), **placement(model)}
    write_json(metrics_path, metrics)
    write_json(curve_path, curve)
    checkpoint_path(out).unlink(missing_ok=True)
    return metrics


def checkpoint_path(out: Path) -> Path:
    """Where the stage writing the artifact `out` keeps its in-stage checkpoint: beside it, never in it."""
    return out.parent / f".{out.name}.checkpoint"


def changing_tensors(model: torch.nn.Module) -> set[str]:
    """State-dict names of what training changes: trainable parameters, plus what the model names in
    `checkpoint_extra` (e.g. a target network updated outside the optimiser)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return names | set(getattr(model, "checkpoint_extra", ()))


def trained_state(model: torch.nn.Module, names: set[str]) -> dict[str, torch.Tensor]:
    """A copy of the state-dict entries in `names` (`changing_tensors`): what a round checkpoint keeps."""
    return {n: t.detach().clone() for n, t in model.state_dict().items() if n in names}


def load_round(ckpt: Path, key: str, stage: str) -> dict | None:
    """The checkpoint an online stage saved after its last finished round, if one exists and was written
    with this `key` (`fingerprint`); None otherwise (a stale one is logged and left for the next save)."""
    if not ckpt.exists():
        return None
    saved = torch.load(ckpt, weights_only=False)
    if saved.get("fingerprint") != key:
        log.warning("%s: ignoring checkpoint %s, written for other settings or other inputs", stage, ckpt)
        return None
    log.warning("%s: resuming from the checkpoint after round %d (%s)", stage, saved["round"], ckpt)
    return saved


def fingerprint(*parts) -> str:
    """sha256 of the JSON of `parts`: what a checkpoint records of the run that wrote it."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def input_digest(*paths: Path) -> str:
    """sha256 over the files under `paths` (names and contents): what an in-stage checkpoint records of
    the stage's input artifacts, so that one written from other inputs (a changed advantage, a retrained
    previous policy, the same data shapes) is not resumed. The base model is left out: it can be many GB,
    and `model.*` fixes it."""
    h = hashlib.sha256()
    for root in map(Path, paths):
        if not root.exists():
            raise FileNotFoundError(f"{root}: an input of this stage is missing")
        for f in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if f.is_file():
                h.update(f"{f.relative_to(root) if root.is_dir() else f.name}\0".encode())
                with open(f, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        h.update(block)
    return h.hexdigest()


def last_epoch_mean(curve: list[dict], key: str) -> float:
    last = [c[key] for c in curve if c["epoch"] == curve[-1]["epoch"]]
    return sum(last) / len(last)
