"""Errors a user can act on: each carries a hint, and the CLI and the flow print message and hint
without a traceback (`--debug` or QEVOLVE_DEBUG=1 shows it)."""

from __future__ import annotations

import os
import sys


class UserError(Exception):
    """A known error: bad input, missing data, a busy workspace. Subclasses set `hint`."""

    hint = ""


class DamagedArtifact(UserError):
    """A stage's output that is missing a file or cannot be read back."""

    hint = (
        "`dvc checkout <stage>` restores the version dvc.lock records from DVC's cache (the flow does this by "
        "itself when it finds an output changed); `dvc repro <stage>` rebuilds it"
    )


class BadName(UserError, ValueError):
    """A name from a person or a flow-run parameter that would leave its folder."""

    hint = "names are letters, digits, '.', '_' and '-', starting with a letter or digit, at most 100 characters"


NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"


def inside(parent, name: str, what: str):
    """`parent / name`, after checking that `name` is a plain name (`NAME_PATTERN`, no '..') and that the path,
    links resolved, stays inside `parent`: a workspace name, a worker's workspace id."""
    import re
    from pathlib import Path

    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name) or ".." in name:
        raise BadName(f"{what}: {name!r} is not a plain name")
    path = Path(parent) / name
    if not path.resolve().is_relative_to(Path(parent).resolve()):
        raise BadName(f"{what}: {name!r} leads outside {parent} (a link?)")
    return path


def artifact(path, problem: str) -> DamagedArtifact:
    """The error for the artifact at `path` (`models/policy@2`, `data/collect@1/...`): names it and the
    stage that wrote it (outputs are named after their stage; under GRPO `online@k` writes `models/policy@k`)."""
    from pathlib import Path

    path = Path(path)
    folder = next((p for p in [path, *path.parents] if p.parent.name in ("models", "data")), path)
    return DamagedArtifact(f"{path}: {problem}; it is the output of stage `{folder.name}`")


def debugging(argv: list[str] | None = None) -> bool:
    return "--debug" in (sys.argv if argv is None else argv) or os.environ.get("QEVOLVE_DEBUG", "") not in ("", "0")


def report(err: UserError) -> int:
    """Print a known error for a person (message, then its hint); the exit status to return."""
    print(f"error: {err}", file=sys.stderr)
    if err.hint:
        print(f"hint: {err.hint}", file=sys.stderr)
    print("(run with --debug or QEVOLVE_DEBUG=1 for the traceback)", file=sys.stderr)
    return 2
