"""The evolution as a Prefect flow: experts -> base -> bc -> evaluate@0 (then the Q-Evolve iterations).

Each stage is a task that DVC skips when its inputs are unchanged, so a second run does no work and a
killed run resumes at the first unfinished stage. Run it from the workspace root:

    python -m flows.evolve
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

from prefect import flow

from flows.tracking import log_stage, start_evolution
from qevolve.cli import summary_table
from qevolve.config import load_params
from qevolve.envs.alfworld import ensure_alfworld_data
from qevolve.stages import stage_name
from tasks import run_pipeline_stage

ROOT = Path(__file__).resolve().parent.parent


def pipeline() -> list[tuple[str, int | None]]:
    """(stage, iteration) in run order; dvc.yaml declares the same stages (a test checks it)."""
    return [("experts", None), ("base", None), ("bc", None), ("evaluate", 0)]


@flow(name="evolve")
def evolve(root: str = str(ROOT)) -> dict:
    """Expert demonstrations, behaviour cloning, then evaluation; each stage tracked in MLflow."""
    os.chdir(root)
    params = load_params("params.yaml")
    if params.env.name == "alfworld":
        ensure_alfworld_data()
    results = {}
    with start_evolution(params, run_name=f"evolve-{time.strftime('%Y%m%d-%H%M%S')}") as run:
        for stage, iteration in pipeline():
            result = run_pipeline_stage(stage, iteration, root)
            log_stage(result)
            results[stage_name(stage, iteration)] = result
        results["mlflow_run_id"] = run.info.run_id
    return results


def peak_rss_gb() -> float:
    """Peak resident memory of this process or any finished child (Linux reports KiB)."""
    return max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 2**20


def main() -> int:
    start = time.perf_counter()
    results = evolve()
    params = load_params(ROOT / "params.yaml")
    ran = [name for name, r in results.items() if isinstance(r, dict) and r.get("ran")]
    print()
    print(summary_table(list(range(params.evolve.iterations + 1))))
    print()
    print(f"stages run: {', '.join(ran) or 'none (all up to date)'}; wall time {time.perf_counter() - start:.0f}s; "
          f"peak RSS {peak_rss_gb():.2f} GB")
    print("Where to look next:")
    print("  mlflow ui --backend-store-uri sqlite:///mlflow.db   # runs, metrics, adapter, trajectories")
    print("  dvc dag && dvc metrics show && dvc plots show        # lineage and results")
    print("  prefect server start                                 # flow runs in the Prefect UI")
    return 0


if __name__ == "__main__":
    sys.exit(main())
