"""In-stage checkpoints: a training run killed part-way resumes where it stopped and ends exactly where
an uninterrupted run ends."""

import pytest
import torch

from qevolve.config import BCConfig, ModelConfig
from qevolve.models.policy import load_policy
from qevolve.models.prompt import PromptBuilder
from qevolve.stages.bc import bc_step
from qevolve.training import input_digest, train

CFG = BCConfig(epochs=3, lr=5e-3, batch_size=2, micro_batch_size=1, warmup_ratio=0.2, checkpoint_every=2)


class Killed(Exception):
    pass


def _model(tiny_base):
    torch.manual_seed(0)
    return load_policy(tiny_base, ModelConfig(lora={"r": 4, "alpha": 8, "dropout": 0.1}))


def _examples(tok):
    builder = PromptBuilder(tok, 512)
    tasks = [("put some book on sidetable.", "Action: take book 1 from desk 1"), ("examine the pen.", "Action: go to desk 1"),
             ("put a cd in shelf.", "Action: open cabinet 1"), ("find a key.", "Action: look"), ("cool an apple.", "Action: go to shelf 2")]
    return [ex for task, act in tasks for ex in builder.training_examples(task, ["You are in the middle of a room."], [act])]


def _run(tiny_base, checkpoint=None, kill_at=None, inputs=""):
    model, tok = _model(tiny_base)
    examples, calls = _examples(tok), []

    def step(micro):
        calls.append(1)
        if kill_at is not None and len(calls) == kill_at:
            raise Killed
        return bc_step(model, micro, tok.pad_token_id)

    curve = train(model, examples, CFG, lambda e: len(e[0]), step, "test", checkpoint=checkpoint, inputs=inputs)
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
    assert got_curve == want_curve
    assert all(torch.equal(got_params[n], p) for n, p in want_params.items())


def test_a_checkpoint_of_other_data_is_ignored(tiny_base, tmp_path):
    ckpt = tmp_path / ".bc.checkpoint"
    _run(tiny_base, ckpt)  # leaves the final checkpoint
    model, tok = _model(tiny_base)
    examples = _examples(tok)[:4]
    curve = train(model, examples, CFG, lambda e: len(e[0]), lambda m: bc_step(model, m, tok.pad_token_id), "test", checkpoint=ckpt)
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
