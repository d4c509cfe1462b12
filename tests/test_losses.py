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
    assert abs(float(masked_nll(logits, ids, mask)) - expected) < 1e-6
    # Only the masked target counts: masking the last token leaves log p(1).
    assert abs(float(masked_nll(logits, ids, torch.tensor([[0, 1, 0]]))) + math.log(p1)) < 1e-6


def test_token_logprobs_shape_and_values():
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    lp = token_logprobs(logits, ids)
    assert lp.shape == (2, 4)
    assert torch.allclose(lp[1, 2], torch.log_softmax(logits[1, 2], -1)[ids[1, 3]])
