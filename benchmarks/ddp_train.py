"""Train a LoRA adapter on a small model with `train()` and `bc_step`, in one process or under
`torchrun`; rank 0 saves the curve and the trained tensors. Used by tests/test_distributed.py (2 gloo
processes against 1) and benchmarks/gpu_check.py (NCCL).

    python benchmarks/ddp_train.py BASE_DIR OUT.pt [--device cpu]
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/ddp_train.py BASE_DIR OUT.pt
"""

import argparse

import torch

from qevolve.config import BCConfig, ModelConfig
from qevolve.models.policy import load_policy
from qevolve.models.prompt import PromptBuilder
from qevolve.stages.bc import bc_step
from qevolve.training import is_main, process_group, train

# 3 micro-batches per optimiser step: under 2 processes, rank 0 runs two of them and rank 1 one.
CFG = BCConfig(epochs=2, lr=5e-3, batch_size=3, micro_batch_size=1, warmup_ratio=0.2)
TASKS = [("put some book on sidetable.", "Action: take book 1 from desk 1"), ("examine the pen.", "Action: go to desk 1"),
         ("put a cd in shelf.", "Action: open cabinet 1"), ("find a key.", "Action: look"), ("cool an apple.", "Action: go to shelf 2"),
         ("heat a mug.", "Action: go to desk 1")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    with process_group(args.device):
        torch.manual_seed(0)
        model, tok = load_policy(args.base, ModelConfig(lora={"r": 4, "alpha": 8}, device=args.device, dtype="float32"))
        builder = PromptBuilder(tok, 512)
        examples = [ex for task, act in TASKS for ex in builder.training_examples(task, ["You are in the middle of a room."], [act])]
        curve = train(model, examples, CFG, lambda e: len(e[0]), lambda micro: bc_step(model, micro, tok.pad_token_id), "ddp-train")
        if is_main():
            trained = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
            torch.save({"curve": curve, "params": trained}, args.out)


if __name__ == "__main__":
    main()
