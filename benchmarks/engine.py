"""Rollout engines side by side: operators dispatched per decode step and per turn, and generation speed.

`SlotEngine` (slot-resident keys and values, one fixed-shape decode step) against `HFBackend` with KV reuse
(the per-slot caches padded into a batch cache every turn) and without (every prompt re-encoded), on one
randomly initialised model, the same prompts and the same greedy tokens. Operators are the aten calls
PyTorch dispatches (each one a kernel launch or more on a GPU), counted with a dispatch mode: per decode
step (from two runs that differ only in the number of new tokens) and per turn, for several numbers of
slots and at the first and a later turn. Engines that dispatch the same number per step whatever the slots
and turns have fixed shapes; that is what a compiled step or a CUDA graph needs. The compiled step
(`--compile`, inductor) is checked to trace once across all of it. It fails (exit 1) if any engine's
tokens differ from the re-encoding reference.

    python -m benchmarks.engine [--shape quickstart|tiny|0.5b] [--slots 4 16 64] [--turns 6] [--device cpu] [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SHAPES = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
    ),
    "quickstart": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=768,
        vocab_size=1024,
    ),
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
    ),
}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def random_model(shape: str, device: torch.device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()


def engines(model, compile_options):
    from qevolve.models.backend import HFBackend
    from qevolve.models.engine import SlotEngine

    out = {
        "hf, re-encode": lambda: HFBackend(model, 0, reuse=False),
        "hf, reuse": lambda: HFBackend(model, 0, reuse=True),
        "slot engine": lambda: SlotEngine(model, 0),
    }
    if compile_options is not None:
        out["slot engine, compiled"] = lambda: SlotEngine(model, 0, compile=compile_options)
    return out


def conversation(vocab: int, slots: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """Per turn, one prompt per slot: a 200-token start, then each turn adds 16 tokens of answer and 40 of
    observation."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (200,), generator=g).tolist() for _ in range(slots)]
    out = []
    for _ in range(turns):
        out.append(prompts)
        prompts = [p + torch.randint(1, vocab, (56,), generator=g).tolist() for p in prompts]
    return out


def play(
    backend, turns: list[list[list[int]]], new: int, count_turns: tuple[int, ...] = ()
) -> tuple[list, dict[int, int], float, int]:
    """Greedy turns; (tokens per turn, operators of the turns in `count_turns`, seconds, new tokens)."""
    tokens, ops, made = [], {}, 0
    start = time.perf_counter()
    for t, prompts in enumerate(turns):
        slots = list(range(len(prompts)))
        if t in count_turns:
            with Count() as c:
                got = backend.generate(
                    slots, prompts, max_new_tokens=new, stop=lambda _: False, greedy=True, temperature=1.0
                )
            ops[t] = c.n
        else:
            got = backend.generate(
                slots, prompts, max_new_tokens=new, stop=lambda _: False, greedy=True, temperature=1.0
            )
        tokens.append([x for x, _ in got])
        made += sum(len(x) for x, _ in got)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return tokens, ops, time.perf_counter() - start, made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="quickstart")
    ap.add_argument("--slots", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--new", type=int, default=16, help="new tokens per turn")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true", help="also the compiled step (inductor; CUDA graphs on a GPU)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats; the median is reported")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    model = random_model(args.shape, device)
    vocab = SHAPES[args.shape]["vocab_size"]
    compile_options = ({"mode": "reduce-overhead"} if device.type == "cuda" else {}) if args.compile else None
    rows, same = [], True
    late = args.turns - 1
    for slots in args.slots:
        turns = conversation(vocab, slots, args.turns)
        reference = None
        for name, make in engines(model, compile_options).items():
            # operators: a turn of `new` tokens and one of 1 token (no decode step) differ by `new - 1` steps
            counted = {}
            for new in (args.new, 1):
                _, counted[new], _, _ = play(
                    make(), turns, new, count_turns=(0, late) if "compiled" not in name else ()
                )
            times = []
            for _ in range(args.repeats):
                backend = make()
                tokens, _, seconds, made = play(backend, turns, args.new)
                times.append(seconds)
            reference = reference or tokens
            same &= tokens == reference
            step = {t: (counted[args.new][t] - counted[1][t]) / (args.new - 1) for t in counted[1]}
            rows.append(
                {
                    "slots": slots,
                    "engine": name,
                    "ops_step_first": step.get(0),
                    "ops_step_late": step.get(late),
                    "ops_turn_late": counted[args.new].get(late),
                    "tok_s": made / statistics.median(times),
                    "encoded": backend.encoded_tokens,
                    "same": tokens == reference,
                }
            )
    print(
        f"\n{args.shape} shape (random weights, {next(model.parameters()).dtype}) on {device}; {args.turns} turns "
        f"of {args.new} greedy "
        f"tokens per slot after 200-token prompts growing by 56 a turn; median of {args.repeats}\n"
    )
    print(
        f"{'slots':>5}  "
        f"{'engine':<22}{'ops/step t1':>12}{f'ops/step t{late + 1}':>12}{f'ops/turn t{late + 1}':>13}{'tok/s':>9}"
        f"{'encoded tok':>13}{'same tokens':>13}"
    )
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    for r in rows:
        print(
            f"{r['slots']:>5}  "
            f"{r['engine']:<22}{fmt(r['ops_step_first']):>12}{fmt(r['ops_step_late']):>12}{fmt(r['ops_turn_late']):>13}"
            f"{r['tok_s']:>9.0f}{r['encoded']:>13}{str(r['same']):>13}"
        )
    if compile_options is not None:
        from torch._dynamo.utils import counters

        print(
            f"\ncompiled step: {counters['stats']['unique_graphs']} graph(s) traced for all slots, turns and runs "
            f"above "
            "(each new SlotEngine's buffers are new tensors: one trace per engine, none per step or turn)"
        )
    print(
        "\nops/step: aten operators dispatched per decode step (first turn, last turn); ops/turn: a whole turn's, "
        "prefill included"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
