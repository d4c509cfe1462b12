"""`online@k` (Multi², k >= 2): System 2's online refinement with System 1 frozen (arXiv 2606.03698, Phase 3).

Rounds of: play `episodes_per_round` hierarchical episodes on train tasks with the current policy
(sampling), cut them into System 2's subgoal segments (the environment's rewards; a segment ends at its
subgoal's end; under `multi2.reward: outcome` only the episode's end is, and only a won episode's last step
is rewarded), push them into the replay buffer (FIFO, `buffer_size` segments; a failed segment, return <= 0,
or under `outcome` one of a lost episode, is kept with probability `keep_fail_ratio`), then
`updates_per_round` updates on batches of the buffer's transitions, each a critic step (Q toward
r + gamma V(s'), V by expectile toward the target Q, then the target's Polyak step) and an actor step on
`qevolve.algos.rl.awac_kl_loss`: -mean(min(exp(A / alpha), max_weight) log pi_on(a)) + eta KL(pi_on || pi_off),
A = Q - V from the critic, the KL (k3) on the actions' tokens against the offline policy `policy@1`, loaded
as one more adapter on the same base (no second model in memory).

The buffer is an artifact (`data/buffer@k`, a transition store of System 2's segments): iteration 2 seeds
it with the expert segments of won trajectories (`annotate`'s, their 0/1 subgoal rewards), later
iterations carry `buffer@(k-1)` over. The iteration stops at the round boundary nearest
`multi2.online.env_steps`. After each round the adapters, the critic, the buffer, the counters and the
random states are checkpointed, so a killed stage resumes at its round to a bit-identical result.

`multi2.repo_compat`: the critic is heads on System 2's own features (`qevolve.methods.multi2.compat`),
batches are whole segments, A = Q_target minus its segment's mean and the "KL" first-order (`update`).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from qevolve.algos.rl import awac_kl_loss, iql_losses
from qevolve.data.atomic import atomic_path, write_json
from qevolve.envs import make_env, select_tasks
from qevolve.errors import artifact
from qevolve.hierarchy.critic import LevelCritic, critic_items, load_critic, load_heads, save_critic, values
from qevolve.hierarchy.roles import Transition, encode, transitions
from qevolve.hierarchy.shared import (
    ROLES_FILE,
    agent_of,
    read_roles,
    role_builder,
    role_names,
    save_roles_policy,
    with_rewards,
)
from qevolve.hierarchy.transitions import read_transitions, write_transitions
from qevolve.methods.multi2.compat import on_actor
from qevolve.models.base import target_logprobs
from qevolve.models.device import pad_ids, placement
from qevolve.models.policy import load_policy, use_adapter
from qevolve.params import Params
from qevolve.rollout import another_round, count_round, online_metrics, play_in
from qevolve.training import changing_tensors, checkpoint_path, fingerprint, input_digest, load_round, trained_state

LEVEL, ANCHOR = "low", "anchor"
"""System 2's role, and the name of the frozen offline adapter the KL is measured against."""


def segments(rows: list[dict]) -> list[list[dict]]:
    """Transitions grouped into their segments (trajectory, subgoal), in order."""
    out: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        out.setdefault((r["trajectory_id"], r["subtask_index"]), []).append(r)
    return list(out.values())


def online_segments(traj, labels, prompts) -> list[list[Transition]]:
    """System 2's segments of an episode it played, with the environment's rewards."""
    low = transitions(traj, labels, prompts, rejected_penalty=0.0)["low"]
    for x in low:
        x.reward = traj.steps[x.step].reward
    grouped: dict[int, list[Transition]] = {}
    for x in low:
        grouped.setdefault(x.subtask_index, []).append(x)
    return list(grouped.values())


def succeeded(segment: list[dict], outcome: bool = False) -> bool:
    """A segment counts as a success: its return is positive, or under `reward: outcome` (where only an
    episode's last step is rewarded) its episode was won."""
    return segment[0]["won"] if outcome else sum(r["reward"] for r in segment) > 0


