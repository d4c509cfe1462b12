"""BC training throughput: packed (padding-free) and length-bucketed micro-batches against padded ones.

Four ways to batch the same optimiser steps over the workspace's expert windows, each from the same
initial adapter: `max-length` pads every window to `model.context_tokens` (a fixed-shape trainer);
`padded` pads each micro-batch, in shuffled order, to its longest window; `bucketed` sorts each
optimiser batch by length first (what `train` does for every trainer); `packed` also packs each
micro-batch into rows of `model.context_tokens` tokens (`bc.pack`); `unpadded` runs one window per
forward pass (micro-batches of 1, `bc.micro_batch_size: 1`), so nothing is padded. Each computes the loss
from log-probs at the action tokens alone (`target_logprobs`); `full logits` is `bucketed` with the loss
made from the model's whole (B, T, V) logits, as the trainers did before. Tokens/s counts real tokens only.
The benchmark fails if the first step's loss differs between them.

    python -m benchmarks.train [--workspace runs/quickstart] [--steps 30] [--batch-size 8] [--micro-batch-size 4]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from benchmarks import workspace_params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--workspace",
        type=Path,
        default=Path("runs/quickstart"),
        help="holds params.yaml, models/base and data/experts",
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    args = ap.parse_args(argv)

    from qevolve.algos.losses import token_logprobs
    from qevolve.data.store import read_store
    from qevolve.models.base import target_logprobs
    from qevolve.models.policy import load_policy
    from qevolve.models.prompt import PromptBuilder, build_examples
    from qevolve.stages.bc import bc_step

    def full_logits(model, ids, mask, **inputs):  # the loss before target_logprobs: every position's logits
        return token_logprobs(model(input_ids=ids, use_cache=False, **inputs).logits, ids)

    ws = args.workspace
    params = workspace_params(ws, ("models/base", "data/experts"))
    torch.manual_seed(0)
    model, tok = load_policy(ws / "models/base", params.model)
    start_state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    builder = PromptBuilder(tok, params.model.context_tokens, "", params.prompt.repeat_task)
    examples = build_examples(builder, read_store(ws / "data/experts"))
    rng = random.Random(0)
    order = [rng.randrange(len(examples)) for _ in range(args.steps * args.batch_size)]
    plans = {}
    width = params.model.context_tokens
    for name in ("max-length", "padded", "bucketed", "full logits", "packed", "unpadded"):
        steps = []
        micro = 1 if name == "unpadded" else args.micro_batch_size
        for i in range(args.steps):
            batch = [examples[j] for j in order[i * args.batch_size : (i + 1) * args.batch_size]]
            if name in ("bucketed", "full logits", "packed"):
                batch.sort(key=lambda e: len(e[0]))
            steps.append([batch[k : k + micro] for k in range(0, len(batch), micro)])
        plans[name] = steps

    results = {}
    for name, steps in plans.items():
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in start_state:
                    p.copy_(start_state[n])
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=params.bc.lr)
        pack_tokens = params.model.context_tokens if name == "packed" else 0
        import qevolve.stages.bc as bc_module

        bc_module.target_logprobs = full_logits if name == "full logits" else target_logprobs
        model.train()
        losses, start = [], time.perf_counter()
        for micro in steps:
            opt.zero_grad(set_to_none=True)
            if name == "max-length":  # trailing padding changes no earlier position of a causal model, nor the loss
                micro = [
                    [(ids + [tok.pad_token_id] * (width - len(ids)), m + [0] * (width - len(m))) for ids, m in mb]
                    for mb in micro
                ]
            losses.append(bc_step(model, micro, tok.pad_token_id, pack_tokens)["loss"])
            opt.step()
        seconds = time.perf_counter() - start
        tokens = sum(len(ids) for micro in steps for mb in micro for ids, _ in mb)  # real tokens only
        results[name] = {"seconds": seconds, "tok_per_s": tokens / seconds, "first": losses[0], "last": losses[-1]}

    print(
        f"\n{args.steps} BC optimiser steps of {args.batch_size} windows (micro-batches of "
        f"{args.micro_batch_size}) from "
        f"{len(examples)} expert windows of <= {params.model.context_tokens} tokens\n"
    )
    print(f"{'batching':<12}{'seconds':>9}{'tok/s':>9}{'speed-up':>10}{'first loss':>12}{'last loss':>11}")
    for name, r in results.items():
        print(
            f"{name:<12}{r['seconds']:>9.1f}{r['tok_per_s']:>9.0f}"
            f"{r['tok_per_s'] / results['max-length']['tok_per_s']:>9.2f}x"
            f"{r['first']:>12.5f}{r['last']:>11.4f}"
        )
    same = max(abs(r["first"] - results["padded"]["first"]) for r in results.values())
    print("\nspeed-up: tokens/s against max-length padding")
    print(f"\nlargest difference of the first step's loss: {same:.1e}")
    return 0 if same < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
