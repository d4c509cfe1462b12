"""Intervals for success rates and for differences between them, where episodes are not independent: a table
evaluates the same tasks under several seeds, and its rows on the same tasks.

- `wilson`: the Wilson score interval of `won` of `n` (never 0 ± 0, never outside [0, 1]).
- `clustered`: a pooled rate with its Wilson interval at the effective sample size: episodes are clustered by
  task, so `n` is divided by Kish's design effect, the clustered variance of the rate over its binomial variance
  (Miller 2024, "Adding Error Bars to Evals", eq. 4). One episode per task: the plain Wilson interval. A rate of
  0 or 1 has no variance to measure the clustering with; it gets the interval of its number of tasks.
- `paired_bootstrap`: the difference of two rows' rates on the (task, seed) pairs both played, with a percentile
  interval from a bootstrap of tasks and seeds drawn independently (seeds are crossed with tasks: a seed is one
  trained model that plays every task, so one draw of seeds is shared by all tasks), each seed's own difference,
  and an exact bound where no pair differs.
- `auc`: how well a score ranks won above lost (a critic's values), with the exact Mann-Whitney p-value.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

Z95 = 1.959964
MIN_CLASS = 5
"""`auc` calls a ranking a contrast only with at least this many positives and negatives."""
EXACT_CELLS = 50_000_000
"""`mann_whitney_p` counts the exact permutation distribution while its table stays under this many cells."""


def wilson(won: float, n: float, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of the rate `won / n` (`n` may be an effective, fractional count)."""
    if n <= 0:
        return 0.0, 1.0
    p = won / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def clustered(outcomes: dict[str, list[float]], z: float = Z95) -> dict:
    """The pooled rate of `outcomes` (task -> its episodes' outcomes, 0 or 1, one per seed) with its Wilson
    interval at n / deff, deff = (Σ_task (Σ_episode (x − p))² / n²) / (p(1 − p) / n), at least 1. Where the rate is
    0 or 1 the episodes show no variance, so deff is taken as n / tasks: the interval of one episode per task
    (episodes of one task may always agree)."""
    xs = [x for xs in outcomes.values() for x in xs]
    n = len(xs)
    if not n:
        raise ValueError("clustered: no episodes")
    p = sum(xs) / n
    binomial = p * (1 - p) / n
    within = sum(sum(x - p for x in xs) ** 2 for xs in outcomes.values()) / n**2
    deff = max(1.0, within / binomial) if binomial > 0 else n / len(outcomes)
    lo, hi = wilson(p * n / deff, n / deff, z)
    return {
        "rate": p,
        "low": lo,
        "high": hi,
        "won": sum(xs),
        "episodes": n,
        "tasks": len(outcomes),
        "design_effect": deff,
    }


def no_difference_bound(tasks: int, level: float = 0.95) -> float:
    """Where no task's pair differs: the largest share of tasks on which the rows could differ that is still
    consistent with none seen, at `level` (Clopper-Pearson's exact upper bound for 0 of `tasks`, 1 − ((1 − level)
    / 2)^(1 / tasks)); |difference| is at most this. Tasks, not pairs: a task's seeds may always agree."""
    return 1 - ((1 - level) / 2) ** (1 / tasks)


def paired_bootstrap(
    a: dict[str, dict[int, float]],
    b: dict[str, dict[int, float]],
    draws: int = 10_000,
    level: float = 0.95,
    seed: int = 0,
) -> dict:
    """Row `a`'s rate minus row `b`'s on the tasks both played, each by the seeds both ran on it (`a[task][seed]`:
    that episode's outcome), with the percentile interval of a bootstrap that draws the tasks with replacement
    and, independently, the seeds with replacement, one draw of seeds shared by every task (seeds and tasks are
    crossed, so the variance between trained models is counted once per seed, not averaged over tasks). Tasks
    not played by the same seeds as most are left out, so every task weighs the same (a seed's episode the
    environment failed takes its task out).

    Also: `per_seed` (seed -> its difference over the tasks), `better`/`worse` (seeds whose difference is above /
    below 0), `discordant` (pairs whose outcomes differ) and, where none does, `bound`: `no_difference_bound`."""
    common = {t: sorted(set(a[t]) & set(b[t])) for t in sorted(set(a) & set(b))}
    seeds = max((len(s) for s in common.values()), default=0)
    tasks = [t for t, s in common.items() if len(s) == seeds and seeds]
    if not tasks:
        raise ValueError("paired_bootstrap: the rows share no task played by the same seeds")
    names = Counter(tuple(common[t]) for t in tasks).most_common(1)[0][0]  # crossed: the same seeds on every task
    tasks = [t for t in tasks if tuple(common[t]) == names]
    diff = np.array([[a[t][s] - b[t][s] for s in names] for t in tasks], dtype=float)  # tasks x seeds
    rng = np.random.default_rng(seed)
    pick_tasks = rng.integers(len(tasks), size=(draws, len(tasks)))
    pick_seeds = rng.integers(seeds, size=(draws, seeds))
    means = diff[pick_tasks[:, :, None], pick_seeds[:, None, :]].mean(axis=(1, 2))
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    per_seed = {int(s): float(diff[:, j].mean()) for j, s in enumerate(names)}
    discordant = int((diff != 0).sum())
    return {
        "difference": float(diff.mean()),
        "low": float(lo),
        "high": float(hi),
        "tasks": len(tasks),
        "seeds": seeds,
        "per_seed": per_seed,
        "better": sum(d > 0 for d in per_seed.values()),
        "worse": sum(d < 0 for d in per_seed.values()),
        "discordant": discordant,
        "bound": None if discordant else no_difference_bound(len(tasks), level),
    }


def midranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n of `values`, tied values sharing the mean of their ranks."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return (sums / counts)[inverse]


def mann_whitney_p(positive: list[float], negative: list[float]) -> tuple[float, bool]:
    """(two-sided p-value of the Mann-Whitney test that the two samples come from one distribution, exact): the
    chance, over every way of choosing which of the pooled scores are the positives, of a rank sum at least as
    far from its mean as the one seen (ties take their mean rank, so they count half, as in the AUC). The
    distribution is counted exactly by dynamic programming over the doubled midranks (integers); where that
    table would exceed `EXACT_CELLS`, the normal approximation with the tie correction is used (then the
    second item is False)."""
    n1, n2 = len(positive), len(negative)
    n = n1 + n2
    ranks = midranks(np.concatenate([np.asarray(positive, float), np.asarray(negative, float)]))
    k = min(n1, n2)
    chosen = ranks[:n1] if n1 <= n2 else ranks[n1:]
    mean = k * (n + 1) / 2
    seen = abs(chosen.sum() - mean)
    doubled = np.rint(2 * ranks).astype(np.int64)
    top = int(np.sort(doubled)[-k:].sum())
    if (k + 1) * (top + 1) <= EXACT_CELLS // max(n, 1):
        ways = np.zeros((k + 1, top + 1))
        ways[0, 0] = 1.0
        for r in doubled:
            ways[1:, r:] += ways[:-1, : top + 1 - r].copy()
        total = ways[k] / math.comb(n, k)
        sums = np.arange(top + 1) / 2
        return float(min(1.0, total[np.abs(sums - mean) >= seen - 1e-9].sum())), True
    _, counts = np.unique(ranks, return_counts=True)
    var = n1 * n2 / 12 * ((n + 1) - (counts**3 - counts).sum() / (n * (n - 1)))
    if var <= 0:
        return 1.0, False
    zscore = max(0.0, seen - 0.5) / math.sqrt(var)
    return float(math.erfc(zscore / math.sqrt(2))), False


def auc(positive: list[float], negative: list[float], alpha: float = 0.05) -> dict:
    """The area under the ROC curve of a score separating `positive` from `negative` (the Mann-Whitney
    statistic: the chance that a positive scores above a negative, ties counting half), with its exact two-sided
    p-value against chance (`mann_whitney_p`). `contrast`: True where the p-value is under `alpha` with at least
    `MIN_CLASS` of each, False where it is not; None where a class has fewer (too few to tell; `auc` and `p` are
    None where one is empty)."""
    n1, n2 = len(positive), len(negative)
    if not n1 or not n2:
        return {"auc": None, "p": None, "positives": n1, "negatives": n2, "contrast": None}
    pos, neg = np.asarray(positive, dtype=float)[:, None], np.asarray(negative, dtype=float)[None, :]
    a = float(((pos > neg) + 0.5 * (pos == neg)).mean())
    p, _ = mann_whitney_p(positive, negative)
    enough = n1 >= MIN_CLASS and n2 >= MIN_CLASS
    return {"auc": a, "p": p, "positives": n1, "negatives": n2, "contrast": (p < alpha) if enough else None}


def percent_interval(rate: float, low: float, high: float, signed: bool = False) -> str:
    """`28.0 [21.9, 35.1]`, in percent; `signed` for a difference (`+4.3 [-2.1, +10.8]`)."""
    f = "{:+.1f}" if signed else "{:.1f}"
    return f"{f.format(100 * rate)} [{f.format(100 * low)}, {f.format(100 * high)}]"


def difference_text(d: dict) -> str:
    """A `paired_bootstrap` result in words: `+4.3 [-2.1, +10.8], better on 2 of 3 seeds`, or, where no pair
    differs, `no discordant pair (Δ within ±3.2 on 112 tasks)` (no pipe: it sits in markdown tables)."""
    if d["bound"] is not None:
        return f"no discordant pair (Δ within ±{100 * d['bound']:.1f} on {d['tasks']} tasks)"
    text = percent_interval(d["difference"], d["low"], d["high"], signed=True)
    if d["seeds"] > 1:
        text += f", better on {d['better']} of {d['seeds']} seeds" + (f", worse on {d['worse']}" if d["worse"] else "")
    return text
