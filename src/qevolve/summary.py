"""The evaluation summary of a workspace (`qevolve summary`, printed by the evolution flow at its end), read
from its metrics files."""

from __future__ import annotations

import json

from qevolve import paths
from qevolve.algos.stats import wilson


def summary_table(iterations: list[int]) -> str:
    """The evaluation table of the given iterations, read from their metrics files: each success rate
    with its 95 % Wilson interval, the games it counts and the episodes the environment failed (left
    out of the rate), then the critic's separation of won and lost episodes for each iteration, so a reader
    can tell what the numbers can say."""
    head = (
        f"{'policy':<10} {'split':<13} {'success':>8} {'95 % interval':>14} {'won':>7} {'env fail':>8} "
        f"{'reward':>7} {'steps':>6} "
        f"{'invalid':>8} {'out tok/ep':>10} {'prompt tok/ep':>13}"
    )
    rows = [head, "-" * len(head)]
    for k in iterations:
        path = paths.metrics(f"evaluate@{k}")
        if not path.exists():
            continue
        name = "bc" if k == 0 else f"iter {k}"
        for split, m in json.loads(path.read_text()).items():
            n, p = m["episodes"], m["success_rate"]
            lo, hi = wilson(round(p * n), n)
            rows.append(
                f"{name:<10} {split:<13} {p:>8.1%} {f'[{lo:.1%}, {hi:.1%}]':>14} {f'{round(p * n)}/{n}':>7} "
                f"{m.get('env_failures', 0):>8} "
                f"{m['avg_reward']:>7.3f} "
                f"{m['avg_steps']:>6.1f} "
                f"{m['invalid_rate']:>8.1%} {m['output_tokens_per_episode']:>10.1f} "
                f"{m['prompt_tokens_per_episode']:>13.0f}"
            )
    rows.append(
        "95 % interval: Wilson's, for the games played (a rate inside another row's interval is not told apart "
        "from it). "
        "env fail: episodes the environment failed (a crash, not the policy), left out of n."
    )
    for k in iterations:
        path = paths.metrics(f"critic@{k}")
        if k and path.exists():
            c = json.loads(path.read_text())
            if "v_mean_won" in c:
                rows.append(
                    f"critic@{k}: mean V on won episodes {c['v_mean_won']:.3f}, on lost {c['v_mean_lost']:.3f} "
                    f"(separation {c['v_mean_won'] - c['v_mean_lost']:+.3f}; V's std {c['v_std']:.3f})"
                )
            else:  # one critic per level (STEP-HRL)
                rows.append(
                    f"critic@{k}: "
                    + "; ".join(
                        f"{level} mean V {c[f'{level}_v_mean']:.3f}, A {c[f'{level}_advantage_mean']:+.3f}"
                        + (
                            f" (std {c[f'{level}_advantage_std']:.3f}), AUC won vs lost in training "
                            f"{_num(c[f'{level}_auc_train'])}"
                            if f"{level}_auc_train" in c
                            else ""
                        )
                        for level in ("high", "low", "progress")
                        if f"{level}_v_mean" in c
                    )
                )
        rows += diagnosis(k)
    return "\n".join(rows)


def diagnosis(k: int) -> list[str]:
    """Iteration k's RL diagnostics (`diagnose@k`, with its advantages' and update's own), and their warnings."""
    path = paths.metrics(f"diagnose@{k}")
    if not k or not path.exists():
        return []
    d = json.loads(path.read_text())
    read = lambda stage: json.loads(p.read_text()) if (p := paths.metrics(f"{stage}@{k}")).exists() else {}  # noqa: E731
    critic, adv, policy = read("critic"), read("advantage"), read("policy")

    if "critic_auc" not in d:  # one critic per level (the hierarchies)
        levels = [key.removesuffix("_critic_auc") for key in d if key.endswith("_critic_auc")]
        scored = [
            f"diagnose@{k}: critic AUC won vs lost on held-out episodes, "
            + "; ".join(
                f"{lv} {_num(d[f'{lv}_critic_auc'])} (p {_num(d.get(f'{lv}_critic_auc_p'), '.2g')}) "
                f"({d[f'{lv}_heldout_won']} won of {d[f'{lv}_heldout_episodes']}; by step "
                f"{_num(d[f'{lv}_critic_auc_steps'])})"
                for lv in levels
            )
        ]
        moved = [
            f"{key.removesuffix('_kl_previous_new')} {d[key]:.1e}" for key in d if key.endswith("_kl_previous_new")
        ]
        kl = [f"  KL(previous ‖ new) per output token: {', '.join(moved)}"] if moved else []
        return [*(scored if levels else [f"diagnose@{k}:"]), *kl, *(f"  WARNING: {w}" for w in d["warnings"])]
    held = (
        f"{_num(d['critic_auc'])} (p {_num(d.get('critic_auc_p'), '.2g')}) on {d['heldout_episodes']} held-out "
        f"episodes "
        f"({d['heldout_won']} won; by step {_num(d['critic_auc_steps'])}, V(s0) {_num(d.get('critic_auc_s0'))}, "
        f"steps 1-3 matched {_num(d.get('critic_auc_matched'))})"
    )
    line = (
        f"diagnose@{k}: critic AUC won vs lost {held}, {_num(critic.get('auc_train'))} on its training data; "
        f"advantages raw std "
        f"{_num(adv.get('raw_std'), '.3f')}, {_num(adv.get('moving_share'), '.0%')} of steps moving, AUC "
        f"{_num(adv.get('auc_won_lost'))}; "
        f"update weight off 1 on {_num(policy.get('weight_off_one_share'), '.0%')} of tokens; KL(previous ‖ new) "
        f"{d['kl_previous_new']:.1e} nats per token"
    )
    return [line, *(f"  WARNING: {w}" for w in d["warnings"])]


def _num(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)
