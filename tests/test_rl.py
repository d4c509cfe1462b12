"""The Q-Evolve maths against values worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from qevolve.algos.rl import (
    anchored_awr_loss,
    awac_kl_loss,
    awr_loss,
    bppo_loss,
    clip_fraction,
    expectile_loss,
    gae_advantages,
    iql_losses,
    kl_on_policy,
    kl_to_reference,
    policy_loss,
    step_weights,
)


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


def test_expectile_loss():
    # tau = 0.7: positive diff 1 weighs 0.7 * 1; negative diff -2 weighs 0.3 * 4 = 1.2; mean 0.95.
    assert close(expectile_loss(torch.tensor([1.0, -2.0]), 0.7), 0.95)
    # tau = 0.5 is half the squared error; zero diff costs nothing.
    assert close(expectile_loss(torch.tensor([2.0, 0.0]), 0.5), (0.5 * 4 + 0) / 2)
    # Single element.
    assert close(expectile_loss(torch.tensor([-1.0]), 0.9), 0.1)


def test_step_weights():
    # t/T = .25 .5 .75 1; success: 0.5*(t/T + 1) + 0.5; failure: 0.5*t/T + 0.5.
    assert close(step_weights(4, True), [1.125, 1.25, 1.375, 1.5])
    assert close(step_weights(4, False), [0.625, 0.75, 0.875, 1.0])
    # T = 1: the only step is the last one.
    assert close(step_weights(1, True), [1.5])
    assert close(step_weights(1, False), [1.0])
    # Uniform weighting for the ablation.
    assert close(step_weights(3, True, progress=0.0, floor=1.0), [1.0, 1.0, 1.0])
    with pytest.raises(ValueError):
        step_weights(0, True)


def test_gae_advantages():
    # gamma .9, lam .8 (gamma*lam = .72); values end with a terminal bootstrap of 0.
    # deltas: 0 + .9*.6 - .5 = .04; 0 + .9*.8 - .6 = .12; 1 + .9*0 - .8 = .2
    # A2 = .2; A1 = .12 + .72*.2 = .264; A0 = .04 + .72*.264 = .23008
    adv = gae_advantages(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.6, 0.8, 0.0]), 0.9, 0.8)
    assert close(adv, [0.23008, 0.264, 0.2])


def test_gae_edge_cases():
    # T = 1, terminal: A = r - V.
    assert close(gae_advantages(torch.tensor([1.0]), torch.tensor([0.3, 0.0]), 0.9, 0.95), [0.7])
    # All-zero rewards and values: all-zero advantages.
    assert close(gae_advantages(torch.zeros(4), torch.zeros(5), 0.99, 0.95), torch.zeros(4))
    # All-zero rewards, non-terminal bootstrap .5: A = .9*.5 - .2 = .25.
    assert close(gae_advantages(torch.tensor([0.0]), torch.tensor([0.2, 0.5]), 0.9, 0.95), [0.25])
    # lam = 1 gives the discounted return minus V: returns 0.81, 0.9, 1 minus V .1 .2 .3.
    adv = gae_advantages(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.1, 0.2, 0.3, 0.0]), 0.9, 1.0)
    assert close(adv, [0.71, 0.7, 0.7])
    with pytest.raises(ValueError):
        gae_advantages(torch.zeros(3), torch.zeros(3), 0.9, 0.9)


def test_bppo_loss_clips_on_both_sides():
    # clip_low .2, clip_high .1 -> ratios are clipped into [0.8, 1.1].
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0])
    # min(r*A, clip(r)*A): min(1.5, 1.1)=1.1; min(-1.5,-1.1)=-1.5; min(.5,.8)=.5; min(-.5,-.8)=-.8; 2
    # mean = (1.1 - 1.5 + .5 - .8 + 2) / 5 = .26 -> loss -.26
    logp_b = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.2])
    logp_new = (logp_b + ratio.log()).requires_grad_()
    loss = bppo_loss(logp_new, logp_b, adv, 0.2, 0.1)
    assert close(loss, -0.26)
    loss.backward()
    # d/dlogp of -r*A/5 where the unclipped branch is the min, 0 where the clipped constant is:
    # 0; -(1.5 * -1)/5 = .3; -(.5 * 1)/5 = -.1; 0; -(1 * 2)/5 = -.4
    assert close(logp_new.grad, [0.0, 0.3, -0.1, 0.0, -0.4], 1e-5)
    assert close(clip_fraction(logp_new.detach(), logp_b, 0.2, 0.1), 0.8)


def test_bppo_at_ratio_one_is_minus_mean_advantage():
    adv = torch.tensor([0.5, -1.5, 2.0])
    lp = torch.tensor([-1.0, -2.0, -3.0])
    assert close(bppo_loss(lp, lp, adv, 0.2, 0.1), -1.0 / 3)


def test_awr_loss():
    # beta 1: weights exp(0)=1, exp(ln 2)=2; -mean(1*-1, 2*-2) = 2.5; capped at 1.5: -mean(-1, -3) = 2.
    adv, lp = torch.tensor([0.0, math.log(2)]), torch.tensor([-1.0, -2.0])
    assert close(awr_loss(lp, adv, 1.0, 10.0), 2.5)
    assert close(awr_loss(lp, adv, 1.0, 1.5), 2.0)


def test_kl_to_reference():
    lp = torch.tensor([-1.0, -2.0])
    assert close(kl_to_reference(lp, lp), 0.0)
    # new = 1/2, ref = 1: r = 1/2, r - 1 - ln r = ln 2 - 1/2.
    assert close(kl_to_reference(torch.tensor([-math.log(2)]), torch.tensor([0.0])), math.log(2) - 0.5)


def test_kl_to_reference_is_unbiased_on_the_reference_tokens():
    # Two tokens, ref = (0.9, 0.1), new = (0.5, 0.5); 9 copies of the first and 1 of the second are the
    # reference's distribution exactly. KL(ref || new) = 0.9 ln 1.8 + 0.1 ln 0.2 = 0.529008 - 0.160944.
    ref = torch.tensor([math.log(0.9)] * 9 + [math.log(0.1)])
    new = torch.tensor([math.log(0.5)] * 10)
    assert close(kl_to_reference(new, ref), 0.368064, tol=1e-5)


def test_relabel_rules_first_match_wins():
    from qevolve.algos.relabel import relabel_step
    from qevolve.methods.qevolve.config import RelabelConfig

    cfg = RelabelConfig(format_penalty=0.3, rejected_penalty=0.2, unchanged_penalty=0.1)
    assert relabel_step(None, False, "a", "a", cfg) == (-0.3, "format")
    assert relabel_step("open door", False, "a", "Nothing happens.", cfg) == (-0.2, "rejected")
    assert relabel_step("look", True, "You are in a room.", "You are in  a room.\n", cfg) == (-0.1, "unchanged")
    assert relabel_step("go to desk 1", True, "a", "You arrive at desk 1.", cfg) == (0.0, "")


def test_iql_losses():
    # V: diff = Q_target - V = [1, -1]; expectile terms (tau .7) [.7 * 1, .3 * 1]; weighted [.7, .15]; / 1.5 = .566667.
    # Q: TD target = [0 + .9 * 1 * 3, 1 + .9 * 0 * 5] = [2.7, 1]; squared errors [1.2^2, 0] = [1.44, 0]; / 1.5 = .96.
    v_s = torch.tensor([1.0, 2.0], requires_grad=True)
    q_sa = torch.tensor([1.5, 1.0], requires_grad=True)
    q_target = torch.tensor([2.0, 1.0], requires_grad=True)
    v_next = torch.tensor([3.0, 5.0], requires_grad=True)
    v_loss, q_loss = iql_losses(
        v_s,
        q_sa,
        q_target,
        v_next,
        torch.tensor([0.0, 1.0]),
        torch.tensor([1.0, 0.0]),
        torch.tensor([1.0, 0.5]),
        gamma=0.9,
        tau=0.7,
        norm=1.5,
    )
    assert close(v_loss, 0.85 / 1.5) and close(q_loss, 0.96)
    (v_loss + q_loss).backward()
    assert q_target.grad is None and v_next.grad is None  # targets get no gradient
    # dV: -2 * w * |tau - 1[diff<0]| * diff / norm = [-2 * .7 * 1, -2 * .5 * .3 * -1] / 1.5 = [-.933333, .2]
    assert close(v_s.grad, [-1.4 / 1.5, 0.3 / 1.5])


def test_policy_loss_compositions():
    # Ratios [1.5, .5], A = [1, -1], clip [.8, 1.1]: min(1.5, 1.1) = 1.1, min(-.5, -.8) = -.8;
    # PG = -(1.1 - .8)/2 = -.15.
    # KL: one token, new .5 against ref .25: r = 2, k3 = 2 - 1 - ln 2 = .306853.
    # loss = .5 * -.15 + .1 * .25 * .306853 = -.075 + .007671 = -.067329.
    logp_new = torch.log(torch.tensor([1.5, 0.5]))
    args = (
        logp_new,
        torch.zeros(2),
        torch.tensor([1.0, -1.0]),
        torch.log(torch.tensor([0.5])),
        torch.log(torch.tensor([0.25])),
    )
    common = dict(
        clip_low=0.2, clip_high=0.1, kl_coef=0.1, awr_beta=1.0, awr_max_weight=20.0, step_share=0.5, token_share=0.25
    )
    loss, pg, kl = policy_loss(*args, algo="bppo", **common)
    assert close(pg, -0.15) and close(kl, 2 - 1 - math.log(2)) and close(loss, -0.075 + 0.1 * 0.25 * (1 - math.log(2)))
    # AWR: weights e^1, e^-1; PG = -(e * ln 1.5 + e^-1 * ln .5) / 2 = -(1.102170 - .254995) / 2 = -.423588.
    loss, pg, _ = policy_loss(*args, algo="awr", **common)
    assert close(pg, -0.423588, tol=1e-5) and close(loss, 0.5 * pg + 0.1 * 0.25 * (1 - math.log(2)))
    with pytest.raises(ValueError, match="unknown algo"):
        policy_loss(*args, algo="ppo", **common)


def test_anchored_awr_loss_hand_computed():
    logp_data, adv_data = torch.tensor([-1.0, -2.0]), torch.tensor([0.1, -0.2])
    logp_pi = torch.tensor([-0.5, -3.0], requires_grad=True)
    adv_pi = torch.tensor([0.3, -0.1])
    # beta 10: weights e^1 = 2.718282, e^-2 = 0.135335 (under the clip 20);
    # AWR = (2.718282 * 1 + 0.135335 * 2) / 2 = 1.494476
    # anchored = mean(0.3 * -0.5, -0.1 * -3) = (-0.15 + 0.3) / 2 = 0.075; loss = 1.494476 - 7 * 0.075 = 0.969476
    loss, awr, anchored = anchored_awr_loss(logp_data, adv_data, logp_pi, adv_pi, beta=10.0, max_weight=20.0, lam=7.0)
    assert close(awr, 1.494476) and close(anchored, 0.075) and close(loss, 0.969476)
    # the anchored term's gradient is the score function: d loss / d logp(â) = -lam * A(â) / n = -7 * [0.3, -0.1] / 2
    loss.backward()
    assert close(logp_pi.grad, [-1.05, 0.35])
    # relu: the negative A(â) drops out, anchored = -0.15 / 2 = -0.075, loss = 1.494476 + 0.525
    loss, _, anchored = anchored_awr_loss(
        logp_data, adv_data, logp_pi, adv_pi, beta=10.0, max_weight=20.0, lam=7.0, relu=True
    )
    assert close(anchored, -0.075) and close(loss, 2.019476)
    # the clip: max_weight 2 caps e^1, AWR = (2 * 1 + 0.135335 * 2) / 2 = 1.135335; lam 0 leaves AWR alone
    loss, awr, _ = anchored_awr_loss(logp_data, adv_data, logp_pi, adv_pi, beta=10.0, max_weight=2.0, lam=0.0)
    assert close(awr, 1.135335) and close(loss, 1.135335)


def test_kl_on_policy_hand_computed_and_unbiased():
    # d = ref - policy = [log 0.5, 0]: k3 = (0.5 - 1 - log 0.5, 0) -> mean (0.193147 + 0) / 2 = 0.096574
    assert close(kl_on_policy(torch.log(torch.tensor([0.8, 0.3])), torch.log(torch.tensor([0.4, 0.3]))), 0.096574)
    # on samples drawn in the policy's own proportions (7, 2 and 1 of 10 of its three outcomes): exactly KL(p || q)
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.2, 0.5, 0.3])
    drawn = torch.tensor([0] * 7 + [1] * 2 + [2])
    # KL = 0.7 log 3.5 + 0.2 log 0.4 + 0.1 log(1/3) = 0.876934 - 0.183258 - 0.109861 = 0.583815
    assert close(kl_on_policy(p.log()[drawn], q.log()[drawn]), 0.583815)


def test_awac_kl_loss_hand_computed():
    logp, adv = torch.tensor([-1.0, -4.0]), torch.tensor([0.5, -0.5])
    tok, ref = torch.log(torch.tensor([0.8, 0.3])), torch.log(torch.tensor([0.4, 0.3]))
    # alpha 1: w = e^0.5 = 1.648721, e^-0.5 = 0.606531; weighted = (1.648721 + 4 * 0.606531) / 2 = 2.037426
    # KL (k3) = 0.096574 (above); loss = 2.037426 + 0.02 * 0.096574 = 2.039357
    loss, weighted, kl = awac_kl_loss(logp, adv, tok, ref, alpha=1.0, max_weight=20.0, eta=0.02)
    assert close(weighted, 2.037426) and close(kl, 0.096574) and close(loss, 2.039357)
    # the public code's first-order "KL": mean(log 0.8 - log 0.4, 0) = log 2 / 2 = 0.346574
    _, _, kl = awac_kl_loss(logp, adv, tok, ref, alpha=1.0, max_weight=20.0, eta=0.02, first_order=True)
    assert close(kl, 0.346574)
