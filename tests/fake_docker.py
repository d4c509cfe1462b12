"""A stand-in for the `docker` command (tests/test_terminal.py): `image inspect`, `run`, `exec` and `rm -f`,
each logged as a JSON line to $FAKE_DOCKER_LOG. A "container" is bubblewrap over the host's system with
the `-v` folders (`:ro` read-only) and a PID namespace; `exec NAME bash -c 'kill -9 -1'` kills everything under its
shell, as kill(-1) inside a container spares only PID 1; `rm -f` kills it. Images: $FAKE_DOCKER_IMAGES."""

import json
import os
import signal
import sys
from pathlib import Path

from qevolve.envs.sandbox import _comm, _descendants

argv = sys.argv[1:]
state = Path(os.environ["FAKE_DOCKER_STATE"])
with open(os.environ["FAKE_DOCKER_LOG"], "a") as log:
    log.write(json.dumps(argv) + "\n")

if argv[:2] == ["image", "inspect"]:
    if argv[2] in os.environ["FAKE_DOCKER_IMAGES"].split(","):
        sys.exit(0)
    print(f"Error: No such image: {argv[2]}", file=sys.stderr)
    sys.exit(1)
if argv[0] == "run":
    name = argv[argv.index("--name") + 1]
    volumes = []  # every -v HOST:INSIDE[:ro]
    for volume in (argv[i + 1] for i, a in enumerate(argv) if a == "-v"):
        parts = volume.split(":")
        volumes += ["--ro-bind" if parts[2:] == ["ro"] else "--bind", parts[0], parts[1]]
    (state / name).write_text(str(os.getpid()))
    shell = argv[argv.index("bash"):]
    binds = [a for prefix in dict.fromkeys([sys.prefix, sys.base_prefix]) for a in ("--ro-bind", prefix, prefix)]  # the image's python3
    os.execvp("bwrap", ["bwrap", "--ro-bind", "/usr", "/usr", "--ro-bind", "/bin", "/bin", "--ro-bind", "/lib", "/lib", "--ro-bind-try", "/lib64",
                        "/lib64", "--ro-bind", "/etc", "/etc", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", *binds,
                        "--ro-bind", str(state / "bin"), "/image-bin", *volumes, "--chdir", argv[argv.index("-w") + 1],
                        "--unshare-pid", "--die-with-parent", "--setenv", "PATH", "/image-bin:/usr/bin:/bin", *shell])
if argv[0] == "exec" and argv[2:] == ["bash", "-c", "kill -9 -1"]:
    pid = int((state / argv[1]).read_text())
    shell = next(p for p in _descendants(pid) if _comm(p) == "bash")
    for p in _descendants(shell):
        os.kill(p, signal.SIGKILL)
    sys.exit(0)
if argv[:2] == ["rm", "-f"]:
    path = state / argv[2]
    if path.exists():
        try:
            os.kill(int(path.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
        path.unlink()
    sys.exit(0)
print(f"fake docker: unsupported {argv}", file=sys.stderr)
sys.exit(2)