def push(
    buffer: list[list[dict]],
    new: list[list[dict]],
    size: int,
    keep_fail: float,
    rng: random.Random,
    outcome: bool = False,
) -> int:
    """Append the segments worth keeping (every `succeeded` one, a failed one with probability `keep_fail`),
    dropping the oldest past `size`; how many were kept."""
    kept = [seg for seg in new if succeeded(seg, outcome) or rng.random() < keep_fail]
    buffer += kept
    del buffer[: max(0, len(buffer) - size)]
    return len(kept)


def load_buffer(seed_dir: Path, iteration: int, size: int, reward: str = "subgoal") -> list[list[dict]]:
    """Iteration 2: the won expert segments of `annotate` (at most `size`), their rewards those of `reward`
    (`multi2.reward`); later: `buffer@(k-1)`."""
    rows = read_transitions(seed_dir)[LEVEL]
    if iteration == 2:
        return segments(with_rewards({LEVEL: [r for r in rows if r["won"]]}, reward)[LEVEL])[:size]
    return segments(rows)


def segment_batch(buffer: list[list[dict]], size: int, rng: random.Random) -> list[dict]:
    """`repo_compat`'s batch: whole segments drawn at random until they hold `size` transitions or the buffer is
    spent."""
    batch = []
    for seg in rng.sample(buffer, len(buffer)):
        if len(batch) >= size:
            break
        batch += seg
    return batch


def segment_centred(q: torch.Tensor, batch: list[dict]) -> torch.Tensor:
    """The public code's online advantage: each transition's `q` minus the mean `q` of its segment in the batch."""
    keys = [(r["trajectory_id"], r["subtask_index"]) for r in batch]
    index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    group = torch.tensor([index[k] for k in keys], device=q.device)
    means = torch.zeros(len(index), device=q.device, dtype=q.dtype).index_add_(0, group, q) / torch.bincount(group).to(
        q.dtype
    )
    return q - means[group]


def update(
    model,
    critic: LevelCritic,
    batch: list[dict],
    builder,
    cfg,
    critic_cfg,
    optimizers,
    pad_id: int,
    compat: bool = False,
) -> dict:
    """One critic step (`critic_cfg`: gamma, expectile, target rate) and one actor step (`cfg`, the online
    section) on `batch`, transitions of System 2. `compat` (`multi2.repo_compat`; the critic's heads on
    System 2's own features): the critic's gradients reach System 2's adapter and its actor step applies
    them, V is read at the action's end, A = Q_target minus its segment's mean, and the "KL" is first-order."""
    actor_opt, critic_opt = optimizers
    if compat:
        use_adapter(model, LEVEL)
        actor_opt.zero_grad(set_to_none=True)  # not again before the actor's backward: the critic's gradients stay
    mb = critic_items(builder, {LEVEL: batch}, action_end=compat)
    x = values(critic, mb, pad_id)
    device = x["v"].device
    rewards = torch.tensor([it.reward for it in mb], device=device)
    not_done = torch.tensor([0.0 if it.done else 1.0 for it in mb], device=device)
    v_loss, q_loss = iql_losses(
        x["v"],
        x["q"],
        x["q_target"],
        x["v_next"],
        rewards,
        not_done,
        torch.ones_like(rewards),
        critic_cfg.gamma,
        critic_cfg.expectile,
        len(batch),
    )
    critic_opt.zero_grad(set_to_none=True)
    (v_loss + q_loss).backward()
    critic_opt.step()
    critic.update_target(critic_cfg.target_rate)
    adv = (segment_centred(x["q_target"], batch) if compat else x["q"] - x["v"]).detach()

    encoded = [encode(builder, r["state_text"], r["output_text"]) for r in batch]
    ids, attn = pad_ids([i for i, _ in encoded], pad_id, device)
    mask, _ = pad_ids([m for _, m in encoded], 0, device)
    target = mask[:, 1:].bool()
    with torch.no_grad():
        use_adapter(model, ANCHOR)
        ref = target_logprobs(model, ids, mask, attention_mask=attn)[target]
    use_adapter(model, LEVEL)
    tok_logp = target_logprobs(model, ids, mask, attention_mask=attn)
    seq = (tok_logp * target).sum(-1) / target.sum(-1).clamp(min=1)
    loss, weighted, kl = awac_kl_loss(
        seq, adv, tok_logp[target], ref, alpha=cfg.alpha, max_weight=cfg.max_weight, eta=cfg.eta, first_order=compat
    )
    if not compat:
        actor_opt.zero_grad(set_to_none=True)
    loss.backward()
    actor_opt.step()
    weights = torch.exp(adv / cfg.alpha).clamp(max=cfg.max_weight)
    return {
        "loss": loss.item(),
        "weighted": weighted.item(),
        "kl": kl.item(),
        "v_loss": v_loss.item(),
        "q_loss": q_loss.item(),
        "advantage": adv.mean().item(),
        "weight_clipped": (weights >= cfg.max_weight).float().mean().item(),
    }


