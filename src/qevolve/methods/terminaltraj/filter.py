"""`filter`: the rollouts `bc` learns from, into the expert store (`data/experts`): those the validators
passed (`terminaltraj.filter.keep: validator`, the paper's code-verified data), those the judge accepted
(`judge`), or all (`none`); then at most `n` of them drawn with `seed`, so both filters can be compared at
equal sizes. It also writes the funnel, from generated tasks to kept rollouts, in total and per family: in its
metrics (`funnel`, `funnel_by_family`, each row with its count and its rate to the row before) and as a DVC
plot (`metrics/filter_curve.json`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from qevolve.data.atomic import write_json
from qevolve.data.store import read_store, write_store
from qevolve.methods.terminaltraj.config import LABELS, REJECTIONS
from qevolve.params import Params

FUNNEL = ("generated", "passed_gate", "train_tasks", "rollouts", "verified", "kept")
"""The funnel's rows; beside them the gate's rejections by reason."""


def funnel(generated: dict, trajs: list, kept: list) -> tuple[dict, dict]:
    """The funnel in total and per family: row -> count, and `<row>_rate` (its share of the row before).
    `generated`: `generate`'s metrics (its `by_family` counts)."""

    def rows(gen: dict, family: str | None) -> dict:
        mine = [t for t in trajs if family in (None, t.task_type)]
        counts = {
            "generated": gen.get("generated", 0),
            "passed_gate": sum(gen.get(s, 0) for s in ("train", "test", "test_ood")),
            "train_tasks": gen.get("train", 0),
            "rollouts": len(mine),
            "verified": sum(t.won for t in mine),
            "kept": sum(family in (None, t.task_type) for t in kept),
        }
        out = dict(counts)
        for before, row in zip(FUNNEL, FUNNEL[1:]):
            out[f"{row}_rate"] = counts[row] / counts[before] if counts[before] else float("nan")
        out |= {f"rejected_{why}": gen.get(why, 0) for why in REJECTIONS}
        return out

    by_family = {f: rows(c, f) for f, c in generated["by_family"].items()}
    keys = ("generated", "train", "test", "test_ood", *REJECTIONS)
    total = {key: sum(c.get(key, 0) for c in generated["by_family"].values()) for key in keys}
    return rows(total, None), by_family


def filter(
    params: Params,
    rollouts_dir: Path,
    verify_dir: Path,
    generate_metrics: Path,
    out: Path,
    metrics_path: Path,  # noqa: A001 - the stage's name
    curve_path: Path,
) -> dict:
    cfg = params.terminaltraj.filter
    labels = json.loads((Path(verify_dir) / LABELS).read_text())
    trajs = read_store(rollouts_dir)
    missing = [t.trajectory_id for t in trajs if t.trajectory_id not in labels]
    if missing:
        raise ValueError(
            f"{Path(verify_dir) / LABELS}: no labels for {len(missing)} rollouts of {rollouts_dir} (e.g. "
            f"{missing[0]}); rerun `verify`"
        )
    kept = [t for t in trajs if cfg.keep == "none" or labels[t.trajectory_id][cfg.keep]]
    if cfg.n and cfg.n < len(kept):
        kept = sorted(random.Random(cfg.seed).sample(kept, cfg.n), key=lambda t: (t.task_id, t.trajectory_id))
    if not kept:
        raise ValueError(f"filter: keep {cfg.keep!r} kept none of the {len(trajs)} rollouts; nothing to clone")
    write_store(out, kept)
    total, by_family = funnel(json.loads(Path(generate_metrics).read_text()), trajs, kept)
    write_json(curve_path, [{"row": f"{i + 1}. {row}", "count": total[row]} for i, row in enumerate(FUNNEL)])
    metrics = {
        "rollouts": len(trajs),
        "kept": len(kept),
        "keep": cfg.keep,
        "kept_validator_passed": sum(t.won for t in kept) / len(kept),
        "tasks": len({t.task_id for t in kept}),
        "cumulative_env_steps": sum(len(t.steps) for t in trajs),
        "funnel": total,
        "funnel_by_family": by_family,
    }
    write_json(metrics_path, metrics)
    return metrics
