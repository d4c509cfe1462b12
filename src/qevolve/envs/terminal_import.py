"""Import a local folder of Harbor / Terminal-Bench 2 tasks, or Terminal-Bench 1 tasks, as terminal tasks
(`qevolve terminal-import SRC DEST`; the layout is `qevolve.envs.terminal`'s).

Such a task's environment is a Docker image built from its Dockerfile. With `build` (`--build`, a Docker engine)
every task with a Dockerfile is imported with its build context and its image built (`qevolve.envs.task_images`),
and runs in it; a failed build is that task's `build_failed`, with its log beside the task. Without, no image is
built: a task is imported when its Dockerfile reduces to what the bwrap sandbox can give, files and commands the host
has:
- `FROM` (the host's system stands in for the image), `WORKDIR /app`, `ENV` (exported for the later
  `RUN`s of `setup.sh`, not into the agent's shell: the gate rejects a task whose oracle needs them),
  `COPY`/`ADD` of the build context's files into /app (copied into `environment/`), and `RUN` commands
  whose programs are on this host and install or fetch nothing (they go to `environment/setup.sh`);
- `LABEL`, `EXPOSE`, `CMD`, `ENTRYPOINT`, `ARG`, `USER` are ignored (the sandbox's user is its own).
Anything else (a package manager, a download, a program the host lacks, a multi-stage `COPY --from`, a
`WORKDIR` other than /app, a docker-compose file with services) marks the task `needs_docker`, with the
Dockerfile's line. The validators are the task's pytest files (`tests/test_*.py`), run as the terminal
environment runs them; where the task's test runner (Harbor's `tests/test.sh`, TB1's `run-tests.sh`) hands pytest
named files, those alone (`[qevolve] validators` in the imported task.toml), as Harbor runs them. The runner itself
is not run: its pytest install needs the network and its verdict is a file it writes, with no per-test results. A
task without pytest files is `unsupported`. A task without an oracle (`solution/solve.sh`, TB1's `solution.sh`)
is imported validator-only (`oracle: false` in the report): it can be evaluated, trained on by RL and rolled
out by an LLM teacher, not demonstrated by an expert (`qevolve.envs.terminal`). Imported tasks then go through
the sanity gate unless asked not to: the oracle passes, a do-nothing agent fails, the oracle passes again; for a
validator-only task, a do-nothing agent fails twice the same way, test by test, and the report says the oracle
check was not possible. `DEST/<split>/import.json` lists every task with its status, reason and oracle.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

import yaml
from tqdm import tqdm

from qevolve.data.atomic import atomic_dir, write_json
from qevolve.envs.task_images import ensure, image_tag, map_base, special_files
from qevolve.errors import UserError

APP = "/app"
REPORT = "import.json"
IGNORED = {
    "LABEL",
    "EXPOSE",
    "CMD",
    "ENTRYPOINT",
    "ARG",
    "USER",
    "MAINTAINER",
    "HEALTHCHECK",
    "STOPSIGNAL",
    "SHELL",
    "VOLUME",
}
FETCHING = {
    "apt",
    "apt-get",
    "aptitude",
    "dpkg",
    "yum",
    "dnf",
    "apk",
    "pacman",
    "zypper",
    "pip",
    "pip3",
    "pipx",
    "uv",
    "conda",
    "mamba",
    "npm",
    "npx",
    "yarn",
    "pnpm",
    "gem",
    "cargo",
    "go",
    "curl",
    "wget",
    "git",
    "snap",
    "brew",
}
"""Programs that install or download: a RUN that calls one needs the image."""
VALIDATOR_ONLY = {
    False: "validator-only (no oracle): not gated; it gives no expert demonstration",
    True: "validator-only (no oracle): the gate checked that the untouched environment fails the validators twice "
    "the same way; "
    "whether the task can be solved could not be checked; it gives no expert demonstration",
}
"""The report's reason for an imported task without an oracle, by whether the gate ran."""


class TaskImportError(UserError, ValueError):
    hint = (
        "qevolve terminal-import SRC DEST: SRC holds task folders (Harbor: task.toml + instruction.md; "
        "Terminal-Bench 1: task.yaml)"
    )


class NeedsDocker(Exception):
    """A Dockerfile line the sandbox cannot stand in for."""


