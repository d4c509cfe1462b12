"""Command line: `qevolve run STAGE` (what dvc.yaml calls), `qevolve dvc-yaml`, `qevolve summary`, `qevolve data`,
`qevolve webshop-data`, `qevolve terminal-import`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qevolve import dvcfile, paths
from qevolve.config import load_params
from qevolve.errors import UserError, debugging, report
from qevolve.lock import under_torchrun, workspace_lock
from qevolve.stages import run_stage


def summary_table(iterations: list[int]) -> str:
    """The evaluation table of the given iterations, read from their metrics files: each success rate
    with its binomial standard error, the games it counts and the episodes the environment failed (left
    out of the rate), then the critic's separation of won and lost episodes for each iteration, so a reader
    can tell what the numbers can say."""
    head = (f"{'policy':<10} {'split':<13} {'success':>8} {'± s.e.':>7} {'won':>7} {'env fail':>8} {'reward':>7} {'steps':>6} {'invalid':>8} "
            f"{'out tok/ep':>10} {'prompt tok/ep':>13}")
    rows = [head, "-" * len(head)]
    for k in iterations:
        path = paths.metrics(f"evaluate@{k}")
        if not path.exists():
            continue
        name = "bc" if k == 0 else f"iter {k}"
        for split, m in json.loads(path.read_text()).items():
            n, p = m["episodes"], m["success_rate"]
            se = (p * (1 - p) / n) ** 0.5 if n else float("nan")
            rows.append(
                f"{name:<10} {split:<13} {p:>8.1%} {se:>7.1%} {f'{round(p * n)}/{n}':>7} {m.get('env_failures', 0):>8} {m['avg_reward']:>7.3f} "
                f"{m['avg_steps']:>6.1f} "
                f"{m['invalid_rate']:>8.1%} {m['output_tokens_per_episode']:>10.1f} {m['prompt_tokens_per_episode']:>13.0f}"
            )
    rows.append("s.e. = sqrt(p(1-p)/n), the binomial standard error: two rates closer than about twice it are not told apart. "
                "env fail: episodes the environment failed (a crash, not the policy), left out of n.")
    for k in iterations:
        path = paths.metrics(f"critic@{k}")
        if k and path.exists():
            c = json.loads(path.read_text())
            if "v_mean_won" in c:
                rows.append(f"critic@{k}: mean V on won episodes {c['v_mean_won']:.3f}, on lost {c['v_mean_lost']:.3f} "
                            f"(separation {c['v_mean_won'] - c['v_mean_lost']:+.3f}; V's std {c['v_std']:.3f})")
            else:  # one critic per level (STEP-HRL)
                rows.append(f"critic@{k}: " + ", ".join(f"{level} mean V {c[f'{level}_v_mean']:.3f}, A {c[f'{level}_advantage_mean']:+.3f}"
                                                        for level in ("high", "low", "progress") if f"{level}_v_mean" in c))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    under_torchrun()  # a trainer's rank dies with its torchrun (and that with the stage that started it)
    parser = argparse.ArgumentParser(prog="qevolve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one pipeline stage in this workspace")
    run.add_argument("stage", help="a stage of the method of params.yaml (experts, base, bc, evaluate, and the method's own: "
                                   "collect, relabel, critic, advantage, policy, rerank for qevolve; online for grpo)")
    run.add_argument("--iteration", type=int, default=None, help="iteration of an iterated stage (collect@K, ..., evaluate@K)")
    run.add_argument("--params", type=Path, default=Path("params.yaml"))
    summary = sub.add_parser("summary", help="print the evaluation table")
    summary.add_argument("--params", type=Path, default=Path("params.yaml"))
    gen = sub.add_parser("dvc-yaml", help="write dvc.yaml for params.yaml (after changing evolve.iterations)")
    gen.add_argument("--params", type=Path, default=Path("params.yaml"))
    sub.add_parser("data", help="prepare ALFWorld's data folder (ALFWORLD_DATA) and print it")
    shop = sub.add_parser("webshop-data", help="write a small synthetic WebShop catalogue and goals (official schema)")
    shop.add_argument("folder", type=Path)
    shop.add_argument("--products", type=int, default=200)
    shop.add_argument("--seed", type=int, default=0)
    imp = sub.add_parser("terminal-import", help="import a folder of Harbor / Terminal-Bench tasks as terminal tasks (DEST/<split>/)")
    imp.add_argument("src", type=Path, help="a folder of task folders")
    imp.add_argument("dest", type=Path, help="the terminal tasks' folder (env.data_dir); the split must be new")
    imp.add_argument("--split", default="test")
    imp.add_argument("--sandbox", default="bwrap", choices=["bwrap", "local"], help="the sandbox the sanity gate runs in (bwrap, or local: no isolation)")
    imp.add_argument("--no-gate", action="store_true", help="skip the sanity gate (the oracle passes, a do-nothing agent fails, twice)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a known error (also QEVOLVE_DEBUG=1)")
    args = parser.parse_args(argv)
    try:
        return _command(args)
    except UserError as err:
        if args.debug or debugging([]):
            raise
        return report(err)


def _command(args) -> int:
    if args.command == "webshop-data":
        from qevolve.envs.webshop_data import write_synthetic

        counts = write_synthetic(args.folder, args.products, args.seed)
        print(f"{args.folder}: {counts['products']} products, {counts['goals']} goals ({counts['train']} train, {counts['test']} test)")
        return 0

    if args.command == "terminal-import":
        from qevolve.config import TerminalConfig
        from qevolve.envs.terminal_import import REPORT, import_tasks

        counts = import_tasks(args.src, args.dest, args.split, TerminalConfig(sandbox=args.sandbox), gate=not args.no_gate)
        print(f"{args.dest / args.split}: " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) + f" (each task's reason in {REPORT})")
        return 0

    if args.command == "data":
        from qevolve.envs.alfworld import ensure_alfworld_data

        print(ensure_alfworld_data())
        return 0
    params = load_params(args.params)
    if args.command == "summary":
        print(summary_table(list(range(params.evolve.iterations + 1))))
        return 0
    if args.command == "dvc-yaml":
        changed = dvcfile.write(params, args.params.parent / "dvc.yaml")
        print(f"dvc.yaml {'written' if changed else 'already up to date'} ({params.evolve.iterations} iterations)")
        return 0
    dvcfile.check(params, args.params.parent / "dvc.yaml")
    from qevolve.training import process_group

    with workspace_lock(args.params.parent, f"stage {args.stage}"), process_group(params.model.device):
        metrics = run_stage(args.stage, params, args.iteration, args.params)
    if metrics:  # the other ranks of a multi-process trainer return none
        print(json.dumps(metrics, indent=2, default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
