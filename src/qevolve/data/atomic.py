"""Atomic artifact writes: a file or folder appears under its final path whole, or not at all.

A failed write (a crash, a full disk) leaves the previous version of the artifact in place; a full disk
is reported as such, naming the artifact.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path | str, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success rename it over `path`, on error delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        with _disk_full_names(path):
            yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(path: Path | str) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path`; on success it replaces `path` whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _restore_interrupted_swap(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        with _disk_full_names(path):
            yield tmp
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old / "x")
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _restore_interrupted_swap(path: Path) -> None:
    """A folder is replaced in two renames (old aside, new in); if a kill fell between them, put the old
    version back so that the artifact is never missing."""
    if path.exists():
        return
    for old in sorted(path.parent.glob(f".{path.name}.*.old")):
        if (old / "x").exists():
            os.replace(old / "x", path)
            shutil.rmtree(old)
            return


@contextmanager
def _disk_full_names(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        raise OSError(
            errno.ENOSPC,
            f"disk full while writing {path}; the previous version (if any) is intact, free some space and run again",
        ) from err


def _finite(obj):
    """`obj` with every NaN or infinite float as None: a rate of nothing (0/0) is null in standard JSON,
    which Python's `NaN` is not (jq, JavaScript and strict parsers refuse it)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: Path | str, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(_finite(obj), indent=2, sort_keys=True, allow_nan=False) + "\n")