def _instructions(dockerfile: Path) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments), continuations joined, comments dropped."""
    out, pending, start = [], "", 0
    for n, raw in enumerate(dockerfile.read_text().splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        start = start or n
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        text, pending = pending + line, ""
        word, _, rest = text.partition(" ")
        out.append((start, word.upper(), rest.strip()))
        start = 0
    return out


def _programs(command: str) -> list[str]:
    """The program names of a shell command line's simple commands (split at ;, &&, ||, |)."""
    names = []
    for part in re.split(r"&&|\|\||[;|]", command):
        words = [w for w in shlex.split(part, posix=True) if not re.match(r"^\w+=", w)] if part.strip() else []
        while words and words[0] in ("sudo", "env", "nohup", "time", "exec"):
            words = words[1:]
        if words and words[0] not in (
            "cd",
            "export",
            "set",
            "true",
            "false",
            "[",
            "test",
            "echo",
            "printf",
            "mkdir",
            "if",
            "then",
            "fi",
            "for",
            "do",
            "done",
            "while",
            "{",
            "}",
            "(",
            ")",
        ):
            names.append(words[0])
    return names


def outward_links(folder: Path) -> list[Path]:
    """The links under `folder` (itself included) that lead outside it: copying or reading through one would
    bring a host file's content into a task (and so into its data, or an LLM's prompt)."""
    root = folder.resolve()
    found = [folder] if folder.is_symlink() else []
    for top, dirs, files in os.walk(folder):  # links to folders are listed, not entered
        for name in [*dirs, *files]:
            path = Path(top) / name
            if path.is_symlink() and not path.resolve().is_relative_to(root):
                found.append(path)
    return found


def translate(dockerfile: Path) -> tuple[list[tuple[Path, str]], list[str]]:
    """What a Dockerfile amounts to under the sandbox: (files to copy, as (source, path under /app), setup
    commands), or `NeedsDocker` naming the line that needs the image."""
    context = dockerfile.parent
    files, setup, workdir = [], [], APP
    for n, word, rest in _instructions(dockerfile):
        where = f"{dockerfile.name}:{n} `{word} {rest}`"
        if word == "FROM" or word in IGNORED:
            continue
        if word == "WORKDIR":
            workdir = posixpath.normpath(rest if rest.startswith("/") else f"{workdir}/{rest}")
            if workdir != APP:
                raise NeedsDocker(f"{where}: the working directory must be {APP}")
        elif word == "ENV":
            pairs = re.findall(r"(\w+)=(\"[^\"]*\"|'[^']*'|\S+)", rest) or [tuple(rest.split(None, 1))]
            if any(len(p) != 2 for p in pairs):
                raise NeedsDocker(f"{where}: not `ENV key=value`")
            setup += [f"export {k}={v}" for k, v in pairs]
        elif word in ("COPY", "ADD"):
            args = shlex.split(rest)
            if any(a.startswith("--") and not a.startswith("--chown") and not a.startswith("--chmod") for a in args):
                raise NeedsDocker(f"{where}: a COPY from another build stage or with flags needs the image")
            *sources, dst = [a for a in args if not a.startswith("--")]
            slash = dst.endswith("/")
            dst = posixpath.normpath(dst if dst.startswith("/") else f"{workdir}/{dst}") + "/" * slash
            if not (dst + "/").startswith(APP + "/"):
                raise NeedsDocker(f"{where}: copies outside {APP}")
            rel = dst[len(APP) :].strip("/")
            for src in sources:
                if re.match(r"^\w+://", src) or not (context / src).exists():
                    raise NeedsDocker(f"{where}: {src} is not a file of the build context")
                if Path(src).is_absolute() or not (context / src).resolve().is_relative_to(context.resolve()):
                    raise ValueError(f"{where}: {src} leads outside the build context {context}")
                into = (context / src).is_file() and (len(sources) > 1 or dst.endswith("/") or not rel)
                files.append(
                    (context / src, f"{rel}/{Path(src).name}".strip("/") if into else rel)
                )  # a folder: its contents
        elif word == "RUN":
            command = rest
            if command.startswith("["):
                command = shlex.join(json.loads(command))
            for program in _programs(command):
                if program in FETCHING:
                    raise NeedsDocker(f"{where}: `{program}` installs or downloads")
                if shutil.which(program) is None:
                    raise NeedsDocker(f"{where}: `{program}` is not on this host")
            setup.append(f"( {command} )")  # each RUN in its own shell, from the working directory
        else:
            raise NeedsDocker(f"{where}: {word} needs the image")
    return files, setup


def _layout(folder: Path) -> dict | None:
    """Where a task folder keeps its parts (Harbor / TB2, or TB1), or None when it is not a task."""
    if (folder / "task.toml").is_file() and (folder / "instruction.md").is_file():
        return {
            "kind": "harbor",
            "dockerfile": folder / "environment" / "Dockerfile",
            "compose": folder / "environment" / "docker-compose.yaml",
            "solution": folder / "solution" / "solve.sh",
            "runner": folder / "tests" / "test.sh",
        }
    if (folder / "task.yaml").is_file():
        return {
            "kind": "tb1",
            "dockerfile": folder / "Dockerfile",
            "compose": folder / "docker-compose.yaml",
            "solution": folder / "solution.sh",
            "runner": folder / "run-tests.sh",
        }
    return None


