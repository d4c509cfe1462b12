"""Sandboxes for the terminal environment (`env.name: terminal`): a persistent bash per episode, in an
episode folder mounted at /app, one command at a time (../shared/research/terminaltraj.md, section 2).

Backends (`env.terminal.sandbox`):
- `bwrap` (the default): bubblewrap, no daemon. No network (`--unshare-all`), the system read-only, its
  own user (uid 1000), a tmpfs /tmp of `tmp_mb`, its own PID namespace (`--die-with-parent`: nothing
  outlives the episode), memory (`ulimit -v`) and file-size (`ulimit -f`) limits, and a process limit
  through a pids cgroup where this host lets us make one (root with cgroup v1 `pids` or v2), else
  `ulimit -u`. The Python that runs qevolve (its venv and base prefix) is bound read-only, for validators.
- `docker`: a container of `env.terminal.image` (which must hold bash, python3 and pytest: images are not
  pulled) with the episode folder at /app, no network, a read-only root, a tmpfs /tmp, every capability
  dropped, memory, process and file-size limits, run as this host's user; a timed-out command's
  processes are killed from inside (`docker exec … kill -9 -1`: everything but the shell, PID 1), and
  closing removes the container.
- `local`: bash in the episode folder with no isolation at all, for tests and trusted tasks; refused unless
  asked for by name.

A command's output is stdout and stderr together, ANSI escapes stripped, undecodable bytes replaced, cut to
`output_bytes` as Terminus-2 does (the first and last halves, with a note of what was left out). Its end
is a random sentinel carrying `$?`, so `cd`, variables and background jobs persist between commands. A
command past its timeout has every process under the shell killed (the shell survives and reports 137);
a loop inside the shell itself, which that cannot stop, gets the sandbox restarted in the same folder,
and the result says so (`restarted`: cd and variables are reset).
"""

from __future__ import annotations

import base64
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from qevolve.errors import UserError

BACKENDS = ("bwrap", "docker", "local")
ANSI = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
GRACE_S = 2.0
"""How long a killed command's shell gets to print its sentinel before the sandbox is restarted."""


class SandboxError(UserError, RuntimeError):
    hint = ("env.terminal.sandbox picks the backend (bwrap; docker with env.terminal.image; or local for no isolation); "
            "`apt-get install bubblewrap` installs bwrap")


@dataclass(frozen=True)
class Limits:
    memory_mb: int = 2048
    """Address space per process (`ulimit -v`)."""
    processes: int = 128
    """Processes in the sandbox at once (a pids cgroup, or `ulimit -u`)."""
    file_mb: int = 256
    """Largest file a command may write (`ulimit -f`)."""
    tmp_mb: int = 64
    """Size of the sandbox's /tmp (bwrap's tmpfs)."""


@dataclass
class Result:
    output: str
    status: int
    """The command's exit status (137 when killed at its timeout)."""
    timed_out: bool = False
    restarted: bool = False
    """The shell could not be stopped or had exited: the sandbox was started again (cd and variables reset)."""


def clip(raw: bytes, budget: int, omitted: int = 0, tail: bytes = b"") -> str:
    """Output as the agent reads it: the first and last budget/2 bytes of `raw` (then `omitted` bytes never
    kept, then `tail`) with a note of how many were left out, ANSI escapes stripped, undecodable bytes replaced."""
    total, raw = len(raw) + omitted + len(tail), raw + tail
    if total > budget:
        half = budget // 2
        raw = raw[:half] + f"\n[... output limited to {budget} bytes; {total - 2 * half} interior bytes omitted ...]\n".encode() + raw[-half:]
    return ANSI.sub(b"", raw).decode("utf-8", errors="replace")


