"""`generate`: task folders from the template families, each through the sanity gate, and the funnel.

Every family makes `per_family` tasks; a task that fails the gate (its oracle fails, a do-nothing agent
passes, or its validators disagree between two oracle runs) is counted by reason and not written. The
kept ones go to `data/instances/<split>/<family>-<seed>/`: the held-out families' to `test_ood`, the
others' to `test` or `train` by a hash of the task id (`terminaltraj.generate.test_share`)."""

from __future__ import annotations

import hashlib
import shutil
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from qevolve.config import Params
from qevolve.data.atomic import atomic_dir, write_json
from qevolve.envs.base import Task
from qevolve.envs.terminal import TerminalEnv
from qevolve.envs.terminal_tasks import gate, make, write_task


def split_of(task_id: str, family: str, cfg) -> str:
    if family in cfg.held_out:
        return "test_ood"
    return "test" if int(hashlib.sha1(task_id.encode()).hexdigest()[:8], 16) / 16**8 < cfg.test_share else "train"


def generate(params: Params, out: Path, metrics_path: Path, details_path: Path) -> dict:
    cfg = params.terminaltraj.generate
    funnel: dict[str, Counter] = {}
    rejected = []
    with atomic_dir(out) as tmp:
        pool = tmp / ".gate"
        env = TerminalEnv(str(pool), params.env.terminal, params.env.max_steps)
        jobs = [(family, cfg.seed + i) for family in cfg.families for i in range(cfg.per_family)]
        try:
            for family, seed in tqdm(jobs, desc="generate", unit="task"):
                task_id = f"{family}-{seed:04d}"
                write_task(make(family, seed), pool / "gate" / task_id)
                why = gate(env, Task(task_id, "gate", family))
                counts = funnel.setdefault(family, Counter())
                counts["generated"] += 1
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
        "generated": total["generated"], "passed_gate": passed, "gate_pass_rate": passed / max(total["generated"], 1),
        **{f"rejected_{why}": total[why] for why in ("oracle_fails", "noop_passes", "flaky")},
        **{f"{split}_tasks": total[split] for split in ("train", "test", "test_ood")},
        "by_family": {f: dict(c) for f, c in funnel.items()},
    }
    write_json(details_path, rejected)
    write_json(metrics_path, metrics)
    return metrics
