"""The import funnel of a public terminal task set: a stratified sample of its task folders through
`qevolve terminal-import` (the sanity gate in the `--sandbox`), counted by outcome, and each blocked or rejected
task by the first thing that stopped it.

    python -m benchmarks.terminal_import FOLDER [--sample 200] [--seed 0] [--sandbox bwrap] [--out FILE.json]
    python -m benchmarks.terminal_import FOLDER --sample 12 --build [--base '*=qevolve-base:bookworm']
        [--build-network host] [--keep DEST [--keep-images]]

FOLDER holds task folders (Harbor / Terminal-Bench 2, or Terminal-Bench 1). The sample is stratified by
difficulty, the `_easy` / `_medium` / `_hard` ending of a folder's name where it has one (TermiGen's names
carry it, sometimes with a `_1` after; its task.toml files all say `medium`), in proportion, drawn with `--seed`.
Beside the funnel, what the sampled tasks' Dockerfiles need that the bwrap sandbox cannot give, a task counted
under each of its needs (the funnel names only the first). `--out` keeps the sample's
names and each task's status and reason (JSON).

`--build` imports the sample with each task's image built from its Dockerfile (`qevolve terminal-import --build`,
with `--base` and `--build-network`), one task at a time, and times each (build and gate); the funnel then groups
failed builds by what their logs say (`build_cause`). `--keep DEST` keeps the imported tasks (DEST/<task>/<task>/),
`--keep-images` their images (for an evaluation); else each image is removed once the next task's is built, so the
layers two tasks share stay in Docker's build cache as on an engine that keeps its images (188 of TermiGen's 200
sampled Dockerfiles begin with the same four steps), and the disk holds about two images. With `--out`,
the file is rewritten after every task, and a run given an `--out` that a killed run of the same sample wrote goes
on from the first task it lacks.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from qevolve.config import TerminalConfig
from qevolve.data.atomic import write_json
from qevolve.envs.task_images import parse_base, present
from qevolve.envs.terminal_import import APP, FETCHING, REPORT, _instructions, _programs, import_tasks

STRATUM = re.compile(r"_(easy|medium|hard)(_\d+)?$")


def stratum(name: str) -> str:
    """A task folder's difficulty, from its name (`STRATUM`), else `other`."""
    return m.group(1) if (m := STRATUM.search(name)) else "other"


