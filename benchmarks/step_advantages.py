"""What STEP-HRL's step-level critics made of a mistake: for iteration k of a STEP-HRL workspace, the advantage,
V and AWR weight `critic@k` gave each level's transitions, grouped by source (expert or corrupted), outcome, and
whether the output is the positive control's mistake (`--action`, default `look`).

A critic that sees what the mistake costs gives it a lower advantage than the other actions of the same episodes;
the weight column is what `policy@k` multiplies its log-likelihood by (min(exp(A / beta), max_weight), with A
standardised under `step_hrl.policy.standardize` and 1 for the constant-advantage control).

    python -m benchmarks.step_advantages runs/shpc-s0/look-outcome-s0 [--iteration 1] [--action look]
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from pathlib import Path

from benchmarks import workspace_params
from qevolve import paths
from qevolve.data.store import read_checked, read_store
from qevolve.hierarchy.config import section
from qevolve.hierarchy.shared import ADVANTAGE_SCHEMA, ADVANTAGES, training_sets
from qevolve.hierarchy.transitions import read_transitions
from qevolve.methods.step_hrl.policy import weighed_by
from qevolve.stages.experts import CORRUPTED
from qevolve.stages.hierarchical import ANNOTATED


def groups(params, ws: Path, k: int, action: str) -> dict[tuple, list[tuple[float, float, float]]]:
    """(level, source, won, is the mistake) -> [(advantage, V, weight)] over the transitions `policy@k` trains on."""
    cfg = section(params)
    rows = read_checked(ws / paths.advantages(k) / ADVANTAGES, ADVANTAGE_SCHEMA, "1").to_pylist()
    critic = {(r["trajectory_id"], r["level"], r["step"]): (r["advantage"], r["v"]) for r in rows}
    sets = training_sets(params, ws / ANNOTATED, ws / paths.collected(k))
    trained = [(level, r) for level, rs in sets.items() for r in rs]
    values = [critic[(r["trajectory_id"], level, r["step"])] for level, r in trained]
    items = [(level, [], [], a) for (level, _), (a, _) in zip(trained, values)]
    weighed = weighed_by(items, cfg.policy, cfg.repo_compat)
    out = defaultdict(list)
    for (level, r), (a, v), (*_, actor_a) in zip(trained, values, weighed):
        w = min(math.exp(actor_a / cfg.policy.beta), cfg.policy.max_weight)
        mistake = r["output_text"].split(";")[0].strip() == action
        out[(level, r["source"], r["won"], mistake)].append((a, v, w))
    return out


def shared_states(ws: Path, action: str) -> tuple[float, float]:
    """Of the corrupted episodes' low-level transitions, the share whose state also occurs in a demonstration;
    and of their actions other than `action`, the share that continue a demonstration of the same task in order
    (the best-matching one): how far the critic can compare the mistake with the demonstrated action."""
    low = read_transitions(ws / ANNOTATED)["low"]
    clean = {r["state_text"] for r in low if r["source"] != CORRUPTED}
    corrupted = [r for r in low if r["source"] == CORRUPTED]
    episodes = defaultdict(list)
    for t in read_store(ws / paths.EXPERTS):
        episodes[t.source, t.task_id].append([s.action for s in t.steps if s.action != action])
    followed = total = 0
    for (source, task), runs in episodes.items():
        if source != CORRUPTED:
            continue
        for run in runs:
            total += len(run)
            followed += max((_prefix(run, demo) for demo in episodes.get(("expert", task), [])), default=0)
    return sum(r["state_text"] in clean for r in corrupted) / max(len(corrupted), 1), followed / max(total, 1)


def _prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workspace", type=Path)
    ap.add_argument("--iteration", type=int, default=1)
    ap.add_argument("--action", default="look", help="the positive control's mistake (experts.corrupt.action)")
    args = ap.parse_args()
    params = workspace_params(args.workspace, needs=(str(ANNOTATED),))
    shared, follow = shared_states(args.workspace, args.action)
    print(f"{args.workspace}; mistake: {args.action!r}")
    print(f"corrupted episodes' low-level states that occur in the demonstrations: {shared:.1%}; their other")
    print(f"actions that follow a demonstration of the same task, in order: {follow:.1%}")
    if not (args.workspace / paths.advantages(args.iteration)).exists():
        print(f"no critic@{args.iteration} in {args.workspace} yet")
        return
    print(f"critic@{args.iteration}, reward {section(params).reward}:")
    print("| level | source | won | output | n | mean V | mean A | A std | mean weight |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    found = groups(params, args.workspace, args.iteration, args.action)
    for (level, source, won, mistake), xs in sorted(found.items()):
        a, v, w = (statistics.fmean(c) for c in zip(*xs))
        std = statistics.stdev([x[0] for x in xs]) if len(xs) > 1 else 0.0
        output = args.action if mistake else "other"
        print(f"| {level} | {source} | {won} | {output} | {len(xs)} | {v:.3f} | {a:+.4f} | {std:.4f} | {w:.3f} |")
    weights = [w for xs in found.values() for *_, w in xs]
    off = [abs(w - 1) for w in weights]
    near = sum(d <= 0.03 for d in off) / len(off)
    print(f"{len(weights)} weights: the farthest {max(off):.3f} from 1, {near:.1%} within 0.03")


if __name__ == "__main__":
    main()
