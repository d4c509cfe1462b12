"""Sandboxes for the terminal environment (`env.name: terminal`): a persistent bash per episode, in an
episode folder mounted at /app, one command at a time (../shared/research/terminaltraj.md, section 2).

Backends (`env.terminal.sandbox`):
- `bwrap` (the default): bubblewrap, no daemon. No network (`--unshare-all`; `Limits.network` shares the host's), the
  system read-only, a minimal /etc (the loader's files and stub passwd/group: none of the host's secrets), uid 1000
  inside, which is this host's user, or when qevolve runs as root an unprivileged host uid (`SANDBOX_UID`, nobody's,
  inside too), so root-only host files stay unreadable; a tmpfs /tmp of `tmp_mb`, its own PID namespace
  (`--die-with-parent`: nothing outlives the episode), memory (`ulimit -v` per process) and file-size (`ulimit -f`)
  limits, and caps on the whole sandbox through cgroups where this host lets us make them (root with cgroup v1 `pids`,
  `memory` and `cpu`, or v2): processes, memory and CPU; else `ulimit -u` (which holds: the sandbox never runs as root).
  The Python that runs qevolve (its venv and base prefix) is bound read-only, for validators. As root, bwrap makes no
  user namespace (its uid 1000 would be host root): it sets the sandbox up as root and the shell drops to nobody
  (`setpriv`, every capability gone).
- `docker`: a container of `env.terminal.image` (which must hold bash, python3 and pytest: images are not pulled), or of
  a task's own image (`qevolve.envs.task_images`), with the episode folder at /app (a task image's working directory),
  no network, a read-only root, a tmpfs /tmp, every capability dropped, memory, process and file-size limits, run as
  this host's user (nobody's when that is root); a timed-out command's processes, and a fork bomb at the process cap,
  are killed from this host through the container's cgroup where the engine runs here (else from inside, `docker exec
  … kill -9 -1`: everything but the shell, PID 1), and closing removes the container.
- `local`: bash in the episode folder with no isolation at all, for tests and trusted tasks; refused unless
  asked for by name.

What the sandbox does on this host, outside it (the episode folder, processes, cgroups): `qevolve.envs.host`.

A command's output is stdout and stderr together, undecodable bytes replaced, ECMA-48 control functions removed, cut to
`output_bytes` as Terminus-2 does (the first and last halves, with a note of what was left out). Its end
is a random sentinel carrying `$?`, so `cd`, variables and background jobs persist between commands. A
command past its timeout has every process under the shell killed (the shell survives and reports 137);
a loop inside the shell itself, which that cannot stop, gets the sandbox restarted in the same folder,
and the result says so (`restarted`: cd and variables are reset).
"""

from __future__ import annotations

import base64
import logging
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

from qevolve.envs.host import (
    SANDBOX_UID,
    ancestors,
    comm,
    descendants,
    hand_over,
    host_uid,
    kill,
    make_cgroups,
    pids_cgroup_of,
)
from qevolve.errors import UserError

log = logging.getLogger(__name__)
BACKENDS = ("bwrap", "docker", "local")
CONTROLS = re.compile(
    "(?:\x1b\\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?"  # CSI, 7- and 8-bit: parameters, intermediates, final
    # OSC, DCS, SOS, PM, APC: to BEL or ST
    "|(?:\x1b[\\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\\\|\x9c)?"
    "|\x1b[\x20-\x2f]*[\x30-\x7e]?"  # every other escape (ESC c, ESC ( 0, ESC # 8, ESC 7, ESC =) and a lone ESC
    "|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]"  # the other C0 controls (tab, newline and carriage return stay), DEL, C1
)
"""ECMA-48's control functions in decoded text: what a terminal would act on rather than show."""
IDLE_PIDS = 4
"""Processes of an idle bwrap sandbox in its pids cgroup (bwrap, its init, the shell) and one to spare."""
GRACE_S = 2.0
"""How long a killed command's shell gets to print its sentinel before the sandbox is restarted."""
START_S = {"bwrap": 30.0, "local": 30.0, "docker": 300.0}
"""How long a sandbox may take to start its shell: a container of a large image takes a while where the engine
copies its layers (`--storage-driver=vfs`: 33 s for a 1.1 GB image on a busy 2-core machine)."""
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "nsswitch.conf", "localtime")
NETWORK_ETC = ("resolv.conf", "hosts", "ssl", "ca-certificates")
"""What a sandbox with the network also reads of the host's /etc: name resolution and the CA certificates."""
"""What of the host's /etc a bwrap sandbox sees (the loader's files and links); passwd and group are stubs."""
PASSWD = (
    "root:x:0:0:root:/root:/usr/sbin/nologin\n"
    "agent:x:1000:1000:agent:/app:/bin/bash\n"
    "nobody:x:65534:65534:nobody:/app:/bin/bash\n"
)
GROUP = "root:x:0:\nagent:x:1000:\nnogroup:x:65534:\n"
# every backend's shell: UTF-8, and listings without clock times (GNU ls reads TIME_STYLE), so what an episode
# shows depends on its task and actions, not on when it ran; `ls --full-time` and `stat` still show them
SHELL_ENV = {"LANG": "C.UTF-8", "TZ": "UTC", "TIME_STYLE": "+"}


