"""What a run was computed with besides its parameters: the checkout's commit, the installed packages and
the machine (each logged to MLflow with every evolution and table, and written into a table's results.json)."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """The checkout's commit, marked `-dirty` when tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return head + ("-dirty" if dirty else "") if head else "unknown"


def packages() -> list[str]:
    """The interpreter's version and every installed distribution as `name==version`, sorted: what a run
    was computed with besides the code (two checkouts of one commit can resolve other versions)."""
    from importlib.metadata import distributions

    found = {f"{d.metadata['Name']}=={d.version}" for d in distributions() if d.metadata["Name"]}
    return [f"python=={platform.python_version()}", *sorted(found, key=str.lower)]


def packages_sha256(listing: list[str]) -> str:
    return hashlib.sha256("\n".join(listing).encode()).hexdigest()


SIMD = ("sse4", "avx", "fma", "f16c", "amx", "vnni", "bf16", "neon", "asimd", "sve")
"""CPU flags that pick between float kernels (and so can change the order of a sum, and a greedy choice)."""

KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""Variables that override those choices: torch's own kernels, and MKL's (its matrix products pick a code path by
the CPU, not by torch's `cpu_capability`) and oneDNN's."""


def machine() -> dict:
    """The machine a run computed on: the CPU's model and its vector instruction sets, the kernels torch picked
    for them (`cpu_capability`) and the variables set to override such choices, the threads torch uses, the GPUs
    with their driver and CUDA. Two machines that differ here can add floats in another order, and a greedy choice
    between near-equal logits can flip."""
    import torch

    cpu: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            cpu.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    flags = cpu.get("flags") or cpu.get("Features") or ""
    out = {
        "platform": platform.platform(),
        "cpu_model": cpu.get("model name") or platform.processor() or platform.machine(),
        "cpu_simd": sorted(f for f in flags.split() if f.startswith(SIMD)),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ},
        "cpus": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }
    if out["gpus"] and shutil.which("nvidia-smi"):
        query = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        out["gpu_driver"] = (
            query.stdout.strip().splitlines()[0] if query.returncode == 0 and query.stdout.strip() else None
        )
    return out


def machine_line(m: dict) -> str:
    """One line of `machine`: `AMD EPYC, AVX512 kernels, 2 torch threads of 2 CPUs, no GPU`, with the kernel
    variables set (`MKL_CBWR=AVX2`) after the kernels."""
    kernels = "".join(f" {k}={v}" for k, v in sorted(m.get("kernel_env", {}).items()))
    gpus = (
        ", ".join(m["gpus"]) + (f" (driver {m['gpu_driver']})" if m.get("gpu_driver") else "")
        if m["gpus"]
        else "no GPU"
    )
    return (
        f"{m['cpu_model']}, {m['cpu_capability']} kernels{kernels}, {m['torch_threads']} torch threads of "
        f"{m['cpus']} CPUs, {gpus}"
    )
