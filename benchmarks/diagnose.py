"""What limits an iteration: the evidence behind a benchmark row, read from a workspace's artifacts.

For iteration k of a Q-Evolve workspace (a table workspace such as runs/alfworld-miniature/qevolve-s0):
- the self-rollouts: how often they won, and on how many tasks the K samples disagree (only those give
  GRPO-like contrast; a task always lost teaches the critic nothing about success);
- the critic: AUC of V for predicting an episode's success, on its own training rollouts and on held-out
  episodes (the greedy evaluation of the policy it judges, `evaluate@k-1`), per step and at step 0;
- the advantages given to won and to lost self-rollout steps, and to expert steps;
- the evaluation: games won before and after the update, and how many flipped either way.

    python -m benchmarks.diagnose runs/alfworld-miniature/qevolve-s0 [--iteration 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from benchmarks import workspace_params


def auc(positive: list[float], negative: list[float]) -> float:
    """P(a positive scores above a negative), ties counting half (the Mann-Whitney AUC); NaN if a class is empty."""
    if not positive or not negative:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in positive for n in negative)
    return wins / (len(positive) * len(negative))


def value_auc(params, ws: Path, critic_dir: Path, trajs: list) -> tuple[float, float, int]:
    """(AUC of V per step, AUC of V(s_0), episodes) for predicting each episode's success."""
    import torch

    from qevolve.models.critic import critic_items, critic_values, load_critic
    from qevolve.models.prompt import make_builder

    torch.manual_seed(0)
    model, tok = load_critic(ws / "models/base", params.model, critic_dir)
    trajs = [t for t in trajs if t.steps]
    values = critic_values(
        model,
        critic_items(make_builder(params, tok, critic_dir), trajs, weighted=False),
        tok.pad_token_id,
        params.critic.micro_batch_size,
    )
    steps = {True: [], False: []}
    first = {True: [], False: []}
    for i, t in enumerate(trajs):
        steps[t.won] += [values[i][s][0] for s in range(len(t.steps))]
        first[t.won].append(values[i][0][0])
    return auc(steps[True], steps[False]), auc(first[True], first[False]), len(trajs)


def main(argv: list[str] | None = None) -> int:
    from qevolve.data.advantages import read_advantages
    from qevolve.data.store import read_store

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workspace", type=Path)
    parser.add_argument("--iteration", type=int, default=1)
    args = parser.parse_args(argv)
    ws, k = args.workspace.resolve(), args.iteration
    params = workspace_params(
        ws, needs=("models/base", f"models/critic@{k}", f"data/relabel@{k}", f"data/evaluate@{k}")
    )

    own = [t for t in read_store(ws / f"data/relabel@{k}") if t.source != "expert"]
    by_task = defaultdict(list)
    for t in own:
        by_task[t.task_id].append(t.won)
    print(f"{ws.name}, iteration {k}\n")
    print(
        f"self-rollouts (collect@{k}): {len(own)} episodes on {len(by_task)} tasks, {sum(t.won for t in own)} won "
        f"({sum(t.won for t in own) / max(len(own), 1):.1%}); tasks with a win "
        f"{sum(any(w) for w in by_task.values())}, "
        f"with mixed outcomes {sum(any(w) and not all(w) for w in by_task.values())}"
    )

    held_out = read_store(ws / f"data/evaluate@{k - 1}")
    rows = [
        ("own rollouts (train)", *value_auc(params, ws, ws / f"models/critic@{k}", own)),
        (f"evaluate@{k - 1} (held out)", *value_auc(params, ws, ws / f"models/critic@{k}", held_out)),
    ]
    print(f"\ncritic@{k}: AUC of V for predicting success (0.5 = chance)")
    print(f"{'episodes':<26}{'n':>5}{'AUC per step':>14}{'AUC of V(s0)':>14}")
    for name, per_step, at_start, n in rows:
        print(f"{name:<26}{n:>5}{per_step:>14.3f}{at_start:>14.3f}")

    adv = read_advantages(ws / f"data/advantage@{k}")
    groups = defaultdict(list)
    for t in read_store(ws / f"data/relabel@{k}"):
        kind = "expert" if t.source == "expert" else ("self, won" if t.won else "self, lost")
        groups[kind] += [adv[(t.trajectory_id, s.step)] for s in t.steps if (t.trajectory_id, s.step) in adv]
    print(
        f"\nadvantage@{k} (normalised): "
        + ", ".join(f"{g} {statistics.mean(v):+.2f} over {len(v)} steps" for g, v in sorted(groups.items()) if v)
    )

    print(f"\nevaluation, policy {k - 1} -> policy {k}")
    after = {(t.split, t.task_id): t.won for t in read_store(ws / f"data/evaluate@{k}")}
    before = {(t.split, t.task_id): t.won for t in held_out}
    print(f"{'split':<14}{'games':>6}{'won before':>12}{'won after':>11}{'lost->won':>11}{'won->lost':>11}")
    for split in sorted({s for s, _ in after}):
        keys = [key for key in after if key[0] == split and key in before]
        print(
            f"{split:<14}{len(keys):>6}{sum(before[x] for x in keys):>12}{sum(after[x] for x in keys):>11}"
            f"{sum(after[x] and not before[x] for x in keys):>11}{sum(before[x] and not after[x] for x in keys):>11}"
        )
    policy = json.loads((ws / "metrics" / f"policy@{k}.json").read_text())
    print(
        f"\npolicy@{k}: KL to the previous policy {policy['kl']:.4f}, clip fraction {policy['clip_fraction']:.3f}, "
        f"ratio {policy['ratio']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
