"""Train a LoRA adapter on a small model with `train()` and `bc_step`, in one process or under
`torchrun` (the model copied into each process, or sharded across them with `--shard`); rank 0 saves the
curve and the trained tensors. Used by tests/test_distributed.py (2 gloo processes against 1) and
benchmarks/gpu_check.py (NCCL).

    python benchmarks/ddp_train.py BASE_DIR OUT.pt [--device cpu]
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/ddp_train.py BASE_DIR OUT.pt [--shard]
"""

import argparse
import sys
from pathlib import Path

import torch

from qevolve.config import BCConfig, ModelConfig, TrainRunConfig
from qevolve.models.device import is_main
from qevolve.models.policy import load_policy
from qevolve.models.prompt import PromptBuilder
from qevolve.stages.bc import bc_step
from qevolve.training import full_state, loading_config, process_group, shard, train

# 3 micro-batches per optimiser step: under 2 processes, rank 0 runs two of them and rank 1 one.
CFG = BCConfig(epochs=2, lr=5e-3, batch_size=3, micro_batch_size=1, warmup_ratio=0.2, checkpoint_every=1)
TASKS = [
    ("put some book on sidetable.", "Action: take book 1 from desk 1"),
    ("examine the pen.", "Action: go to desk 1"),
    ("put a cd in shelf.", "Action: open cabinet 1"),
    ("find a key.", "Action: look"),
    ("cool an apple.", "Action: go to shelf 2"),
    ("heat a mug.", "Action: go to desk 1"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shard", action="store_true", help="shard the model across the processes (FSDP2)")
    ap.add_argument("--checkpoint", type=Path, help="the in-training checkpoint (resumed from when it exists)")
    ap.add_argument(
        "--stop-after", type=int, default=0, help="exit with status 3 after this many optimiser steps (a killed run)"
    )
    args = ap.parse_args()
    run = TrainRunConfig(shard=args.shard)
    with process_group(args.device):
        torch.manual_seed(0)
        cfg = ModelConfig(lora={"r": 4, "alpha": 8}, device=args.device, dtype="float32")
        model, tok = load_policy(args.base, loading_config(cfg, run))
        model = shard(model, run, args.device)
        builder = PromptBuilder(tok, 512)
        examples = [
            ex
            for task, act in TASKS
            for ex in builder.training_examples(task, ["You are in the middle of a room."], [act])
        ]
        done = []

        def stop() -> None:
            done.append(1)
            if len(done) == args.stop_after:
                sys.exit(3)

        curve = train(
            model,
            examples,
            CFG,
            lambda e: len(e[0]),
            lambda micro: bc_step(model, micro, tok.pad_token_id),
            "ddp-train",
            after_step=stop,
            checkpoint=args.checkpoint,
        )
        state = full_state(model)
        if is_main():
            trained = state or {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
            torch.save({"curve": curve, "params": trained}, args.out)


if __name__ == "__main__":
    main()
