"""`generate`: task folders, from the template families or by a chat model from source repositories
(`terminaltraj.generate.kind`), each through the sanity gate, and the funnel.

A candidate task that fails the gate (its oracle fails, a do-nothing agent passes, or its validators
disagree between two oracle runs), or a model's answer that is no task (`unusable`), is counted by reason
and not written. The kept ones go to `data/instances/<split>/<task id>/`: the held-out families' (under
`llm`, repositories') to `test_ood`, the others' to `test` or `train` by a hash of the task id
(`terminaltraj.generate.test_share`)."""

from __future__ import annotations

import hashlib
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from tqdm import tqdm

from qevolve.data.atomic import atomic_dir, write_json
from qevolve.envs.base import Task
from qevolve.envs.terminal import TerminalEnv
from qevolve.envs.terminal_tasks import gate, make, write_task
from qevolve.methods.terminaltraj.config import REJECTIONS
from qevolve.params import Params

Candidate = tuple[str, str, Callable[[Path], str]]
"""(task id, family, write(folder) -> '' when written, else why not)."""


def split_of(task_id: str, family: str, cfg) -> str:
    if family in cfg.held_out:
        return "test_ood"
    return "test" if int(hashlib.sha1(task_id.encode()).hexdigest()[:8], 16) / 16**8 < cfg.test_share else "train"


def _from_templates(cfg) -> Iterator[Candidate]:
    for family in cfg.families:
        for seed in range(cfg.seed, cfg.seed + cfg.per_family):
            yield f"{family}-{seed:04d}", family, lambda folder, f=family, s=seed: write_task(make(f, s), folder) or ""


def _from_sources(cfg) -> Iterator[Candidate]:
    from qevolve.methods.terminaltraj.author import AuthorError, author, context, repositories

    repos = repositories(Path(cfg.sources))
    unknown = sorted(set(cfg.held_out) - {r.name for r in repos})
    if unknown:
        raise AuthorError(
            f"terminaltraj.generate.held_out: {unknown} name no repository in {cfg.sources} (under `llm` it lists "
            f"repositories)"
        )
    for repo in repos:
        text = context(repo, cfg.max_source_chars)
        for i in range(cfg.per_source):
            yield f"{repo.name}-{i:04d}", repo.name, lambda folder, r=repo, t=text, n=i: author(cfg, r, t, n, folder)


def generate(params: Params, out: Path, metrics_path: Path, details_path: Path) -> dict:
    cfg = params.terminaltraj.generate
    candidates = list(_from_sources(cfg) if cfg.kind == "llm" else _from_templates(cfg))
    funnel: dict[str, Counter] = {}
    rejected = []
    with atomic_dir(out) as tmp:
        pool = tmp / ".gate"
        env = TerminalEnv(str(pool), params.env.terminal, params.env.max_steps)
        try:
            for task_id, family, write in tqdm(candidates, desc="generate", unit="task"):
                counts = funnel.setdefault(family, Counter())
                counts["generated"] += 1
                why = write(pool / "gate" / task_id) or gate(env, Task(task_id, "gate", family))
                if why:
                    counts[why] += 1
                    rejected.append({"task_id": task_id, "reason": why})
                    continue
                split = split_of(task_id, family, cfg)
                counts[split] += 1
                (tmp / split).mkdir(exist_ok=True)
                shutil.move(pool / "gate" / task_id, tmp / split / task_id)
        finally:
            env.close()
            shutil.rmtree(pool, ignore_errors=True)
    total = sum(funnel.values(), Counter())
    passed = total["train"] + total["test"] + total["test_ood"]
    metrics = {
        "generated": total["generated"],
        "passed_gate": passed,
        "gate_pass_rate": passed / max(total["generated"], 1),
        **{f"rejected_{why}": total[why] for why in REJECTIONS},
        **{f"{split}_tasks": total[split] for split in ("train", "test", "test_ood")},
        "by_family": {f: dict(c) for f, c in funnel.items()},
    }
    write_json(details_path, rejected)
    write_json(metrics_path, metrics)
    return metrics
