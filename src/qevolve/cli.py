"""Command line: `qevolve run STAGE` (what dvc.yaml calls), `qevolve dvc-yaml`, `qevolve summary`, `qevolve profile`,
`qevolve data`, `qevolve webshop-data`, `qevolve terminal-import`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from qevolve import dvcfile
from qevolve.errors import UserError, debugging, report
from qevolve.lock import under_torchrun, workspace_lock
from qevolve.params import load_params
from qevolve.recipe import load_recipe
from qevolve.stages import run_stage


def main(argv: list[str] | None = None) -> int:
    under_torchrun()  # a trainer's rank dies with its torchrun (and that with the stage that started it)
    parser = argparse.ArgumentParser(prog="qevolve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one pipeline stage in this workspace")
    run.add_argument(
        "stage",
        help="a stage of the method of params.yaml (experts, base, bc, evaluate, and its recipe's own; "
        "`dvc dag` lists this workspace's)",
    )
    run.add_argument(
        "--iteration", type=int, default=None, help="iteration of an iterated stage (collect@K, ..., evaluate@K)"
    )
    run.add_argument("--params", type=Path, default=Path("params.yaml"))
    summary = sub.add_parser("summary", help="print the evaluation table")
    summary.add_argument("--params", type=Path, default=Path("params.yaml"))
    gen = sub.add_parser("dvc-yaml", help="write dvc.yaml for params.yaml (after changing evolve.iterations)")
    gen.add_argument("--params", type=Path, default=Path("params.yaml"))
    prof = sub.add_parser(
        "profile", help="print a profile resolved over params.yaml: the parameters its workspace records"
    )
    prof.add_argument("name", help="profiles/NAME.yaml (`ls profiles/`)")
    prof.add_argument(
        "--root", type=Path, default=Path("."), help="the checkout whose profiles/ and params.yaml it reads"
    )
    sub.add_parser("data", help="prepare ALFWorld's data folder (ALFWORLD_DATA) and print it")
    shop = sub.add_parser("webshop-data", help="write a small synthetic WebShop catalogue and goals (official schema)")
    shop.add_argument("folder", type=Path)
    shop.add_argument("--products", type=int, default=200)
    shop.add_argument("--seed", type=int, default=0)
    imp = sub.add_parser(
        "terminal-import", help="import a folder of Harbor / Terminal-Bench tasks as terminal tasks (DEST/<split>/)"
    )
    imp.add_argument("src", type=Path, help="a folder of task folders")
    imp.add_argument("dest", type=Path, help="the terminal tasks' folder (env.data_dir); the split must be new")
    imp.add_argument("--split", default="test")
    imp.add_argument(
        "--sandbox",
        default="bwrap",
        choices=["bwrap", "local"],
        help="the sandbox the sanity gate runs in (bwrap, or local: no isolation)",
    )
    imp.add_argument(
        "--build",
        action="store_true",
        help="build each task's image from its Dockerfile (a Docker engine; the content-addressed "
        "tag qevolve-task/<task>:<digest> is built once) and run the task in it, instead of importing only what "
        "reduces to files",
    )
    imp.add_argument(
        "--base",
        action="append",
        default=[],
        metavar="ORIGINAL=LOCAL",
        help="with --build: build FROM LOCAL where a Dockerfile names ORIGINAL (without a tag: any tag of it; *: "
        "every base), "
        "for machines that cannot pull it (e.g. onto qevolve-base:bookworm from docker/base.sh); repeatable",
    )
    imp.add_argument(
        "--build-network",
        default="default",
        help="with --build: the network of `docker build` (default: Docker's bridge; "
        "host where dockerd runs without one: the build then reaches this host's loopback services too)",
    )
    imp.add_argument(
        "--build-timeout", type=float, default=1800.0, help="with --build: seconds a task's build may take"
    )
    imp.add_argument(
        "--no-gate",
        action="store_true",
        help="skip the sanity gate (the oracle passes, a do-nothing agent fails, the oracle passes again; "
        "without an oracle: a do-nothing agent fails twice the same way)",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a known error (also QEVOLVE_DEBUG=1)"
    )
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
        print(
            f"{args.folder}: {counts['products']} products, {counts['goals']} goals ({counts['train']} train, "
            f"{counts['test']} test)"
        )
        return 0

    if args.command == "terminal-import":
        from qevolve.config import TerminalConfig
        from qevolve.envs.task_images import parse_base
        from qevolve.envs.terminal_import import REPORT, TaskImportError, import_tasks

        if args.base and not args.build:
            raise TaskImportError("--base maps the images a Dockerfile builds FROM: it needs --build")
        try:
            base = parse_base(args.base) if args.build else None
            terminal = TerminalConfig(
                sandbox=args.sandbox, build_network=args.build_network, build_timeout=args.build_timeout
            )
        except ValueError as err:
            raise TaskImportError(str(err)) from None
        counts = import_tasks(args.src, args.dest, args.split, terminal, gate=not args.no_gate, build=base)
        print(
            f"{args.dest / args.split}: "
            + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
            + f" (each task's reason and oracle in {REPORT}; a validator-only task gives no expert demonstration)"
        )
        return 0

    if args.command == "profile":
        import yaml

        from qevolve.params import find_profile, parse_params, resolve_params

        path = find_profile(args.root, args.name)
        raw = resolve_params(path)
        parse_params(raw, path)  # a profile that does not validate says so, naming its keys
        print(yaml.safe_dump(raw, sort_keys=False), end="")
        return 0

    if args.command == "data":
        from qevolve.envs.alfworld import ensure_alfworld_data

        print(ensure_alfworld_data())
        return 0
    params = load_params(args.params)
    if args.command == "summary":
        from qevolve.summary import (
            summary_table,
        )  # here: a stage's `qevolve run` never prints it, so it is no stage's dep

        print(summary_table(list(range(params.evolve.iterations + 1))))
        return 0
    if args.command == "dvc-yaml":
        changed = dvcfile.write(params, args.params.parent / "dvc.yaml")
        print(f"dvc.yaml {'written' if changed else 'already up to date'} ({params.evolve.iterations} iterations)")
        return 0
    dvcfile.check(params, args.params.parent / "dvc.yaml")
    if not load_recipe(params.method).stage(args.stage, params).accelerated:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks CUDA: this stage's process never touches the GPU
    from qevolve.training import process_group

    with workspace_lock(args.params.parent, f"stage {args.stage}"), process_group(params.model.device):
        metrics = run_stage(args.stage, params, args.iteration, args.params)
    if metrics:  # the other ranks of a multi-process trainer return none
        print(json.dumps(metrics, indent=2, default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
