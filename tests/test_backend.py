"""KV-cache reuse across turns changes no result: same scores, same generated tokens, same rollouts."""

import torch

from qevolve.config import ModelConfig
from qevolve.models.backend import HFBackend
from qevolve.models.policy import Actor, load_policy
from qevolve.models.prompt import PromptBuilder
from qevolve.rollout import play
from tests.test_rollout import Corridor

MODEL = ModelConfig(lora={"r": 4, "alpha": 8})
OBS = [
    "You are in the middle of a room. You see a desk 1 and a shelf 2.",
    "You arrive at desk 1. On the desk 1, you see a book 1.",
    "Nothing happens.",
    "You pick up the book 1 from the desk 1.",
    "You arrive at shelf 2. On the shelf 2, you see nothing.",
]
ACTS = ["Action: go to desk 1", "Action: look", "Action: take book 1 from desk 1", "Action: go to shelf 2"]


def _conversations(builder):
    """Per turn, the prompts of three slots: two episodes of different lengths, one of which is truncated
    (the context budget is small), and a third that starts a new episode half-way."""
    turns = []
    for t in range(len(ACTS) + 1):
        a = builder.prompt("put some book on shelf.", OBS[: t + 1], ACTS[:t])
        b = builder.prompt("put some book on desk.", OBS[: max(1, t - 1)], ACTS[: max(0, t - 2)])
        c = builder.prompt("examine the book." if t < 3 else "put a book on shelf.", OBS[: t % 3 + 1], ACTS[: t % 3])
        turns.append([a, b, c])
    return turns


def test_cached_scores_and_generation_equal_full_reencoding(tiny_base):
    model, tok = load_policy(tiny_base, MODEL)
    builder = PromptBuilder(tok, 120)
    cands = [builder.action_ids(a) for a in ACTS]
    cached, full = (
        HFBackend(model.eval(), tok.pad_token_id, reuse=True, score_rows=3),
        HFBackend(model, tok.pad_token_id, reuse=False),
    )
    one_by_one = HFBackend(
        model, tok.pad_token_id, reuse=True, score_rows=1
    )  # each episode's candidates in a pass of its own

    def stop(toks):
        return len(toks) >= 5

    for prompts in _conversations(builder):
        want = full.score([0, 1, 2], prompts, [cands, cands[:2], cands[1:]])
        for backend in (cached, one_by_one):
            got = backend.score([0, 1, 2], prompts, [cands, cands[:2], cands[1:]])
            assert [len(g) for g in got] == [4, 2, 3]
            for g, w in zip(got, want):
                assert torch.allclose(g, w, atol=1e-4)
        kw = dict(max_new_tokens=6, stop=stop, greedy=True, temperature=1.0)
        assert [t for t, _ in cached.generate([0, 1, 2], prompts, **kw)] == [
            t for t, _ in full.generate([0, 1, 2], prompts, **kw)
        ]
    # the budget is small enough that the history is truncated (a cache miss after the shared head)
    assert _conversations(builder)[-1][0] != _conversations(PromptBuilder(tok, 4096))[-1][0]
    assert cached.encoded_tokens < full.encoded_tokens


def test_generation_stops_at_the_end_of_the_action_line(tiny_base):
    model, tok = load_policy(tiny_base, MODEL)
    actor = Actor(model, tok, PromptBuilder(tok, 256), "free", temperature=1.0, max_new_tokens=8)

    def enc(s):
        return tok.encode(s, add_special_tokens=False)

    assert actor.stop(enc("Thought: find the book.\nAction: go to desk 1\n"))
    assert not actor.stop(enc("Thought: find the book.\nAction: go to desk 1"))
    assert not actor.stop(enc("Action:\n"))
    assert actor.stop(enc("look") + PromptBuilder(tok, 256).end_ids)


def test_rollouts_take_the_same_greedy_actions_with_and_without_reuse(tiny_base):
    model, tok = load_policy(tiny_base, MODEL)
    outputs = []
    for mode in ("admissible", "free"):
        for reuse in (True, False):
            actor = Actor(model, tok, PromptBuilder(tok, 120), mode, 1.0, 6, reuse_cache=reuse)
            env = Corridor()
            trajs = play(
                lambda: env, env.tasks("valid_seen"), actor, max_steps=5, greedy=True, source="t", batch_size=2
            )
            outputs.append([[s.output for s in t.steps] for t in trajs])
    assert outputs[0] == outputs[1] and outputs[2] == outputs[3]


def test_scoring_makes_the_heads_logits_a_bounded_chunk_at_a_time(tiny_base):
    """`score` gathers each candidate token's logit and subtracts a log-sum-exp over chunks of scored positions:
    the logits it holds at once are `score_elements`, however many candidates and tokens, and the sums are
    those of the full log-softmax."""
    model, tok = load_policy(tiny_base, MODEL)
    builder = PromptBuilder(tok, 120)
    cands = [builder.action_ids(a) for a in ACTS] * 5  # 20 candidates
    prompts = _conversations(builder)[2]
    backend = HFBackend(model.eval(), tok.pad_token_id, reuse=False, score_rows=3)
    vocab = model.get_output_embeddings().out_features
    rows = []
    head = backend.head
    backend.head = lambda h: rows.append(h.shape[0]) or head(h)
    backend.score_elements = 4 * vocab
    got = backend.score([0, 1, 2], prompts, [cands, cands[:7], cands[3:]])
    scored = sum(len(c) for c in cands) + sum(len(c) for c in cands[:7]) + sum(len(c) for c in cands[3:])
    assert max(rows) == 4 and sum(rows) == scored + 1  # one pass: chunks of 4 positions, and one row for the size
    with torch.no_grad():  # the full (tokens, vocabulary) log-softmax, by hand
        hidden, layout, _, _ = backend._forward([0, 1, 2], prompts, [cands, cands[:7], cands[3:]])
        for b, ((s, starts), cs) in enumerate(zip(layout, [cands, cands[:7], cands[3:]])):
            for j, (start, c) in enumerate(zip(starts, cs)):
                logp = torch.log_softmax(head(hidden[b, [s - 1] + list(range(start, start + len(c) - 1))]).float(), -1)
                assert abs(float(logp[torch.arange(len(c)), torch.tensor(c)].sum()) - float(got[b][j])) < 1e-5
