"""`base`: the base model every adapter sits on: built from a config (embedded) or named by id/path."""

from __future__ import annotations

from pathlib import Path

from qevolve.data.atomic import atomic_dir, write_json
from qevolve.data.store import read_store
from qevolve.environments import ENVIRONMENTS
from qevolve.models.base import build_embedded, write_pointer
from qevolve.params import Params


def corpus(experts_dir: Path, env: str) -> list[str]:
    """Environment text the embedded tokenizer is trained on: instructions, observations, actions."""
    texts = [ENVIRONMENTS[env].intro, "Action: Thought: Your task is to: Here is an example."]
    for traj in read_store(experts_dir):
        texts.append(traj.instruction)
        for s in traj.steps:
            texts += [s.observation, s.output]
    return texts


def base(params: Params, experts_dir: Path, out: Path, metrics_path: Path) -> dict:
    cfg = params.model
    with atomic_dir(out) as tmp:
        if cfg.base == "embedded":
            metrics = build_embedded(
                cfg.embedded, corpus(experts_dir, params.env.name), tmp, max_positions=2 * cfg.context_tokens
            )
        else:
            metrics = write_pointer(cfg.base, tmp)
    write_json(metrics_path, metrics)
    return metrics
