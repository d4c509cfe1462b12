"""`diagnose@k` (hierarchical methods): does each level's critic of iteration k rank won above lost on
episodes it never trained on? The held-out data are the transitions of the episodes the previous policy played
greedily in `evaluate@{k-1}` (evaluation tasks); per level with a critic (the heads `critic@k` wrote), the AUC
of an episode's mean V(s) over its transitions at that level for won against lost episodes, with the exact
Mann-Whitney p, and of each transition's V (`_steps`, no interval: transitions of one episode are not
independent). V is read at the state prompt's end, the paper's reading; a `repo_compat` critic (heads on a
policy's frozen features) is not scored. A level without a contrast (fewer than 5 won or lost, p >= 0.05, or
ranking lost above won) is warned of.
And per role, how far iteration k's update moved the policy: KL(previous ‖ new) per output token, exact over
the vocabulary, teacher-forced on the same held-out calls (`qevolve.policy_update.policy_kl`); an update that
moved no role by `NO_OP_KL` is warned of.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

from qevolve.algos.stats import auc
from qevolve.data.atomic import write_json
from qevolve.hierarchy.config import section
from qevolve.hierarchy.critic import critic_items, load_critic, values, with_steps
from qevolve.hierarchy.roles import encode
from qevolve.hierarchy.shared import COLLECTED, load_roles_policy, role_builder
from qevolve.hierarchy.transitions import read_transitions
from qevolve.models.base import load_tokenizer
from qevolve.models.policy import use_adapter
from qevolve.params import Params
from qevolve.policy_update import policy_kl
from qevolve.stages.diagnosis import NO_OP_KL, contrast_warning, no_op_warning, useless

BATCH = 8


def diagnose(
    params: Params,
    base_dir: Path,
    previous_dir: Path,
    policy_dir: Path,
    critic_dir: Path,
    heldout_dir: Path,
    metrics_path: Path,
) -> dict:
    heldout = read_transitions(Path(heldout_dir) / COLLECTED)
    metrics: dict = {"warnings": []} | role_kl(params, base_dir, previous_dir, policy_dir, heldout)
    moved = [metrics[key] for key in metrics if key.endswith("_kl_previous_new")]
    metrics["no_op"] = int(bool(moved) and max(moved) < NO_OP_KL)
    if metrics["no_op"]:
        metrics["warnings"].append(no_op_warning(max(moved)).replace("KL(previous", "every role's KL(previous"))
    with safe_open(str(Path(critic_dir) / "heads.safetensors"), "pt") as heads:
        levels = tuple(sorted({k.split(".")[1] for k in heads.keys() if k.startswith("v.")}))
    if not (Path(critic_dir) / "adapter_config.json").exists():  # `repo_compat`: heads on a policy's frozen features
        metrics["warnings"].append(
            f"{critic_dir}: a repo_compat critic (heads on a policy's features, no adapter of its own) is not scored"
        )
        write_json(metrics_path, metrics)
        return metrics
    critic = load_critic(params, base_dir, critic_dir, levels)
    tok = load_tokenizer(base_dir)
    read = with_steps(heldout) if section(params).critic_time_aware else heldout  # as critic@k read its states
    sets = {role: rows for role, rows in read.items() if role in levels}
    items = critic_items(role_builder(params, tok), sets)
    v: dict[tuple, float] = {}
    with torch.no_grad():
        for i in range(0, len(items), BATCH):
            mb = items[i : i + BATCH]
            v |= {it.key: float(x) for it, x in zip(mb, values(critic, mb, tok.pad_token_id)["v"])}
    for level, rows in sets.items():
        episodes: dict[str, list[float]] = {}
        won = {r["trajectory_id"]: r["won"] for r in rows}
        for r in rows:
            episodes.setdefault(r["trajectory_id"], []).append(v[(r["trajectory_id"], level, r["step"])])
        means = {tid: sum(vs) / len(vs) for tid, vs in episodes.items()}
        ranked = auc([m for tid, m in means.items() if won[tid]], [m for tid, m in means.items() if not won[tid]])
        by_step = auc(
            [v[(r["trajectory_id"], level, r["step"])] for r in rows if r["won"]],
            [v[(r["trajectory_id"], level, r["step"])] for r in rows if not r["won"]],
        )
        metrics |= {
            f"{level}_heldout_episodes": len(means),
            f"{level}_heldout_won": sum(won.values()),
            f"{level}_critic_auc": ranked["auc"],
            f"{level}_critic_auc_p": ranked["p"],
            f"{level}_critic_auc_steps": by_step["auc"],
            f"{level}_no_contrast": useless(ranked),
        }
        warning = contrast_warning(ranked, len(means), f"the {level} level's critic")
        metrics["warnings"] += [warning] if warning else []
    write_json(metrics_path, metrics)
    return metrics


def role_kl(
    params: Params, base_dir: Path, previous_dir: Path, policy_dir: Path, heldout: dict[str, list[dict]]
) -> dict:
    """Per role with held-out calls: KL(previous ‖ new) per output token and the tokens it was read on."""
    previous, tok, previous_separate = load_roles_policy(params, base_dir, previous_dir)
    new, _, new_separate = load_roles_policy(params, base_dir, policy_dir)
    builder = role_builder(params, tok)
    out = {}
    for role, rows in heldout.items():
        if not rows:
            continue
        for model, separate in ((previous, previous_separate), (new, new_separate)):
            if separate:
                use_adapter(model, role)
        calls = [
            SimpleNamespace(ids=ids, mask=mask)
            for ids, mask in (encode(builder, r["state_text"], r["output_text"]) for r in rows)
        ]
        kl, tokens = policy_kl(previous, new, calls, tok.pad_token_id, BATCH)
        out |= {f"{role}_kl_previous_new": kl, f"{role}_kl_tokens": tokens}
    return out