def online(
    params: Params,
    base_dir: Path,
    previous_dir: Path,
    anchor_dir: Path,
    critic_dir: Path,
    seed_dir: Path,
    out: Path,
    critic_out: Path,
    buffer_out: Path,
    metrics_path: Path,
    curve_path: Path,
    iteration: int,
    previous_metrics: Path,
) -> dict:
    hrl, env_cfg = params.multi2, params.env
    cfg, compat = hrl.online, hrl.repo_compat
    roles = read_roles(previous_dir)
    model, tok, critic = _online_models(params, base_dir, previous_dir, anchor_dir, critic_dir, roles)
    builder = role_builder(params, tok)
    outcome = hrl.reward == "outcome"
    buffer = load_buffer(seed_dir, iteration, cfg.buffer_size, hrl.reward)
    rng = random.Random(cfg.seed + 1000 * iteration)
    torch.manual_seed(cfg.seed + 1000 * iteration)
    ckpt = checkpoint_path(out)
    key = fingerprint(
        iteration,
        params.model_dump(include={"env", "model", "policy", "multi2"}),
        input_digest(previous_dir, anchor_dir, critic_dir, seed_dir),
    )
    state = {
        "round": 0,
        "env_steps": 0,
        "tokens": 0,
        "generated_tokens": 0,
        "episodes": 0,
        "won": 0,
        "kept": 0,
        "curve": [],
        "fingerprint": key,
    }
    trained = changing_tensors(model)
    critic_trained = {
        n for n in changing_tensors(critic) if not (compat and n.startswith("lm."))
    }  # under compat, `lm` is the actor
    if saved := load_round(ckpt, key, f"online@{iteration}"):
        model.load_state_dict(saved.pop("model"), strict=False)
        critic.load_state_dict(saved.pop("critic"), strict=False)
        buffer = saved.pop("buffer")
        rng.setstate(saved.pop("rng"))
        torch.set_rng_state(saved.pop("torch_rng"))
        state = saved
    lister = make_env(env_cfg)
    start = time.perf_counter()
    while another_round(state["env_steps"], cfg.env_steps, state["round"]):
        r = state["round"]
        seed = cfg.seed + 1000 * iteration + r
        agent = agent_of(params, model, tok, True, roles, params.policy.temperature)
        tasks = select_tasks(lister, "train", env_cfg, cfg.episodes_per_round, seed)
        trajs = play_in(
            env_cfg,
            tasks,
            agent,
            greedy=False,
            source=f"policy@{iteration - 1}",
            batch_size=len(tasks),
            seed=seed,
            desc=f"online@{iteration} round {r + 1}",
        )
        trajs = count_round(state, trajs, env_cfg, f"online@{iteration}")
        new = []
        for t in (t for t in trajs if t.steps):
            rows = [
                {**vars(x), "level": LEVEL}
                for seg in online_segments(t, agent.labels[t.trajectory_id], agent.prompts)
                for x in seg
            ]
            new += segments(with_rewards({LEVEL: rows}, hrl.reward)[LEVEL])
        state["kept"] += push(buffer, new, cfg.buffer_size, cfg.keep_fail_ratio, rng, outcome)
        rows = _round_updates(model, critic, buffer, builder, hrl, rng, tok.pad_token_id)
        row = {
            "round": r + 1,
            "env_steps": state["env_steps"],
            "success_rate": sum(t.won for t in trajs) / max(len(trajs), 1),
            "buffer_segments": len(buffer),
            "kept_segments": state["kept"],
        }
        row |= {k: sum(x[k] for x in rows) / len(rows) for k in rows[0]} if rows else {}
        state["curve"].append(row)
        state["round"] = r + 1
        with atomic_path(ckpt) as tmp:
            torch.save(
                {
                    **state,
                    "model": trained_state(model, trained),
                    "critic": trained_state(critic, critic_trained),
                    "buffer": buffer,
                    "rng": rng.getstate(),
                    "torch_rng": torch.get_rng_state(),
                },
                tmp,
            )
    model.delete_adapter(ANCHOR)
    save_roles_policy(model, out, previous_dir)
    save_critic(critic, critic_out, adapter=not compat)
    write_transitions(
        buffer_out,
        {
            LEVEL: [
                Transition(**{k: v for k, v in x.items() if k in Transition.__dataclass_fields__})
                for seg in buffer
                for x in seg
            ]
        },
        lambda text: len(tok.encode(text, add_special_tokens=False)),
    )
    metrics = {
        **online_metrics(state, previous_metrics),
        "buffer_segments": len(buffer),
        "buffer_success_share": sum(succeeded(seg, outcome) for seg in buffer) / max(len(buffer), 1),
        "kept_segments": state["kept"],
        **(
            {k: state["curve"][-1][k] for k in ("loss", "kl", "v_loss", "q_loss", "advantage", "weight_clipped")}
            if "kl" in state["curve"][-1]
            else {}
        ),
        "seconds": time.perf_counter() - start,
        **placement(model),
    }
    write_json(metrics_path, metrics)
    write_json(curve_path, state["curve"])
    ckpt.unlink(missing_ok=True)
    return metrics


