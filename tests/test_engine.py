"""`SlotEngine`, the slot-resident rollout engine, against the reference path (`HFBackend` re-encoding every
prompt): the same greedy tokens, seeded samples and log-probs over several turns with reuse; its decode step
compiles once; the shared sampler on hand-computed values."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qevolve.models.backend import HFBackend, draw, uniforms
from qevolve.models.engine import SlotEngine, attention, rollout_engine
from qevolve.models.policy import Actor, load_policy
from qevolve.models.prompt import PromptBuilder
from tests.test_backend import ACTS, MODEL, _conversations

STOP = lambda tokens: len(tokens) >= 5  # noqa: E731


def _agree(engine, reference, builder, slots=(0, 1, 2)):
    """Play `_conversations` on both backends (scores, greedy and sampled turns); the largest log-prob difference."""
    cands = [builder.action_ids(a) for a in ACTS]
    worst = 0.0
    for prompts in _conversations(builder):
        c = [cands, cands[:2], cands[1:]]
        for got, want in zip(engine.score(list(slots), prompts, c), reference.score(list(slots), prompts, c)):
            worst = max(worst, float((got - want).abs().max()))
        for greedy in (True, False):
            kw = dict(max_new_tokens=6, stop=STOP, greedy=greedy, temperature=0.8, seeds=[11, 12, 13])
            got, want = engine.generate(list(slots), prompts, **kw), reference.generate(list(slots), prompts, **kw)
            assert [t for t, _ in got] == [t for t, _ in want]
            worst = max(worst, max(abs(a - b) for (_, a), (_, b) in zip(got, want)))
    return worst


def test_the_engine_scores_and_generates_as_reencoding_does_over_turns_with_reuse(tiny_base):
    model, tok = load_policy(tiny_base, MODEL)
    builder = PromptBuilder(tok, 120)  # small: histories are truncated, so some turns miss the cache after the head
    reference = HFBackend(model.eval(), tok.pad_token_id, reuse=False)
    for slots in ((0, 1, 2), (5, 2, 9)):  # consecutive rows (a view) and scattered ones (an index)
        engine = SlotEngine(model, tok.pad_token_id, score_rows=3)
        assert _agree(engine, reference, builder, slots) < 1e-5
        assert engine.encoded_tokens < reference.encoded_tokens / 3  # it did reuse
    unmerged, _ = load_policy(
        tiny_base, MODEL
    )  # a fresh peft adapter, not merged: LoRA acts inside the engine's layers
    with torch.no_grad():
        for name, p in unmerged.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    assert (
        _agree(
            SlotEngine(unmerged.eval(), tok.pad_token_id), HFBackend(unmerged, tok.pad_token_id, reuse=False), builder
        )
        < 1e-5
    )


def test_a_llama_model_runs_on_the_engine_and_others_fall_back(tiny_base):
    from qevolve.models.policy import lora_model

    _, tok = load_policy(tiny_base, MODEL)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok) + 64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    llama = lora_model(LlamaForCausalLM(config), MODEL).eval()  # SmolLM2's architecture
    assert isinstance(rollout_engine(llama, tok.pad_token_id), SlotEngine)
    assert (
        _agree(
            SlotEngine(llama, tok.pad_token_id),
            HFBackend(llama, tok.pad_token_id, reuse=False),
            PromptBuilder(tok, 120),
        )
        < 1e-5
    )
    assert type(rollout_engine(llama, tok.pad_token_id, reuse=False)) is HFBackend  # the re-encoding baseline
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert type(rollout_engine(gpt2, 0)) is HFBackend
    with pytest.raises(ValueError, match="SlotEngine cannot run this model"):
        SlotEngine(gpt2, 0)


def test_the_decode_step_compiles_once_for_every_step_turn_and_batch(tiny_base):
    """`torch.compile(fullgraph=True)` traces the whole step (no graph break), and no later step, turn, greedy or
    sampled call, or call with fewer episodes traces it again (dynamo raises on a recompile)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model, tok = load_policy(tiny_base, MODEL)
    builder = PromptBuilder(tok, 120)
    torch._dynamo.reset()
    counters.clear()
    engine = SlotEngine(model.eval(), tok.pad_token_id, compile={"backend": "eager"})
    engine.reserve(3, 200)  # the buffer sized ahead, as a rollout stage does
    with torch._dynamo.config.patch(error_on_recompile=True):  # (monkeypatch's undo deletes dynamo's config entry)
        assert _agree(engine, HFBackend(model, tok.pad_token_id, reuse=False), builder) < 1e-5
        engine.generate(
            [1], _conversations(builder)[-1][1:2], max_new_tokens=6, stop=STOP, greedy=True, temperature=1.0
        )
    assert counters["stats"]["unique_graphs"] == 1 and counters["stats"]["calls_captured"] > 100
    torch._dynamo.reset()