def available(backend: str, image: str = "") -> str | None:
    """None when `backend` can run here, else why not (and how to fix it)."""
    if backend not in BACKENDS:
        return f"unknown sandbox {backend!r}; expected one of {list(BACKENDS)}"
    if backend == "bwrap" and shutil.which("bwrap") is None:
        return "bubblewrap (`bwrap`) is not installed: `apt-get install bubblewrap` (Debian/Ubuntu), or env.terminal.sandbox: local without isolation"
    if backend == "docker":
        if not image:
            return "docker needs env.terminal.image, an image with bash, python3 and pytest"
        if shutil.which("docker") is None:
            return "the `docker` command is not installed"
        try:
            done = subprocess.run(["docker", "image", "inspect", image], capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return "`docker image inspect` did not answer in 30 s: is the daemon running?"
        if done.returncode != 0:
            return f"docker has no image {image!r} here ({done.stderr.strip()[:200]}); build it or `docker pull` it first (images are not pulled)"
    return None


class _Capture:
    """One command's output as it arrives: the head and the tail kept, the middle only counted, so a
    command writing gigabytes costs `budget` bytes of memory."""

    def __init__(self, budget: int, marker: bytes):
        self.head, self.tail, self.dropped = bytearray(), bytearray(), 0
        self.half, self.marker = budget // 2 + len(marker) + 16, marker

    def add(self, chunk: bytes) -> None:
        room = self.half - len(self.head)
        self.head += chunk[:room]
        self.tail += chunk[room:] if room > 0 else chunk
        if len(self.tail) > self.half:
            self.dropped += len(self.tail) - self.half
            del self.tail[: len(self.tail) - self.half]

    def status(self) -> int | None:
        """The exit status in the sentinel, once it has arrived."""
        found = re.search(re.escape(self.marker) + rb"(\d+)\n", bytes(self.head[-64:] + self.tail) if self.tail else bytes(self.head))
        return int(found.group(1)) if found else None

    def text(self, budget: int) -> str:
        """The output without the sentinel, clipped to `budget`."""
        head, tail = bytes(self.head), bytes(self.tail)
        if tail:
            cut = tail.rfind(b"\n" + self.marker)
            return clip(head, budget, self.dropped, tail[:cut] if cut >= 0 else tail)
        cut = head.rfind(b"\n" + self.marker)
        return clip(head[:cut] if cut >= 0 else head, budget)


class Session:
    """A persistent bash in a sandbox over `workdir` (mounted at /app under bwrap and docker)."""

    def __init__(self, backend: str, workdir: Path, limits: Limits = Limits(), output_bytes: int = 10_000, image: str = ""):
        why = available(backend, image)
        if why:
            raise SandboxError(f"env.terminal.sandbox: {why}")
        self.backend, self.workdir, self.limits, self.output_bytes, self.image = backend, Path(workdir).resolve(), limits, output_bytes, image
        self.container = f"qevolve-{os.getpid()}-{secrets.token_hex(6)}" if backend == "docker" else None
        self.cgroup = _pids_cgroup(limits.processes) if backend == "bwrap" else None
        self.proc: subprocess.Popen | None = None
        self._start()

    @property
    def app(self) -> str:
        """The working directory as the shell sees it."""
        return str(self.workdir) if self.backend == "local" else "/app"

    @property
    def python(self) -> str:
        """The Python the validators run with inside: the image's, or the one running qevolve."""
        return "python3" if self.backend == "docker" else sys.executable

    def _argv(self) -> list[str]:
        shell = ["bash", "--noprofile", "--norc"]
        if self.backend == "local":
            return shell
        if self.backend == "docker":
            lim = self.limits
            return ["docker", "run", "--rm", "-i", "--name", self.container, "--network", "none", "--read-only", "--cap-drop", "ALL",
                    "--security-opt", "no-new-privileges", "--user", f"{os.getuid()}:{os.getgid()}", "--memory", f"{lim.memory_mb}m",
                    "--pids-limit", str(lim.processes), "--ulimit", f"fsize={lim.file_mb << 20}", "--tmpfs", f"/tmp:size={lim.tmp_mb}m",
                    "-v", f"{self.workdir}:/app", "-w", "/app", "-e", "HOME=/app", "-e", "LANG=C.UTF-8", self.image, *shell]
        binds = []
        for prefix in dict.fromkeys([sys.prefix, sys.base_prefix]):  # the Python validators run with
            binds += ["--ro-bind", prefix, prefix]
        return ["bwrap", "--ro-bind", "/usr", "/usr", "--ro-bind", "/bin", "/bin", "--ro-bind", "/lib", "/lib", "--ro-bind-try", "/lib64", "/lib64",
                "--ro-bind", "/etc", "/etc", "--proc", "/proc", "--dev", "/dev", "--size", str(self.limits.tmp_mb << 20), "--tmpfs", "/tmp",
                *binds, "--bind", str(self.workdir), "/app", "--chdir", "/app", "--unshare-all", "--unshare-user", "--uid", "1000", "--gid", "1000",
                "--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/app",
                "--setenv", "LANG", "C.UTF-8", *shell]

    def _start(self) -> None:
        cgroup = self.cgroup
        preexec = (lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.workdir), "LANG": "C.UTF-8"}
        if self.backend == "docker":  # the client's settings (DOCKER_HOST, ...); the container gets none of them
            env = dict(os.environ)
        self.proc = subprocess.Popen(self._argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=self.workdir,
                                     env=env, start_new_session=True, preexec_fn=preexec)
        self.marker = f"\x1e{secrets.token_hex(8)}:".encode()
        self.chunks: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.chunks), daemon=True).start()
        self.shell_pid: int | None = None
        limits = [f"ulimit -v {self.limits.memory_mb << 10}", f"ulimit -f {self.limits.file_mb << 10}"]  # bash counts KiB
        if self.backend == "docker":
            limits = []  # the container's own limits
        if self.backend == "bwrap" and cgroup is None:
            limits.append(f"ulimit -u {self.limits.processes}")
        setup = self._exchange("; ".join(["exec 2>&1", *limits, "echo $$"]), 30.0, restart=False)
        if setup.status != 0 or not setup.output.strip().isdigit():
            self._stop()
            raise SandboxError(f"env.terminal.sandbox: {self.backend} did not start a shell: {setup.output.strip()[:300]!r}")
        self.shell_pid = self._find_shell()

    @staticmethod
    def _read(proc: subprocess.Popen, chunks: queue.Queue) -> None:
        # This thread alone reads and closes the pipe: closed from elsewhere, its descriptor number could be
        # reused by the next sandbox's pipe while this read still waits on it.
        with proc.stdout as out:
            while chunk := os.read(out.fileno(), 1 << 16):
                chunks.put(chunk)
        chunks.put(b"")  # end of output: the shell exited

    def _find_shell(self) -> int:
        """The sandbox's bash as this host numbers it: the Popen process itself, or under bwrap its first bash
        descendant (a container's processes are not this host's children: it is not looked for)."""
        if self.backend in ("local", "docker"):
            return self.proc.pid
        for _ in range(100):
            for pid in _descendants(self.proc.pid):
                if _comm(pid) == "bash":
                    return pid
            time.sleep(0.01)
        raise SandboxError(f"env.terminal.sandbox: no bash found under bwrap (pid {self.proc.pid})")

    def run(self, command: str, timeout: float = 30.0) -> Result:
        """Run one command; its output and exit status. A dead shell is started again first."""
        restarted = False
        if self.proc is None or self.proc.poll() is not None:
            self._stop()
            self._start()
            restarted = True
        result = self._exchange(command, timeout)
        result.restarted = result.restarted or restarted
        return result

    def _exchange(self, command: str, timeout: float, restart: bool = True) -> Result:
        encoded = base64.b64encode(command.encode()).decode()
        line = f"eval \"$(printf %s {encoded} | base64 -d)\" </dev/null; printf '\\n{self.marker.decode()}%d\\n' $?\n"
        capture = _Capture(self.output_bytes, self.marker)
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._died(capture, restart)
        deadline = time.monotonic() + timeout
        timed_out = False
        while (status := capture.status()) is None:
            try:
                chunk = self.chunks.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                if timed_out:  # the kill did not bring the sentinel: the shell itself is stuck
                    text = capture.text(self.output_bytes)
                    self._stop()
                    if restart:
                        self._start()
                    return Result(text, 137, timed_out=True, restarted=restart)
                timed_out = True
                self._kill_children()
                deadline = time.monotonic() + GRACE_S
                continue
            if not chunk:
                return self._died(capture, restart)
            capture.add(chunk)
        return Result(capture.text(self.output_bytes), status, timed_out=timed_out)

    def _died(self, capture: _Capture, restart: bool) -> Result:
        """The shell exited (the command ran `exit`, or was killed): what it printed, and a fresh sandbox."""
        code = self.proc.wait()
        text = capture.text(self.output_bytes)
        self._stop()
        if restart:
            self._start()
        return Result(text, code if code >= 0 else 128 - code, restarted=restart)

    def _kill_children(self) -> None:
        if self.backend == "docker":  # from inside: kill(-1) spares PID 1, the shell, and the caller
            subprocess.run(["docker", "exec", self.container, "bash", "-c", "kill -9 -1"], capture_output=True, timeout=30)
            return
        for pid in _descendants(self.shell_pid) if self.shell_pid else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """End the sandbox and everything in it."""
        self._stop()
        if self.cgroup is not None:
            for _ in range(50):  # the sandbox's processes leave it as the kernel reaps them
                try:
                    self.cgroup.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)
            self.cgroup = None

    def _stop(self) -> None:
        if self.container and self.proc is not None:  # killing the client leaves the container running
            subprocess.run(["docker", "rm", "-f", self.container], capture_output=True, timeout=60)
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        if self.proc is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        self.proc = None

    def __del__(self):
        if hasattr(self, "proc"):
            try:
                self.close()
            except Exception:  # at interpreter exit, subprocess may be gone: the PID namespace / --rm still end it
                pass


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _descendants(pid: int) -> list[int]:
    """Every process under `pid`, parents before children."""
    found, todo = [], _children(pid)
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo += _children(p)
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _pids_cgroup(limit: int) -> Path | None:
    """A fresh pids cgroup capped at `limit` processes, where this host lets us make one; else None."""
    for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
            continue
        group = root / f"qevolve-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            group.mkdir()
            (group / "pids.max").write_text(str(limit))
            return group
        except OSError:
            try:
                group.rmdir()
            except OSError:
                pass
    return None