def _online_models(params: Params, base_dir: Path, previous_dir: Path, anchor_dir: Path, critic_dir: Path, roles: dict):
    """(policy, tokenizer, critic) of the online phase: the policy with System 2's adapter trainable and the
    other roles' frozen, the offline System 2 loaded beside it as the KL anchor (`ANCHOR`), and the critic
    (under `repo_compat`, heads on the actor's own features)."""
    names = role_names(roles["adapters"], roles["progress"])
    if not names:
        raise artifact(
            Path(previous_dir) / ROLES_FILE,
            "the online phase trains System 2's own adapter; this policy's roles share one",
        )
    model, tok = load_policy(base_dir, params.model, adapter=previous_dir, trainable=True, names=names)
    for name in names:  # System 1 (and any other role) stays frozen
        if name != LEVEL:
            for n, p in model.named_parameters():
                if f".{name}." in n:
                    p.requires_grad_(False)
    try:
        model.load_adapter(str(Path(anchor_dir) / LEVEL), adapter_name=ANCHOR, is_trainable=False)
    except Exception as err:  # noqa: BLE001 - peft and safetensors raise many kinds for a missing or cut file
        raise artifact(
            Path(anchor_dir) / LEVEL,
            f"cannot load the offline System 2 adapter ({type(err).__name__}: {str(err)[:300]})",
        ) from err
    use_adapter(model, LEVEL)
    cfg = params.multi2.online
    if params.multi2.repo_compat:
        critic = load_heads(on_actor(model, (LEVEL,), cfg.critic_lr), critic_dir)
    else:
        critic = load_critic(params, base_dir, critic_dir, (LEVEL,), trainable=True)
    return model, tok, critic


def _round_updates(model, critic, buffer: list, builder, hrl, rng: random.Random, pad_id: int) -> list[dict]:
    """A round's `updates_per_round` critic and actor updates on batches drawn from the replay buffer (whole
    segments under `repo_compat`, transitions otherwise). Both optimisers are made anew each round: the round
    checkpoint holds no optimiser state, so a resumed stage updates exactly as an uninterrupted one."""
    cfg, compat = hrl.online, hrl.repo_compat
    model.train()
    critic.train()
    flat = [x for seg in buffer for x in seg]
    optimizers = (
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0),
        torch.optim.AdamW(
            [p for n, p in critic.named_parameters() if p.requires_grad and not (compat and n.startswith("lm."))],
            lr=cfg.critic_lr,
            weight_decay=0.0,
        ),
    )
    draw = (
        (lambda: segment_batch(buffer, cfg.batch_size, rng))
        if compat
        else (lambda: rng.sample(flat, min(cfg.batch_size, len(flat))))
    )
    return (
        [
            update(model, critic, draw(), builder, cfg, hrl.critic, optimizers, pad_id, compat)
            for _ in range(cfg.updates_per_round)
        ]
        if flat
        else []
    )
