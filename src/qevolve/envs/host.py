"""What a sandbox does on this host, outside it: the episode folder handed over, capped, removed and read safely, and
the host's processes and cgroups that hold a sandbox's processes (`qevolve.envs.sandbox`)."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import stat
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)
SANDBOX_UID = 65534
"""The host uid and gid a sandbox runs as when qevolve runs as root (nobody's): never root."""


def host_uid() -> int:
    """The host uid a sandbox runs as: this process's, or `SANDBOX_UID` when that is root."""
    return SANDBOX_UID if os.geteuid() == 0 else os.geteuid()


def hand_over(folder: Path) -> None:
    """Make `folder` (and everything in it, links not followed) the sandbox user's, so it can write there.

    coreutils walks a tree of any depth; Python's `os.walk` recurses, and a tree an agent made 1,500 folders
    deep raised `RecursionError` when the validators' sandbox took its /app over."""
    uid = host_uid()
    if uid == os.geteuid():
        return
    done = subprocess.run(
        ["chown", "-R", "-h", "-P", f"{uid}:{uid}", "--", str(folder)], capture_output=True, text=True
    )
    if done.returncode:
        log.warning("sandbox: chown of %s to uid %d: %s", folder, uid, done.stderr.strip()[:300])


_told: dict[str, bool] = {}


def cap_folder(folder: Path, mb: int) -> bool:
    """Mount a tmpfs of `mb` MiB on `folder` (empty; root only): what a sandbox writes under it stops at that size,
    held in memory rather than on the host's disk. False, with a warning, where it cannot be (not root, or
    the mount refused); `release_folder` undoes it."""
    if not mb:
        return False
    if os.geteuid() != 0:
        if not _told.get("root"):
            _told["root"] = True
            log.warning(
                "sandbox: not root: an episode's /app gets no disk cap (env.terminal.disk_mb), only file_mb per file"
            )
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mb}m,mode=0755,nosuid,nodev", "qevolve-app", str(folder)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        log.warning("sandbox: no disk cap for %s: mount refused: %s", folder, done.stderr.strip()[:300])
        return False
    return True


def release_folder(folder: Path) -> None:
    """Unmount `cap_folder`'s tmpfs (lazily: a process still holding a file there does not keep it mounted)."""
    done = subprocess.run(["umount", "--lazy", str(folder)], capture_output=True, text=True)
    if done.returncode:
        log.warning("sandbox: %s could not be unmounted: %s", folder, done.stderr.strip()[:300])


def remove_tree(path: Path) -> None:
    """Delete `path` and whatever a sandbox left in it: a tree of any depth, folders it took the permissions of
    (on a host that is not root), links (removed, never followed). A failure is logged, never raised: the next
    episode starts in a folder of its own."""
    if not os.path.lexists(path):
        return
    subprocess.run(["chmod", "-R", "u+rwX", "--", str(path)], capture_output=True)  # chmod -R ignores links
    done = subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], capture_output=True, text=True)
    if os.path.lexists(path):
        log.warning("sandbox: %s could not be removed: %s", path, done.stderr.strip()[:300])


def read_regular(path: Path, limit: int = 16 << 20) -> bytes:
    """The bytes of `path`, which must be a regular file of at most `limit` bytes: never through a link, and
    never blocking on a FIFO or a device a sandbox may have left in its place."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        raise ValueError(f"{path}: cannot be opened as a plain file ({err.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path}: larger than {limit} bytes")
    return data


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (every thread's children)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def kill(pid: int) -> None:
    """SIGKILL to `pid`, which may be gone already."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def ancestors(pid: int, top: int) -> list[int]:
    """The processes above `pid`, up to and including `top` (or to init)."""
    out = []
    while pid not in (top, 0, 1):
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        out.append(pid)
    return out


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, parents before children."""
    found, todo = [], children(pid)
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo += children(p)
    return found


def comm(pid: int) -> str:
    """The command name of `pid` (empty when it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def pids_cgroup_of(pid: int) -> Path | None:
    """The cgroup holding `pid` whose `pids.max` caps it (cgroup v1's pids hierarchy or v2's unified one), or None."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, where = line.split(":", 2)
        if controllers and "pids" not in controllers.split(","):
            continue
        group = Path("/sys/fs/cgroup", *(["pids"] if controllers else []), where.lstrip("/"))
        if (group / "pids.max").exists():
            return group
    return None


CPU_PERIOD_US = 100_000


def make_cgroups(processes: int, memory_mb: int, cpus: float) -> list[Path]:
    """Fresh cgroups capping a sandbox's processes (`pids.max`) and, where the controller is there, its memory
    as a whole (`memory.limit_in_bytes`, v2 `memory.max`) and its CPU time (`cpu.cfs_quota_us` per
    `CPU_PERIOD_US`, v2 `cpu.max`), where this host lets us make them; else none."""
    memory, quota = str(memory_mb << 20), str(round(cpus * CPU_PERIOD_US))
    pids = make_cgroup(Path("/sys/fs/cgroup/pids"), {"pids.max": str(processes)})  # cgroup v1
    if pids is not None:
        cpu = {"cpu.cfs_period_us": str(CPU_PERIOD_US), "cpu.cfs_quota_us": quota} if cpus else None
        more = [
            make_cgroup(Path("/sys/fs/cgroup/memory"), {"memory.limit_in_bytes": memory}),
            cpu and make_cgroup(Path("/sys/fs/cgroup/cpu"), cpu),
        ]
        return [pids] + [g for g in more if g]
    unified = make_cgroup(
        Path("/sys/fs/cgroup"),
        {"pids.max": str(processes)},  # v2
        {"memory.max": memory, **({"cpu.max": f"{quota} {CPU_PERIOD_US}"} if cpus else {})},
    )
    return [unified] if unified is not None else []


def make_cgroup(root: Path, settings: dict[str, str], optional: dict[str, str] | None = None) -> Path | None:
    """A new cgroup under `root` with `settings` written (and `optional` where they can be), or None."""
    if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
        return None
    group = root / f"qevolve-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        group.mkdir()
        for name, value in settings.items():
            (group / name).write_text(value)
        for name, value in (optional or {}).items():
            try:
                (group / name).write_text(value)
            except OSError:
                pass
        return group
    except OSError:
        try:
            group.rmdir()
        except OSError:
            pass
        return None
