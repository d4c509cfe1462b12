import torch

from qevolve.config import BCConfig, ModelConfig
from qevolve.models.backend import HFBackend
from qevolve.models.policy import Actor, load_policy, save_adapters
from qevolve.models.prompt import PromptBuilder
from qevolve.stages.bc import bc_step
from qevolve.training import train

MODEL = ModelConfig(lora={"r": 8, "alpha": 16})


def test_batched_candidate_scores_equal_one_sequence_at_a_time(tiny_base):
    model, tok = load_policy(tiny_base, MODEL)
    model.eval()

    def enc(s):
        return tok.encode(s, add_special_tokens=False)

    prompts = [enc("You arrive at desk 1. On the desk 1, you see a book 1."), enc("Nothing happens.")]
    cands = [[enc("Action: take book 1"), enc("Action: go to cabinet 1"), enc("Action: look")], [enc("Action: look")]]
    scores = HFBackend(model, tok.pad_token_id, reuse=False).score([0, 1], prompts, cands)
    with torch.no_grad():
        for p, cs, got in zip(prompts, cands, scores):
            for c, s in zip(cs, got):
                logp = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits[0], -1)
                want = sum(logp[len(p) - 1 + i, t] for i, t in enumerate(c))
                assert abs(float(want) - float(s)) < 1e-4


def test_admissible_actor_greedy_and_sampled_logp(tiny_base):
    model, tok = load_policy(tiny_base, MODEL)
    builder = PromptBuilder(tok, 512)
    actor = Actor(model, tok, builder, "admissible", temperature=2.0, max_new_tokens=8)
    prompt = builder.prompt("put some book on sidetable.", ["You are in the middle of a room."], [])
    acts = ["go to desk 1", "go to cabinet 1", "look"]
    cand = [builder.action_ids(f"Action: {a}") for a in acts]
    scores = HFBackend(model, tok.pad_token_id, reuse=False).score([0], [prompt], [cand])[0]
    [greedy] = actor.act([prompt], [acts], greedy=True)
    best = int(scores.argmax())
    assert greedy.output == f"Action: {acts[best]}"
    assert abs(greedy.logp - float(torch.log_softmax(scores, -1)[best])) < 1e-5
    [sampled] = actor.act([prompt], [acts], greedy=False, generators=[torch.Generator().manual_seed(0)])
    k = [f"Action: {a}" for a in acts].index(sampled.output)
    assert abs(sampled.logp - float(torch.log_softmax(scores / 2.0, -1)[k])) < 1e-5


def test_free_actor_generates_text(tiny_base):
    model, tok = load_policy(tiny_base, MODEL)
    builder = PromptBuilder(tok, 512)
    actor = Actor(model, tok, builder, "free", temperature=1.0, max_new_tokens=6)
    prompt = builder.prompt("put some book on sidetable.", ["You are in the middle of a room."], [])
    decisions = actor.act([prompt, prompt[:20]], [[], []], greedy=True)
    assert len(decisions) == 2 and all(0 < d.output_tokens <= 6 and d.logp <= 0 for d in decisions)


def test_an_adapter_loaded_for_inference_is_merged_and_acts_the_same(tiny_base, tmp_path):
    torch.manual_seed(0)
    model, tok = load_policy(tiny_base, MODEL)
    with torch.no_grad():  # a trained adapter: every trainable tensor moved (a fresh one's lora_B is zero)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path)
    peft_model, _ = load_policy(tiny_base, MODEL, adapter=tmp_path, trainable=True)
    merged, _ = load_policy(tiny_base, MODEL, adapter=tmp_path)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    builder = PromptBuilder(tok, 512)
    prompt = builder.prompt(
        "put some book on sidetable.", ["You arrive at desk 1. On the desk 1, you see a book 1."], []
    )
    base, _ = load_policy(tiny_base, MODEL)
    with torch.no_grad():
        want, got = (
            peft_model.eval()(input_ids=torch.tensor([prompt])).logits,
            merged(input_ids=torch.tensor([prompt])).logits,
        )
        assert (want - base.eval()(input_ids=torch.tensor([prompt])).logits).abs().max() > 0.1  # the adapter matters
    assert torch.allclose(want, got, atol=1e-4)
    acts = ["go to desk 1", "go to cabinet 1", "take book 1 from desk 1", "look"]
    for mode in ("admissible", "free"):
        a, b = (
            Actor(m, tok, builder, mode, temperature=1.0, max_new_tokens=8).act([prompt], [acts], greedy=True)[0]
            for m in (peft_model, merged)
        )
        assert a.output == b.output and abs(a.logp - b.logp) < 1e-4


