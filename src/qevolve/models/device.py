"""Where a model computes: the device and dtype that `model.device` and `model.dtype` resolve to.

The setting `auto` picks the GPU where one is present; on a GPU, float32 matmuls run as TF32. Under `torchrun` (several
training processes) each process takes the GPU of its local rank. `QEVOLVE_DEVICE` overrides `model.device`, so a worker
can be pointed at a device without editing params.yaml (the device is not part of a stage's lineage)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from qevolve.errors import UserError


class DeviceError(UserError, ValueError):
    hint = "set model.device (or QEVOLVE_DEVICE) to `auto` or `cpu`, or run where the GPU is"


def resolve_device(setting: str = "auto") -> torch.device:
    key = "QEVOLVE_DEVICE" if os.environ.get("QEVOLVE_DEVICE") else "model.device"
    setting = os.environ.get("QEVOLVE_DEVICE") or setting
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(setting)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"{key}: {setting!r} asked for, but torch {torch.__version__} sees no CUDA device; use `auto` or `cpu`"
            )
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if device.index >= torch.cuda.device_count():
            raise DeviceError(
                f"{key}: {setting!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        # float32 matmuls (LoRA adapters kept in float32 beside a bfloat16 base, float32 models) on the tensor
        # cores as TF32 (10-bit mantissa inputs, float32 accumulation) instead of the plain float32 units
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on a CPU (bfloat16 matmuls are slow there) and bfloat16 on a GPU."""
    if setting == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, setting)


PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
}
"""Dense bf16 peaks by GPU name (the vendors' datasheets, without sparsity); the first name contained in the
device's name counts, so the PCIe and NVL H100s come before the SXM one ("NVIDIA H100 80GB HBM3")."""


def peak_tflops(device: torch.device) -> float:
    """The device's dense bf16 peak in TFLOP/s where its name contains a key of `PEAK_BF16_TFLOPS`, else 0
    (then give it as `train.peak_tflops` or `--peak-tflops`)."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 0.0)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def describe(device: torch.device) -> str:
    """What a stage's metrics record of where it ran: `cpu`, or `cuda:0 (NVIDIA H200)`."""
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def placement(model: torch.nn.Module) -> dict:
    """What a stage's metrics record of where it computed: device, weights' dtype, processes, whether
    the model was sharded across them, torch's threads and CPU kernels (`AVX512`, `AVX2`: they fix the float
    order), and on a GPU the peak memory this process allocated there."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    p = next(model.parameters())
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    out = {
        "device": describe(p.device),
        "dtype": str(p.dtype).removeprefix("torch."),
        "processes": world,
        "sharded": isinstance(model, FSDPModule),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    if p.device.type == "cuda":
        out["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated(p.device) / 2**30
    return out


def pad_ids(
    seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists to the longest: (ids, attention_mask), each (B, T), on `device`."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s))
        attn[i, : len(s)] = 1
    return ids.to(device), attn.to(device)


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes (0, 1 outside torch.distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    """Whether this process writes artifacts: rank 0, or the only process."""
    return rank_and_world()[0] == 0
