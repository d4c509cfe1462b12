"""`verify`: per rollout, the validators' verdict (the episode was won: every test passed) and the judge's
beside it (`terminaltraj.judge`: the transcript rule, which reads what an LLM judge would, the
instruction's episode transcript, and not the end state), and the judge's confusion matrix against the
validators: precision, recall, and the false-positive rate (accepted, but the state is wrong)."""

from __future__ import annotations

from pathlib import Path

from qevolve.config import Params
from qevolve.data.atomic import atomic_dir, write_json
from qevolve.data.store import read_store
from qevolve.envs.terminal_tasks import transcript_judge
from qevolve.methods.terminaltraj.config import LABELS


def verify(params: Params, rollouts_dir: Path, out: Path, metrics_path: Path) -> dict:
    cfg = params.terminaltraj.judge
    labels = {}
    for t in read_store(rollouts_dir):
        accepted, reason = transcript_judge([s.next_observation for s in t.steps], [s.action for s in t.steps], cfg.window)
        labels[t.trajectory_id] = {"validator": t.won, "judge": accepted, "judge_reason": reason, "family": t.task_type}
    with atomic_dir(out) as tmp:
        write_json(tmp / LABELS, labels)
    metrics = {"trajectories": len(labels), **confusion([(x["validator"], x["judge"]) for x in labels.values()]), "judge": cfg.kind}
    write_json(metrics_path, metrics)
    return metrics


def confusion(pairs: list[tuple[bool, bool]]) -> dict:
    """(validator, judge) verdicts -> the judge's counts and rates, the validator taken as the truth."""
    tp = sum(v and j for v, j in pairs)
    fp = sum(j and not v for v, j in pairs)
    fn = sum(v and not j for v, j in pairs)
    tn = len(pairs) - tp - fp - fn
    return {"true_positives": tp, "false_positives": fp, "false_negatives": fn, "true_negatives": tn,
            "precision": tp / (tp + fp) if tp + fp else float("nan"), "recall": tp / (tp + fn) if tp + fn else float("nan"),
            "false_positive_rate": fp / (fp + tn) if fp + tn else float("nan")}
