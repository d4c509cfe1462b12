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

from qevolve.training.batching import batches, pack, packed_rows
from qevolve.training.checkpoint import (
    changing_tensors,
    checkpoint_path,
    fingerprint,
    input_digest,
    last_epoch_mean,
    load_round,
    save_and_report,
    trained_state,
)
from qevolve.training.distributed import full_state, is_sharded, loading_config, local_share, process_group, shard
from qevolve.training.loop import by_rate, train
from qevolve.training.speed import checkpoint_activations, compile_layers, per_token_parameters, train_speed

__all__ = [
    "batches",
    "by_rate",
    "changing_tensors",
    "checkpoint_activations",
    "checkpoint_path",
    "compile_layers",
    "fingerprint",
    "full_state",
    "input_digest",
    "is_sharded",
    "last_epoch_mean",
    "load_round",
    "loading_config",
    "local_share",
    "pack",
    "packed_rows",
    "per_token_parameters",
    "process_group",
    "save_and_report",
    "shard",
    "train",
    "train_speed",
    "trained_state",
]
