"""One evolution per workspace at a time.

`workspace_lock(root)` holds an exclusive `flock` on `<root>/.qevolve/lock` for as long as an evolution
(or a `qevolve run` stage, which is what `dvc repro` calls) runs. The lock file names its holder, so a
second attempt refuses with a message saying who holds it. The kernel drops the lock when the holder
dies, even by SIGKILL, so a killed run never leaves a stale lock behind.

A holder's child processes (the `torchrun` ranks of a multi-process trainer) inherit the lock: the
holder puts `QEVOLVE_LOCK_HELD` in their environment (`inherit_env`), and a process whose ancestor is
the holder named there works under that lock instead of being refused. They also die with it: `torchrun`
is started with the kernel's parent-death signal (`die_with_parent`), and so is each rank (`under_torchrun`),
so a holder killed by SIGKILL, which releases the lock, leaves no rank writing into the workspace.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qevolve.errors import UserError

STATE_DIR = ".qevolve"
INHERIT = "QEVOLVE_LOCK_HELD"


class WorkspaceBusy(UserError, RuntimeError):
    hint = (
        "one evolution per workspace: wait for the one named above, stop it, or clone the project into another folder"
    )


_held: dict[Path, int] = {}
"""Lock file -> nesting depth of the locks this process holds on it."""


@contextmanager
def workspace_lock(root: Path | str, what: str) -> Iterator[None]:
    """Hold the workspace lock while the block runs; raise `WorkspaceBusy` at once if another process has it.

    Re-entrant within one process (a flow that calls stage code that also locks)."""
    path = Path(root).resolve() / STATE_DIR / "lock"
    if _held.get(path) or _inherited(path):
        _held[path] = _held.get(path, 0) + 1
        try:
            yield
        finally:
            _held[path] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkspaceBusy(
                f"{path.parent.parent}: another qevolve process is using this workspace ({_holder(path)}); "
                "wait for it to finish or stop it, then run again"
            ) from None
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "what": what,
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder).encode())
        _held[path] = 1
        try:
            yield
        finally:
            _held.pop(path, None)
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # closing releases the flock


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the thread that started it ends (Linux's PR_SET_PDEATHSIG),
    and end now if that parent is already gone. For `preexec_fn`, or the first thing a child does."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent or parent == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def under_torchrun() -> None:
    """In a rank that `torchrun` started (it sets TORCHELASTIC_RUN_ID): die with `torchrun`."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()


def inherit_env(root: Path | str) -> dict[str, str]:
    """Environment variables that let this process's children work under the lock it holds on `root`."""
    path = Path(root).resolve() / STATE_DIR / "lock"
    if not _held.get(path):
        raise RuntimeError(f"{path}: this process does not hold the workspace lock it would hand down")
    return {INHERIT: f"{os.getpid()}:{path}"}


def _inherited(path: Path) -> bool:
    """Whether an ancestor of this process holds the lock on `path` and handed it down (`inherit_env`)."""
    pid, _, locked = os.environ.get(INHERIT, "").partition(":")
    if not pid.isdigit() or Path(locked) != path:
        return False
    return int(pid) in _ancestors()


def _ancestors() -> set[int]:
    """The process ids above this one (Linux /proc)."""
    out, pid = set(), os.getppid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
    return out


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        h = {}
    if not h:
        return "holder unknown"
    return f"{h.get('what', '?')}, pid {h.get('pid')} on {h.get('host')} since {h.get('since')}: {h.get('command', '')}"
