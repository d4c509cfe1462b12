"""Benchmarks: each module prints a table of side-by-side measurements (see benchmarks/README.md)."""

from __future__ import annotations

import sys
from pathlib import Path


def workspace_params(ws: Path, needs: tuple[str, ...] = ("models/base", "models/bc")):
    """The parameters of a workspace where the quickstart has run; exit with a hint if it has not."""
    from qevolve.params import load_params

    for need in ("params.yaml", *needs):
        if not (ws / need).exists():
            sys.exit(f"{ws / need}: missing; run `make quickstart` first (or pass --workspace)")
    return load_params(ws / "params.yaml")
