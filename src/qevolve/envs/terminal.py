"""Terminal tasks behind the `TextEnv` protocol (`env.name: terminal`; ../shared/research/terminaltraj.md).

A task is a folder in the Harbor / Terminal-Bench 2 layout, under `env.data_dir/<split>/<task id>/`:
- `instruction.md`: what the agent is asked to do;
- `task.toml`: `[metadata] category` (the task's type: its family or domain), `difficulty`;
  `[agent] timeout_sec` (the episode's wall clock), `[verifier] timeout_sec` (the validators', at most
  `env.terminal.verifier_timeout`); `[environment]` `memory_mb`, `cpus`, `storage_mb` (the largest file) given
  up to `env.terminal`'s, and `allow_internet`, the host's network for the agent's sandbox only where
  `env.terminal.allow_internet` allows it (`task_limits`);
- `environment/`: the files the episode starts with, copied into its working directory (/app), and an
  optional `setup.sh` run there first (it is not left for the agent to read). Or, holding a `Dockerfile`, the
  build context of the task's own image (`qevolve terminal-import --build`): the episode then runs in a
  container of that image (`qevolve.envs.task_images`; built or pulled when missing), in a copy of what the
  image holds in its working directory, mounted there, and so do the validators, with the image's python3;
- `tests/`: pytest validators of the end state, which the agent never sees: every `test_*.py`, or the files
  `task.toml`'s `[qevolve] validators` names (the rest of `tests/` then only supports them; an imported task's are
  the ones its `tests/test.sh` or `run-tests.sh` hands pytest, as Harbor runs them);
- `solution/solve.sh`: the oracle, one command per line (the expert's steps; a script whose lines do not
  each parse alone is one step). Optional: a task without one is *validator-only*. It can be played, evaluated,
  trained on by RL and rolled out by an LLM teacher (the validators decide), but gives no expert demonstration
  (an expert's split holding one is refused when its tasks are listed) and no scripted teacher.

An episode is a persistent shell in a sandbox (`qevolve.envs.sandbox`, `env.terminal.sandbox`); an action is one
command, or `submit`. The observation is the command's output and its exit status. The valid actions it lists, for
`policy.action_mode: admissible`, are the task's own candidate commands (`candidates`). A step is invalid (relabel's
"rejected") when the command is empty or does not parse, is not found (status 127) or timed out. When the agent submits,
reaches `env.max_steps` or the wall clock, the validators run, and inherit nothing from the agent (`_validate`): its
sandbox is closed first, which ends every process it started; a fresh sandbox over the same /app, with a clean
environment and a new shell (no variables, functions or aliases of the agent's; the task's own `export` lines of
setup.sh, a Dockerfile's ENV, are set again), runs the task's `tests/`, bound read-only at /tests from a copy the agent
never saw, with Python in isolated mode (nothing from /app or the environment on its path) and pytest's configuration,
rootdir and conftest discovery confined to /tests (no plugin, ini file or conftest.py of /app counts). pytest writes its
report into a folder only that sandbox sees, under a random name, and the host reads it only as a regular file. won =
pytest exited 0 and every test passed; the reward is 1/0, or the share passed (`env.terminal.partial_reward`). A
validation that cannot run, times out or crashes is a lost episode (`info["validation_error"]`), never a dropped one.
The per-test results are in the last step's `info`. Residual risk: tests that import the agent's code run it in the
validators' process."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from qevolve.envs.base import Observation, Step, Task, check_types
from qevolve.envs.host import cap_folder, read_regular, release_folder, remove_tree
from qevolve.envs.sandbox import Limits, SandboxError, Session, available, encode
from qevolve.envs.task_images import ensure, export_workdir, image_tag, workdir

SUBMIT = "submit"
VALIDATOR_MOUNTS = ("/tests", "/qevolve", "/report")
"""Where the validators' sandbox sees the tests, pytest's configuration and its report folder."""


class TaskError(ValueError):
    """A task folder that does not hold what the layout needs."""


Seconds = Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False, strict=True)]
Amount = Annotated[float, Field(ge=0, le=2**20, allow_inf_nan=False, strict=True)]


EXPECTED = {
    "agent.timeout_sec": "a finite number of seconds, 0 < s <= 86400",
    "verifier.timeout_sec": "a finite number of seconds, 0 < s <= 86400",
    **{
        f"environment.{k}": "a finite number >= 0 (0 or absent: the config's)"
        for k in ("cpus", "memory_mb", "storage_mb")
    },
    "environment.allow_internet": "true or false",
    "metadata.category": "a non-empty string",
    "qevolve.validators": "a list of file names in tests/ (name.py, no folder)",
}
"""What each checked key of `task.toml` must hold, for the error that names it."""


class _Table(BaseModel):
    model_config = ConfigDict(
        extra="allow"
    )  # Harbor's other keys (version, author, difficulty, ...) are read by no one


class _Metadata(_Table):
    category: Annotated[str, Field(min_length=1, strict=True)] = "general"


class _Agent(_Table):
    timeout_sec: Seconds = 360.0


class _Verifier(_Table):
    timeout_sec: Seconds = 60.0


class _Environment(_Table):
    cpus: Amount = 0
    memory_mb: Amount = 0
    storage_mb: Amount = 0
    allow_internet: StrictBool = False


class _Qevolve(_Table):
    validators: list[Annotated[str, Field(pattern=r"^[\w.-]+\.py$", strict=True)]] = []


class TaskToml(_Table):
    """The schema of `task.toml` (every table and key optional): numbers finite and in range, 0 or absent
    meaning the config's for the `[environment]` amounts."""

    metadata: _Metadata = _Metadata()
    agent: _Agent = _Agent()
    verifier: _Verifier = _Verifier()
    environment: _Environment = _Environment()
    qevolve: _Qevolve = _Qevolve()