def validators(runner: Path, tests: Path) -> list[str]:
    """The files of `tests` a task's test runner (Harbor's `tests/test.sh`, TB1's `run-tests.sh`) hands pytest, as
    `/tests/NAME.py` or `$TEST_DIR/NAME.py`, in order; [] when it names none or there is no runner (then every
    `test_*.py` is a validator). A named file `tests` lacks is a ValueError (unsupported)."""
    if not runner.is_file():
        return []
    named = list(
        dict.fromkeys(re.findall(r"(?:/tests|\$\{?TEST_DIR\}?)/([\w.-]+\.py)\b", runner.read_text(errors="replace")))
    )
    missing = [n for n in named if not (tests / n).is_file()]
    if missing:
        raise ValueError(f"{runner}: runs {missing[0]}, which {tests} does not hold")
    return named


def _compose_services(path: Path) -> int:
    if not path.is_file():
        return 0
    return len((yaml.safe_load(path.read_text()) or {}).get("services", {}) or {})


def _task_toml(meta: dict) -> str:
    """A TB1 task.yaml's settings as a Harbor task.toml."""

    def q(v) -> str:
        return json.dumps(str(v))

    return (
        f'version = "1.0"\n\n[metadata]\ncategory = {q(meta.get("category") or "general")}\ndifficulty = '
        f"{q(meta.get('difficulty') or 'unknown')}\n\n"
        f"[agent]\ntimeout_sec = {float(meta.get('max_agent_timeout_sec', 360))}\n\n[verifier]\ntimeout_sec = "
        f"{float(meta.get('max_test_timeout_sec', 60))}\n"
    )


def convert(folder: Path, out: Path, base: tuple[tuple[str, str], ...] | None = None) -> bool:
    """Write `folder` (a task) as a terminal task at `out`, or raise `NeedsDocker` / `ValueError` (unsupported).
    With `base` (a build's base mapping, `task_images.parse_base`), a task with a Dockerfile becomes a task run in
    its own image: its build context as `environment/` (Harbor's `environment/`; a Terminal-Bench 1 task's folder
    without its tests, solution and task.yaml), the Dockerfile's `FROM` mapped by `base`. True for such a task."""
    parts = _layout(folder)
    links = outward_links(folder)
    if links:
        raise ValueError(f"{links[0]}: a link leading outside the task folder ({len(links)} in all)")
    special = special_files(folder)
    if special:
        raise ValueError(
            f"{special[0]}: not a regular file, a folder or a link (a device, a FIFO or a socket; {len(special)} "
            f"in all)"
        )
    tests = sorted((folder / "tests").glob("test_*.py")) if (folder / "tests").is_dir() else []
    if not tests:
        raise ValueError(f"{folder / 'tests'}: no pytest validators (test_*.py)")
    if _compose_services(parts["compose"]) > 1:
        raise NeedsDocker(f"{parts['compose'].name}: {_compose_services(parts['compose'])} services")
    image = base is not None and parts["dockerfile"].is_file()
    files, setup = translate(parts["dockerfile"]) if parts["dockerfile"].is_file() and not image else ([], [])
    if parts["kind"] == "harbor":
        tomllib.loads((folder / "task.toml").read_text())  # a malformed task.toml is an unsupported task
        instruction, toml = (folder / "instruction.md").read_text(), (folder / "task.toml").read_text()
    else:
        meta = yaml.safe_load((folder / "task.yaml").read_text()) or {}
        if not isinstance(meta.get("instruction"), str):
            raise ValueError(f"{folder / 'task.yaml'}: instruction: expected the task's text")
        instruction, toml = meta["instruction"], _task_toml(meta)
    env = out / "environment"
    if image:
        context = parts["dockerfile"].parent
        skip = ("tests", "solution.sh", "task.yaml") if parts["kind"] == "tb1" else ()
        shutil.copytree(
            context,
            env,
            symlinks=True,
            ignore=lambda top, names: [n for n in names if Path(top) == context and n in skip],
        )
        (env / "Dockerfile").write_text(map_base((env / "Dockerfile").read_text(), base))
    env.mkdir(parents=True, exist_ok=True)
    for src, rel in files:
        target = env / rel if rel else env
        if src.is_dir():
            shutil.copytree(
                src,
                target,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("Dockerfile", "docker-compose.yaml"),
                symlinks=True,
            )
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    if setup:
        (env / "setup.sh").write_text("\n".join(setup) + "\n")
    shutil.copytree(
        folder / "tests", out / "tests", ignore=shutil.ignore_patterns("test.sh", "__pycache__"), symlinks=True
    )
    if parts["solution"].is_file():
        (out / "solution").mkdir()
        shutil.copy2(parts["solution"], out / "solution" / "solve.sh")
    named = validators(parts["runner"], folder / "tests")
    if named:  # appended as a table of its own
        if "qevolve" in tomllib.loads(toml):
            raise ValueError(f"{folder / 'task.toml'}: a [qevolve] table of its own (the importer writes that table)")
        toml = (
            f"{toml.rstrip()}\n\n# the validators {parts['runner'].name} runs (qevolve "
            f"terminal-import)\n[qevolve]\nvalidators = {json.dumps(named)}\n"
        )
    (out / "instruction.md").write_text(instruction.strip() + "\n")
    (out / "task.toml").write_text(toml)
    return image


