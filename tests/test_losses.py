import math

import torch

from qevolve.algos.losses import masked_nll, token_logprobs


def test_masked_nll_hand_computed():
    # vocabulary of 2; logits make p(token 1) = e/(1+e) at every position.
    logits = torch.tensor([[[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]])
    ids = torch.tensor([[0, 1, 0]])
    mask = torch.tensor([[0, 1, 1]])
    p1 = math.e / (1 + math.e)
    expected = -(math.log(p1) + math.log(1 - p1)) / 2
    assert abs(float(masked_nll(token_logprobs(logits, ids), mask)) - expected) < 1e-6
    # Only the masked target counts: masking the last token leaves log p(1).
    assert abs(float(masked_nll(token_logprobs(logits, ids), torch.tensor([[0, 1, 0]]))) + math.log(p1)) < 1e-6


def test_token_logprobs_shape_and_values():
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    lp = token_logprobs(logits, ids)
    assert lp.shape == (2, 4)
    assert torch.allclose(lp[1, 2], torch.log_softmax(logits[1, 2], -1)[ids[1, 3]])


def test_head_logprobs_in_chunks_equal_the_full_log_softmax_in_value_and_gradient():
    from qevolve.algos.losses import head_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11)
    hidden = torch.randn(23, 8, requires_grad=True)
    targets = torch.randint(0, 11, (23,))
    full = torch.log_softmax(head(hidden).float(), -1).gather(-1, targets[:, None])[:, 0]
    (g_full,) = torch.autograd.grad(full.sum(), hidden)
    chunked = head_logprobs(
        hidden, head, targets, chunk_elements=5 * 11
    )  # 5 positions a chunk: 5 chunks, the last of 3
    (g_chunked,) = torch.autograd.grad(chunked.sum(), hidden)
    assert torch.allclose(chunked, full, atol=1e-6) and torch.allclose(g_chunked, g_full, atol=1e-6)
    assert head_logprobs(hidden[:0], head, targets[:0]).shape == (0,)


def test_target_logprobs_equal_the_models_own_at_the_targets_and_keep_no_full_logits(tiny_base):
    from qevolve.config import ModelConfig
    from qevolve.models.base import target_logprobs
    from qevolve.models.policy import load_policy

    model, _ = load_policy(tiny_base, ModelConfig(lora={"r": 4, "alpha": 8}))
    ids = torch.randint(5, 300, (3, 17))
    attn = torch.ones_like(ids)
    attn[2, 12:] = 0
    mask = torch.zeros_like(ids)
    mask[:, 6:12] = 1
    ways = {
        "plain": lambda: token_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids) * mask[:, 1:],
        "chunked": lambda: target_logprobs(model, ids, mask, attention_mask=attn),
    }
    values, grads = {}, {}
    for name, way in ways.items():
        model.zero_grad()
        values[name] = way()
        values[name].sum().backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert torch.allclose(values["chunked"], values["plain"], atol=1e-5)
    assert grads["plain"].keys() == grads["chunked"].keys() and len(grads["plain"]) > 0
    assert all(torch.allclose(grads["plain"][n], grads["chunked"][n], atol=1e-5) for n in grads["plain"])
    # the head is never run over the whole (B, T, V) output: only at the 3 x 6 target positions
    seen = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    target_logprobs(model, ids, mask, attention_mask=attn)
    handle.remove()
    assert sum(s[0] for s in seen[1:]) == 18 and all(len(s) == 2 for s in seen)
