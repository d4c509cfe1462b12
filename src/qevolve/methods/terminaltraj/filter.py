"""`filter`: the rollouts `bc` learns from, into the expert store (`data/experts`): those the validators
passed (`terminaltraj.filter.keep: validator`, the paper's code-verified data), those the judge accepted
(`judge`), or all (`none`); then at most `n` of them drawn with `seed`, so both filters can be compared at
equal sizes."""

from __future__ import annotations

import json
import random
from pathlib import Path

from qevolve.config import Params
from qevolve.data.atomic import write_json
from qevolve.data.store import read_store, write_store
from qevolve.methods.terminaltraj.config import LABELS


def filter(params: Params, rollouts_dir: Path, verify_dir: Path, out: Path, metrics_path: Path) -> dict:  # noqa: A001 - the stage's name
    cfg = params.terminaltraj.filter
    labels = json.loads((Path(verify_dir) / LABELS).read_text())
    trajs = read_store(rollouts_dir)
    missing = [t.trajectory_id for t in trajs if t.trajectory_id not in labels]
    if missing:
        raise ValueError(f"{Path(verify_dir) / LABELS}: no labels for {len(missing)} rollouts of {rollouts_dir} (e.g. {missing[0]}); rerun `verify`")
    kept = [t for t in trajs if cfg.keep == "none" or labels[t.trajectory_id][cfg.keep]]
    if cfg.n and cfg.n < len(kept):
        kept = sorted(random.Random(cfg.seed).sample(kept, cfg.n), key=lambda t: (t.task_id, t.trajectory_id))
    if not kept:
        raise ValueError(f"filter: keep {cfg.keep!r} kept none of the {len(trajs)} rollouts; nothing to clone")
    write_store(out, kept)
    metrics = {"rollouts": len(trajs), "kept": len(kept), "keep": cfg.keep, "kept_validator_passed": sum(t.won for t in kept) / len(kept),
               "tasks": len({t.task_id for t in kept}), "cumulative_env_steps": sum(len(t.steps) for t in trajs)}
    write_json(metrics_path, metrics)
    return metrics
