"""Errors a user can act on: each carries a hint, and the CLI and the flow print message and hint
without a traceback (`--debug` or QEVOLVE_DEBUG=1 shows it)."""

from __future__ import annotations

import os
import sys


class UserError(Exception):
    """A known error: bad input, missing data, a busy workspace. Subclasses set `hint`."""

    hint = ""


def debugging(argv: list[str] | None = None) -> bool:
    return "--debug" in (sys.argv if argv is None else argv) or os.environ.get("QEVOLVE_DEBUG", "") not in ("", "0")


def report(err: UserError) -> int:
    """Print a known error for a person (message, then its hint); the exit status to return."""
    print(f"error: {err}", file=sys.stderr)
    if err.hint:
        print(f"hint: {err.hint}", file=sys.stderr)
    print("(run with --debug or QEVOLVE_DEBUG=1 for the traceback)", file=sys.stderr)
    return 2