def test_bc_step_lowers_loss_and_changes_only_the_adapter(tiny_base):
    torch.manual_seed(0)
    model, tok = load_policy(tiny_base, MODEL)
    builder = PromptBuilder(tok, 512)
    examples = builder.training_examples(
        "put some book on sidetable.",
        ["You are in the middle of a room.", "You arrive at desk 1."],
        ["Action: go to desk 1", "Action: take book 1 from desk 1"],
    )
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert any("lora_" in n for n in trainable)
    cfg = BCConfig(epochs=5, lr=1e-2, batch_size=8, micro_batch_size=1, warmup_ratio=0.0)
    curve = train(
        model, examples, cfg, lambda e: len(e[0]), lambda micro: bc_step(model, micro, tok.pad_token_id), "test"
    )
    assert len(curve) == 5 and curve[-1]["loss"] < curve[0]["loss"]
    params = dict(model.named_parameters())
    assert any(not torch.equal(params[n], v) for n, v in trainable.items() if "lora_B" in n)
    assert all(torch.equal(params[n], v) for n, v in frozen.items())


def test_a_fresh_adapter_depends_on_its_seed_alone(tiny_base):
    """The BC stages' starting adapter: torch 2.13 seeds its global generator differently in each process, and a
    flow's earlier stages move it, so the adapter must not be drawn from whatever state it is in."""

    def lora_a(seed, state_before):
        torch.manual_seed(state_before)
        model, _ = load_policy(tiny_base, MODEL, seed=seed)
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}

    first, moved, other = lora_a(3, 1), lora_a(3, 2), lora_a(4, 1)
    assert first and all(torch.equal(first[n], moved[n]) for n in first)
    assert any(not torch.equal(first[n], other[n]) for n in first)


def test_a_saved_adapter_config_does_not_depend_on_set_order(tiny_base, tmp_path):
    """peft holds `target_modules` ("all-linear" resolved) as a set and writes it in the set's order, which string
    hashing changes from process to process: the same adapter got two DVC hashes. Two iteration orders stand in
    for two processes."""

    class Ordered(set):
        def __init__(self, items=()):
            super().__init__(items)
            self.order = list(items)

        def __iter__(self):
            return iter(self.order)

    model, _ = load_policy(tiny_base, MODEL, seed=0)
    modules = sorted(model.peft_config["default"].target_modules)
    assert len(modules) > 1
    texts = []
    for i, order in enumerate((modules, modules[::-1])):
        model.peft_config["default"].target_modules = Ordered(order)
        save_adapters(model, tmp_path / str(i))
        texts.append((tmp_path / str(i) / "adapter_config.json").read_text())
    assert texts[0] == texts[1]


def test_packed_bc_loss_equals_padded_loss(tiny_base):
    from qevolve.training import pack

    assert sorted(map(sorted, pack([5, 3, 4, 2, 9], 9))) == [[0, 2], [1, 3], [4]]
    model, tok = load_policy(tiny_base, MODEL)
    builder = PromptBuilder(tok, 512)
    examples = builder.training_examples(
        "put some book on sidetable.",
        ["You are in the middle of a room.", "You arrive at desk 1."],
        ["Action: go to desk 1", "Action: take book 1 from desk 1"],
    ) + builder.training_examples("examine the book.", ["You are in a room."], ["Action: look"])
    from qevolve.training import packed_rows

    ids, _, pos = packed_rows([x for x, _ in examples], [m for _, m in examples], 512, tok.pad_token_id)
    assert ids.shape[0] == 1 and (pos == 0).sum() == 2  # both windows share one row
    losses, grads = [], []
    for pack_tokens in (0, 512):
        model.zero_grad()
        losses.append(bc_step(model, [examples], tok.pad_token_id, pack_tokens)["loss"])
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert abs(losses[0] - losses[1]) < 1e-5
    assert torch.allclose(grads[0], grads[1], atol=1e-5)
