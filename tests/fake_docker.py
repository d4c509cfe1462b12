"""A stand-in for the `docker` command (tests/test_terminal.py): `image inspect`, `run`, `exec`, `rm -f`, `build`,
`create`, `cp`, `tag`, `push` and `pull` (a registry: $FAKE_DOCKER_STATE/registry.json), each logged as a JSON line to
$FAKE_DOCKER_LOG. A "container" is bubblewrap over the host's system with the `-v` folders (`:ro` read-only) and a PID
namespace; `exec NAME bash -c 'kill -9 -1'` kills everything under its shell, as kill(-1) inside a container spares only
PID 1; `rm -f` kills it. Images: $FAKE_DOCKER_IMAGES, and those `build` made: it fails where the Dockerfile has `RUN
false`, else the image holds its context's files (not the Dockerfile) at its `WORKDIR`, which `create` + `cp` copy
out."""

import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

from qevolve.envs.host import comm, descendants

argv = sys.argv[1:]
state = Path(os.environ["FAKE_DOCKER_STATE"])
with open(os.environ["FAKE_DOCKER_LOG"], "a") as log:
    log.write(json.dumps(argv) + "\n")

built = state / "images.json"
images = json.loads(built.read_text()) if built.exists() else {}  # tag -> [context, workdir]
if argv[:2] == ["image", "inspect"]:
    if argv[-1] in os.environ["FAKE_DOCKER_IMAGES"].split(",") + list(images):
        if "--format" in argv:
            print(images.get(argv[-1], ["", "/app"])[1])
        sys.exit(0)
    print(f"Error: No such image: {argv[-1]}", file=sys.stderr)
    sys.exit(1)
if argv[0] == "build":
    context, tag = Path(argv[-1]), argv[argv.index("-t") + 1]
    dockerfile = (context / "Dockerfile").read_text()
    print(f"Step 1/1 : {dockerfile.splitlines()[0]}")
    if "RUN false" in dockerfile:
        print("The command '/bin/sh -c false' returned a non-zero code: 1")
        sys.exit(1)
    workdir = (re.findall(r"^WORKDIR (\S+)", dockerfile, re.M) or ["/"])[-1]
    keep = state / "fs" / re.sub(r"\W", "_", tag)  # the image's files: the context as it was
    shutil.copytree(context, keep, symlinks=True)
    built.write_text(json.dumps({**images, tag: [str(keep), workdir]}))
    sys.exit(0)
registry = state / "registry.json"
pushed = json.loads(registry.read_text()) if registry.exists() else {}  # remote name -> [context, workdir]
if argv[0] == "tag":
    built.write_text(json.dumps({**images, argv[2]: images[argv[1]]}))
    sys.exit(0)
if argv[0] == "push":
    registry.write_text(json.dumps({**pushed, argv[1]: images[argv[1]]}))
    sys.exit(0)
if argv[0] == "pull":
    if argv[1] not in pushed:
        print(f"Error response from daemon: manifest for {argv[1]} not found", file=sys.stderr)
        sys.exit(1)
    built.write_text(json.dumps({**images, argv[1]: pushed[argv[1]]}))
    sys.exit(0)
if argv[0] == "create":
    (state / "created").write_text(argv[-2])
    print("c0ffee")
    sys.exit(0)
if argv[0] == "cp":
    context = Path(images[(state / "created").read_text()][0])
    os.execvp(
        "sh", ["sh", "-c", 'cp -a "$1"/. "$2" && rm -f "$2/Dockerfile"', "cp", str(context), argv[2]]
    )  # special files as they are, like a tar
    sys.exit(0)
if argv[0] == "run":
    name = argv[argv.index("--name") + 1]
    volumes = []  # every -v HOST:INSIDE[:ro]
    for volume in (argv[i + 1] for i, a in enumerate(argv) if a == "-v"):
        parts = volume.split(":")
        volumes += ["--ro-bind" if parts[2:] == ["ro"] else "--bind", parts[0], parts[1]]
    (state / name).write_text(str(os.getpid()))
    shell = argv[argv.index("bash") :]
    binds = [
        a for prefix in dict.fromkeys([sys.prefix, sys.base_prefix]) for a in ("--ro-bind", prefix, prefix)
    ]  # the image's python3
    os.execvp(
        "bwrap",
        [
            "bwrap",
            "--ro-bind",
            "/usr",
            "/usr",
            "--ro-bind",
            "/bin",
            "/bin",
            "--ro-bind",
            "/lib",
            "/lib",
            "--ro-bind-try",
            "/lib64",
            "/lib64",
            "--ro-bind",
            "/etc",
            "/etc",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
            "--tmpfs",
            "/tmp",
            *binds,
            "--ro-bind",
            str(state / "bin"),
            "/image-bin",
            *volumes,
            "--chdir",
            argv[argv.index("-w") + 1],
            "--unshare-pid",
            "--die-with-parent",
            "--setenv",
            "PATH",
            "/image-bin:/usr/bin:/bin",
            *shell,
        ],
    )
if argv[0] == "exec" and argv[2:] == ["bash", "-c", "kill -9 -1"]:
    pid = int((state / argv[1]).read_text())
    shell = next(p for p in descendants(pid) if comm(p) == "bash")
    for p in descendants(shell):
        os.kill(p, signal.SIGKILL)
    sys.exit(0)
if argv[:2] == ["rm", "-f"]:
    path = state / argv[2]
    if argv[2] == "c0ffee":
        sys.exit(0)
    if path.exists():
        try:
            os.kill(int(path.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
        path.unlink()
    sys.exit(0)
print(f"fake docker: unsupported {argv}", file=sys.stderr)
sys.exit(2)