def test_a_rollout_stage_sizes_the_buffer_first_and_compiles_its_decode_step_once(tiny_base, tmp_path, monkeypatch):
    """The production path with `policy.compile: true`: `local_backend` sizes the engine's buffer for the stage's
    batch and the context budget before any call, then greedy and sampled episodes of growing prompts, three
    slots at a time, run on one compiled graph (dynamo raises on a recompile). "auto" is eager on a CPU, and a
    compiled engine's buffer at least doubles when a longer prompt makes it grow."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import qevolve.models.policy as policy
    from qevolve.params import parse_params
    from qevolve.rollout import play
    from tests.test_rollout import Corridor

    raw = {
        "model": {"context_tokens": 300, "lora": {"r": 4, "alpha": 8}},
        "policy": {"action_mode": "free", "max_new_tokens": 6},
    }
    model = load_policy(tiny_base, parse_params(raw).model)[0]
    model.save_pretrained(tmp_path / "adapter")
    assert policy.compile_options(parse_params(raw), model) is None  # "auto", on a CPU
    raw["policy"]["compile"] = True
    real = policy.compile_options  # the real decision; only the compiler changes, to dynamo's eager backend
    monkeypatch.setattr(
        policy, "compile_options", lambda p, m: None if real(p, m) is None else {**real(p, m), "backend": "eager"}
    )
    torch._dynamo.reset()
    counters.clear()
    backend, tok = policy.local_backend(parse_params(raw), tiny_base, tmp_path / "adapter", slots=3)
    assert backend.capacity == 512 and backend.keys[0].shape[0] == 3  # 300 + 6 positions and the free one
    actor = Actor(None, tok, PromptBuilder(tok, 300), "free", temperature=1.0, max_new_tokens=6, backend=backend)
    env = Corridor()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for greedy in (True, False):
            trajs = play(
                lambda: env,
                env.tasks("valid_seen") * 2,
                actor,
                max_steps=30,
                greedy=greedy,
                source="p",
                batch_size=3,
                seed=1,
            )
            assert (
                max(s.prompt_tokens for t in trajs for s in t.steps) > 256
            )  # past the first block the buffer would grow by
    assert counters["stats"]["unique_graphs"] == 1 and counters["stats"]["calls_captured"] > 50
    torch._dynamo.reset()
    backend.reserve(3, 520)
    assert backend.capacity == 1024


@pytest.mark.parametrize("heads, kv_heads, queries", [(9, 3, 1), (9, 3, 7), (4, 1, 5), (2, 2, 3)])
def test_folded_attention_equals_grouped_query_attention(heads, kv_heads, queries):
    """The engine's attention folds each key-value head's query heads into the query length instead of asking
    `scaled_dot_product_attention` for `enable_gqa` with a mask: the same result, on prefill (several
    queries) and decode (one) masks."""
    torch.manual_seed(0)
    B, L, d = 3, 11, 8
    q, k, v = torch.randn(B, heads, queries, d), torch.randn(B, kv_heads, L, d), torch.randn(B, kv_heads, L, d)
    mask = torch.rand(B, 1, queries, L) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    got = attention(q, k, v, mask, 0.3, fold=True)  # the CUDA path, here on the CPU
    assert got.shape == want.shape and (got - want).abs().max() < 1e-5
    assert torch.equal(attention(q, k, v, mask, 0.3), want)  # the CPU's default: the grouped call itself
    row = mask[:, :, :1]  # a mask of one row for every query (the decode step's shape, broadcast)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=row, scale=0.3, enable_gqa=True)
    assert (attention(q, k, v, row, 0.3, fold=True) - want).abs().max() < 1e-5


def test_uniforms_are_a_hash_of_seed_and_step_as_computed_by_hand():
    def mix(x):  # the same hash in plain Python integers
        x &= 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x5BD1E995) & 0xFFFFFFFF
        return x ^ (x >> 16)

    seeds = [0, 1, 2**40 + 7, 2**62 - 1]
    for step in (0, 1, 37):
        want = [((mix(mix(mix(s) ^ (s >> 32)) + step * 0x9E3779B1) >> 8) + 0.5) / 2**24 for s in seeds]
        assert uniforms(torch.tensor(seeds), step).tolist() == want
    assert all(0 < u < 1 for u in want)
    # a row's draw depends on its seed and step only, not on the rows beside it
    assert uniforms(torch.tensor(seeds[2:3]), 37).tolist() == want[2:3]


def test_draw_inverts_the_cumulative_distribution(monkeypatch):
    import qevolve.models.backend as backend

    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]] * 4))
    monkeypatch.setattr(
        backend, "uniforms", lambda seeds, step: torch.tensor([0.05, 0.15, 0.31, 0.999], dtype=torch.float64)
    )
    tokens, logp = draw(logits, False, 1.0, torch.zeros(4, dtype=torch.long), 0)
    assert tokens.tolist() == [0, 1, 2, 2]  # cumulative 0.1, 0.3, 1.0
    assert torch.allclose(logp, torch.log(torch.tensor([0.1, 0.2, 0.7, 0.7])))
    tokens, logp = draw(
        torch.tensor([[0.0, 2.0, 1.0]]), True, 5.0, None, 0
    )  # greedy: the argmax, log-prob at temperature 1
    assert tokens.tolist() == [1] and torch.allclose(logp, torch.log_softmax(torch.tensor([0.0, 2.0, 1.0]), -1)[1:2])


def test_the_largest_uniform_never_draws_a_token_without_mass(monkeypatch):
    """`uniforms`' largest value, (2**24 - 0.5) / 2**24, is 1.0 once it is float32; times the total mass it
    equalled the last cumulative sum, and the vocabulary's last token was drawn whatever its probability."""
    import qevolve.models.backend as backend

    top = (2**24 - 1 + 0.5) / 2**24
    assert torch.tensor(top, dtype=torch.float32).item() == 1.0  # the case
    monkeypatch.setattr(backend, "uniforms", lambda seeds, step: torch.full((len(seeds),), top, dtype=torch.float64))
    logits = torch.tensor([[0.0, 1.0, 2.0, -float("inf"), -float("inf")], [0.0, 1.0, 2.0, -5.0, -200.0]])
    tokens, logp = draw(logits, False, 1.0, torch.zeros(2, dtype=torch.long), 0)
    assert tokens.tolist() == [2, 3]  # the last token with mass (exp(-200) is 0 in float32)
    assert torch.isfinite(logp).all()


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.7])
    n = 20000
    tokens, _ = draw(torch.log(probs).expand(n, 3), False, 1.0, torch.arange(n) * 7919 + 3, 4)
    freq = torch.bincount(tokens, minlength=3).float() / n
    assert ((freq - probs).abs() < 3 * (probs * (1 - probs) / n).sqrt() + 1e-3).all()
    half, _ = draw(torch.log(probs).expand(n, 3), False, 2.0, torch.arange(n) * 7919 + 3, 4)  # temperature 2 flattens
    assert torch.bincount(half, minlength=3)[0] > torch.bincount(tokens, minlength=3)[0] * 1.5
