"""Intervals for success rates and for differences between them, where episodes are not independent: a table
evaluates the same tasks under several seeds, and its rows on the same tasks.

- `wilson`: the Wilson score interval of `won` of `n` (never 0 ± 0, never outside [0, 1]).
- `clustered`: a pooled rate with its Wilson interval at the effective sample size: episodes are clustered by
  task, so `n` is divided by Kish's design effect, the clustered variance of the rate over its binomial variance
  (Miller 2024, "Adding Error Bars to Evals", eq. 4). One episode per task: the plain Wilson interval.
- `paired_bootstrap`: the difference of two rows' rates on the (task, seed) pairs both played, with a percentile
  interval from a two-level bootstrap: tasks drawn with replacement, then within each drawn task its seeds.
- `auc`: how well a score ranks won above lost (a critic's values), with Hanley and McNeil's interval.
"""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959964


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
    interval at n / deff, deff = (Σ_task (Σ_episode (x − p))² / n²) / (p(1 − p) / n), at least 1."""
    xs = [x for xs in outcomes.values() for x in xs]
    n = len(xs)
    if not n:
        raise ValueError("clustered: no episodes")
    p = sum(xs) / n
    binomial = p * (1 - p) / n
    within = sum(sum(x - p for x in xs) ** 2 for xs in outcomes.values()) / n**2
    deff = max(1.0, within / binomial) if binomial > 0 else 1.0
    lo, hi = wilson(p * n / deff, n / deff, z)
    return {"rate": p, "low": lo, "high": hi, "won": sum(xs), "episodes": n, "tasks": len(outcomes), "design_effect": deff}


def paired_bootstrap(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]], draws: int = 10_000, level: float = 0.95,
                     seed: int = 0) -> dict:
    """Row `a`'s rate minus row `b`'s on the tasks both played, each by the seeds both ran on it (`a[task][seed]`:
    that episode's outcome), with the percentile interval of a two-level bootstrap: each draw takes the tasks with
    replacement, then for each drawn task its seeds with replacement. Tasks with fewer common seeds than the most
    are left out, so every task weighs the same (a seed's episode the environment failed takes its task out)."""
    common = {t: sorted(set(a[t]) & set(b[t])) for t in sorted(set(a) & set(b))}
    seeds = max((len(s) for s in common.values()), default=0)
    tasks = [t for t, s in common.items() if len(s) == seeds and seeds]
    if not tasks:
        raise ValueError("paired_bootstrap: the rows share no task played by the same seeds")
    diff = np.array([[a[t][s] - b[t][s] for s in common[t]] for t in tasks], dtype=float)  # tasks x seeds
    rng = np.random.default_rng(seed)
    pick_tasks = rng.integers(len(tasks), size=(draws, len(tasks)))
    pick_seeds = rng.integers(seeds, size=(draws, len(tasks), seeds))
    means = diff[pick_tasks[..., None], pick_seeds].mean(axis=(1, 2))
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {"difference": float(diff.mean()), "low": float(lo), "high": float(hi), "tasks": len(tasks), "seeds": seeds}


def auc(positive: list[float], negative: list[float], z: float = Z95) -> dict:
    """The area under the ROC curve of a score separating `positive` from `negative` (the Mann-Whitney
    statistic: the chance that a positive scores above a negative, ties counting half), with Hanley and McNeil's
    (1982) standard error and its 95 % interval, clipped to [0, 1]. `contrast`: whether the interval leaves
    out 0.5 (chance). None where a class is empty."""
    n1, n2 = len(positive), len(negative)
    if not n1 or not n2:
        return {"auc": None, "low": None, "high": None, "positives": n1, "negatives": n2, "contrast": None}
    pos, neg = np.asarray(positive, dtype=float)[:, None], np.asarray(negative, dtype=float)[None, :]
    a = float(((pos > neg) + 0.5 * (pos == neg)).mean())
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    se = math.sqrt(max(0.0, a * (1 - a) + (n1 - 1) * (q1 - a * a) + (n2 - 1) * (q2 - a * a)) / (n1 * n2))
    lo, hi = max(0.0, a - z * se), min(1.0, a + z * se)
    return {"auc": a, "low": lo, "high": hi, "positives": n1, "negatives": n2, "contrast": not lo <= 0.5 <= hi}


def percent_interval(rate: float, low: float, high: float, signed: bool = False) -> str:
    """`28.0 [21.9, 35.1]`, in percent; `signed` for a difference (`+4.3 [-2.1, +10.8]`)."""
    f = "{:+.1f}" if signed else "{:.1f}"
    return f"{f.format(100 * rate)} [{f.format(100 * low)}, {f.format(100 * high)}]"