def encode(command: str) -> bytes:
    """A command's bytes for bash: UTF-8, with lone surrogates (which no decoder makes, but an agent's text may
    hold) passed through as bytes rather than raising."""
    return command.encode("utf-8", errors="surrogatepass")


class SandboxError(UserError, RuntimeError):
    hint = (
        "env.terminal.sandbox picks the backend (bwrap; docker with env.terminal.image; or local for no isolation); "
        "`apt-get install bubblewrap` installs bwrap"
    )


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
    cpus: float = 0.0
    """CPU time the sandbox may use at once, in CPUs (a cpu cgroup's quota under bwrap, where this host lets us make
    one; docker's `--cpus`); 0: no cap."""
    network: bool = False
    """Give the sandbox the host's network (bwrap `--share-net`, with the host's /etc/resolv.conf and hosts; docker's
    default bridge). Off, it has none."""


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
    kept, then `tail`) with a note of how many were left out, undecodable bytes replaced, control functions
    (`CONTROLS`) removed."""
    total, raw = len(raw) + omitted + len(tail), raw + tail
    if total > budget:
        half = budget // 2
        raw = (
            raw[:half]
            + f"\n[... output limited to {budget} bytes; {total - 2 * half} interior bytes omitted ...]\n".encode()
            + raw[-half:]
        )
    return CONTROLS.sub("", raw.decode("utf-8", errors="replace"))


def available(backend: str, image: str | None = "") -> str | None:
    """None when `backend` can run here with `image`, else why not (and how to fix it); `image` None: whichever
    image a task needs (its own, or env.terminal.image), checked when its episode starts."""
    if backend not in BACKENDS:
        return f"unknown sandbox {backend!r}; expected one of {list(BACKENDS)}"
    if backend == "bwrap" and shutil.which("bwrap") is None:
        return (
            "bubblewrap (`bwrap`) is not installed: `apt-get install bubblewrap` (Debian/Ubuntu), or "
            "env.terminal.sandbox: local without isolation"
        )
    if backend == "docker":
        if shutil.which("docker") is None:
            return "the `docker` command is not installed"
        if not image:
            return None if image is None else "docker needs env.terminal.image, an image with bash, python3 and pytest"
        try:
            done = subprocess.run(["docker", "image", "inspect", image], capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return "`docker image inspect` did not answer in 30 s: is the daemon running?"
        if done.returncode != 0:
            return (
                f"docker has no image {image!r} here ({done.stderr.strip()[:200]}); build it or `docker pull` "
                f"it first (images are not pulled)"
            )
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
        found = re.search(
            re.escape(self.marker) + rb"(\d+)\n", bytes(self.head[-64:] + self.tail) if self.tail else bytes(self.head)
        )
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
    """A persistent bash in a sandbox over `workdir` (mounted at /app under bwrap; under docker at `inside`, a task
    image's working directory). `mounts`: more host folders as (host path, path inside, writable); `where` says
    where the shell sees them."""

    def __init__(
        self,
        backend: str,
        workdir: Path,
        limits: Limits = Limits(),
        output_bytes: int = 10_000,
        image: str = "",
        mounts: tuple[tuple[Path, str, bool], ...] = (),
        inside: str = "/app",
    ):
        why = available(backend, image)
        if why:
            raise SandboxError(f"env.terminal.sandbox: {why}")
        self.backend, self.workdir, self.limits, self.output_bytes, self.image = (
            backend,
            Path(workdir).resolve(),
            limits,
            output_bytes,
            image,
        )
        self.inside = inside if backend == "docker" else "/app"
        self.mounts = tuple((Path(host).resolve(), inside, writable) for host, inside, writable in mounts)
        self.container = f"qevolve-{os.getpid()}-{secrets.token_hex(6)}" if backend == "docker" else None
        self.cgroups = make_cgroups(limits.processes, limits.memory_mb, limits.cpus) if backend == "bwrap" else []
        self.container_group: Path | None = None  # docker's cgroup of the container, where this host shows it
        if backend != "local":  # the sandbox's user writes there
            for folder in [self.workdir, *(host for host, _, writable in self.mounts if writable)]:
                hand_over(folder)
        self.proc: subprocess.Popen | None = None
        self._start()

    @property
    def app(self) -> str:
        """The working directory as the shell sees it."""
        return str(self.workdir) if self.backend == "local" else self.inside

    def where(self, inside: str) -> str:
        """Where the shell sees the mount whose path inside is `inside` (the host path under `local`)."""
        return next(str(host) for host, path, _ in self.mounts if path == inside) if self.backend == "local" else inside

    @property
    def python(self) -> str:
        """The Python the validators run with inside: the image's, or the one running qevolve."""
        return "python3" if self.backend == "docker" else sys.executable

    def _argv(self, fds: list[int]) -> list[str]:
        """The command that starts the sandbox's shell; descriptors it needs open are appended to `fds`."""
        shell = ["bash", "--noprofile", "--norc"]
        if self.backend == "local":
            return shell
        if self.backend == "docker":
            lim, uid = self.limits, host_uid()
            mounts = [a for host, inside, rw in self.mounts for a in ("-v", f"{host}:{inside}{'' if rw else ':ro'}")]
            return [
                "docker",
                "run",
                "--rm",
                "-i",
                "--name",
                self.container,
                "--network",
                "bridge" if lim.network else "none",
                "--read-only",
                "--cap-drop",
                "ALL",
                *(["--cpus", f"{lim.cpus:g}"] if lim.cpus else []),
                "--security-opt",
                "no-new-privileges",
                "--user",
                f"{uid}:{uid}",
                "--memory",
                f"{lim.memory_mb}m",
                "--pids-limit",
                str(lim.processes),
                "--ulimit",
                f"fsize={lim.file_mb << 20}",
                *(
                    ["--tmpfs", f"/tmp:size={lim.tmp_mb}m"] if self.inside != "/tmp" else []
                ),  # a task image's WORKDIR /tmp is the episode's folder
                "-v",
                f"{self.workdir}:{self.inside}",
                *mounts,
                "-w",
                self.inside,
                "-e",
                f"HOME={self.inside}",
                *(a for k, v in SHELL_ENV.items() for a in ("-e", f"{k}={v}")),
                self.image,
                *shell,
            ]

        def data(text: str, inside: str) -> list[str]:
            read, write = os.pipe()
            os.write(write, text.encode())
            os.close(write)
            fds.append(read)
            return ["--perms", "0644", "--ro-bind-data", str(read), inside]

        system = [d for d in ("/usr", "/bin", "/lib", "/lib64") if os.path.exists(d)]
        binds = [a for d in system for a in ("--ro-bind", d, d)]
        binds += ["--perms", "0755", "--dir", "/etc"]
        etc = ETC + NETWORK_ETC * self.limits.network
        binds += [
            a for name in etc if os.path.lexists(f"/etc/{name}") for a in ("--ro-bind", f"/etc/{name}", f"/etc/{name}")
        ]
        binds += [
            *data(PASSWD, "/etc/passwd"),
            *data(GROUP, "/etc/group"),
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--perms",
            "1777",
            "--size",
            str(self.limits.tmp_mb << 20),
            "--tmpfs",
            "/tmp",
        ]
        # then what lives under those (a venv under /tmp): mounted before, the tmpfs would hide it
        made: set[str] = set()
        for host, inside, writable in [
            *((p, p, False) for p in dict.fromkeys([sys.prefix, sys.base_prefix])),
            *self.mounts,
        ]:
            if any(Path(inside).is_relative_to(d) for d in system):
                continue  # a system Python: already there
            for parent in reversed(Path(inside).parents[:-1]):  # bwrap would make them 0700 where the host's are
                if str(parent) not in made:
                    made.add(str(parent))
                    binds += ["--perms", "0755", "--dir", str(parent)]
            binds += ["--bind" if writable else "--ro-bind", str(host), str(inside)]
        if (
            os.geteuid() == 0
        ):  # no user namespace (it would map to root): bwrap sets up as root, then the shell drops to nobody
            user = [
                "--unshare-pid",
                *(["--unshare-net"] * (not self.limits.network)),
                "--unshare-ipc",
                "--unshare-uts",
                "--unshare-cgroup-try",
                "--cap-add",
                "CAP_SETUID",
                "--cap-add",
                "CAP_SETGID",
            ]
            shell = [
                "setpriv",
                "--reuid",
                str(SANDBOX_UID),
                "--regid",
                str(SANDBOX_UID),
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                *shell,
            ]
        else:
            user = [
                "--unshare-all",
                *(["--share-net"] * self.limits.network),
                "--unshare-user",
                "--disable-userns",
                "--uid",
                "1000",
                "--gid",
                "1000",
            ]
        return [
            "bwrap",
            *binds,
            "--bind",
            str(self.workdir),
            "/app",
            "--chdir",
            "/app",
            *user,
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/local/bin:/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/app",
            *(a for k, v in SHELL_ENV.items() for a in ("--setenv", k, v)),
            *shell,
        ]

    def _enter(self) -> None:
        """In the sandbox's process before it runs bwrap: join the cgroups."""
        for group in self.cgroups:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    def _start(self) -> None:
        cgroup = self.cgroups
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.workdir), **SHELL_ENV}
        if self.backend == "docker":  # the client's settings (DOCKER_HOST, ...); the container gets none of them
            env = dict(os.environ)
        fds: list[int] = []
        try:
            self.proc = subprocess.Popen(
                self._argv(fds),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd="/" if self.backend == "bwrap" else self.workdir,
                env=env,
                start_new_session=True,
                pass_fds=fds,
                preexec_fn=self._enter if self.backend == "bwrap" else None,
            )
        finally:
            for fd in fds:
                os.close(fd)
        self.marker = f"\x1e{secrets.token_hex(8)}:".encode()
        self.chunks: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.chunks), daemon=True).start()
        self.shell_pid: int | None = None
        limits = [
            f"ulimit -v {self.limits.memory_mb << 10}",
            f"ulimit -f {self.limits.file_mb << 10}",
        ]  # bash counts KiB
        if self.backend == "docker":
            limits = []  # the container's own limits
        if (
            self.backend == "bwrap" and not cgroup
        ):  # no pids cgroup: a per-user cap, which holds since the sandbox is never root
            limits.append(f"ulimit -u {self.limits.processes}")
        setup = self._exchange("; ".join(["exec 2>&1", *limits, "echo $$"]), START_S[self.backend], restart=False)
        if setup.status != 0 or not setup.output.strip().isdigit():
            self._stop()
            raise SandboxError(
                f"env.terminal.sandbox: {self.backend} did not start a shell: {setup.output.strip()[:300]!r}"
            )
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
        """The sandbox's bash as this host numbers it: the Popen process itself, under bwrap its first bash
        descendant, under docker the container's first process (its bash) where the engine runs on this host, whose
        cgroup then caps the container's processes (`container_group`); else the client."""
        if self.backend == "local":
            return self.proc.pid
        if self.backend == "docker":
            inspect = ["docker", "inspect", "--format", "{{.State.Pid}}", self.container]
            done = subprocess.run(inspect, capture_output=True, text=True, timeout=60)
            pid = int(done.stdout.strip()) if done.stdout.strip().isdigit() else 0
            self.container_group = pids_cgroup_of(pid) if pid and comm(pid) == "bash" else None
            return pid if self.container_group is not None else self.proc.pid
        for _ in range(100):
            for pid in descendants(self.proc.pid):
                if comm(pid) == "bash":
                    return pid
            time.sleep(0.01)
        raise SandboxError(f"env.terminal.sandbox: no bash found under bwrap (pid {self.proc.pid})")

    def run(self, command: str, timeout: float = 30.0) -> Result:
        """Run one command; its output and exit status. A dead shell is started again first; a sandbox at its
        process cap (a fork bomb left running in the background) has every process but its shell killed first,
        and the output says so."""
        restarted = False
        if self.proc is None or self.proc.poll() is not None:
            self._stop()
            self._start()
            restarted = True
        reaped = self._reap_runaway()
        while (
            reaped and not self.chunks.empty()
        ):  # what the killed printed since the last command: not this one's output
            self.chunks.get_nowait()
        result = self._exchange(command, timeout)
        result.restarted = result.restarted or restarted
        if reaped:
            result.output = (
                f"[the sandbox reached its cap of {self.limits.processes} processes: {reaped} of them, all but the "
                f"shell, "
                "were killed]\n" + result.output
            )
        return result

    def _pids_group(self) -> Path | None:
        """The cgroup whose `pids.max` caps this sandbox (cgroup v1's pids hierarchy, or v2's unified group)."""
        return self.container_group or next((g for g in self.cgroups if (g / "pids.max").exists()), None)

    def _reap_runaway(self) -> int:
        """Before a command: a sandbox at its process cap (within 2) has everything but its shell killed; how many
        processes that was. Where more than the shell runs and the count still grows (a fork bomb left by the step
        before, slowed by a busy host), it gets up to a second to settle or reach the cap. Only at the cap: a
        background job that holds still is never touched."""
        group = self._pids_group()
        if group is None or self.shell_pid is None:
            return 0

        def count() -> int:
            try:
                return int((group / "pids.current").read_text())
            except (OSError, ValueError):
                return 0

        cap, now = self.limits.processes, count()
        for _ in range(10):
            if now >= cap - 2:
                return self._kill_all_but_shell()
            if now <= IDLE_PIDS:
                return 0
            time.sleep(0.1)
            now, before = count(), now
            if now <= before:
                return 0
        return 0

    def _kill_all_but_shell(self) -> int:
        """Kill every process of the sandbox but its shell (and the bwrap processes above it): with a pids cgroup,
        every member of it, orphans of killed parents included, pass after pass until none is left (a fork
        bomb refills freed slots); else the shell's descendants. How many were killed."""
        group = self._pids_group()
        if group is None:
            victims = descendants(self.shell_pid) if self.shell_pid else []
            for pid in victims:
                kill(pid)
            return len(victims)
        keep = {self.shell_pid, *ancestors(self.shell_pid, self.proc.pid)}
        killed: set[int] = set()

        def members() -> set[int]:
            try:
                return {int(p) for p in (group / "cgroup.procs").read_text().split()} - keep
            except OSError:
                return set()

        for _ in range(400):  # until a read after the count settled finds no one: a fork bomb refills freed slots
            victims = members()
            if not victims:
                for _ in range(
                    50
                ):  # the killed leave the count as they are reaped: the shell's next forks need the room
                    try:
                        if int((group / "pids.current").read_text()) <= len(keep) + 1:
                            break
                    except (OSError, ValueError):
                        break
                    time.sleep(0.02)
                if not members():
                    break
                continue
            for pid in victims:
                kill(pid)
            killed |= victims
        return len(killed)

    def _exchange(self, command: str, timeout: float, restart: bool = True) -> Result:
        encoded = base64.b64encode(encode(command)).decode()
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
        if self.backend == "docker" and self.container_group is None:  # from inside: kill(-1) spares PID 1, the shell
            # (at the container's process cap `docker exec` cannot start: only the host-side kill below ends a bomb)
            subprocess.run(
                ["docker", "exec", self.container, "bash", "-c", "kill -9 -1"], capture_output=True, timeout=30
            )
            return
        self._kill_all_but_shell()

    def close(self) -> None:
        """End the sandbox and everything in it."""
        self._stop()
        for group in self.cgroups:
            for _ in range(50):  # the sandbox's processes leave it as the kernel reaps them
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)
        self.cgroups = []

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
