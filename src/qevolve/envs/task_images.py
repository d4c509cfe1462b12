"""Docker images of terminal tasks built from each task's own Dockerfile (`qevolve terminal-import --build`,
`qevolve.envs.terminal_import`); the terminal environment runs such a task in its image (`qevolve.envs.terminal`).

A task's image is named by its content: `qevolve-task/<task name>:<digest>`, the digest a SHA-256 of its build
context (the task's `environment/` folder, Dockerfile included: every path, executable bit and byte, a link by its
target), so a task is built once, and again only when its Dockerfile or context changes. The import writes the
Dockerfile as built, its `FROM` lines mapped by `--base` (`ORIGINAL=LOCAL`: an image named without a tag maps
every tag of it, `*` every image not mapped otherwise) onto images this machine has, for machines that cannot
pull a task's base; the mapping is thus part of the digest, and any machine rebuilds the same image from the task.

`ensure` makes an image present: already here; else pulled from the registry (`QEVOLVE_TASK_REGISTRY`, e.g.
`registry.lab:5000/qevolve`, set on a cluster's workers by scaleout.yaml's `images: {registry: ...}`), else
built here and pushed there, so the workers of a cluster build each task once between them. `docker build` runs
with the network given (`default`, Docker's bridge; `host` where the engine has no bridge, as a dockerd started with
`--bridge=none`: the build's commands then reach this host's loopback services as well) and the host's proxy
settings (Docker's predefined build arguments); package installs reach the indexes the image itself is
configured with. Its output is kept in a log.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
from pathlib import Path

REPOSITORY = "qevolve-task"
REGISTRY_ENV = "QEVOLVE_TASK_REGISTRY"
PROXIES = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
DEFAULT_WORKDIR = "/app"


def parse_base(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`--base ORIGINAL=LOCAL` arguments as pairs (an error naming the malformed one)."""
    pairs = []
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old.strip() or not new.strip() or any(c.isspace() for c in item):
            raise ValueError(
                f"--base {item!r}: expected ORIGINAL=LOCAL (an image a Dockerfile names, `=`, an image this "
                f"machine has), "
                "e.g. ghcr.io/laude-institute/t-bench/ubuntu-24-04=qevolve-base:bookworm, or *=IMAGE for every base"
            )
        pairs.append((old, new))
    return tuple(pairs)


def _untagged(image: str) -> str:
    name = image.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def map_base(dockerfile: str, base: tuple[tuple[str, str], ...]) -> str:
    """`dockerfile` with each `FROM` image mapped by `base` (an exact name first, then the name without its tag,
    then `*`); a `FROM` naming an earlier build stage is left alone."""
    table = dict(base)
    stages: set[str] = set()
    out = []
    for line in dockerfile.splitlines(keepends=True):
        words = line.split()
        if words and words[0].upper() == "FROM":
            at = next((i for i, w in enumerate(words[1:], 1) if not w.startswith("--")), None)
            if at is not None:
                image = words[at]
                new = None if image.lower() in stages else table.get(image, table.get(_untagged(image), table.get("*")))
                if len(words) > at + 2 and words[at + 1].upper() == "AS":
                    stages.add(words[at + 2].lower())
                if new:
                    line = line.replace(image, new, 1)
        out.append(line)
    return "".join(out)


def context_digest(context: Path) -> str:
    """SHA-256 of a build context: every path under it in order, its kind, executable bit and bytes (a link's
    target)."""
    h = hashlib.sha256()
    for top, dirs, files in os.walk(context):
        dirs.sort()
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(top, d))]):
            path = Path(top) / name
            rel = path.relative_to(context).as_posix()
            if path.is_symlink():
                h.update(f"L {rel}\0{os.readlink(path)}\0".encode())
                continue
            h.update(f"F {rel} {os.stat(path).st_mode & 0o111:o}\0".encode())
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            h.update(b"\0")
    return h.hexdigest()


def special_files(folder: Path) -> list[Path]:
    """What under `folder` is neither a directory, a regular file nor a link: a device node there (which a tar
    extracted as root can make) would be read through by a copy, a FIFO would block it."""
    found = []
    for top, dirs, files in os.walk(folder):
        for name in [*dirs, *files]:
            mode = os.lstat(Path(top) / name).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
                found.append(Path(top) / name)
    return found


def image_tag(name: str, context: Path) -> str:
    """`qevolve-task/<name>:<digest>`: the task's name reduced to what a Docker repository allows."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:60].strip("-") or "task"
    return f"{REPOSITORY}/{slug}:{context_digest(context)[:20]}"


def _docker(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kw)


def present(tag: str) -> bool:
    try:
        return _docker("image", "inspect", tag, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def workdir(tag: str) -> str:
    """The working directory the image's Dockerfile set (`DEFAULT_WORKDIR` when it set none)."""
    done = _docker("image", "inspect", "--format", "{{.Config.WorkingDir}}", tag, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"docker image inspect {tag}: {done.stderr.strip()[:300]}")
    path = done.stdout.strip()
    return path if path.startswith("/") and path != "/" else DEFAULT_WORKDIR


def export_workdir(tag: str, inside: str, dest: Path) -> None:
    """Copy what the image holds at `inside` into `dest` (a container made, copied from, removed; never started),
    then remove what is neither a folder, a regular file nor a link (a device node the build made would be read
    through by each episode's copy, a FIFO would block it)."""
    made = _docker("create", "--network", "none", tag, "true", timeout=120)
    if made.returncode != 0:
        raise RuntimeError(f"docker create {tag}: {made.stderr.strip()[:300]}")
    container = made.stdout.strip()
    try:
        done = _docker("cp", f"{container}:{inside}/.", str(dest), timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"docker cp {tag}:{inside}: {done.stderr.strip()[:300]}")
    finally:
        _docker("rm", "-f", container, timeout=120)
    for path in special_files(dest):
        path.unlink()


def ensure(
    tag: str, context: Path, log: Path, network: str = "default", timeout: float = 1800.0, registry: str | None = None
) -> str:
    """Make `tag` present here: pulled from `registry` (default: $QEVOLVE_TASK_REGISTRY), else built from `context`
    (its output appended to `log`) and pushed there. "" when it is present, else why not (with the log's last lines)."""
    if present(tag):
        return ""
    registry = (os.environ.get(REGISTRY_ENV, "") if registry is None else registry).rstrip("/")
    remote = f"{registry}/{tag}" if registry else ""
    if (
        remote
        and _docker("pull", remote, timeout=timeout).returncode == 0
        and _docker("tag", remote, tag).returncode == 0
    ):
        return ""
    args = [a for k in PROXIES if os.environ.get(k) for a in ("--build-arg", f"{k}={os.environ[k]}")]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        out.write(f"$ docker build --network {network} -t {tag} {context}\n")
        out.flush()
        try:
            code = subprocess.run(
                ["docker", "build", "--network", network, *args, "-t", tag, str(context)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=timeout,
            ).returncode
            why = f"docker build exited with status {code}" if code else ""
        except subprocess.TimeoutExpired:
            why = f"the build did not end in {timeout:g} s"
        except OSError as err:
            why = f"docker could not run: {err}"
        if why:
            out.write(f"\n[qevolve: {why}]\n")
    if why:
        tail = [ln.strip()[:200] for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-4:-1]
        return f"{why}: " + " | ".join(tail)
    if remote:
        pushed = (
            _docker("tag", tag, remote).returncode == 0 and _docker("push", remote, timeout=timeout).returncode == 0
        )
        if not pushed:
            with open(log, "a") as out:
                out.write(f"[qevolve: pushing {remote} failed; the image is here only]\n")
    return ""