def read_task(folder: Path) -> dict:
    """The task's settings from `task.toml` (an error naming the file and field when malformed)."""
    folder = Path(folder)
    for need in ("instruction.md", "tests"):
        if not (folder / need).exists():
            raise TaskError(f"{folder / need}: missing; a terminal task needs instruction.md, tests/ and task.toml")
    path = folder / "task.toml"
    try:
        meta = TaskToml.model_validate(tomllib.loads(path.read_text()))
    except FileNotFoundError:
        raise TaskError(f"{path}: missing; a terminal task needs instruction.md, tests/ and task.toml") from None
    except tomllib.TOMLDecodeError as err:
        raise TaskError(f"{path}: not valid TOML: {err}") from None
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(part) for part in first["loc"] if isinstance(part, str))
        raise TaskError(
            f"{path}: {field} must be {EXPECTED.get(field, 'a table')} ({first['msg'].lower()}), got "
            f"{first.get('input')!r}"
        ) from None
    env = meta.environment
    out = {
        "category": meta.metadata.category,
        "agent_timeout": meta.agent.timeout_sec,
        "verifier_timeout": meta.verifier.timeout_sec,
        "cpus": env.cpus,
        "memory_mb": env.memory_mb,
        "storage_mb": env.storage_mb,
        "allow_internet": env.allow_internet,
        "validators": meta.qevolve.validators,
    }
    missing = [f for f in out["validators"] if not (folder / "tests" / f).is_file()]
    if missing:
        raise TaskError(f"{path}: qevolve.validators names {missing[0]}, which is not a file in {folder / 'tests'}")
    return out


ORACLE = Path("solution") / "solve.sh"


def has_oracle(folder: Path) -> bool:
    return (Path(folder) / ORACLE).is_file()


