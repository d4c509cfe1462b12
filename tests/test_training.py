"""In-stage checkpoints: a training run killed part-way resumes where it stopped and ends exactly where
an uninterrupted run ends."""

import pytest
import torch

from qevolve.config import BCConfig, ModelConfig, TrainConfig, TrainRunConfig
from qevolve.models.policy import load_policy
from qevolve.models.prompt import PromptBuilder
from qevolve.stages.bc import bc_step
from qevolve.training import batches, input_digest, train, train_speed

CFG = BCConfig(epochs=3, lr=5e-3, batch_size=2, micro_batch_size=1, warmup_ratio=0.2, checkpoint_every=2)


class Killed(Exception):
    pass


def _model(tiny_base, dropout=0.1):
    torch.manual_seed(0)
    return load_policy(tiny_base, ModelConfig(lora={"r": 4, "alpha": 8, "dropout": dropout}))


def _examples(tok):
    builder = PromptBuilder(tok, 512)
    tasks = [
        ("put some book on sidetable.", "Action: take book 1 from desk 1"),
        ("examine the pen.", "Action: go to desk 1"),
        ("put a cd in shelf.", "Action: open cabinet 1"),
        ("find a key.", "Action: look"),
        ("cool an apple.", "Action: go to shelf 2"),
    ]
    return [
        ex for task, act in tasks for ex in builder.training_examples(task, ["You are in the middle of a room."], [act])
    ]


def _run(tiny_base, checkpoint=None, kill_at=None, inputs="", run=None, dropout=0.1):
    model, tok = _model(tiny_base, dropout)
    examples, calls = _examples(tok), []

    def step(micro):
        calls.append(1)
        if kill_at is not None and len(calls) == kill_at:
            raise Killed
        return bc_step(model, micro, tok.pad_token_id)

    curve = train(
        model, examples, CFG, lambda e: len(e[0]), step, "test", checkpoint=checkpoint, inputs=inputs, run=run
    )
    return curve, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, len(calls)


def test_killed_training_resumes_from_its_checkpoint_and_matches_an_uninterrupted_run(tiny_base, tmp_path):
    want_curve, want_params, steps = _run(tiny_base)
    assert steps == 9  # 3 epochs of 3 batches
    ckpt = tmp_path / ".bc.checkpoint"
    with pytest.raises(Killed):
        _run(tiny_base, ckpt, kill_at=6)  # in epoch 2; checkpoints after steps 2, 3 (epoch end) and 4
    assert ckpt.exists() and not list(tmp_path.glob("*.tmp"))
    got_curve, got_params, calls = _run(tiny_base, ckpt)
    assert calls == 9 - 4  # resumed after step 4, not from the start
    timeless = lambda curve: [{k: v for k, v in c.items() if k != "seconds"} for c in curve]  # noqa: E731
    assert timeless(got_curve) == timeless(want_curve)
    assert all(torch.equal(got_params[n], p) for n, p in want_params.items())


def test_a_checkpoint_of_other_data_is_ignored(tiny_base, tmp_path):
    ckpt = tmp_path / ".bc.checkpoint"
    _run(tiny_base, ckpt)  # leaves the final checkpoint
    model, tok = _model(tiny_base)
    examples = _examples(tok)[:4]
    curve = train(
        model,
        examples,
        CFG,
        lambda e: len(e[0]),
        lambda m: bc_step(model, m, tok.pad_token_id),
        "test",
        checkpoint=ckpt,
    )
    assert len(curve) == 3 * 2


def test_a_checkpoint_of_other_inputs_is_ignored(tiny_base, tmp_path):
    """Same data shapes and config, other input artifacts (e.g. a retrained previous policy): start over."""
    ckpt = tmp_path / ".bc.checkpoint"
    (tmp_path / "a").write_text("one previous policy")
    (tmp_path / "b").write_text("another")
    with pytest.raises(Killed):
        _run(tiny_base, ckpt, kill_at=6, inputs=input_digest(tmp_path / "a"))
    _, _, calls = _run(tiny_base, ckpt, inputs=input_digest(tmp_path / "b"))
    assert calls == 9
    with pytest.raises(FileNotFoundError, match="missing"):
        input_digest(tmp_path / "c")


def test_input_digest_reads_names_and_contents(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "x.bin").write_bytes(b"same")
    assert input_digest(a) == input_digest(b) != input_digest(a, b)
    (b / "sub" / "x.bin").write_bytes(b"other")
    assert input_digest(a) != input_digest(b)
    (b / "sub" / "x.bin").rename(b / "sub" / "y.bin")
    (b / "sub" / "y.bin").write_bytes(b"same")
    assert input_digest(a) != input_digest(b)


