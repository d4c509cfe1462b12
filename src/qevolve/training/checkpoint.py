"""A trained stage's end and its identity: the adapter saved with its metrics, the in-stage checkpoint's path and the
digest that says whether it still fits the stage's settings and inputs."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from qevolve.config import TrainRunConfig
from qevolve.data.atomic import write_json
from qevolve.models.device import (
    is_main,
    placement,
)
from qevolve.training.speed import train_speed

log = logging.getLogger(__name__)


def save_and_report(
    save: Callable[[], None],
    metrics: dict,
    model: torch.nn.Module,
    curve: list[dict],
    elapsed: float,
    run: TrainRunConfig,
    out: Path,
    metrics_path: Path,
    curve_path: Path,
    speed_of: torch.nn.Module | None = None,
) -> dict:
    """How every trainer ends, after any pass that takes every rank (`full_state`): on rank 0, `save()` writes
    the artifact(s) atomically; then `metrics`, with the training time, speed (`train_speed` of `speed_of`,
    default `model`) and placement of `model`, go to `metrics_path` and the curve to `curve_path`, and the
    in-stage checkpoint of `out` is removed, the artifact being complete. Other ranks write nothing: {}."""
    if not is_main():
        return {}
    save()
    metrics = {**metrics, "train_seconds": elapsed, **train_speed(speed_of or model, curve, run), **placement(model)}
    write_json(metrics_path, metrics)
    write_json(curve_path, curve)
    checkpoint_path(out).unlink(missing_ok=True)
    return metrics


def checkpoint_path(out: Path) -> Path:
    """Where the stage writing the artifact `out` keeps its in-stage checkpoint: beside it, never in it."""
    return out.parent / f".{out.name}.checkpoint"


def changing_tensors(model: torch.nn.Module) -> set[str]:
    """State-dict names of what training changes: trainable parameters, plus what the model names in
    `checkpoint_extra` (e.g. a target network updated outside the optimiser)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return names | set(getattr(model, "checkpoint_extra", ()))


def trained_state(model: torch.nn.Module, names: set[str]) -> dict[str, torch.Tensor]:
    """A copy of the state-dict entries in `names` (`changing_tensors`): what a round checkpoint keeps."""
    return {n: t.detach().clone() for n, t in model.state_dict().items() if n in names}


def load_round(ckpt: Path, key: str, stage: str) -> dict | None:
    """The checkpoint an online stage saved after its last finished round, if one exists and was written
    with this `key` (`fingerprint`); None otherwise (a stale one is logged and left for the next save)."""
    if not ckpt.exists():
        return None
    saved = torch.load(ckpt, weights_only=False)
    if saved.get("fingerprint") != key:
        log.warning("%s: ignoring checkpoint %s, written for other settings or other inputs", stage, ckpt)
        return None
    log.warning("%s: resuming from the checkpoint after round %d (%s)", stage, saved["round"], ckpt)
    return saved


def fingerprint(*parts) -> str:
    """sha256 of the JSON of `parts`: what a checkpoint records of the run that wrote it."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def input_digest(*paths: Path) -> str:
    """sha256 over the files under `paths` (names and contents): what an in-stage checkpoint records of
    the stage's input artifacts, so that one written from other inputs (a changed advantage, a retrained
    previous policy, the same data shapes) is not resumed. The base model is left out: it can be many GB,
    and `model.*` fixes it."""
    h = hashlib.sha256()
    for root in map(Path, paths):
        if not root.exists():
            raise FileNotFoundError(f"{root}: an input of this stage is missing")
        for f in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if f.is_file():
                h.update(f"{f.relative_to(root) if root.is_dir() else f.name}\0".encode())
                with open(f, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        h.update(block)
    return h.hexdigest()


def last_epoch_mean(curve: list[dict], key: str) -> float:
    last = [c[key] for c in curve if c["epoch"] == curve[-1]["epoch"]]
    return sum(last) / len(last)
