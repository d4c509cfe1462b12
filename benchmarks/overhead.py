"""Orchestration overhead: the share of one Q-Evolve iteration's wall time spent outside the stages'
computation (Prefect task and flow runs, DVC status and commit, MLflow logging).

It copies a workspace where the quickstart has run (code, params, DVC state and cache, BC outputs) to a
scratch folder without its iteration outputs, runs the flow there so that exactly iteration 1 runs,
and prints the timing the flow recorded (`metrics/timing@1.json`): each stage function's own time, and
the iteration's wall time around them.

    python -m benchmarks.overhead [--workspace runs/quickstart] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ITERATION_OUTPUT = re.compile(r".*@[1-9]\d*(_curve)?(\.json)?$")
SKIP = {".venv", "mlruns", "mlflow.db", ".pytest_cache", "__pycache__"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, default=Path("runs/quickstart"))
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy")
    args = ap.parse_args(argv)
    ws = args.workspace.resolve()
    if not (ws / "models/bc").exists():
        sys.exit(f"{ws / 'models/bc'}: missing; run `make quickstart` first (or pass --workspace)")
    scratch = Path(tempfile.mkdtemp(prefix="qevolve-overhead-"))
    copy = scratch / ws.name
    shutil.copytree(
        ws, copy, symlinks=True, ignore=lambda d, names: [n for n in names if n in SKIP or ITERATION_OUTPUT.match(n)]
    )
    params = (copy / "params.yaml").read_text()
    (copy / "params.yaml").write_text(re.sub(r"(?m)^(\s+iterations:).*$", r"\1 1", params))
    print(f"running iteration 1 in {copy} ...", flush=True)
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "flows.evolve", "--root", str(copy)],
        cwd=copy,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    timing_file = copy / "metrics" / "timing@1.json"
    if done.returncode or not timing_file.exists():
        sys.exit(f"the flow failed (exit {done.returncode}); scratch copy kept at {copy}")
    t = json.loads(timing_file.read_text())
    print(f"\n{'stage':<14}{'compute s':>10}")
    for name, s in t["stages"].items():
        print(f"{name:<14}{s:>10.1f}")
    print(f"{'all stages':<14}{t['compute_s']:>10.1f}")
    print(f"{'iteration':<14}{t['wall_s']:>10.1f}   (wall time of the `iteration` sub-flow)")
    print(f"\noverhead (Prefect, DVC, MLflow): {t['overhead_s']:.1f} s = {t['overhead_share']:.1%} of the iteration")
    if not args.keep:
        shutil.rmtree(scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
