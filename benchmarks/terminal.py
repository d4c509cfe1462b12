"""The terminal environment's costs per task family: sandbox start, one command, one validation, the
sanity gate, medians over `--seeds` generated tasks of each family, for each sandbox backend.

    python -m benchmarks.terminal [--seeds 5] [--sandboxes bwrap local]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from qevolve.config import TerminalConfig
from qevolve.envs.base import Task
from qevolve.envs.sandbox import Session
from qevolve.envs.terminal import SUBMIT, TerminalEnv
from qevolve.envs.terminal_tasks import FAMILIES, gate, make, write_task


def _ms(f) -> float:
    start = time.perf_counter()
    f()
    return 1000 * (time.perf_counter() - start)


def measure(sandbox: str, seeds: int) -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="qevolve-bench-terminal-"))
    env = TerminalEnv(str(root), TerminalConfig(sandbox=sandbox), max_steps=10)
    rows = []
    for family in FAMILIES:
        start, command, validate, gated, rejected = [], [], [], [], 0
        for seed in range(seeds):
            write_task(make(family, seed), root / "train" / f"{family}-{seed}")
            task = Task(f"{family}-{seed}", "train", family)
            work = Path(tempfile.mkdtemp(dir=root))
            session = None

            def begin():
                nonlocal session
                session = Session(sandbox, work)

            start.append(_ms(begin))
            command.append(_ms(lambda: session.run("ls -la")))
            session.close()
            env.reset(task)
            validate.append(_ms(lambda: env.step(SUBMIT)))
            t = time.perf_counter()
            rejected += bool(gate(env, task))
            gated.append(time.perf_counter() - t)
        rows.append(
            {
                "sandbox": sandbox,
                "family": family,
                "start_ms": statistics.median(start),
                "command_ms": statistics.median(command),
                "validate_ms": statistics.median(validate),
                "gate_s": statistics.median(gated),
                "rejected": rejected,
                "tasks": seeds,
            }
        )
    env.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--sandboxes", nargs="+", default=["bwrap", "local"])
    args = ap.parse_args()
    print(
        "| sandbox | family | sandbox start (ms) | `ls -la` (ms) | validation (ms) | gate (s) | rejected by the gate |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for sandbox in args.sandboxes:
        for r in measure(sandbox, args.seeds):
            print(
                f"| {r['sandbox']} | {r['family']} | {r['start_ms']:.0f} | {r['command_ms']:.1f} | "
                f"{r['validate_ms']:.0f} | {r['gate_s']:.2f} | "
                f"{r['rejected']}/{r['tasks']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