def stratified(names: list[str], n: int, seed: int) -> list[str]:
    """`n` of `names` (all of them if fewer), each `stratum` in proportion to its size, the remainders to the
    largest fractions, drawn with `seed`."""
    strata: dict[str, list[str]] = {}
    for name in sorted(names):
        strata.setdefault(stratum(name), []).append(name)
    n = min(n, len(names))
    exact = {k: n * len(v) / len(names) for k, v in strata.items()}
    take = {k: int(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: (take[k] - exact[k], k))[: n - sum(take.values())]:
        take[k] += 1
    rng = random.Random(seed)
    return sorted(name for k in sorted(strata) for name in rng.sample(strata[k], take[k]))


BUILD_CAUSES = (
    (
        r"Unable to locate package|has no installation candidate|Package .* is not available",
        "apt: a package the base's Debian lacks",
    ),
    (r"externally-managed-environment", "pip: the base's Python is externally managed"),
    (r"No matching distribution|Could not find a version", "pip: no matching distribution"),
    (r"pip3?: (command )?not found|No module named pip", "pip: not in the base"),
    (r"did not end in", "the build timed out"),
    (
        r"Temporary failure resolving|Could not resolve|Network is unreachable|Name or service not known",
        "network: a download failed",
    ),
    (
        r"^docker build exited with status 4: .*\bwget\b|^docker build exited with status [67]: .*\bcurl\b",
        "network: wget or curl could not reach its host (here only the package indexes answer)",
    ),
    (r"COPY failed|failed to compute cache key|not found: not found", "COPY: a file missing from the context"),
    (r"failed to solve|error from sender", "the builder"),
)
"""Failed builds grouped by what their logs' last lines say (first match)."""


def build_cause(reason: str) -> str:
    return next(
        (label for pattern, label in BUILD_CAUSES if re.search(pattern, reason)),
        "other (the task's own build step failed)",
    )


def cause(reason: str) -> str:
    """What a reason says stopped the task, without the task's own details (its Dockerfile line, its paths)."""
    if reason.startswith(("docker build exited", "the build did not end", "docker could not run")):
        return build_cause(reason)
    reason = re.sub(r"^Dockerfile:\d+ `[^`]*`: ", "", reason)
    reason = re.sub(r"^\S*/([^/\s]+/)?([^/\s:]+): ", r"\2: ", reason)
    return re.sub(r"\d+ services", "several services", reason)


def needs(dockerfile: Path) -> set[str]:
    """Everything in a Dockerfile that only an image built from it gives: each installing or downloading program
    its RUNs call, a working directory or a COPY outside /app, a base image."""
    out = set()
    for _, word, rest in _instructions(dockerfile) if dockerfile.is_file() else []:
        if word == "FROM":
            out.add(f"base image {rest.split()[0]}")
        elif word == "WORKDIR" and rest.rstrip("/") != APP:
            out.add("WORKDIR outside /app")
        elif word in ("COPY", "ADD") and not shlex.split(rest)[-1].startswith(APP):
            out.add("COPY outside /app")
        elif word == "RUN":
            out |= {
                f"RUN {p}"
                for p in _programs(shlex.join(json.loads(rest)) if rest.startswith("[") else rest)
                if p in FETCHING
            }
    return out


def dockerfile(task: Path) -> Path:
    """A task folder's Dockerfile: Harbor's `environment/Dockerfile`, else Terminal-Bench 1's at its top."""
    return (
        task / "environment" / "Dockerfile" if (task / "environment" / "Dockerfile").is_file() else task / "Dockerfile"
    )


def funnel(report: dict) -> list[tuple[str, str, int]]:
    """(status, cause, tasks) rows, by status then count."""
    counts = Counter()
    for r in report.values():
        status = r["status"] + (" (validator-only)" if r["status"] == "imported" and not r.get("oracle", True) else "")
        counts[status, "" if r["status"] == "imported" else cause(r["reason"])] += 1
    return sorted(((s, c, n) for (s, c), n in counts.items()), key=lambda x: (x[0], -x[2], x[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--sample", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sandbox", default="bwrap", choices=("bwrap", "local"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--build", action="store_true", help="build each task's image (a Docker engine)")
    ap.add_argument("--base", action="append", default=[], metavar="ORIGINAL=LOCAL")
    ap.add_argument("--build-network", default="default")
    ap.add_argument("--keep", type=Path, help="with --build: keep the imported tasks here (DEST/<task>/<task>/)")
    ap.add_argument("--keep-images", action="store_true", help="with --build: keep the built images")
    args = ap.parse_args(argv)
    names = [d.name for d in args.folder.iterdir() if d.is_dir() and not d.is_symlink()]
    sample = stratified(names, args.sample, args.seed)
    cfg = TerminalConfig(sandbox=args.sandbox, build_network=args.build_network)
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="qevolve-bench-import-") as tmp:
        if not args.build:
            src = Path(tmp) / "src"
            for name in sample:  # copied, not linked: the importer refuses a task folder that is a link
                shutil.copytree(args.folder / name, src / name, symlinks=True)
            counts = import_tasks(src, Path(tmp) / "dest", "sample", cfg)
            report = json.loads((Path(tmp) / "dest" / "sample" / REPORT).read_text())
        else:
            report, dest = {}, args.keep or Path(tmp) / "dest"
            done = resumed(args.out, sample)
            if done:
                report, seconds = done["report"], done["build"]["seconds"]
                print(
                    f"{args.out}: {len(report)} of the {len(sample)} tasks done by an earlier run, going on", flush=True
                )
            previous = None
            for name in (n for n in sample if n not in report):  # one at a time: each split DEST/<task>/
                shutil.copytree(args.folder / name, Path(tmp) / "src" / name / name, symlinks=True)
                started = time.monotonic()
                import_tasks(Path(tmp) / "src" / name, dest, name, cfg, build=parse_base(args.base))
                seconds[name] = round(time.monotonic() - started, 1)
                report |= json.loads((dest / name / REPORT).read_text())
                image = report[name].get("image")
                if image and present(image):
                    size = subprocess.run(
                        ["docker", "image", "inspect", "--format", "{{.Size}}", image], capture_output=True, text=True
                    ).stdout.strip()
                    report[name]["image_mb"] = round(int(size) / 1e6) if size.isdigit() else None
                    if (
                        not args.keep_images
                    ):  # the previous task's image goes once this one is built: the layers they share stay cached
                        remove(previous)
                        previous = image
                built = f", image {report[name]['image_s']:.0f} s" if "image_s" in report[name] else ""
                print(
                    f"{name}: {report[name]['status']} in {seconds[name]:.0f} s{built} ({len(report)} of "
                    f"{len(sample)})",
                    flush=True,
                )
                if args.out:
                    write(args, names, sample, report, seconds)
            remove(previous)
            counts = Counter(r["status"] for r in report.values())
    strata, gated_in = Counter(stratum(n) for n in sample), "each task's image" if args.build else args.sandbox
    oracles = sum(
        (args.folder / n / "solution" / "solve.sh").is_file() or (args.folder / n / "solution.sh").is_file()
        for n in names
    )
    print(
        f"{args.folder}: {len(sample)} of {len(names)} task folders "
        f"({', '.join(f'{k} {v}' for k, v in sorted(strata.items()))}), "
        f"seed {args.seed}, gate in {gated_in}; {oracles} of the {len(names)} have an oracle\n"
    )
    print(f"{'status':<34} {'tasks':>5}  first thing that stopped it")
    for status, why, n in funnel(report):
        print(f"{status:<34} {n:>5}  {why}")
    print(f"\n{sum(counts.values())} tasks: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    if seconds:
        built = sorted(t for n, t in seconds.items() if report[n]["status"] != "build_failed")
        sizes = sorted(r["image_mb"] for r in report.values() if r.get("image_mb"))
        print(
            f"import with the build and gate, per task: median {statistics.median(seconds.values()):.0f} s (min "
            f"{min(seconds.values()):.0f}, "
            f"max {max(seconds.values()):.0f})"
            + (f"; of the {len(built)} built, median {statistics.median(built):.0f} s" if built else "")
            + (f"; image size median {statistics.median(sizes):.0f} MB" if sizes else "")
        )
    needed = Counter(need for name in sample for need in needs(dockerfile(args.folder / name)))
    print(f"\n{'what the Dockerfiles need':<66} {'tasks':>5}")
    for need, n in sorted(needed.items(), key=lambda x: (-x[1], x[0])):
        print(f"{need:<66} {n:>5}")
    if args.out:
        write(args, names, sample, report, seconds, needed)
    return 0


def remove(image: str | None) -> None:
    if image:
        subprocess.run(["docker", "rmi", "-f", image], capture_output=True)


def write(args, names, sample, report, seconds, needed=None) -> None:
    """The `--out` file (atomically): the sample, each task's outcome, and with `--build` the times so far."""
    write_json(
        args.out,
        {
            "folder": str(args.folder),
            "seed": args.seed,
            "sandbox": "docker, each task's image" if args.build else args.sandbox,
            "of": len(names),
            "sample": sample,
            "report": report,
            **({"needs": dict(needed)} if needed is not None else {}),
            **({"build": {"base": args.base, "network": args.build_network, "seconds": seconds}} if args.build else {}),
        },
    )


def resumed(out: Path | None, sample: list[str]) -> dict | None:
    """What a killed `--build` run with this `--out` and the same sample finished, or None."""
    if not out or not out.is_file():
        return None
    done = json.loads(out.read_text())
    if done.get("sample") != sample or "build" not in done:
        raise SystemExit(f"{out}: written for another sample or without --build; give a new --out")
    return done


if __name__ == "__main__":
    raise SystemExit(main())
