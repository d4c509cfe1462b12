"""What a run was computed with besides its parameters: the checkout's commit and the installed packages
(both logged to MLflow with every evolution and table, and written into a table's results.json)."""

from __future__ import annotations

import hashlib
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """The checkout's commit, marked `-dirty` when tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head + ("-dirty" if dirty else "") if head else "unknown"


def packages() -> list[str]:
    """The interpreter's version and every installed distribution as `name==version`, sorted: what a run
    was computed with besides the code (two checkouts of one commit can resolve other versions)."""
    from importlib.metadata import distributions

    found = {f"{d.metadata['Name']}=={d.version}" for d in distributions() if d.metadata["Name"]}
    return [f"python=={platform.python_version()}", *sorted(found, key=str.lower)]


def packages_sha256(listing: list[str]) -> str:
    return hashlib.sha256("\n".join(listing).encode()).hexdigest()