def oracle_steps(script: str) -> list[str]:
    """`solve.sh` as steps: its command lines (comments, blank lines and the shebang dropped), or the whole
    script as one step when some line does not parse alone (a heredoc, a multi-line block)."""
    lines = [ln for ln in script.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if all(_parses(ln) for ln in lines):
        return lines
    return [script]


def candidates(folder: Path, oracle: list[str]) -> list[str]:
    """The commands `policy.action_mode: admissible` chooses among, the same at every step (the spec's
    miniature): the oracle's steps, the task's plausible mistakes (`solution/mistakes.json`, where the
    task has them), a look (`ls -la`) and `submit`."""
    path = folder / "solution" / "mistakes.json"
    try:
        mistakes = json.loads(path.read_text()) if path.is_file() else []
    except ValueError as err:
        mistakes = err
    if not isinstance(mistakes, list) or not all(
        isinstance(g, list) and all(isinstance(c, str) for c in g) for g in mistakes
    ):
        raise TaskError(
            f"{path}: expected a JSON list of lists of commands (one list per oracle step), got {str(mistakes)[:100]!r}"
        )
    wrong = [c for group in mistakes for c in group]
    return list(dict.fromkeys([*oracle, *wrong, "ls -la", SUBMIT]))


def task_limits(meta: dict, cfg, validators: bool = False) -> Limits:
    """The sandbox limits of a task (`read_task`) under `cfg` (`env.terminal`): what its `[environment]` asks for, up
    to the config's (memory, CPUs, the largest file at most its storage), the network only where the task asks for
    it and `cfg.allow_internet` allows it, and never for the validators."""

    def up_to(asked, cap):
        return min(asked, cap) if asked and cap else asked or cap

    return Limits(
        memory_mb=int(up_to(meta["memory_mb"], cfg.memory_mb)),
        processes=cfg.processes,
        file_mb=int(up_to(meta["storage_mb"], cfg.file_mb)),
        tmp_mb=cfg.tmp_mb,
        cpus=float(up_to(meta["cpus"], cfg.cpus)),
        network=meta["allow_internet"] and cfg.allow_internet and not validators,
    )


def _parses(command: str) -> bool:
    """bash reads `command` alone without an error or a warning (an unterminated heredoc only warns). The command
    goes to bash on its stdin, never as an argument: any bytes (NUL) and any length (past the kernel's 128 KiB
    for one argument)."""
    done = subprocess.run(["bash", "-n"], input=encode(command), capture_output=True)
    return done.returncode == 0 and not done.stderr


def test_results(report: bytes) -> dict[str, str]:
    """pytest's JUnit XML -> test name -> passed | failed | error | skipped."""
    out = {}
    for case in ET.fromstring(report).iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        out[f"{case.get('classname', '')}::{case.get('name', '')}"] = (
            {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
        )
    return out


class TerminalEnv:
    def __init__(self, data_dir: str, cfg, max_steps: int, expert: str | None = None):
        self.root, self.cfg, self.max_steps, self.expert = Path(data_dir), cfg, max_steps, expert
        self.session: Session | None = None
        self.episode_dir: Path | None = None
        self.info: dict = {}
        self.image: tuple[str, str] | None = None
        self._images: dict[Path, tuple[str, str, tempfile.TemporaryDirectory]] = {}

    def tasks(self, split: str) -> list[Task]:
        folder = self.root / split
        if not folder.is_dir():
            raise ValueError(
                f"{folder}: no split {split!r} of terminal tasks here (env.data_dir holds <split>/<task id>/ folders)"
            )
        tasks = [
            Task(id=d.name, split=split, type=read_task(d)["category"]) for d in sorted(folder.iterdir()) if d.is_dir()
        ]
        if self.expert:
            without = [t.id for t in tasks if not has_oracle(folder / t.id)]
            if without:
                raise TaskError(
                    f"{folder}: {len(without)} of its {len(tasks)} tasks are validator-only (no {ORACLE}: "
                    f"{', '.join(without[:3])}"
                    f"{', ...' if len(without) > 3 else ''}); the expert `{self.expert}` plays a task's oracle, so "
                    f"its split "
                    "(`experts.split`) must hold tasks that have one"
                )
        return tasks

    def reset(self, task: Task) -> Observation:
        self.close()
        self.folder = self.root / (task.home or task.split) / task.id
        self.meta = read_task(self.folder)
        self.image = self._task_image()
        # /app is a folder of its own under a private parent: a listing of `..` shows that parent, never the host's
        # /tmp (whose link count any other process changes)
        self.episode_dir = Path(tempfile.mkdtemp(prefix="qevolve-terminal-")) / "app"
        self.episode_dir.mkdir()
        self.capped = cap_folder(self.episode_dir, self.cfg.disk_mb)
        env_dir = self.folder / "environment"
        try:
            if self.image:  # what the image holds in its working directory
                shutil.copytree(self._images[self.folder][2].name, self.episode_dir, dirs_exist_ok=True, symlinks=True)
            elif env_dir.is_dir():
                # links are copied as links: they resolve inside the sandbox, never to a host file's content
                shutil.copytree(
                    env_dir,
                    self.episode_dir,
                    dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("setup.sh"),
                    symlinks=True,
                )
        except OSError as err:  # shutil.Error too: it gathers each file's
            if self.capped and "No space left on device" in str(err):
                raise TaskError(
                    f"{self.folder}: its files do not fit in env.terminal.disk_mb = {self.cfg.disk_mb} MiB"
                ) from None
            raise
        self.session = self._sandbox()
        cfg = self.cfg
        setup = env_dir / "setup.sh"
        if setup.is_file() and not self.image:
            done = self.session.run(f"(\n{setup.read_text()}\n)", cfg.command_timeout * 4)
            if done.status != 0:
                raise TaskError(f"{setup}: exited with status {done.status}: {done.output[-300:]!r}")
        self.steps, self.started = 0, time.monotonic()
        oracle = oracle_steps((self.folder / ORACLE).read_text()) if has_oracle(self.folder) else []
        if self.expert and not oracle:
            raise TaskError(f"{self.folder / ORACLE}: missing: a validator-only task gives no expert demonstration")
        self.plan = oracle + [SUBMIT] if self.expert else []
        self.candidates = candidates(self.folder, oracle)
        listing = self.session.run("ls -la", cfg.command_timeout).output
        instruction = (self.folder / "instruction.md").read_text().strip()
        return Observation(instruction, f"{self.session.app}$ ls -la\n{listing}".rstrip(), list(self.candidates))

    def step(self, action: str) -> Step:
        if self.session is None:
            raise RuntimeError("step before reset")
        self.steps += 1
        command = action.strip()
        if self.plan and command == self.plan[0]:
            self.plan.pop(0)
        if command == SUBMIT:
            return self._validate("submitted")
        if not command or not _parses(command):
            text, valid = f"bash: cannot parse the command {command!r}", False
        else:
            result = self.session.run(command, self.cfg.command_timeout)
            notes = [f"[timed out after {self.cfg.command_timeout:g} s]"] * result.timed_out
            notes += ["[the shell was restarted: the working directory and variables are reset]"] * result.restarted
            text = "\n".join([result.output.rstrip(), *notes, f"[exit status {result.status}]"]).strip()
            valid = not (result.timed_out or result.status == 127 or "command not found" in result.output)
        if self.steps >= self.max_steps:
            return self._validate("max_steps", text, valid)
        if time.monotonic() - self.started > min(self.cfg.episode_timeout, self.meta["agent_timeout"]):
            return self._validate("timeout", text, valid)
        return Step(text, 0.0, False, False, valid, list(self.candidates))

    def _sandbox(self, mounts: tuple = (), validators: bool = False) -> Session:
        backend, image, inside = ("docker", *self.image) if self.image else (self.cfg.sandbox, self.cfg.image, "/app")
        return Session(
            backend,
            self.episode_dir,
            task_limits(self.meta, self.cfg, validators),
            self.cfg.output_bytes,
            image,
            mounts,
            inside,
        )

    def _task_image(self) -> tuple[str, str] | None:
        """(image, its working directory) of a task built from its Dockerfile (`environment/Dockerfile`), made present
        here (`qevolve.envs.task_images.ensure`) with what it holds there copied out once; None for a task of files."""
        context = self.folder / "environment"
        if not (context / "Dockerfile").is_file():
            return None
        if self.cfg.sandbox == "local":
            raise TaskError(
                f"{context / 'Dockerfile'}: this task runs in its own image, in a docker container; "
                f"env.terminal.sandbox: local runs none"
            )
        if self.folder not in self._images:
            tag = image_tag(self.folder.name, context)
            log = Path(tempfile.gettempdir()) / "qevolve-task-builds" / f"{tag.replace('/', '_').replace(':', '_')}.log"
            why = ensure(tag, context, log, self.cfg.build_network, self.cfg.build_timeout)
            if why:
                raise TaskError(
                    f"{context / 'Dockerfile'}: its image {tag} is not here and could not be made: {why} (the "
                    f"build's log: {log})"
                )
            inside = workdir(tag)
            if inside in VALIDATOR_MOUNTS:
                raise TaskError(
                    f"{context / 'Dockerfile'}: WORKDIR {inside} is where the validators' files go; a task's "
                    f"working directory must be elsewhere"
                )
            template = tempfile.TemporaryDirectory(prefix="qevolve-image-")
            export_workdir(tag, inside, Path(template.name))
            self._images[self.folder] = (tag, inside, template)
        return self._images[self.folder][:2]

    def _validate(self, why: str, text: str = "", valid: bool = True) -> Step:
        """End the agent's sandbox (every process in it), run the validators in a fresh one, and end the episode;
        a validation that fails to run is a lost episode."""
        self.session.close()
        self.session = None
        results, status, timed_out, error = {}, None, False, ""
        try:
            results, status, timed_out, error = self._run_validators()
        except Exception as err:  # noqa: BLE001 - whatever the agent left that breaks validation loses the episode
            error = f"{type(err).__name__}: {err}"[:300]
        passed = sum(v == "passed" for v in results.values())
        won = bool(results) and passed == len(results) and status == 0
        reward = 1.0 if won else (passed / len(results) if results and self.cfg.partial_reward else 0.0)
        self.info = {
            "ended": why,
            "tests": results,
            "tests_passed": passed,
            "tests_total": len(results),
            "validator_timed_out": timed_out,
            **({"validation_error": error} if error else {}),
        }
        summary = (
            f"[episode ended ({why}): {passed}/{len(results)} tests passed{'; validation failed' if error else ''}]"
        )
        return Step(f"{text}\n{summary}".strip(), reward, True, won, valid)

    def _run_validators(self) -> tuple[dict[str, str], int, bool, str]:
        """(results, pytest's exit status, timed out, what went wrong): the task's tests in a fresh sandbox over
        /app (the module docstring)."""
        with tempfile.TemporaryDirectory(prefix="qevolve-validate-") as tmp:
            tests, report, config = Path(tmp) / "tests", Path(tmp) / "report", Path(tmp) / "config"
            shutil.copytree(self.folder / "tests", tests, symlinks=True)
            config.mkdir()
            (config / "pytest.ini").write_text("[pytest]\n")
            report.mkdir()
            for folder in (tests, config, Path(tmp)):
                folder.chmod(0o755)  # readable by the sandbox's user
            for path in tests.rglob("*"):
                if not path.is_symlink():
                    path.chmod(0o755 if path.is_dir() else 0o644)
            name = f"{secrets.token_hex(8)}.xml"
            setup = (
                self.folder / "environment" / "setup.sh"
            )  # the task's own variables (a Dockerfile's ENV), not the agent's
            exports = (
                [ln for ln in setup.read_text().splitlines() if ln.startswith("export ")] if setup.is_file() else []
            )
            session = self._sandbox(
                tuple(zip((tests, config, report), VALIDATOR_MOUNTS, (False, False, True))), validators=True
            )
            try:
                inside = session.where
                targets = " ".join(f"{inside('/tests')}/{f}" for f in self.meta["validators"]) or inside("/tests")
                run = session.run(
                    "".join(f"{e}; " for e in exports)
                    + f"cd {session.app} && PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {session.python} -I -m pytest -q -p "
                    f"no:cacheprovider "
                    f"-c {inside('/qevolve')}/pytest.ini --rootdir {inside('/tests')} --confcutdir {inside('/tests')} "
                    f"--junitxml {inside('/report')}/{name} {targets}",
                    self.verifier_timeout,
                )
            finally:
                session.close()
            try:
                return test_results(read_regular(report / name)), run.status, run.timed_out, ""
            except (ValueError, ET.ParseError) as err:  # no report, or not one pytest wrote
                why = (
                    f"timed out after {self.verifier_timeout:g} s"
                    if run.timed_out
                    else f"pytest exited with status {run.status}"
                )
                return {}, run.status, run.timed_out, f"no validators' report ({why}): {err}"[:300]

    @property
    def verifier_timeout(self) -> float:
        return min(self.meta["verifier_timeout"], self.cfg.verifier_timeout)

    def expert_action(self) -> str | None:
        return self.plan[0] if self.plan else None

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
        if self.episode_dir is not None:
            if self.capped:
                release_folder(self.episode_dir)
            remove_tree(self.episode_dir.parent)
            self.episode_dir = None


def create(cfg, expert: str | None) -> TerminalEnv:
    return TerminalEnv(cfg.data_dir, cfg.terminal, cfg.max_steps, expert)


def check_data(cfg, generated: bool = False) -> None:
    """The sandbox works here and `env.data_dir` is set; its train tasks' types unless `generated` (a stage of
    the pipeline writes them)."""
    if why := available(cfg.terminal.sandbox, cfg.terminal.image or None):
        raise SandboxError(f"env.terminal.sandbox: {why}")
    if not cfg.data_dir:
        raise ValueError(
            "env.data_dir: the terminal environment needs the folder of its <split>/<task id>/ task folders"
        )
    if not generated:
        check_types(cfg, TerminalEnv(cfg.data_dir, cfg.terminal, cfg.max_steps).tasks("train"))
