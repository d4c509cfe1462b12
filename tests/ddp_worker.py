"""Run by tests/test_distributed.py, in one process or under `torchrun`: train a LoRA adapter on a tiny
model with `train()` and `bc_step`, and (rank 0) save the curve and the trained tensors to argv[2]."""

import sys

import torch

from qevolve.config import BCConfig, ModelConfig
from qevolve.models.policy import load_policy
from qevolve.models.prompt import PromptBuilder
from qevolve.stages.bc import bc_step
from qevolve.stages.training import is_main, process_group, train

# 3 micro-batches per optimiser step: under 2 processes, rank 0 runs two of them and rank 1 one.
CFG = BCConfig(epochs=2, lr=5e-3, batch_size=3, micro_batch_size=1, warmup_ratio=0.2)
TASKS = [("put some book on sidetable.", "Action: take book 1 from desk 1"), ("examine the pen.", "Action: go to desk 1"),
         ("put a cd in shelf.", "Action: open cabinet 1"), ("find a key.", "Action: look"), ("cool an apple.", "Action: go to shelf 2"),
         ("heat a mug.", "Action: go to desk 1")]


def main(base: str, out: str) -> None:
    with process_group("cpu"):
        torch.manual_seed(0)
        model, tok = load_policy(base, ModelConfig(lora={"r": 4, "alpha": 8}, device="cpu"))
        builder = PromptBuilder(tok, 512)
        examples = [ex for task, act in TASKS for ex in builder.training_examples(task, ["You are in the middle of a room."], [act])]
        curve = train(model, examples, CFG, lambda e: len(e[0]), lambda micro: bc_step(model, micro, tok.pad_token_id), "ddp-test")
        if is_main():
            trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            torch.save({"curve": curve, "params": trained}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
