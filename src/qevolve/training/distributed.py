"""Several training processes: data parallelism (each rank's share of a batch's micro-batches, gradients summed
across ranks) and sharding (FSDP2), and the process group a stage runs under."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

from qevolve.config import ModelConfig, TrainRunConfig
from qevolve.models.device import (
    rank_and_world,
    resolve_device,
    resolve_dtype,
)
from qevolve.training.checkpoint import changing_tensors

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


def sum_across_ranks(params: list[torch.nn.Parameter], metrics: dict, device: torch.device) -> dict:
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
