"""`verify`: per rollout, the validators' verdict (the episode was won: every test passed) and the judge's
beside it (`terminaltraj.judge`: the transcript rule, or a chat model at a URL; either reads the
instruction and the episode's transcript only, never the end state), and the judge's confusion matrix against the
validators: precision, recall, and the false-positive rate (accepted, but the state is wrong)."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from qevolve.data.atomic import atomic_dir, write_json
from qevolve.data.store import Trajectory, read_store
from qevolve.envs.terminal_tasks import transcript_judge
from qevolve.llm import LLMError, chat, json_content
from qevolve.methods.terminaltraj.config import LABELS
from qevolve.params import Params

JUDGE_PROMPT = (
    "You are judging whether an agent completed a task in a Linux terminal. You see the task and the transcript of "
    "the commands it ran with their outputs, not the machine itself. Reply with JSON only: "
    '{{"verdict": "pass" or "fail", "reason": <one sentence>}}.\n\nTask:\n{instruction}\n\nTranscript:\n{transcript}'
)
OUTPUT_CHARS = 2000
"""How much of each command's output the LLM judge reads (its head and tail)."""


def transcript(t: Trajectory) -> str:
    lines = []
    for s in t.steps:
        out = (
            s.next_observation
            if len(s.next_observation) <= OUTPUT_CHARS
            else (s.next_observation[: OUTPUT_CHARS // 2] + "\n[...]\n" + s.next_observation[-OUTPUT_CHARS // 2 :])
        )
        lines += [f"$ {s.action}", out]
    return "\n".join(lines)


def llm_judge(cfg, t: Trajectory) -> tuple[bool, str]:
    """A chat model's verdict on one rollout: (accepted, its reason)."""
    key = "terminaltraj.judge.url"
    content = chat(
        cfg.url,
        cfg.model,
        [{"role": "user", "content": JUDGE_PROMPT.format(instruction=t.instruction, transcript=transcript(t))}],
        key=key,
    )
    try:
        answer = json_content(content)
        verdict = str(answer["verdict"]).strip().lower()
        if verdict not in ("pass", "fail"):
            raise ValueError(f"verdict {verdict!r}")
    except (ValueError, KeyError, TypeError) as err:
        raise LLMError(
            f"{key} = {cfg.url!r}: the verdict on rollout {t.trajectory_id} is not the JSON asked for, "
            f'{{"verdict": "pass"|"fail", "reason": ...}} ({err}): {content[:300]!r}'
        ) from None
    return verdict == "pass", str(answer.get("reason", ""))[:300]


def verify(params: Params, rollouts_dir: Path, out: Path, metrics_path: Path) -> dict:
    cfg = params.terminaltraj.judge
    labels = {}
    for t in tqdm(read_store(rollouts_dir), desc=f"verify ({cfg.kind} judge)", unit="rollout"):
        if cfg.kind == "llm":
            accepted, reason = llm_judge(cfg, t)
        else:
            accepted, reason = transcript_judge(
                [s.next_observation for s in t.steps], [s.action for s in t.steps], cfg.window
            )
        labels[t.trajectory_id] = {"validator": t.won, "judge": accepted, "judge_reason": reason, "family": t.task_type}
    with atomic_dir(out) as tmp:
        write_json(tmp / LABELS, labels)
    metrics = {
        "trajectories": len(labels),
        **confusion([(x["validator"], x["judge"]) for x in labels.values()]),
        "judge": cfg.kind,
    }
    write_json(metrics_path, metrics)
    return metrics


def confusion(pairs: list[tuple[bool, bool]]) -> dict:
    """(validator, judge) verdicts -> the judge's counts and rates, the validator taken as the truth."""
    tp = sum(v and j for v, j in pairs)
    fp = sum(j and not v for v, j in pairs)
    fn = sum(v and not j for v, j in pairs)
    tn = len(pairs) - tp - fp - fn
    return {
        "true_positives": tp,
        "false_positives": fp,
        "false_negatives": fn,
        "true_negatives": tn,
        "precision": tp / (tp + fp) if tp + fp else float("nan"),
        "recall": tp / (tp + fn) if tp + fn else float("nan"),
        "false_positive_rate": fp / (fp + tn) if fp + tn else float("nan"),
    }
