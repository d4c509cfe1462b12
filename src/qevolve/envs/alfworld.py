"""ALFWorld (TextWorld engine) behind the `TextEnv` protocol.

Games are read from `$ALFWORLD_DATA/json_2.1.1/<split>/<task>/<trial>/game.tw-pddl`, ALFWorld's own layout.
One TextWorld environment object is kept and each game is loaded into it (`load` + `reset`), which is
how ALFWorld's own loader reuses an environment. TextWorld translates the same PDDL problem four times
per game; `_memoize_grounding` makes it once and keeps it on disk for later processes, and
`_copy_contexts_shallowly` stops its text generation from deep-copying the game for every phrase. With
both, games play 4.55x faster than with a translation at every reset (1.8x faster than with the kept
translations alone), with the same observations (`benchmarks/alfworld.py`, benchmarks/README.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
from functools import cache
from pathlib import Path

from qevolve.environments import ENVIRONMENTS
from qevolve.envs.base import Observation, Step, Task
from qevolve.errors import UserError

SPEC = ENVIRONMENTS["alfworld"]
REJECTED = "Nothing happens."
ARCHIVE_NAME = "json_2.1.1_all_splits.tar.xz"


class AlfworldDataError(UserError, RuntimeError):
    hint = (
        "the README's Quickstart says where they come from: ALFWORLD_DATA, QEVOLVE_ALFWORLD_ARCHIVE, alfworld-download"
    )
    pass


def _has_games(root: Path) -> bool:
    return (root / "json_2.1.1" / "valid_seen").is_dir()


def ensure_alfworld_data(archive: Path | None = None) -> Path:
    """Return ALFWorld's data folder, preparing it once if needed, and export `ALFWORLD_DATA`.

    1. `ALFWORLD_DATA` is set and holds the games: use it.
    2. A local copy of the games archive exists (`archive`, `$QEVOLVE_ALFWORLD_ARCHIVE`): unpack it once
       into `ALFWORLD_DATA` (default `~/.cache/alfworld`, ALFWorld's own default).
    3. Otherwise run ALFWorld's official `alfworld-download`.
    """
    root = Path(os.environ.get("ALFWORLD_DATA") or Path.home() / ".cache" / "alfworld").expanduser()
    if not _has_games(root):
        archive = archive or (Path(p) if (p := os.environ.get("QEVOLVE_ALFWORLD_ARCHIVE")) else None)
        if archive is not None:
            if not archive.exists():
                raise AlfworldDataError(f"QEVOLVE_ALFWORLD_ARCHIVE: {archive} does not exist")
            _unpack(archive, root)
        else:
            root.mkdir(parents=True, exist_ok=True)
            why = _download(root)
            if why:
                given = os.environ.get("ALFWORLD_DATA")
                raise AlfworldDataError(
                    f"ALFWorld's games are not in {root}, and none of the three ways of getting them worked:\n"
                    f"  1. ALFWORLD_DATA naming a folder that holds them: "
                    f"{f'{given} holds no games' if given else 'not set'};\n"
                    f"  2. QEVOLVE_ALFWORLD_ARCHIVE naming a local copy of {ARCHIVE_NAME}: not set;\n"
                    f"  3. ALFWorld's own download (needs internet): {why}."
                )
    os.environ["ALFWORLD_DATA"] = str(root)
    return root


def _download(root: Path) -> str:
    """Run ALFWorld's `alfworld-download` into `root`; return why it did not fill it ('' if it did).

    The script is looked for beside this Python first (the project's virtual environment, whether or
    not it is activated), then on PATH."""
    beside = Path(sys.executable).with_name("alfworld-download")
    script = str(beside) if beside.exists() else shutil.which("alfworld-download")
    if script is None:
        return (
            f"the `alfworld-download` script is neither beside {sys.executable} nor on PATH (is the alfworld "
            f"package installed?)"
        )
    done = subprocess.run([script], env={**os.environ, "ALFWORLD_DATA": str(root)})
    if done.returncode != 0:
        return f"{script} exited with {done.returncode} (its output is above)"
    return "" if _has_games(root) else f"{script} finished but {root} holds no games"


def _unpack(archive: Path, root: Path) -> None:
    """Unpack into a temporary folder beside `root`, then rename, so a kill leaves no half-copy."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".unpack.", dir=root))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        shutil.rmtree(root / "json_2.1.1", ignore_errors=True)
        os.replace(tmp / "json_2.1.1", root / "json_2.1.1")
        logic = root / "logic"
        logic.mkdir(exist_ok=True)
        for name in ("alfred.pddl", "alfred.twl2"):
            src = archive.parent / name
            if src.exists():
                shutil.copyfile(src, logic / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@cache
def list_tasks(root: str, split: str) -> tuple[Task, ...]:
    """Every game of a split, sorted, as ALFWorld's loader finds them (no movable or sliced games)."""
    if split not in SPEC.splits:
        raise ValueError(f"unknown ALFWorld split {split!r}; expected one of {SPEC.splits}")
    base = Path(root) / "json_2.1.1" / split
    if not base.is_dir():
        raise AlfworldDataError(f"{base}: no such folder; is ALFWORLD_DATA={root} an ALFWorld data folder?")
    tasks = []
    for game in sorted(base.glob("*/*/game.tw-pddl")):
        rel = game.parent.relative_to(base).as_posix()
        if "movable" in rel or "Sliced" in rel:
            continue
        tasks.append(Task(id=rel, split=split, type=rel.split("-", 1)[0]))
    return tuple(tasks)


def split_observation(feedback: str) -> tuple[str, str]:
    """(instruction, observation) from ALFWorld's first feedback."""
    text = feedback.split("-= Welcome to TextWorld, ALFRED! =-", 1)[-1].strip()
    obs, _, task = text.partition("Your task is to:")
    return task.strip(), obs.strip()


def sas_cache_dir() -> Path | None:
    """Where PDDL-to-SAS translations are kept between processes: `$QEVOLVE_SAS_CACHE`, default
    `~/.cache/qevolve/pddl2sas`; the value `off` keeps them in memory only."""
    value = os.environ.get("QEVOLVE_SAS_CACHE", str(Path.home() / ".cache" / "qevolve" / "pddl2sas"))
    return None if value == "off" else Path(value).expanduser()


def _memoize_grounding() -> None:
    """Serve TextWorld's PDDL-to-SAS translations of a game from a cache, in memory and on disk.

    TextWorld translates each game four times per reset: plain and "optimised", in both `load` and
    `reset`. The translation is a pure function of (domain, problem) and its result, a (task, SAS text) pair, is only
    read, so `load` and `reset` share it. The optimised one only speeds up TextWorld's replanning
    (`policy_commands`, the `walkthrough` extra), which qevolve never requests; the plain translation is a
    valid task for the replanner too, so it serves both. A reset then costs one translation instead of four,
    and none once the game has been translated by any earlier process (`sas_cache_dir`): every stage is
    its own process and replays the same evaluation games. Idempotent; applied once per process.
    """
    import hashlib
    import pickle

    import fast_downward

    from qevolve.data.atomic import atomic_path

    if getattr(fast_downward.pddl2sas, "_qevolve_cached", False):
        return
    translate = fast_downward.pddl2sas
    cache: dict[tuple[str, str], tuple] = {}

    def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
        key = (domain, problem)
        if key not in cache:
            if len(cache) >= 2:  # this game and the previous one
                cache.pop(next(iter(cache)))
            folder = sas_cache_dir()
            digest = hashlib.sha256((domain + "\0" + problem).encode()).hexdigest()
            file = folder / f"{digest}.pkl" if folder else None
            kept = _read_translation(file) if file is not None and file.exists() else None
            if kept is not None:
                cache[key] = kept
            else:
                cache[key] = translate(domain, problem, verbose=verbose, optimize=False)
                if file is not None:
                    with atomic_path(file) as tmp:
                        tmp.write_bytes(pickle.dumps(cache[key]))
        return cache[key]

    pddl2sas._qevolve_cached = True
    pddl2sas.cache = cache  # benchmarks clear it between runs
    fast_downward.pddl2sas = pddl2sas


def _read_translation(file: Path) -> tuple | None:
    """A kept translation, or None (with a warning) when the file cannot be read back, e.g. written by
    another version of fast_downward or cut short: the caller translates again and replaces it."""
    import pickle

    try:
        kept = pickle.loads(file.read_bytes())
    except Exception as err:  # noqa: BLE001 - unpickling can raise almost anything
        warnings.warn(
            f"{file}: unreadable kept PDDL translation ({type(err).__name__}: {err}); translating again", stacklevel=2
        )
        return None
    if not (isinstance(kept, tuple) and len(kept) == 2):
        warnings.warn(
            f"{file}: expected a (task, SAS text) pair, found {type(kept).__name__}; translating again", stacklevel=2
        )
        return None
    return kept


def _memoize_text_parsing() -> None:
    """Parse each of TextWorld's text-generation templates and logic expressions once.

    Every step re-parses the same template strings with a PEG parser (tatsu), which is most of a step's
    cost. The parse is a pure function of its arguments; callers mutate the symbols they get back, so
    each call gets a deep copy of the cached result. Idempotent; applied once per process."""
    import copy

    from textworld import logic as tw_logic
    from textworld.envs.pddl import textgen

    for module in (textgen, tw_logic):
        parse = module._parse_and_convert
        if getattr(parse, "_qevolve_cached", False):
            continue

        def cached(*args, _parse=parse, _cache={}, **kwargs):  # noqa: B006 - the cache is meant to persist
            key = (args, tuple(sorted(kwargs.items())))
            if key not in _cache:
                _cache[key] = _parse(*args, **kwargs)
            return copy.deepcopy(_cache[key])

        cached._qevolve_cached = True
        module._parse_and_convert = cached


def _copy_contexts_shallowly() -> None:
    """Copy TextWorld's text-generation contexts without deep-copying the game's objects.

    Text generation copies its context for every symbol it derives, deep-copying the `variables` and
    `mapping` dicts and with them every entity of the game, which is most of a step's and a reset's cost.
    The copies exist so that one derivation's `dict.update` of those two dicts does not leak into its
    siblings; the entities and logic variables in them are only read. Copying the two dicts keeps that
    isolation: the same observations and admissible commands, step for step (tests/test_alfworld.py).
    Idempotent; applied once per process."""
    from textworld.envs.pddl import textgen

    if getattr(textgen.copy_context, "_qevolve_shallow", False):
        return
    deep = textgen.copy_context

    def copy_context(context):
        return {
            "state": context["state"],
            "facts": context["facts"],
            "entity_infos": context["entity_infos"],
            "variables": dict(context["variables"]),
            "mapping": dict(context["mapping"]),
        }

    copy_context._qevolve_shallow = True
    copy_context.deep = deep  # the original, for the equivalence test
    textgen.copy_context = copy_context


class AlfworldEnv:
    """One TextWorld environment, reused across games. Not thread-safe; one per worker."""

    def __init__(self, data_dir: Path | str | None = None, expert: str | None = "handcoded"):
        """`expert`: `handcoded` (searches as a person does), `walkthrough` (the game's omniscient gold path)
        or None (no expert, for policy rollouts)."""
        if expert not in SPEC.experts + (None,):
            raise ValueError(f"unknown ALFWorld expert {expert!r}; expected one of {SPEC.experts}")
        self.root = Path(data_dir) if data_dir else ensure_alfworld_data()
        self.expert = expert
        self._env = None
        self._state = None
        self._won = False
        self._walkthrough: list[str] = []
        self._t = 0

    def tasks(self, split: str) -> list[Task]:
        return list(list_tasks(str(self.root), split))

    def _wrappers(self):
        from alfworld.agents.environment.alfred_tw_env import (
            AlfredDemangler,
            AlfredExpert,
            AlfredExpertType,
            AlfredInfos,
        )

        wrappers = [AlfredDemangler(), AlfredInfos]
        if self.expert == "handcoded":
            wrappers.append(AlfredExpert(AlfredExpertType.HANDCODED))
        return wrappers

    def reset(self, task: Task) -> Observation:
        import textworld

        game = self.root / "json_2.1.1" / (task.home or task.split) / task.id / "game.tw-pddl"
        if not game.exists():
            raise AlfworldDataError(f"{game}: game file missing for task {task.id!r}")
        if self._env is None:
            _memoize_grounding()
            _memoize_text_parsing()
            _copy_contexts_shallowly()
            extras = ["gamefile"] + (["expert_plan"] if self.expert == "handcoded" else [])
            infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=extras)
            self._env = textworld.start(str(game), request_infos=infos, wrappers=self._wrappers())
        with contextlib.redirect_stdout(io.StringIO()):  # the PDDL planner prints its grounding log
            self._env.load(str(game))
            self._state = self._env.reset()
        self._won = False
        self._t = 0
        if self.expert == "walkthrough":
            self._walkthrough = json.loads(game.read_text()).get("walkthrough") or []
        instruction, obs = split_observation(self._state.feedback)
        return Observation(instruction=instruction, text=obs, admissible=self._admissible())

    def _admissible(self) -> list[str]:
        # `help` prints the command list; it is never part of a solution.
        return [a for a in self._state["admissible_commands"] if a != "help"]

    def step(self, action: str) -> Step:
        self._state, _, done = self._env.step(action)
        obs = self._state.feedback.strip()
        won = bool(self._state["won"])
        reward = 1.0 if won and not self._won else 0.0
        self._won = won
        self._t += 1
        return Step(
            observation=obs,
            reward=reward,
            done=bool(done) or won,
            won=won,
            valid=obs != REJECTED,
            admissible=self._admissible(),
        )

    def seed_random(self, key: str) -> None:
        """Seed the handcoded expert's tie-breaks. Its module draws from Python's global `random`, which anything else
        in the process may draw from between two of its calls (a Prefect thread did, in a flow that plays the experts
        in-process: one demonstration came out two ways); it gets a generator of its own, seeded by `key`, which
        draws what `random.seed(key)` would have."""
        from alfworld.agents.expert import handcoded_expert

        handcoded_expert.random = random.Random(key)

    def expert_action(self) -> str | None:
        if self.expert == "walkthrough":
            return self._walkthrough[self._t] if self._t < len(self._walkthrough) else None
        plan = self._state.get("extra.expert_plan") if self._state is not None else None
        return plan[0] if plan else None

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


def create(cfg, expert: str | None) -> AlfworldEnv:
    return AlfworldEnv(expert=expert)


def check_data(cfg, generated: bool = False) -> None:
    """Prepare ALFWorld's games (`ensure_alfworld_data`)."""
    ensure_alfworld_data()