def import_tasks(
    src: Path,
    dest: Path,
    split: str = "test",
    terminal=None,
    max_steps: int = 40,
    gate: bool = True,
    build: tuple[tuple[str, str], ...] | None = None,
) -> dict:
    """Every task folder under `src` into `dest/<split>/<task id>/` (a new split, written whole or not at all);
    `dest/<split>/import.json` the report. The gate runs in `terminal`'s sandbox (an `env.terminal` config) unless
    `gate` is False. With `build` (a base mapping, `task_images.parse_base`; () maps nothing), every task with a
    Dockerfile gets its image built (`terminal`'s `build_network` and `build_timeout`; the log beside it, `<task
    id>.build.log`) and runs in it; a failed build is that task's `build_failed`. Returns the counts by status."""
    from qevolve.config import TerminalConfig
    from qevolve.envs.base import Task
    from qevolve.envs.terminal import TerminalEnv, has_oracle
    from qevolve.envs.terminal_tasks import gate as sanity_gate

    terminal = terminal or TerminalConfig()

    src, dest = Path(src), Path(dest)
    folders = sorted(f for f in src.iterdir() if f.is_dir() and _layout(f)) if src.is_dir() else []
    if not folders:
        raise TaskImportError(
            f"{src}: no task folders (a Harbor task has task.toml and instruction.md, a Terminal-Bench 1 task "
            f"task.yaml)"
        )
    if (dest / split).exists():
        raise TaskImportError(f"{dest / split}: already exists; import into a new split (--split) or another folder")
    report = {}
    with atomic_dir(dest / split) as tmp:
        env = TerminalEnv(str(dest), terminal, max_steps) if gate else None
        try:
            for folder in tqdm(folders, desc="import", unit="task"):
                try:
                    image = convert(folder, tmp / folder.name, build)
                except NeedsDocker as err:
                    report[folder.name] = {"status": "needs_docker", "reason": str(err)}
                    continue
                except (ValueError, OSError, yaml.YAMLError, tomllib.TOMLDecodeError) as err:
                    shutil.rmtree(tmp / folder.name, ignore_errors=True)
                    report[folder.name] = {"status": "unsupported", "reason": str(err)}
                    continue
                oracle, made = has_oracle(tmp / folder.name), {}
                if image:
                    context, log = tmp / folder.name / "environment", tmp / f"{folder.name}.build.log"
                    made, started = {"image": image_tag(folder.name, context), "build_log": log.name}, time.monotonic()
                    failed = ensure(made["image"], context, log, terminal.build_network, terminal.build_timeout)
                    made["image_s"] = round(time.monotonic() - started, 1)  # pulled or built; about 0 where it was here
                    if failed:
                        shutil.rmtree(tmp / folder.name)
                        report[folder.name] = {"status": "build_failed", "reason": failed, "oracle": oracle, **made}
                        continue
                try:
                    why = sanity_gate(env, Task(folder.name, tmp.name, "imported")) if env else ""
                except (
                    UserError,
                    ValueError,
                    RuntimeError,
                    OSError,
                    subprocess.SubprocessError,
                ) as err:  # an environment that cannot start
                    why, made["error"] = "environment_fails", f"{type(err).__name__}: {err}"[:500]
                # this task's last episode's (an earlier task's info must not stand for an environment that never
                # started)
                else:
                    if why and env.info.get("validation_error"):
                        made["error"] = env.info["validation_error"]
                if why:
                    shutil.rmtree(tmp / folder.name)
                    report[folder.name] = {
                        "status": f"rejected_{why}",
                        "reason": f"the sanity gate: {why.replace('_', ' ')}",
                        "oracle": oracle,
                        **made,
                    }
                else:
                    report[folder.name] = {
                        "status": "imported",
                        "oracle": oracle,
                        "reason": "" if oracle else VALIDATOR_ONLY[bool(env)],
                        **made,
                    }
        finally:
            if env:
                env.close()
        write_json(tmp / REPORT, report)
    counts = {}
    for r in report.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    return counts
