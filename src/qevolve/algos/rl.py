"""The RL maths every method's stages share, pure torch, no I/O, no models: Q-Evolve's IQL critic, GAE and BPPO
(arXiv 2606.07367), AWR, the KL estimates, STEP-HRL's and Multi²'s advantage-weighted and anchored losses.

1-D tensors are per trajectory (index t = step). The critic, advantage and policy stages call these.
"""

from __future__ import annotations

import torch


def expectile_loss(diff: torch.Tensor, tau: float) -> torch.Tensor:
    """Mean of |tau - 1[diff < 0]| * diff**2 (IQL's asymmetric L2; tau > 0.5 fits an upper expectile).

    `diff` is target minus prediction, e.g. Q(s,a) - V(s) when fitting V."""
    return weighted_expectile(diff, tau).mean()


def weighted_expectile(diff: torch.Tensor, tau: float) -> torch.Tensor:
    """The elementwise terms of `expectile_loss`, for callers that weight them."""
    weight = torch.where(diff < 0, 1.0 - tau, tau)
    return weight * diff.pow(2)


def iql_losses(
    v_s: torch.Tensor,
    q_sa: torch.Tensor,
    q_target: torch.Tensor,
    v_next: torch.Tensor,
    rewards: torch.Tensor,
    not_done: torch.Tensor,
    weights: torch.Tensor,
    gamma: float,
    tau: float,
    norm: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted IQL losses over a batch of steps (every argument 1-D, one entry per step):
    V(s) by expectile regression towards the slow target Q(s, a), and Q(s, a) by TD regression towards
    r + gamma * V(s') (no bootstrap after a terminal step, `not_done` = 0). The targets get no gradient.
    Each is the weighted sum over the steps divided by `norm` (the weights' sum over the whole
    optimiser batch, so that micro-batches add up to its mean)."""
    v_loss = (weights * weighted_expectile(q_target.detach() - v_s, tau)).sum() / norm
    td_target = rewards + gamma * not_done * v_next.detach()
    q_loss = (weights * (td_target - q_sa).pow(2)).sum() / norm
    return v_loss, q_loss


def step_weights(T: int, success: bool, progress: float = 0.5, floor: float = 0.5) -> torch.Tensor:
    """Per-step IQL weights w_t = progress * (t/T + d) + floor for t = 1..T, with d = 1 on success.

    Q-Evolve weights its critic's losses so that steps of successful trajectories (d = 1) and steps near
    the end of a trajectory (t/T close to 1) count more. Late steps carry the clearest evidence of whether
    the episode is being won, and successful trajectories are rare early in self-evolution, so an
    unweighted critic is dominated by long failed episodes; the paper's ablation ("unweighted IQL",
    87.9/86.6 -> 83.6/76.1 on ALFWorld seen/unseen) shows the loss. The default (0.5, 0.5) gives weights
    in (0.5, 1] for a failure and (1, 1.5] for a success. `progress = 0` with `floor = 1` is uniform.
    """
    if T < 1:
        raise ValueError(f"step_weights: T must be >= 1, got {T}")
    t = torch.arange(1, T + 1, dtype=torch.float32)
    return progress * (t / T + float(success)) + floor


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Generalised advantage estimates A_t = sum_l (gamma*lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t.

    rewards: T entries; values: T+1 entries, the last being the bootstrap value (0 after a terminal step).
    """
    T = rewards.shape[0]
    if values.shape[0] != T + 1:
        raise ValueError(f"gae_advantages: values needs T+1 = {T + 1} entries, got {values.shape[0]}")
    deltas = rewards + gamma * values[1:] - values[:-1]
    out = torch.empty_like(deltas)
    running = torch.zeros((), dtype=deltas.dtype)
    for t in range(T - 1, -1, -1):
        running = deltas[t] + gamma * lam * running
        out[t] = running
    return out


def bppo_loss(
    logp_new: torch.Tensor, logp_behavior: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> torch.Tensor:
    """Negative mean of min(ratio*A, clip(ratio, 1-clip_low, 1+clip_high)*A), ratio = exp(logp_new - logp_behavior).

    PPO's clipped surrogate with the behaviour policy as the reference (BPPO). Asymmetric clipping,
    clip_low > clip_high, lets a negative advantage push an action's probability down further than a
    positive one can pull it up."""
    ratio = torch.exp(logp_new - logp_behavior)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -torch.minimum(ratio * advantages, clipped * advantages).mean()


def clip_fraction(
    logp_new: torch.Tensor, logp_behavior: torch.Tensor, clip_low: float, clip_high: float
) -> torch.Tensor:
    """Share of samples whose ratio lies outside [1-clip_low, 1+clip_high]."""
    ratio = torch.exp(logp_new - logp_behavior)
    return ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float().mean()


def awr_loss(logp_new: torch.Tensor, advantages: torch.Tensor, beta: float, max_weight: float) -> torch.Tensor:
    """Advantage-weighted regression: -mean(min(exp(A/beta), max_weight) * logp_new). Weights are > 0,
    so AWR can only pull probability towards actions, never push it away (the ablation to BPPO)."""
    weights = torch.exp(advantages / beta).clamp(max=max_weight)
    return -(weights.detach() * logp_new).mean()


def update_weights(advantages: torch.Tensor, algo: str, awr_beta: float, awr_max_weight: float) -> torch.Tensor:
    """Each step's weight on its log-likelihood's gradient at ratio 1, where behaviour cloning's is 1: BPPO's
    advantage (its clipped surrogate's gradient there is A·∇log π), AWR's min(exp(A/β), max_weight)."""
    if algo == "awr":
        return torch.exp(advantages / awr_beta).clamp(max=awr_max_weight)
    return advantages


def off_one_share(weights: torch.Tensor, tokens: torch.Tensor, tolerance: float = 0.1) -> float:
    """The share of `tokens` (per step: its action's token count) whose step's weight is more than `tolerance`
    from behaviour cloning's 1: near 0, the update is behaviour cloning by another name."""
    tokens = tokens.float()
    return float(tokens[(weights - 1).abs() > tolerance].sum() / tokens.sum()) if tokens.sum() > 0 else float("nan")


def policy_loss(
    logp_new: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    token_logp_new: torch.Tensor,
    token_logp_ref: torch.Tensor,
    *,
    algo: str,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    awr_beta: float,
    awr_max_weight: float,
    step_share: float,
    token_share: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch's share of the policy update's loss: (loss, policy-gradient term, KL term).

    loss = step_share * PG + kl_coef * token_share * KL, PG being `bppo_loss` (Q-Evolve) or `awr_loss`
    (the ablation) over the micro-batch's action steps and KL `kl_to_reference` over their tokens;
    `step_share` and `token_share` are the micro-batch's shares of the optimiser batch's steps and
    tokens, so the micro-batches' losses add up to the batch's mean over steps and over tokens."""
    if algo == "bppo":
        pg = bppo_loss(logp_new, logp_behavior, advantages, clip_low, clip_high)
    elif algo == "awr":
        pg = awr_loss(logp_new, advantages, awr_beta, awr_max_weight)
    else:
        raise ValueError(f"policy_loss: unknown algo {algo!r}; expected bppo or awr")
    kl = kl_to_reference(token_logp_new, token_logp_ref)
    return pg * step_share + kl_coef * kl * token_share, pg, kl


def kl_to_reference(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """KL(ref || new) estimated on tokens the reference sampled: the mean of Schulman's non-negative,
    unbiased k3 = r - 1 - log r, r = new/ref = exp(logp_new - logp_ref).

    The policy's own rollouts were sampled by the reference (the previous policy, or GRPO's round
    policy), so it is their sampling distribution; on expert steps this is a penalty of the same form,
    not an estimate. (The other form, ref/new - 1 - log(ref/new), is k3 only for tokens the new policy
    sampled; on the reference's tokens it estimates chi^2(ref || new) - KL(ref || new), which explodes on
    any token an update pushed far down.)"""
    d = logp_new - logp_ref
    return (torch.exp(d) - 1.0 - d).mean()


def advantage_pg_loss(logp_new: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """-mean(A * logp_new): what the public STEP-HRL code's actor minimises (raw, unclipped advantages, so a
    negative one pushes probability away), in place of the paper's AWR (`awr_loss`)."""
    return -(advantages.detach() * logp_new).mean()


def anchored_awr_loss(
    logp_data: torch.Tensor,
    adv_data: torch.Tensor,
    logp_pi: torch.Tensor,
    adv_pi: torch.Tensor,
    *,
    beta: float,
    max_weight: float,
    lam: float,
    relu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi²'s offline actor (arXiv 2606.03698): (loss, AWR term, anchored term), loss = AWR - lam * anchored.

    AWR = -mean(min(exp(beta * A(o, a)), max_weight) * log pi(a | o)) over dataset actions a; anchored =
    mean(A(o, â) * log pi(â | o)) over actions â the current policy sampled, scored by the critic: the
    policy-anchored advantage E_{â~pi}[A(o, â)], whose gradient for text actions is the score function
    E[A(o, â) grad log pi(â | o)]. Advantages get no gradient. `relu`: only positive A(o, â) count (the
    public code's version of the term, which its release never runs)."""
    weights = torch.exp(beta * adv_data).clamp(max=max_weight)
    awr = -(weights.detach() * logp_data).mean()
    anchor = (adv_pi.clamp(min=0) if relu else adv_pi).detach()
    anchored = (anchor * logp_pi).mean()
    return awr - lam * anchored, awr, anchored


def kl_on_policy(logp_policy: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """KL(policy || ref) estimated on tokens the policy sampled: the mean of k3 = r - 1 - log r with
    r = ref/policy = exp(logp_ref - logp_policy) (non-negative, unbiased on the policy's own samples; the
    form GRPO uses). `kl_to_reference` is the other direction, for tokens the reference sampled."""
    d = logp_ref - logp_policy
    return (torch.exp(d) - 1.0 - d).mean()


def awac_kl_loss(
    logp: torch.Tensor,
    adv: torch.Tensor,
    token_logp: torch.Tensor,
    token_logp_ref: torch.Tensor,
    *,
    alpha: float,
    max_weight: float,
    eta: float,
    first_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi²'s online actor: (loss, weighted term, KL term), loss = -mean(w * log pi_on(a)) + eta * KL with
    w = min(exp(A / alpha), max_weight) per action and the KL `kl_on_policy` over the actions' tokens against
    the frozen offline policy. `first_order`: the public code's "KL", mean(log pi_on - log pi_off) on the
    tokens (its gradient lowers every weight by eta: not a divergence)."""
    weights = torch.exp(adv / alpha).clamp(max=max_weight)
    weighted = -(weights.detach() * logp).mean()
    kl = (token_logp - token_logp_ref).mean() if first_order else kl_on_policy(token_logp, token_logp_ref)
    return weighted + eta * kl, weighted, kl
