"""The benchmark table: the paper's comparison, ablations and online baseline, run in miniature.

A spec (`benchmarks/table.yaml`, `benchmarks/table-smoke.yaml`) names workspaces, each a set of parameter
changes over a base profile run for some iterations and seeds, and rows, each one stage's evaluation in
one workspace. Every workspace and seed is an evolution of its own (`flows.evolve`) in
`<out>/<workspace>-s<seed>/`, and all of them share one DVC cache: a stage whose code, parameters and
inputs match one already run anywhere in the table (BC per seed, `collect@1` for the ablations) is
checked out from DVC's run cache instead of being computed again. A killed table resumes the same way.

    python -m flows.table benchmarks/table.yaml                 # into runs/<name>/
    python -m flows.table benchmarks/table-smoke.yaml --out /tmp/smoke
    python -m flows.table benchmarks/table.yaml --seeds 1       # the first seed only
    python -m flows.table benchmarks/multi2.yaml --seed 1 --env-steps N --out runs/s1   # one seed, elsewhere
    python -m flows.table benchmarks/multi2.yaml --seed 0 --workspace multi2 --env-steps N --out runs/s0b  # one
    python -m flows.table benchmarks/multi2.yaml --merge runs/s0/results.json runs/s1/results.json

It writes `<out>/table.md` (mean and std over seeds per row), `<out>/results.json`, `<out>/curves/`
and their DVC plots rendered to `<out>/success_by_iteration.png` and `success_by_env_steps.png`, and logs
one MLflow parent run for the table with one child run per row and seed (`<out>/mlflow.db`). The spec and
each workspace's parameters are `flows.table_spec`'s, the results and their reports `flows.table_report`'s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from prefect import flow

from flows.provenance import git_commit, machine, packages, packages_sha256
from flows.table_report import code_of, gather, log_table, markdown, merge, render_plots, write_curves
from flows.table_spec import budget, first_seeds, load_spec, only_seeds, only_workspaces, workspace_params
from flows.workspace import ROOT, prepare
from qevolve.config import ConfigError
from qevolve.data.atomic import atomic_path, write_json
from qevolve.errors import inside


@flow(name="table")
def table(
    spec_path: str,
    out: str | None = None,
    seeds: int | None = None,
    only: list[int] | None = None,
    env_steps: int | None = None,
    workspaces: list[str] | None = None,
) -> dict:
    """Run every workspace and seed of the spec (each an evolution; only the first `seeds` seeds, or the
    seeds in `only`, and only `workspaces`, if given), then write and log the table. `env_steps`: the
    budget of the `match_env_steps` workspaces, where the workspace they match does not run here."""
    from flows.evolve import evolve

    start = time.perf_counter()
    commit = git_commit()
    full = spec = load_spec(Path(spec_path))
    if seeds is not None:
        spec = first_seeds(spec, seeds)
    if only:
        spec = only_seeds(spec, only)
    if workspaces:
        spec = only_workspaces(spec, workspaces)
    out_dir = Path(out or ROOT / "runs" / spec.name).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{out_dir / 'mlflow.db'}")
    # Seed-major: every workspace's first seed before any second seed, so a partial table has every row.
    plan = [(name, seed) for i, seed in enumerate(spec.seeds) for name, ws in spec.workspaces.items() if i < ws.seeds]
    for name, ws in spec.workspaces.items():  # validate every workspace's parameters before any compute
        for seed in spec.seeds[: ws.seeds]:
            workspace_params(spec, name, seed, 1 if ws.match_env_steps else None)
    budgets = {}
    for n, (name, seed) in enumerate(plan, 1):
        if spec.workspaces[name].match_env_steps:
            budgets[name] = budget(full, name, out_dir, env_steps)
        root = inside(out_dir, f"{name}-s{seed}", f"{spec_path}: workspace")
        prepare(root, workspace_params(spec, name, seed, budgets.get(name)), out_dir / "dvc-cache")
        print(f"[table] {n}/{len(plan)}: {name} seed {seed} in {root}", flush=True)
        try:
            evolve(root=str(root))
        finally:
            os.chdir(ROOT)
    results = gather(spec, out_dir)
    wall = time.perf_counter() - start
    write_curves(spec, out_dir)
    images = render_plots(out_dir)
    listing = packages()
    run_id = log_table(spec, results, wall, images, commit, listing)
    text = markdown(results, spec.by_type, spec.splits())
    write_json(
        out_dir / "results.json",
        {
            "spec": spec.model_dump(),
            "rows": results,
            "wall_s": wall,
            "git_commit": commit,
            "mlflow_parent_run_id": run_id,
            "env_steps_budget": budgets,
            "packages_sha256": packages_sha256(listing),
            "packages": listing,
            "machine": machine(),
        },
    )
    with atomic_path(out_dir / "table.md") as tmp:
        tmp.write_text(text)
    return {
        "out": str(out_dir),
        "mlflow_parent_run_id": run_id,
        "wall_s": wall,
        "table": text,
        "images": [str(p) for p in images],
        "git_commit": commit,
    }


def write_merged(
    spec_path: str, files: list[str], out: str | None = None, replace: bool = False, mixed: bool = False
) -> dict:
    """`merge` of the results files into `<out>/table.md` and `<out>/results.json` (no runs, no plots:
    those stay with each run's own folder and MLflow database). With `mixed`, a table joined from other code
    says which."""
    spec = load_spec(Path(spec_path))
    results, sources = merge(spec, [Path(f) for f in files], replace, mixed)
    out_dir = Path(out or ROOT / "runs" / spec.name).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(results, spec.by_type, spec.splits())
    codes = {c for s in sources for c in code_of(s)}
    if len(codes) > 1:
        text += (
            f"\n**Joined from runs of different code** (`--mixed-code`): commits "
            f"{', '.join(sorted({str(c) for c, _ in codes}))}, "
            f"{len({p for _, p in codes})} package listing(s); a difference between rows may be the code's.\n"
        )
    write_json(out_dir / "results.json", {"spec": spec.model_dump(), "rows": results, "merged_from": sources})
    with atomic_path(out_dir / "table.md") as tmp:
        tmp.write_text(text)
    return {"out": str(out_dir), "table": text, "sources": sources}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", help="table spec, e.g. benchmarks/table.yaml")
    parser.add_argument("--out", help="output folder (default runs/<spec name>)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--seeds", type=int, help="run only the spec's first N seeds")
    which.add_argument(
        "--seed",
        type=int,
        action="append",
        help="run only this seed of the spec (repeatable); join the runs with --merge",
    )
    which.add_argument(
        "--merge",
        nargs="+",
        metavar="RESULTS",
        help="run nothing: join these results.json files of the spec's table into one table",
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="with --merge: a later file's seed with other figures replaces the earlier file's",
    )
    parser.add_argument(
        "--mixed-code",
        action="store_true",
        help="with --merge: join files computed with other code (commits, packages); the table says so",
    )
    parser.add_argument(
        "--workspace", action="append", help="run only this workspace of the spec (repeatable), with its rows"
    )
    parser.add_argument(
        "--env-steps",
        type=int,
        help="the budget of the match_env_steps workspaces when the workspace they match does not run here",
    )
    args = parser.parse_args(argv)
    if (args.replace or args.mixed_code) and not args.merge:
        parser.error("--replace and --mixed-code: only with --merge")
    try:
        if args.merge:
            result = write_merged(args.spec, args.merge, args.out, args.replace, args.mixed_code)
            print(result["table"])
            for s in result["sources"]:
                for r in s.get("replaced", []):
                    print(
                        f"{s['file']}: replaced seed {r['seed']} of row {r['row']!r} that an earlier file gave "
                        f"with other figures"
                    )
            print(
                "joined "
                + ", ".join(
                    f"{s['file']} ({'a joined table' if 'merged_from' in s else 'commit ' + str(s['git_commit'])})"
                    for s in result["sources"]
                )
                + f" into {result['out']}"
            )
            return 0
        result = table(args.spec, args.out, args.seeds, args.seed, args.env_steps, args.workspace)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    print()
    print(result["table"])
    print(
        f"wall time {result['wall_s'] / 60:.1f} min at commit {result['git_commit']}; MLflow parent run "
        f"{result['mlflow_parent_run_id']} "
        f"in {result['out']}/mlflow.db; plots {', '.join(result['images'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