def test_micro_batches_by_token_budget_as_counted_by_hand():
    import random

    items = [3, 9, 4, 1, 7, 5]  # each item is its own length
    cfg = TrainConfig(batch_size=6, micro_batch_size=2)
    [by_count] = batches(items, cfg, random.Random(0), lambda x: x)
    assert by_count == [[1, 3], [4, 5], [7, 9]]
    [by_tokens] = batches(items, cfg, random.Random(0), lambda x: x, token_budget=10)
    # sorted 1 3 4 5 7 9: [1, 3] pads to 2 x 3 = 6, adding 4 would pad to 3 x 4 = 12 > 10; [4, 5] 10; 7 and 9 alone
    assert by_tokens == [[1, 3], [4, 5], [7], [9]]
    [one] = batches([30, 2], cfg, random.Random(0), lambda x: x, token_budget=10)
    assert one == [[2], [30]]  # an item longer than the budget still gets a micro-batch of its own


def test_a_token_budget_and_compiled_layers_change_how_the_update_is_computed_not_what_it_is(tiny_base):
    """Micro-batches by token budget, activation checkpointing and `train.compile` (alone and together) give the same
    curve and adapter as the defaults, and the curve's tokens and seconds give the speed; with a peak, the MFU at 4
    FLOPs per parameter per token. (No dropout: its draws follow the micro-batches.)"""
    want_curve, want_params, _ = _run(tiny_base, dropout=0.0)  # micro-batches of one window
    assert want_curve[-1]["loss"] < want_curve[0]["loss"]
    for run in (
        TrainRunConfig(micro_batch_tokens=400),
        TrainRunConfig(checkpoint_activations=True),
        TrainRunConfig(compile=True),
        TrainRunConfig(compile=True, checkpoint_activations=True),
    ):  # compiled layers inside checkpoints, on a peft model
        torch._dynamo.reset()
        curve, params, _ = _run(tiny_base, run=run, dropout=0.0)  # two windows of about 190 tokens fit in 400
        assert [c["tokens"] for c in curve] == [c["tokens"] for c in want_curve]
        assert all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(curve, want_curve))
        # float rounding of the summed micro-batches, which Adam scales up on near-zero gradients (measured: 3e-4 at
        # most, on weights up to 0.14)
        assert all(torch.allclose(params[n], p, atol=1e-3) for n, p in want_params.items())
    model, _ = _model(tiny_base, dropout=0.0)
    from qevolve.models.base import causal_lm
    from qevolve.training import checkpoint_activations

    assert not causal_lm(model).is_activation_checkpointing
    checkpoint_activations(model)
    assert causal_lm(model).is_activation_checkpointing  # the setting above did take effect
    start = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(start[n], p) for n, p in want_params.items())  # training changed the adapter
    curve = [{"tokens": 300, "seconds": 2.0}, {"tokens": 100, "seconds": 2.0}]
    lm = causal_lm(model)  # embeddings trained: peft keeps the originals and trained copies of both, all left out
    embeddings = {
        id(p): p.numel() for m in (lm.get_input_embeddings(), lm.get_output_embeddings()) for p in m.parameters()
    }
    assert len(embeddings) >= 3
    n = sum(p.numel() for p in model.parameters()) - sum(embeddings.values())
    assert train_speed(model, curve) == {"train_tokens": 400, "tokens_per_s": 100.0}  # no peak known for a CPU
    speed = train_speed(model, curve, TrainRunConfig(peak_tflops=2.0))
    assert speed["mfu"] == pytest.approx(4 * n * 100.0 / 2e12)


def test_adapters_multiply_in_a_bfloat16_bases_dtype_and_keep_float32_weights(tiny_base):
    """On a bfloat16 base (a GPU's `auto`), the LoRA matmuls of a training pass run in bfloat16 (a GPU's tensor
    cores) while peft keeps the adapter's weights, and so AdamW's steps, in float32; BC still learns. On a float32
    base nothing is cast."""
    from qevolve.models.base import adapters_in_float32

    def lora_outputs(model) -> list[torch.dtype]:
        seen = []
        for name, module in model.named_modules():
            if name.endswith("lora_A.default"):
                module.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        return seen

    torch.manual_seed(0)
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "train_embeddings": False}
    model, tok = load_policy(tiny_base, ModelConfig(dtype="bfloat16", lora=lora))
    seen = lora_outputs(model)
    examples = _examples(tok)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert start and all(p.dtype == torch.float32 for p in start.values())
    with adapters_in_float32():
        bc_step(model, [examples[:1]], tok.pad_token_id)
    assert seen and set(seen) == {torch.float32}  # what peft does alone: the adapters off the tensor cores
    seen.clear()
    curve = train(model, examples, CFG, lambda e: len(e[0]), lambda m: bc_step(model, m, tok.pad_token_id), "bf16")
    assert seen and set(seen) == {torch.bfloat16}
    assert curve[-1]["loss"] < curve[0]["loss"]
    after = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.dtype == torch.float32 for p in after.values())
    assert any(not torch.equal(start[n], p) for n, p in after.items())

    model, tok = load_policy(tiny_base, ModelConfig(lora=lora))  # float32 on a CPU
    seen = lora_outputs(model)
    bc_step(model, [examples[:1]], tok.pad_token_id)
    assert seen and set(seen) == {torch.float32}
