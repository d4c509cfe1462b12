"""`diagnose@k`: did iteration k's RL phase have anything to learn from, and did it move the policy?

On the episodes the previous policy played in `evaluate@{k-1}` (evaluation tasks, which no critic or policy
update trains on):
- the critic's contrast: the AUC of its values for won against lost episodes (an episode's mean V over its
  states, with the exact Mann-Whitney p) and steps (V at each state, labelled with its episode's outcome; steps of
  one episode are not independent, so no p); and, since lost episodes run longer and hold more penalised states,
  what it knows beyond that (`credit_aucs`): V(s0), and V at steps 1-3 among the episodes still running;
- how far the update moved the policy: KL(previous ‖ new) per action token, exact over the vocabulary,
  teacher-forced on those episodes' states and actions.
It warns when the critic's contrast cannot be measured (no held-out episode was won, or none lost, or fewer than 5
of either), when it carries none (p >= 0.05) or ranks lost above won, or the update is a no-op (KL under
`NO_OP_KL`): `qevolve.stages.diagnosis`. The advantages' spread (`advantage@k`:
`raw_std`, `moving_share`, `auc_won_lost`) and the update's weights (`policy@k`: `weight_off_one_share`) are
their own stages' metrics; the summary table prints them on one line with these.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qevolve.algos.stats import auc
from qevolve.data.atomic import write_json
from qevolve.data.store import read_store
from qevolve.models.critic import critic_items, critic_values, load_critic
from qevolve.models.policy import load_policy
from qevolve.models.prompt import make_builder
from qevolve.params import Params
from qevolve.policy_update import policy_kl
from qevolve.stages.diagnosis import NO_OP_KL, contrast_warning, credit_aucs, no_op_warning, useless


def diagnose(
    params: Params,
    base_dir: Path,
    previous_dir: Path,
    policy_dir: Path,
    critic_dir: Path,
    heldout_dir: Path,
    metrics_path: Path,
) -> dict:
    torch.manual_seed(0)
    trajs = [t for t in read_store(heldout_dir) if t.steps]
    critic, tok = load_critic(base_dir, params.model, critic_dir)
    values = critic_values(
        critic,
        critic_items(make_builder(params, tok, critic_dir), trajs, weighted=False),
        tok.pad_token_id,
        params.critic.micro_batch_size,
    )
    del critic
    episodes: dict[bool, list[float]] = {True: [], False: []}
    steps: dict[bool, list[float]] = {True: [], False: []}
    per_state = [[values[i][s][0] for s in range(len(t.steps))] for i, t in enumerate(trajs)]
    for t, vs in zip(trajs, per_state):
        episodes[t.won].append(sum(vs) / len(vs))
        steps[t.won] += vs
    by_episode, by_step = auc(episodes[True], episodes[False]), auc(steps[True], steps[False])

    previous, tok = load_policy(base_dir, params.model, adapter=previous_dir)
    new, _ = load_policy(base_dir, params.model, adapter=policy_dir)
    builder = make_builder(params, tok, previous_dir)
    windows = [
        w
        for t in trajs
        for w in builder.windows(t.instruction, [s.observation for s in t.steps], [s.output for s in t.steps])
    ]
    kl, tokens = policy_kl(previous, new, windows, tok.pad_token_id, params.policy.micro_batch_size)

    metrics = {
        "heldout_episodes": len(trajs),
        "heldout_won": len(episodes[True]),
        "critic_auc": by_episode["auc"],
        "critic_auc_p": by_episode["p"],
        "critic_auc_steps": by_step["auc"],
        **{f"critic_{key}": value for key, value in credit_aucs(per_state, [t.won for t in trajs]).items()},
        "kl_previous_new": kl,
        "kl_tokens": tokens,
        "no_contrast": useless(by_episode),
        "no_op": int(kl < NO_OP_KL),
        "warnings": [w for w in (contrast_warning(by_episode, len(trajs)), no_op_warning(kl)) if w],
    }
    write_json(metrics_path, metrics)
    return metrics
