"""The terminal environment: the sandbox's promises on the real bubblewrap backend, task folders, the
oracle's steps and the validators' verdict."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from qevolve.config import TerminalConfig
from qevolve.envs.base import Task
from qevolve.envs.sandbox import Limits, SandboxError, Session, clip
from qevolve.envs.terminal import SUBMIT, TaskError, TerminalEnv, oracle_steps, read_task
from qevolve.envs.terminal_import import REPORT, import_tasks

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (scripts/setup.sh installs it where it can)"
)


@pytest.mark.parametrize(
    "sequence",
    [
        "\x1b[31m",
        "\x1b[0m",
        "\x1b[2J",
        "\x1b[?1049h",
        "\x1b[38;5;196m",
        "\x1b[1 q",  # CSI, with parameters and intermediates
        "\u009b31m",
        "\u009b2J",  # CSI in 8 bits (U+009B in UTF-8 text)
        "\x1b]0;a title\x07",
        "\x1b]8;;http://x\x1b\\",
        "\u009d0;title\u009c",  # OSC to BEL or ST, 7- and 8-bit
        "\x1bP1$r0m\x1b\\",
        "\x1bXsos\x1b\\",
        "\x1b^pm\x1b\\",
        "\x1b_apc\x1b\\",
        "\u0090dcs\u009c",  # DCS, SOS, PM, APC
        "\x1bc",
        "\x1b(0",
        "\x1b)B",
        "\x1b#8",
        "\x1b%G",
        "\x1b7",
        "\x1b8",
        "\x1b=",
        "\x1b>",
        "\x1bD",
        "\x1bM",
        "\x1bZ",  # RIS, nF, Fp, Fe
        "\x07",
        "\x08",
        "\x0e",
        "\x0f",
        "\x7f",
        "\u0085",
        "\u009a",  # C0 (BEL, BS, SO, SI), DEL, C1
    ],
)
def test_observations_carry_no_control_function(sequence):
    """Every ECMA-48 escape, control string and C1 control is removed from what the agent reads; the text around it
    stays, as do tab, newline and carriage return."""
    raw = f"before{sequence}after\tend\r\n".encode()
    assert clip(raw, 1000) == "beforeafter\tend\r\n"
    assert clip(f"x{sequence}".encode(), 1000) == "x"  # at the very end too


def test_output_is_cut_to_its_head_and_tail_with_ansi_stripped():
    assert clip(b"\x1b[31mred\x1b[0m ok \xff", 100) == "red ok \ufffd"
    # 26 bytes, budget 10: the first 5 and last 5 kept, 16 left out
    assert (
        clip(b"abcdefghijklmnopqrstuvwxyz", 10)
        == "abcde\n[... output limited to 10 bytes; 16 interior bytes omitted ...]\nvwxyz"
    )
    # what a streamed capture never kept counts too
    assert (
        clip(b"abcdefg", 10, omitted=100, tail=b"uvwxyz")
        == "abcde\n[... output limited to 10 bytes; 103 interior bytes omitted ...]\nvwxyz"
    )


@needs_bwrap
def test_the_bwrap_sandbox_keeps_shell_state_and_isolates_the_system(tmp_path):
    s = Session("bwrap", tmp_path)
    try:
        assert s.run("mkdir sub && cd sub && export X=5; pwd").output.strip() == "/app/sub"
        assert s.run("echo $X; pwd").output.split() == ["5", "/app/sub"], "cd and variables persist"
        # as root, the sandbox is nobody on this host (a user namespace's uid 1000 would be host root), so host secrets
        # stay unreadable
        assert s.run("id -u").output.strip() == ("65534" if os.geteuid() == 0 else "1000")
        host_uid = int(open(f"/proc/{s.shell_pid}/status").read().split("Uid:")[1].split()[0])
        assert host_uid == (65534 if os.geteuid() == 0 else os.geteuid())
        assert (
            "Permission denied" in s.run("cat /etc/shadow /root/.bashrc 2>&1").output
            or "No such file" in s.run("cat /etc/shadow 2>&1").output
        )
        r = s.run("echo hi > /app/sub/f.txt; touch /usr/x /etc/x; echo $?")
        assert "Read-only file system" in r.output and (tmp_path / "sub" / "f.txt").read_text() == "hi\n"
        assert s.run(f"test -e {__file__}; echo $?").output.strip() == "1", "the host's files are not there"
        assert s.run("python3 -c 'x = bytearray(4 << 30)' 2>&1 | tail -1").output.strip() == "MemoryError"
        assert s.run("false").status == 1 and s.run("nonexistent-cmd").status == 127
    finally:
        s.close()


@needs_bwrap
def test_a_mount_under_tmp_is_not_hidden_by_the_sandboxs_own_tmp(tmp_path):
    """A checkout (and so the validators' Python) under /tmp, as CI's fresh clone is: once hidden by the tmpfs."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    (shared / "hello.txt").write_text("hi\n")
    (shared / "hello.txt").chmod(0o644)
    (tmp_path / "app").mkdir()
    s = Session("bwrap", tmp_path / "app", mounts=((shared, "/tmp/deep/shared", False),))
    try:
        assert s.run("cat /tmp/deep/shared/hello.txt; touch /tmp/own && echo writable").output.split() == [
            "hi",
            "writable",
        ]
        assert s.run(f"{sys.executable} -I -c 'print(7)'").output.strip() == "7"
    finally:
        s.close()


@needs_bwrap
def test_a_runaway_command_is_killed_and_the_shell_survives(tmp_path):
    s = Session("bwrap", tmp_path)
    try:
        s.run("cd /tmp; export KEEP=1")
        start = time.monotonic()
        r = s.run("sleep 60; echo after", timeout=1.0)
        assert r.timed_out and not r.restarted and time.monotonic() - start < 10
        assert "after" in r.output, "only the command's process is killed: the rest of the line runs"
        assert s.run("echo $KEEP; pwd").output.split() == ["1", "/tmp"]
        # a loop in the shell itself cannot be killed apart from it: the sandbox is started again, same folder
        r = s.run("while true; do :; done", timeout=1.0)
        assert r.timed_out and r.restarted and r.status == 137
        assert s.run("echo ${KEEP:-unset}; pwd").output.split() == ["unset", "/app"]
    finally:
        s.close()


@needs_bwrap
def test_a_fork_bomb_and_a_gigabyte_of_output_are_contained(tmp_path):
    s = Session("bwrap", tmp_path, Limits(processes=64), output_bytes=1000)
    try:
        start = time.monotonic()
        r = s.run("head -c 1000000000 /dev/zero | tr '\\0' b", timeout=60)
        assert r.status == 0 and "999999000 interior bytes omitted" in r.output and len(r.output) < 1200
        s.run(":(){ :|:& };:", timeout=3)
        time.sleep(1)
        count = len(_under(s.proc.pid))
        assert count <= 64 + 3, f"{count} processes in the sandbox"
        assert time.monotonic() - start < 60
    finally:
        s.close()
    assert not _under(s.proc.pid if s.proc else -1)


@needs_bwrap
def test_nothing_of_an_episode_survives_it(tmp_path):
    s = Session("bwrap", tmp_path)
    s.run("sleep 1234 & setsid sleep 1235 & nohup sleep 1236 >/dev/null 2>&1 &")
    s.close()
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", "sleep 123[456]"], capture_output=True, text=True).stdout
    assert left == "", f"processes outlived the sandbox: {left}"


def test_an_unknown_or_missing_backend_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(SandboxError, match=r"env.terminal.sandbox: unknown sandbox 'docker2'"):
        Session("docker2", tmp_path)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SandboxError, match=r"bubblewrap .* is not installed: `apt-get install bubblewrap`"):
        Session("bwrap", tmp_path)


def _under(pid: int) -> list[int]:
    from qevolve.envs.host import descendants

    return descendants(pid) if pid > 0 and os.path.exists(f"/proc/{pid}") else []


def _task(root, name="count", split="train", tests=None, solve="wc -l < data.txt > count.txt\n", toml=None):
    """A task: count the lines of data.txt (made by setup.sh) into count.txt."""
    t = root / split / name
    (t / "environment").mkdir(parents=True)
    (t / "tests").mkdir()
    (t / "solution").mkdir()
    (t / "instruction.md").write_text("Write the number of lines of data.txt to count.txt.\n")
    (t / "task.toml").write_text(
        toml or '[metadata]\ncategory = "text"\n[agent]\ntimeout_sec = 60\n[verifier]\ntimeout_sec = 10\n'
    )
    (t / "environment" / "setup.sh").write_text("printf 'a\\nb\\nc\\n' > data.txt\n")
    (t / "environment" / "README").write_text("data.txt is made at start\n")
    (t / "tests" / "test_count.py").write_text(
        tests
        or textwrap.dedent("""
        from pathlib import Path

        def test_count():
            assert Path("count.txt").read_text().strip() == "3"

        def test_data_kept():
            assert Path("data.txt").read_text().count("\\n") == 3
        """)
    )
    (t / "solution" / "solve.sh").write_text("#!/bin/bash\n# the oracle\n" + solve)
    return t


def _play(env, task, actions):
    obs = env.reset(task)
    steps = []
    for a in actions:
        steps.append(env.step(a))
        if steps[-1].done:
            break
    return obs, steps


@pytest.mark.parametrize("sandbox", ["bwrap", "local"])
def test_the_oracle_wins_a_do_nothing_agent_loses_and_the_tests_stay_hidden(tmp_path, sandbox):
    if sandbox == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    _task(tmp_path / "tasks")
    env = TerminalEnv(str(tmp_path / "tasks"), TerminalConfig(sandbox=sandbox), max_steps=10, expert="oracle")
    try:
        [task] = env.tasks("train")
        assert task == Task("count", "train", "text")
        obs = env.reset(task)
        assert (
            "README" in obs.text and "data.txt" in obs.text and "setup.sh" not in obs.text and "tests" not in obs.text
        )
        assert obs.instruction.startswith("Write the number of lines")
        actions = []
        while (a := env.expert_action()) is not None:
            actions.append(a)
            step = env.step(a)
        assert actions == ["wc -l < data.txt > count.txt", SUBMIT]
        assert (
            step.done and step.won and step.reward == 1.0 and env.info["tests_passed"] == env.info["tests_total"] == 2
        )
        _, steps = _play(env, task, ["ls tests 2>&1", SUBMIT])
        assert "No such file" in steps[0].observation
        assert steps[-1].done and not steps[-1].won and steps[-1].reward == 0.0 and env.info["tests_passed"] == 1
        assert "[episode ended (submitted): 1/2 tests passed]" in steps[-1].observation
        # partial credit on request; a step cap validates as well
        env.cfg = TerminalConfig(sandbox=sandbox, partial_reward=True)
        env.max_steps = 2
        _, steps = _play(env, task, ["true", "nonexistent-cmd"])
        assert steps[0].valid and not steps[1].valid and "[exit status 127]" in steps[1].observation
        assert steps[-1].done and steps[-1].reward == 0.5 and env.info["ended"] == "max_steps"
    finally:
        env.close()


@needs_bwrap
def test_the_validators_see_the_tasks_own_variables_and_not_the_agents(tmp_path):
    """A Dockerfile's ENV (an `export` line of setup.sh) holds for the validators, as in the task's image; what the
    agent exports does not."""
    t = _task(
        tmp_path / "tasks",
        tests="import os\n\ndef test_env():\n    assert os.environ['TASK_VAR'] == '3'\n    assert 'AGENT_VAR' not "
        "in os.environ\n",
    )
    (t / "environment" / "setup.sh").write_text("export TASK_VAR=3\nprintf 'a\\nb\\nc\\n' > data.txt\n")
    env = TerminalEnv(str(tmp_path / "tasks"), TerminalConfig(), max_steps=5)
    try:
        _, steps = _play(env, env.tasks("train")[0], ["export AGENT_VAR=1", SUBMIT])
        assert steps[-1].won, env.info
    finally:
        env.close()


@needs_bwrap
def test_a_hanging_validator_is_timed_out_and_loses(tmp_path):
    _task(
        tmp_path / "tasks",
        tests="import time\n\ndef test_hangs():\n    time.sleep(60)\n",
        toml='[metadata]\ncategory = "text"\n[verifier]\ntimeout_sec = 2\n',
    )
    env = TerminalEnv(str(tmp_path / "tasks"), TerminalConfig(), max_steps=5)
    try:
        start = time.monotonic()
        _, steps = _play(env, env.tasks("train")[0], [SUBMIT])
        assert (
            steps[-1].done and not steps[-1].won and env.info["validator_timed_out"] and time.monotonic() - start < 30
        )
    finally:
        env.close()


def test_a_bad_task_folder_names_the_file_and_the_field(tmp_path):
    t = _task(tmp_path, toml='[verifier]\ntimeout_sec = "soon"\n')
    with pytest.raises(
        TaskError,
        match=r"task.toml: verifier.timeout_sec must be a finite number of seconds, 0 < s <= 86400 \(.*\), got 'soon'",
    ):
        read_task(t)
    for toml, field in (
        ("[verifier]\ntimeout_sec = nan", "verifier.timeout_sec"),
        ("[agent]\ntimeout_sec = inf", "agent.timeout_sec"),
        ("[agent]\ntimeout_sec = 0", "agent.timeout_sec"),
        ("[verifier]\ntimeout_sec = true", "verifier.timeout_sec"),
        ("[environment]\nmemory_mb = nan", "environment.memory_mb"),
        ("[environment]\ncpus = -inf", "environment.cpus"),
        ("[environment]\nstorage_mb = 1e30", "environment.storage_mb"),
        ("[metadata]\ncategory = 3", "metadata.category"),
        ("environment = 3", "environment"),
    ):
        (t / "task.toml").write_text(toml + "\n")
        with pytest.raises(TaskError, match=re.escape(f"{t / 'task.toml'}: {field} must be ")):
            read_task(t)
    (t / "task.toml").write_text("[metadata\n")
    with pytest.raises(TaskError, match=r"task.toml: not valid TOML"):
        read_task(t)
    for validators, why in (
        ('["../count.py"]', "must be a list of file names in tests/"),
        ('"test_count.py"', "must be a list of file names"),
        ('["test_other.py"]', "names test_other.py, which is not a file in"),
    ):
        (t / "task.toml").write_text(f"[qevolve]\nvalidators = {validators}\n")
        with pytest.raises(TaskError, match=re.escape(why)):
            read_task(t)
    shutil.rmtree(t / "tests")
    with pytest.raises(TaskError, match=r"tests: missing; a terminal task needs"):
        read_task(t)


def test_the_validators_are_the_files_a_tasks_test_runner_names_as_harbor_runs_them(tmp_path):
    import json

    from qevolve.envs.terminal_import import import_tasks, validators

    src = tmp_path / "src"
    # TermiGen's shape: test.sh runs one file, and tests/ holds another test_*.py, the puzzle's, that cannot pass;
    # "every" has no runner naming files, so every test_*.py validates
    for name in ("named", "every"):
        task = _task(src, name, split=".")
        (task / "environment" / "setup.sh").unlink()
        (task / "environment" / "data.txt").write_text("a\nb\nc\n")
        (task / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\nCOPY data.txt /app/\n")
        (task / "tests" / "test_fixture_puzzle.py").write_text(
            "def test_needs_a_fixture(db_connection):\n    assert db_connection\n"
        )
    (src / "named" / "tests" / "test.sh").write_text(
        "#!/bin/bash\npytest /tests/test_count.py -rA\necho 1 > /logs/verifier/reward.txt\n"
    )
    import_tasks(src, tmp_path / "dest", gate=False)
    assert read_task(tmp_path / "dest" / "test" / "named")["validators"] == ["test_count.py"]
    assert read_task(tmp_path / "dest" / "test" / "every")["validators"] == []
    env = TerminalEnv(str(tmp_path / "dest"), TerminalConfig(sandbox="local", command_timeout=5), 5)
    won = {t.id: _play(env, t, ["wc -l < data.txt > count.txt", SUBMIT])[1][-1].won for t in env.tasks("test")}
    assert won == {"named": True, "every": False}, (
        "the fixture-less file decides only where no runner names the validators"
    )
    env.close()
    tb1 = tmp_path / "tb1"
    (tb1 / "tests").mkdir(parents=True)
    (tb1 / "tests" / "test_outputs.py").write_text("")
    (tb1 / "run-tests.sh").write_text(
        "uv run pytest $TEST_DIR/test_outputs.py -rA\nuv run pytest ${TEST_DIR}/test_outputs.py\n"
    )
    assert validators(tb1 / "run-tests.sh", tb1 / "tests") == ["test_outputs.py"]
    assert validators(tb1 / "none.sh", tb1 / "tests") == []
    (tb1 / "run-tests.sh").write_text("pytest /tests/test_missing.py\n")
    with pytest.raises(ValueError, match=r"runs test_missing.py, which \S*tb1/tests does not hold"):
        validators(tb1 / "run-tests.sh", tb1 / "tests")
    report = json.loads((tmp_path / "dest" / "test" / "import.json").read_text())
    assert {k: v["status"] for k, v in report.items()} == {"named": "imported", "every": "imported"}


def test_the_oracle_is_split_into_its_command_lines_unless_a_line_does_not_parse_alone():
    assert oracle_steps("#!/bin/bash\n# c\n\ncd x\necho 'a b' > f\n") == ["cd x", "echo 'a b' > f"]
    heredoc = "cat > f <<'EOF'\nline\nEOF\necho done\n"
    assert oracle_steps(heredoc) == [heredoc]


def test_params_pick_the_terminal_environment_and_check_its_data(tmp_path):
    from qevolve.config import ConfigError
    from qevolve.envs import check_data, make_env
    from qevolve.params import parse_params

    _task(tmp_path / "tasks")
    raw = {
        "env": {
            "name": "terminal",
            "data_dir": str(tmp_path / "tasks"),
            "terminal": {"sandbox": "local", "command_timeout": 5},
        },
        "experts": {"demos": {"oracle": 1}},
        "evaluate": {"splits": {"train": 1}},
        "policy": {"action_mode": "free"},
    }
    params = parse_params(raw)
    check_data(params.env)
    env = make_env(params.env, "oracle")
    assert [t.id for t in env.tasks("train")] == ["count"] and env.cfg.command_timeout == 5
    with pytest.raises(ConfigError, match=r"env.terminal.sandbox"):
        parse_params({**raw, "env": {**raw["env"], "terminal": {"sandbox": "docker2"}}})
    with pytest.raises(ValueError, match=r"env.data_dir: the terminal environment needs"):
        check_data(parse_params({**raw, "env": {"name": "terminal", "terminal": {"sandbox": "local"}}}).env)
    # TerminalTraj's tasks are written by its `generate` stage: the folder is not read before the pipeline runs
    from qevolve.dvcfile import env_data_generated

    traj = parse_params({**raw, "method": "terminaltraj", "env": {**raw["env"], "data_dir": "data/instances"}})
    assert env_data_generated(traj) and not env_data_generated(params)
    check_data(traj.env, generated=True)
    with pytest.raises(ValueError, match=r"data/instances/train: no split 'train'"):
        check_data(traj.env)


@needs_bwrap
def test_every_family_passes_the_sanity_gate_and_its_mistakes_fail_its_validators(tmp_path):
    from qevolve.envs.terminal_tasks import FAMILIES, _episode, gate, make, write_task

    assert make("csv", 3) == make("csv", 3) and make("csv", 3) != make("csv", 4), "a family and seed make one task"
    env = TerminalEnv(str(tmp_path), TerminalConfig(), max_steps=10)
    try:
        for family in FAMILIES:
            spec = make(family, 0)
            write_task(spec, tmp_path / "train" / family)
            task = Task(family, "train", family)
            assert env.tasks("train")[-1].type in FAMILIES and gate(env, task) == "", family
            for i, wrongs in enumerate(spec.mistakes):
                for wrong in wrongs:
                    assert not _episode(env, task, [*spec.solution[:i], wrong, *spec.solution[i + 1 :], SUBMIT]), (
                        f"{family}: {wrong!r} passes"
                    )
    finally:
        env.close()


@pytest.mark.parametrize("sandbox", ["bwrap", "local"])
def test_an_episode_shows_the_same_whenever_it_runs(tmp_path, sandbox):
    """The archive is made in the episode (setup.sh), the folder copied from files written at another time: neither
    the archive's bytes nor a listing may carry the clock, else one run's prompts differ from the next's."""
    from qevolve.envs.terminal_tasks import make, write_task

    if sandbox == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    write_task(make("archive", 1), tmp_path / "train" / "a")
    env = TerminalEnv(str(tmp_path), TerminalConfig(sandbox=sandbox), max_steps=5)
    seen = []
    try:
        for when in (1_000_000_000, 1_500_000_000):
            for f in (tmp_path / "train" / "a").rglob("*"):
                os.utime(f, (when, when))
            obs = env.reset(Task("a", "train", "archive"))
            looked = env.step("touch later.txt && ls -la").observation
            here = env.session.app  # the local backend's folder is a new temporary one each episode
            seen.append(
                (
                    obs.text.replace(here, "/app"),
                    looked.replace(here, "/app"),
                    (env.episode_dir / "bundle.tar.gz").read_bytes(),
                )
            )
            time.sleep(1.1)
    finally:
        env.close()
    assert seen[0] == seen[1]
    assert "bundle.tar.gz" in seen[0][0] and "later.txt" in seen[0][1]
    assert not re.search(r"\d\d:\d\d|20\d\d", seen[0][0] + seen[0][1]), "a listing shows no clock"


def test_a_local_listing_does_not_show_the_hosts_temporary_folder(tmp_path):
    """Another process making a folder in the host's temporary folder (as any other work on the machine does) must not
    change what the agent sees when it lists /app, `..` included: /app sits under a private folder of its own."""
    import tempfile
    from pathlib import Path

    from qevolve.envs.terminal_tasks import make, write_task

    write_task(make("archive", 1), tmp_path / "train" / "a")
    env = TerminalEnv(str(tmp_path), TerminalConfig(sandbox="local"), max_steps=5)
    try:
        env.reset(Task("a", "train", "archive"))
        before = env.step("ls -la | head -3").observation  # total, `.` and `..`
        other = tempfile.mkdtemp()
        try:
            after = env.step("ls -la | head -3").observation
        finally:
            os.rmdir(other)
        assert before == after and env.episode_dir.parent != Path(tempfile.gettempdir())
        folder = env.episode_dir.parent
    finally:
        env.close()
    assert not folder.exists(), "closing the episode removes its private folder too"


def test_the_gate_rejects_a_task_a_do_nothing_agent_passes_and_one_its_oracle_fails(tmp_path):
    from qevolve.envs.terminal_tasks import gate

    free = _task(tmp_path, "free", tests="def test_nothing():\n    assert True\n")
    broken = _task(tmp_path, "broken", solve="echo 4 > count.txt\n")
    env = TerminalEnv(str(tmp_path), TerminalConfig(sandbox="local"), max_steps=5)
    try:
        assert gate(env, Task(free.name, "train", "text")) == "noop_passes"
        assert gate(env, Task(broken.name, "train", "text")) == "oracle_fails"
        assert gate(env, Task(_task(tmp_path, "fine").name, "train", "text")) == ""
    finally:
        env.close()


def test_the_noisy_teacher_makes_its_mistakes_at_their_rate_and_recovers_at_its_own():
    import random

    from qevolve.envs.terminal_tasks import teacher_plan

    assert teacher_plan(["a", "b"], [["x"], ["y"]], random.Random(0), p_err=0.0) == ["a", "b", SUBMIT]
    assert teacher_plan(["a", "b"], [["x"], ["y"]], random.Random(0), p_err=1.0, p_fix=0.0) == ["x", "y", SUBMIT]
    assert teacher_plan(["a", "b"], [["x"], ["y"]], random.Random(0), p_err=1.0, p_fix=1.0) == [
        "x",
        "ls -la",
        "a",
        "y",
        "ls -la",
        "b",
        SUBMIT,
    ]
    plans = [teacher_plan(["a"], [["x"]], random.Random(s), p_err=0.3, p_fix=0.5) for s in range(2000)]
    wrong = [p for p in plans if p[0] == "x"]
    assert abs(len(wrong) / 2000 - 0.3) < 0.03 and abs(sum(len(p) == 4 for p in wrong) / len(wrong) - 0.5) < 0.06


def test_the_transcript_judge_believes_a_confident_ending_and_nothing_else():
    from qevolve.envs.terminal_tasks import transcript_judge

    ok = ["out\n[exit status 0]", "[exit status 0]", "[episode ended (submitted): 0/1 tests passed]"]
    assert transcript_judge(ok, ["cmd", "cmd", SUBMIT]) == (True, "accepted"), "it cannot see the state was wrong"
    assert transcript_judge(ok[:2], ["cmd", "cmd"]) == (False, "not_submitted")
    assert transcript_judge(["x\n[exit status 1]", "end"], ["cmd", SUBMIT]) == (False, "last_command_failed")
    assert transcript_judge(
        ["ls: cannot access 'x': No such file or directory\n[exit status 2]", "[exit status 0]", "end"],
        ["ls x", "true", SUBMIT],
    ) == (False, "error_seen")


@needs_bwrap
def test_terminaltraj_runs_end_to_end_and_keeps_only_verified_rollouts(tmp_path, monkeypatch):
    import json

    from qevolve import dvcfile, paths
    from qevolve.config import ConfigError
    from qevolve.data.store import read_store
    from qevolve.params import parse_params
    from qevolve.stages import pipeline, run_stage
    from tests.test_env_pipelines import _tiny

    raw = _tiny("terminal", tmp_path)
    raw["terminaltraj"] = {
        "generate": {
            "families": ["text", "json", "csv", "files"],
            "held_out": ["files"],
            "per_family": 3,
            "test_share": 0.5,
        },
        "teacher": {"rollouts": 2, "p_err": 0.5},
    }
    raw["policy"]["action_mode"] = "free"
    params = parse_params(raw)
    with pytest.raises(ConfigError, match=r"env.data_dir: under TerminalTraj the tasks are the ones `generate` writes"):
        parse_params({**raw, "env": {**raw["env"], "data_dir": "elsewhere"}})
    spec = dvcfile.spec(params)["stages"]
    assert "data/instances" in spec["collect"]["do"]["deps"] and "data/instances" in spec["evaluate"]["do"]["deps"], (
        "the tasks are a dep"
    )
    monkeypatch.chdir(tmp_path)
    metrics = {f"{s}@{k}" if k is not None else s: run_stage(s, params, k) for s, k in pipeline(params, 1)}
    g = metrics["generate"]
    assert (
        g["generated"] == 12
        and g["passed_gate"] == 12
        and g["test_ood_tasks"] == 3
        and g["train_tasks"] > 0
        and g["test_tasks"] > 0
    )
    assert sorted(p.name for p in (tmp_path / "data" / "instances" / "test_ood").iterdir()) == [
        "files-0000",
        "files-0001",
        "files-0002",
    ]
    t = metrics["teacher"]
    assert t["rollouts"] == 2 * g["train_tasks"] and 0 < t["verified"] < t["rollouts"], (
        "a noisy teacher wins some and loses some"
    )
    v = metrics["verify"]
    assert v["true_positives"] + v["false_negatives"] == t["verified"] and v["trajectories"] == t["rollouts"]
    kept = read_store(paths.EXPERTS)
    assert kept and all(x.won for x in kept) and len(kept) == metrics["filter"]["kept"] == t["verified"]
    fun, fam = metrics["filter"]["funnel"], metrics["filter"]["funnel_by_family"]
    assert [fun[r] for r in ("generated", "passed_gate", "train_tasks", "rollouts", "verified", "kept")] == [
        12,
        12,
        g["train_tasks"],
        t["rollouts"],
        t["verified"],
        t["verified"],
    ]
    assert (
        fun["rollouts_rate"] == 2.0
        and fun["verified_rate"] == t["verified_rate"]
        and fam["files"]["train_tasks"] == fam["files"]["rollouts"] == 0
    )
    assert sum(f["verified"] for f in fam.values()) == t["verified"] and fam["text"]["generated"] == 3
    plot = json.loads((tmp_path / "metrics" / "filter_curve.json").read_text())
    assert [p["row"] for p in plot] == [
        "1. generated",
        "2. passed_gate",
        "3. train_tasks",
        "4. rollouts",
        "5. verified",
        "6. kept",
    ]
    assert spec["filter"]["plots"] == [
        {"metrics/filter_curve.json": {"x": "count", "y": "row", "template": "bar_horizontal", "cache": False}}
    ]
    assert "metrics/generate.json" in spec["filter"]["deps"]
    assert metrics["bc"]["loss"] < metrics["bc"]["first_loss"]
    for k in (0, 1):
        assert set(metrics[f"evaluate@{k}"]) >= {"test", "test_ood"}
        assert metrics[f"evaluate@{k}"]["test_ood"]["episodes"] == 2
    assert metrics["evaluate@0"]["test"]["cumulative_env_steps"] == t["cumulative_env_steps"]
    # the judge's filter keeps what the transcript rule accepts, won or not
    judged = parse_params({**raw, "terminaltraj": {**raw["terminaltraj"], "filter": {"keep": "judge"}}})
    f = run_stage("filter", judged, None)
    assert f["kept"] == v["true_positives"] + v["false_positives"]


def test_shell_actions_keep_their_case():
    from qevolve.models.prompt import parse_action

    assert parse_action("Action: grep -c 'ERROR' app.log", keep_case=True) == ("grep -c 'ERROR' app.log", "")
    assert parse_action("Action: Open Drawer 1") == ("open drawer 1", ""), (
        "the text games' actions are lower-cased as before"
    )


def test_an_llm_teacher_and_an_llm_judge_behind_a_url(tmp_path, fake_chat):
    import json

    from qevolve.config import ConfigError
    from qevolve.data.store import read_store
    from qevolve.llm import LLMError
    from qevolve.methods.terminaltraj.teacher import command_of, teacher
    from qevolve.methods.terminaltraj.verify import verify
    from qevolve.params import parse_params

    episodes = []

    def answer(body):
        first = body["messages"][0]["content"]
        if first.startswith("You are judging"):  # the judge: believes every ending that mentions count.txt
            return json.dumps(
                {"verdict": "pass" if "count.txt" in first else "fail", "reason": "count.txt was written"}
            )
        turns = sum(m["role"] == "assistant" for m in body["messages"])
        if turns == 0:
            episodes.append(body)
            right = len(episodes) % 2 == 1  # every second episode writes a wrong count
            return (
                "Count the lines.\n```bash\n"
                + ("wc -l < data.txt > count.txt" if right else "echo 4 > count.txt")
                + "\n```"
            )
        return "submit"

    server = fake_chat(answer)
    _task(tmp_path / "tasks")
    raw = {
        "method": "terminaltraj",
        "env": {
            "name": "terminal",
            "data_dir": "data/instances",
            "max_steps": 4,
            "terminal": {"sandbox": "local", "command_timeout": 5},
        },
        "terminaltraj": {
            "teacher": {"kind": "llm", "url": server.url, "model": "coder", "rollouts": 2},
            "judge": {"kind": "llm", "url": server.url, "model": "judge"},
        },
        "experts": {"demos": {"oracle": 1}},
        "evaluate": {"splits": {"train": 1}},
        "policy": {"action_mode": "free"},
    }
    params = parse_params(raw)
    t = teacher(params, tmp_path / "tasks", tmp_path / "rollouts", tmp_path / "teacher.json")
    assert t["rollouts"] == 2 and t["verified"] == 1
    trajs = read_store(tmp_path / "rollouts")
    assert (
        [s.action for s in trajs[0].steps] == ["wc -l < data.txt > count.txt", SUBMIT]
        and trajs[0].won
        and not trajs[1].won
    )
    second = next(b for b in server.requests if sum(m["role"] == "assistant" for m in b["messages"]) == 1)
    assert (
        second["model"] == "coder"
        and second["temperature"] == 0.7
        and "Write the number of lines" in second["messages"][1]["content"]
    )
    assert second["messages"][-1]["content"].endswith("[exit status 0]"), "the teacher reads each command's output"
    v = verify(params, tmp_path / "rollouts", tmp_path / "verify", tmp_path / "verify.json")
    assert (v["true_positives"], v["false_positives"], v["judge"]) == (1, 1, "llm"), (
        "the judge believes the confident wrong ending"
    )
    assert (
        json.loads((tmp_path / "verify" / "labels.json").read_text())[trajs[1].trajectory_id]["judge_reason"]
        == "count.txt was written"
    )
    assert (
        command_of("```sh\nls -la\n```\nthen more") == "ls -la"
        and command_of("  Submit \n") == SUBMIT
        and command_of("cat f") == "cat f"
    )

    server.answer = lambda body: "It looks complete to me."
    with pytest.raises(
        LLMError,
        match=r"terminaltraj.judge.url = 'http://127.0.0.1:\d+/v1': the verdict on rollout \w+ is not the JSON "
        r"asked for",
    ):
        verify(params, tmp_path / "rollouts", tmp_path / "verify2", tmp_path / "verify2.json")
    assert not (tmp_path / "verify2").exists(), "nothing half-written"
    with pytest.raises(ConfigError, match=r"terminaltraj.teacher.url: teacher `llm` needs the http\(s\) URL"):
        parse_params({**raw, "terminaltraj": {"teacher": {"kind": "llm", "url": "localhost:8000"}}})


def test_harbor_and_terminal_bench_tasks_import_when_their_dockerfile_reduces_to_files(tmp_path):
    import json

    from qevolve.cli import main
    from qevolve.envs.terminal_import import NeedsDocker, translate

    src = tmp_path / "src"
    harbor = _task(
        src, "harbor-count", split="."
    )  # Harbor layout: instruction.md, task.toml, environment/, tests/, solution/
    (harbor / "environment" / "setup.sh").unlink()
    (harbor / "environment" / "data").mkdir()
    (harbor / "environment" / "data" / "words.txt").write_text("x\n")
    (harbor / "environment" / "Dockerfile").write_text(
        "FROM ubuntu:24.04\n# the task's files\nWORKDIR /app\nCOPY README /app/\nCOPY data ./data\n"
        'ENV LINES=3\nRUN for i in $(seq 1 $LINES); do \\\n  echo line >> data.txt; done\nCMD ["bash"]\n'
    )
    (harbor / "tests" / "test.sh").write_text("#!/bin/bash\ncurl -LsSf https://astral.sh/uv/install.sh | sh\n")
    apt = _task(src, "needs-apt", split=".")
    (apt / "environment" / "Dockerfile").write_text(
        "FROM ubuntu:24.04\nWORKDIR /app\nRUN apt-get update && \\\n    apt-get install -y jq\n"
    )
    _task(src, "free-win", split=".", solve="true\n", tests="def test_nothing():\n    assert True\n")
    tb1 = src / "tb1-count"  # Terminal-Bench 1: task.yaml, Dockerfile, solution.sh, tests/test_outputs.py
    (tb1 / "tests").mkdir(parents=True)
    (tb1 / "task.yaml").write_text(
        "instruction: |\n  Write the number of lines of data.txt to count.txt.\ndifficulty: easy\ncategory: "
        "file-operations\n"
        "max_agent_timeout_sec: 180\nmax_test_timeout_sec: 20\n"
    )
    (tb1 / "data.txt").write_text("a\nb\nc\n")
    (tb1 / "Dockerfile").write_text(
        "FROM ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest\nWORKDIR /app\nCOPY data.txt /app/data.txt\n"
    )
    (tb1 / "solution.sh").write_text("#!/bin/bash\nwc -l < data.txt > count.txt\n")
    (tb1 / "tests" / "test_outputs.py").write_text((harbor / "tests" / "test_count.py").read_text())
    (src / "no-tests").mkdir()
    (src / "no-tests" / "task.yaml").write_text("instruction: hi\n")
    (src / "notes").mkdir()  # not a task: ignored

    files, setup = translate(harbor / "environment" / "Dockerfile")
    assert [(p.name, rel) for p, rel in files] == [("README", "README"), ("data", "data")]
    assert setup == ["export LINES=3", "( for i in $(seq 1 $LINES); do echo line >> data.txt; done )"]
    for line, why in (
        ("RUN curl -L https://x | sh", "`curl` installs or downloads"),
        ("WORKDIR /srv", "must be /app"),
        ("COPY --from=build /out /app/", "another build stage"),
        ("RUN qevolve-no-such-tool", "not on this host"),
        ("VOLUME /data\nHEALTHCHECK CMD true\nONBUILD RUN true", "ONBUILD needs the image"),
    ):
        (tmp_path / "Dockerfile").write_text(f"FROM x\n{line}\n")
        with pytest.raises(NeedsDocker, match=re.escape(why)):
            translate(tmp_path / "Dockerfile")

    dest = tmp_path / "tasks"
    assert main(["terminal-import", str(src), str(dest), "--sandbox", "local"]) == 0
    report = json.loads((dest / "test" / "import.json").read_text())
    assert {k: v["status"] for k, v in report.items()} == {
        "free-win": "rejected_noop_passes",
        "harbor-count": "imported",
        "needs-apt": "needs_docker",
        "no-tests": "unsupported",
        "tb1-count": "imported",
    }
    assert (
        report["needs-apt"]["reason"]
        == "Dockerfile:3 `RUN apt-get update && apt-get install -y jq`: `apt-get` installs or downloads"
    )
    assert sorted(p.name for p in (dest / "test").iterdir()) == ["harbor-count", "import.json", "tb1-count"]
    assert sorted(p.name for p in (dest / "test" / "harbor-count" / "environment").rglob("*")) == [
        "README",
        "data",
        "setup.sh",
        "words.txt",
    ]
    assert not (dest / "test" / "harbor-count" / "tests" / "test.sh").exists()
    env = TerminalEnv(str(dest), TerminalConfig(sandbox="local", command_timeout=5), 5)
    tb = next(t for t in env.tasks("test") if t.id == "tb1-count")
    assert tb.type == "file-operations" and read_task(dest / "test" / "tb1-count")["agent_timeout"] == 180
    _, steps = _play(env, tb, ["wc -l < data.txt > count.txt", SUBMIT])
    assert steps[-1].won
    env.close()
    assert main(["terminal-import", str(src), str(dest), "--sandbox", "local"]) == 2, (
        "an existing split is not overwritten"
    )
    assert main(["terminal-import", str(tmp_path / "notes"), str(dest), "--split", "x"]) == 2


def test_tasks_without_an_oracle_import_validator_only_and_the_gate_checks_what_it_can(tmp_path):
    import json

    from qevolve.cli import main

    src = tmp_path / "src"
    for name in ("plain", "free-win", "flaky", "broken"):
        _task(src, name, split=".")
        (src / name / "solution" / "solve.sh").unlink()
        (src / name / "environment" / "setup.sh").unlink()
        (src / name / "environment" / "Dockerfile").write_text(
            "FROM ubuntu:24.04\nWORKDIR /app\nRUN printf 'a\\nb\\nc\\n' > data.txt\n"
        )
    (src / "free-win" / "tests" / "test_count.py").write_text("def test_nothing():\n    assert True\n")
    # judged apart on two untouched runs: a count kept on the host (the `local` sandbox lets the validators reach it)
    counter = tmp_path / "runs.txt"
    (src / "flaky" / "tests" / "test_count.py").write_text(
        textwrap.dedent(f"""
        from pathlib import Path

        def test_fails():
            assert Path("count.txt").exists()

        def test_every_other_run():
            counter = Path({str(counter)!r})
            runs = int(counter.read_text()) if counter.exists() else 0
            counter.write_text(str(runs + 1))
            assert runs % 2 == 0
        """)
    )
    (src / "broken" / "task.toml").write_text('[metadata]\ncategory = "text"\n[verifier]\ntimeout_sec = 1\n')
    (src / "broken" / "tests" / "test_count.py").write_text(
        "import time\ntime.sleep(30)\n\ndef test_count():\n    pass\n"
    )
    dest = tmp_path / "tasks"
    assert main(["terminal-import", str(src), str(dest), "--sandbox", "local"]) == 0
    report = json.loads((dest / "test" / "import.json").read_text())
    assert {k: (v["status"], v["oracle"]) for k, v in report.items()} == {
        "plain": ("imported", False),
        "free-win": ("rejected_noop_passes", False),
        "flaky": ("rejected_flaky", False),
        "broken": ("rejected_validators_broken", False),
    }
    assert "whether the task can be solved could not be checked" in report["plain"]["reason"]
    assert (
        sorted(p.name for p in (dest / "test").iterdir()) == ["import.json", "plain"]
        and not (dest / "test" / "plain" / "solution").exists()
    )

    # played, and judged by the validators, as any task; an expert is refused before it plays anything
    env = TerminalEnv(str(dest), TerminalConfig(sandbox="local", command_timeout=5), 5)
    obs, steps = _play(env, env.tasks("test")[0], ["wc -l < data.txt > count.txt", SUBMIT])
    assert steps[-1].won and obs.admissible == ["ls -la", SUBMIT]
    env.close()
    expert = TerminalEnv(str(dest), TerminalConfig(sandbox="local"), 5, expert="oracle")
    with pytest.raises(
        TaskError,
        match=r"test: 1 of its 1 tasks are validator-only \(no solution/solve.sh: plain\); the expert `oracle`",
    ):
        expert.tasks("test")
    with pytest.raises(
        TaskError, match=r"plain/solution/solve.sh: missing: a validator-only task gives no expert demonstration"
    ):
        expert.reset(Task("plain", "test", "text"))
    expert.close()
    assert main(["terminal-import", str(src), str(tmp_path / "ungated"), "--sandbox", "local", "--no-gate"]) == 0
    ungated = json.loads((tmp_path / "ungated" / "test" / "import.json").read_text())
    assert ungated["free-win"] == {
        "status": "imported",
        "oracle": False,
        "reason": "validator-only (no oracle): not gated; it gives no expert demonstration",
    }


def test_a_tasks_own_limits_are_given_up_to_the_configs_and_the_verifier_timeout_is_capped(tmp_path):
    from qevolve.envs.sandbox import Limits
    from qevolve.envs.terminal import task_limits

    asks = (
        '[metadata]\ncategory = "text"\n[verifier]\ntimeout_sec = 900\n'
        "[environment]\ncpus = 4\nmemory_mb = 512\nstorage_mb = 64\nallow_internet = true\n"
    )
    meta = read_task(_task(tmp_path / "tasks", "asks", toml=asks))
    assert task_limits(meta, TerminalConfig(cpus=2)) == Limits(
        memory_mb=512, processes=128, file_mb=64, tmp_mb=64, cpus=2.0, network=False
    )
    assert task_limits(meta, TerminalConfig()).cpus == 4.0, "no cap in the config: the task's"
    assert task_limits(meta, TerminalConfig(allow_internet=True)).network, "asked for, and allowed"
    assert not task_limits(meta, TerminalConfig(allow_internet=True), validators=True).network, (
        "never for the validators"
    )
    plain = read_task(_task(tmp_path / "tasks", "plain"))
    assert task_limits(plain, TerminalConfig(allow_internet=True)) == Limits(network=False), (
        "no [environment]: the config's, no network"
    )
    for bad, field in (
        ('memory_mb = "lots"', "environment.memory_mb must be a finite number"),
        ("cpus = -1", "environment.cpus must be"),
        ('allow_internet = "yes"', "environment.allow_internet must be true or false"),
    ):
        folder = _task(tmp_path / "bad", bad.split()[0], toml=f'[metadata]\ncategory = "text"\n[environment]\n{bad}\n')
        with pytest.raises(TaskError, match=re.escape(f"{folder / 'task.toml'}: {field}")):
            read_task(folder)
    # the task's verifier may take 900 s; the config gives it 1
    _task(
        tmp_path / "slow",
        "slow",
        split="test",
        toml=asks,
        tests="import time\ntime.sleep(20)\n\ndef test_late():\n    pass\n",
    )
    env = TerminalEnv(str(tmp_path / "slow"), TerminalConfig(sandbox="local", verifier_timeout=1), 5)
    started = time.monotonic()
    _, steps = _play(env, env.tasks("test")[0], [SUBMIT])
    env.close()
    assert (
        not steps[-1].won and "timed out after 1 s" in env.info["validation_error"] and time.monotonic() - started < 15
    )


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_the_bwrap_sandbox_has_the_network_only_when_given_it_and_its_cpu_quota_holds(tmp_path):
    import socket

    from qevolve.envs.sandbox import Limits

    server = socket.create_server(("127.0.0.1", 0))
    probe = (
        f'{sys.executable} -c \'import socket; socket.create_connection(("127.0.0.1", '
        f'{server.getsockname()[1]}), timeout=2); print("reached")\''
    )
    for network in (False, True):
        session = Session("bwrap", tmp_path, Limits(network=network))
        try:
            assert ("reached" in session.run(probe, 20).output) == network
        finally:
            session.close()
    server.close()
    busy = (
        f"{sys.executable} -c 'import time; t = time.time()\nwhile time.time() - t < 1.5: "
        f"pass\nprint(time.process_time())'"
    )
    used = {}
    for cpus in (0.1, 0.0):
        session = Session("bwrap", tmp_path, Limits(cpus=cpus))
        try:
            if cpus and not any("cpu" in str(g) for g in session.cgroups):
                pytest.skip("this host lets us make no cpu cgroup")
            used[cpus] = float(session.run(busy, 30).output.split()[-1])
        finally:
            session.close()
    assert used[0.1] < 0.35 and used[0.0] > 2 * used[0.1], (
        used
    )  # a tenth of a CPU for 1.5 s of wall time, then unbounded


def test_the_import_benchmark_samples_by_difficulty_and_lists_every_need_of_a_dockerfile(tmp_path):
    from benchmarks.terminal_import import cause, dockerfile, needs, stratified

    names = [f"t{i}_hard" for i in range(6)] + [f"t{i}_medium_1" for i in range(3)] + ["plain"]
    picked = stratified(names, 5, seed=0)
    # 5 of 10: hard 3.0, medium 1.5, other 0.5; the one left over goes to the largest remainder (medium before other by
    # name)
    assert (
        sum(n.endswith("_hard") for n in picked) == 3
        and sum("_medium" in n for n in picked) == 2
        and picked == stratified(names, 5, seed=0)
    )
    assert stratified(names, 50, seed=1) == sorted(names)
    (tmp_path / "Dockerfile").write_text(
        "FROM ghcr.io/x/ubuntu:1\nWORKDIR /workspace\nRUN apt-get update && pip3 install pytest\n"
        'COPY data /workspace/data\nRUN ["curl", "-O", "https://x"]\n'
    )
    assert needs(tmp_path / "Dockerfile") == {
        "base image ghcr.io/x/ubuntu:1",
        "WORKDIR outside /app",
        "RUN apt-get",
        "RUN pip3",
        "COPY outside /app",
        "RUN curl",
    }
    (tmp_path / "tb1").mkdir()
    (tmp_path / "tb1" / "Dockerfile").write_text("FROM ghcr.io/x/python-3-13:1\nWORKDIR /app\n")
    assert needs(dockerfile(tmp_path / "tb1")) == {"base image ghcr.io/x/python-3-13:1"}, (
        "a Terminal-Bench 1 task's Dockerfile is at its top"
    )
    assert (
        cause("Dockerfile:3 `RUN apt-get update`: `apt-get` installs or downloads") == "`apt-get` installs or downloads"
    )
    assert (
        cause("docker build exited with status 100: E: Unable to locate package r-base-dev")
        == "apt: a package the base's Debian lacks"
    )
    assert cause("the build did not end in 1800 s: Step 3/9") == "the build timed out"
    assert (
        cause(
            "docker build exited with status 4: Step 7/16 : RUN cd /opt && wget -q https://dl.google.com/x.zip | "
            "---> Running in ab"
        )
        == "network: wget or curl could not reach its host (here only the package indexes answer)"
    )
    assert (
        cause(
            "docker build exited with status 2: ERROR:  Could not find a valid gem 'cocoapods' (>= 0), here is "
            "why: | Unable to "
            "download data from https://rubygems.org/ - SocketError: (getaddrinfo: Name or service not known)"
        )
        == "network: a download failed"
    )
    assert (
        cause("docker build exited with status 4: Step 7/16 : RUN make | ---> Running in ab")
        == "other (the task's own build step failed)"
    )
    assert (
        cause("docker build exited with status 1: make: *** [all] Error 2")
        == "other (the task's own build step failed)"
    )


@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    """`docker` on PATH is tests/fake_docker.py (bubblewrap standing in for containers); its calls are logged."""
    import sys

    state, bin_dir = tmp_path / "docker-state", tmp_path / "docker-state" / "bin"
    bin_dir.mkdir(parents=True)
    here = os.path.dirname(os.path.abspath(__file__))
    (bin_dir / "docker").write_text(f'#!/bin/sh\nexec {sys.executable} {here}/fake_docker.py "$@"\n')
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # the image's python3, with pytest
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(state))
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(state / "log.jsonl"))
    monkeypatch.setenv("FAKE_DOCKER_IMAGES", "qevolve-task:1")
    return lambda: [__import__("json").loads(line) for line in (state / "log.jsonl").read_text().splitlines()]


@needs_bwrap
def test_the_docker_backend_against_a_fake_docker(tmp_path, fake_docker):
    work = tmp_path / "w"
    work.mkdir()
    s = Session("docker", work, Limits(memory_mb=512, processes=64, file_mb=8, tmp_mb=16), image="qevolve-task:1")
    run = next(c for c in fake_docker() if c[0] == "run")
    flags = " ".join(run)
    for want in (
        "--network none",
        "--read-only",
        "--cap-drop ALL",
        "--security-opt no-new-privileges",
        "--memory 512m",
        "--pids-limit 64",
        f"--ulimit fsize={8 << 20}",
        "--tmpfs /tmp:size=16m",
        f"-v {work}:/app",
        "-w /app",
        "qevolve-task:1 bash --noprofile --norc",
    ):
        assert want in flags, want
    assert s.app == "/app" and s.python == "python3"
    assert (
        s.run("cd /app && export X=7 && echo hi > f").status == 0 and s.run("echo $X $(cat f)").output.strip() == "7 hi"
    )
    started = time.monotonic()
    r = s.run("sleep 60", timeout=1)
    assert r.timed_out and r.status == 137 and not r.restarted and time.monotonic() - started < 10
    assert ["exec", run[run.index("--name") + 1], "bash", "-c", "kill -9 -1"] in fake_docker()
    assert s.run("echo $X").output.strip() == "7", "the shell survived the kill"
    s.close()
    assert ["rm", "-f", run[run.index("--name") + 1]] in fake_docker()

    _task(tmp_path / "tasks")
    env = TerminalEnv(
        str(tmp_path / "tasks"), TerminalConfig(sandbox="docker", image="qevolve-task:1", command_timeout=5), 5
    )
    _, steps = _play(env, env.tasks("train")[0], ["wc -l < data.txt > count.txt", SUBMIT])
    assert steps[-1].won and env.info["tests_total"] == 2, "the validators ran with the image's python3"
    env.close()
    tmp_work = Session(
        "docker", work, image="qevolve-task:1", inside="/tmp"
    )  # a task image's WORKDIR /tmp: no tmpfs over it
    assert "--tmpfs" not in next(c for c in fake_docker()[::-1] if c[0] == "run") and tmp_work.app == "/tmp"
    tmp_work.close()
    with pytest.raises(SandboxError, match=r"docker has no image 'missing:0' here \(Error: No such image: missing:0\)"):
        Session("docker", work, image="missing:0")
    with pytest.raises(SandboxError, match=r"docker needs env.terminal.image"):
        Session("docker", work)


def test_admissible_mode_offers_the_oracle_its_mistakes_a_look_and_submit(tmp_path):
    from qevolve.envs.terminal_tasks import make, write_task
    from qevolve.params import parse_params

    spec = make("csv", 3)
    write_task(spec, tmp_path / "train" / "csv-0003")
    _task(tmp_path, "count")
    env = TerminalEnv(str(tmp_path), TerminalConfig(sandbox="local", command_timeout=5), 5)
    obs = env.reset(Task("csv-0003", "train", "csv"))
    wrong = [c for group in spec.mistakes for c in group]
    assert obs.admissible == list(dict.fromkeys([*spec.solution, *wrong, "ls -la", SUBMIT])) and wrong
    assert env.step("ls -la").admissible == obs.admissible, "the same candidates at every step"
    assert env.reset(Task("count", "train", "text")).admissible == ["wc -l < data.txt > count.txt", "ls -la", SUBMIT]
    (tmp_path / "train" / "count" / "solution" / "mistakes.json").write_text('{"not": "a list"}')
    with pytest.raises(TaskError, match=r"count/solution/mistakes.json: expected a JSON list of lists"):
        env.reset(Task("count", "train", "text"))
    env.close()
    assert (
        parse_params(
            {
                "env": {"name": "terminal", "data_dir": str(tmp_path)},
                "experts": {"demos": {"oracle": 1}},
                "evaluate": {"splits": {"test": 0}},
                "policy": {"action_mode": "admissible"},
            }
        ).policy.action_mode
        == "admissible"
    )


def test_nothing_a_task_folder_or_repository_holds_brings_a_host_file_in(tmp_path):
    """An imported task's Dockerfile COPY from an absolute or `..` source, or a link in a task folder or a source
    repository, once copied a host file into the task's data (and into an LLM author's prompt)."""
    import json

    from qevolve.cli import main
    from qevolve.methods.terminaltraj.author import _skipped, context

    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-SECRET-42\n")
    src = tmp_path / "src"
    for name, line in (
        ("abs-copy", f"COPY {secret} /app/s.txt"),
        ("dotdot-copy", "COPY ../../../host-secret.txt /app/s.txt"),
    ):
        t = _task(src, name, split=".")
        (t / "environment" / "Dockerfile").write_text(f"FROM ubuntu:24.04\nWORKDIR /app\n{line}\n")
    (_task(src, "env-link", split=".") / "environment" / "s.txt").symlink_to(secret)
    solution = _task(src, "solution-link", split=".") / "solution" / "solve.sh"
    solution.unlink()
    solution.symlink_to(secret)
    (_task(src, "inner-link", split=".") / "environment" / "again").symlink_to(
        "README"
    )  # a link inside the folder is fine
    os.mkfifo(
        _task(src, "fifo", split=".") / "tests" / "data.txt"
    )  # a device node, which root can extract from a tar, is refused the same way
    dest = tmp_path / "tasks"
    assert main(["terminal-import", str(src), str(dest), "--sandbox", "local", "--no-gate"]) == 0
    report = json.loads((dest / "test" / "import.json").read_text())
    assert {k: v["status"] for k, v in report.items()} == {
        "abs-copy": "unsupported",
        "dotdot-copy": "unsupported",
        "env-link": "unsupported",
        "solution-link": "unsupported",
        "inner-link": "imported",
        "fifo": "unsupported",
    }, report
    assert (
        "leads outside the build context" in report["abs-copy"]["reason"]
        and "outside the task folder" in report["env-link"]["reason"]
    )
    assert "tests/data.txt: not a regular file, a folder or a link" in report["fifo"]["reason"]
    assert not any("HOST-SECRET" in p.read_text() for p in dest.rglob("*") if p.is_file() and not p.is_symlink())

    repo = tmp_path / "sources" / "tool"
    repo.mkdir(parents=True)
    (repo / "tool.py").write_text("print('hi')\n")
    (repo / "notes.md").symlink_to(secret)
    (repo / "up").symlink_to(tmp_path)
    text = context(repo, 100_000)
    assert "tool.py" in text and "HOST-SECRET" not in text and "notes.md" not in text
    assert _skipped(str(repo), ["tool.py", "notes.md", "up", ".git"]) == {"notes.md", "up", ".git"}


def test_an_llm_writes_tasks_from_source_repositories_and_the_gate_judges_them(tmp_path, fake_chat):
    import json
    import tomllib

    from qevolve import dvcfile
    from qevolve.config import ConfigError
    from qevolve.methods.terminaltraj.author import AuthorError, context, parse
    from qevolve.methods.terminaltraj.generate import generate
    from qevolve.params import parse_params

    sources = tmp_path / "sources"
    for name, script in {
        "wordcount": "import sys\nprint(len(open(sys.argv[1]).read().split()))\n",
        "shouter": "import sys\nprint(open(sys.argv[1]).read().upper(), end='')\n",
    }.items():
        (sources / name / ".git").mkdir(parents=True)
        (sources / name / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        (sources / name / "tool.py").write_text(script)
        (sources / name / "input.txt").write_text("three little words\n")
        (sources / name / "README.md").write_text(f"# {name}\nRun `python3 tool.py FILE`.\n")
    text = context(sources / "wordcount", 10_000)
    assert "tool.py" in text and "three little words" in text and ".git" not in text
    assert len(context(sources / "wordcount", 60)) < 60 + 40, "the budget bounds what the model reads"

    def task(out: str, expected: str, noop: bool = False) -> str:
        check = "True" if noop else f"Path({out!r}).read_text().strip() == {expected!r}"
        return json.dumps(
            {
                "instruction": f"Run tool.py on input.txt and write what it prints to {out}.",
                "tests": f"from pathlib import Path\n\ndef test_out():\n    assert {check}\n",
                "solution": [f"python3 tool.py input.txt > {out}"],
                "mistakes": [[f"python3 tool.py README.md > {out}"]],
                "domain": "Data Processing",
                "difficulty": "easy",
            }
        )

    def answer(body):
        user = body["messages"][1]["content"]
        first = "task number 1 " in user
        if user.startswith("Repository wordcount"):
            return (
                task("count.txt", "3") if first else "I would suggest counting the words."
            )  # the second answer is no task
        return (
            task("loud.txt", "THREE LITTLE WORDS") if first else "```json\n" + task("loud.txt", "", noop=True) + "\n```"
        )

    server = fake_chat(answer)
    raw = {
        "method": "terminaltraj",
        "env": {
            "name": "terminal",
            "data_dir": "data/instances",
            "max_steps": 4,
            "terminal": {"sandbox": "local", "command_timeout": 5},
        },
        "terminaltraj": {
            "generate": {
                "kind": "llm",
                "sources": str(sources),
                "per_source": 2,
                "held_out": ["shouter"],
                "url": server.url,
                "model": "author",
                "test_share": 0.0,
            }
        },
        "experts": {"demos": {"oracle": 1}},
        "evaluate": {"splits": {"train": 1}},
        "policy": {"action_mode": "free"},
    }
    params = parse_params(raw)
    assert str(sources) in dvcfile.spec(params)["stages"]["generate"]["deps"], (
        "the source repositories are a dep of generate"
    )
    assert str(sources) not in dvcfile.spec(parse_params({**raw, "terminaltraj": {}}))["stages"]["generate"]["deps"]
    m = generate(params, tmp_path / "instances", tmp_path / "generate.json", tmp_path / "details.json")
    assert (m["generated"], m["passed_gate"], m["rejected_unusable"], m["rejected_noop_passes"]) == (4, 2, 1, 1)
    assert m["by_family"] == {
        "wordcount": {"generated": 2, "unusable": 1, "train": 1},
        "shouter": {"generated": 2, "test_ood": 1, "noop_passes": 1},
    }
    kept = tmp_path / "instances" / "train" / "wordcount-0000"
    assert sorted(p.name for p in (kept / "environment").iterdir()) == ["README.md", "input.txt", "tool.py"], (
        "the repository, without .git"
    )
    meta = tomllib.loads((kept / "task.toml").read_text())
    assert meta["metadata"]["category"] == "wordcount" and meta["source"] == {
        "repository": "wordcount",
        "domain": "data-processing",
    }
    assert json.loads((kept / "solution" / "mistakes.json").read_text()) == [["python3 tool.py README.md > count.txt"]]
    assert (tmp_path / "instances" / "test_ood" / "shouter-0000").is_dir()
    assert server.requests[0]["model"] == "author" and server.requests[0]["temperature"] == 0.7

    with pytest.raises(ValueError, match="solution: expected a list of non-empty strings"):
        parse(json.dumps({"instruction": "x", "tests": "def test(): pass", "solution": "ls"}), "r")
    with pytest.raises(ValueError, match="mistakes: expected at most one list per solution command"):
        parse(json.dumps({"instruction": "x", "tests": "t", "solution": ["ls"], "mistakes": [[], []]}), "r")
    with pytest.raises(
        ConfigError, match=r"terminaltraj.generate: .*sources: generate `llm` reads source repositories"
    ):
        parse_params({**raw, "terminaltraj": {"generate": {"kind": "llm", "url": server.url}}})
    bad = {**raw["terminaltraj"]["generate"], "held_out": ["nosuch"]}
    with pytest.raises(AuthorError, match=r"terminaltraj.generate.held_out: \['nosuch'\] name no repository"):
        generate(
            parse_params({**raw, "terminaltraj": {"generate": bad}}),
            tmp_path / "i2",
            tmp_path / "g2.json",
            tmp_path / "d2.json",
        )
    server.server.shutdown()
    server.server.server_close()
    with pytest.raises(AuthorError, match=r"terminaltraj.generate.url = 'http://127.0.0.1:\d+/v1': no usable answer"):
        generate(params, tmp_path / "i3", tmp_path / "g3.json", tmp_path / "d3.json")
    assert not (tmp_path / "i3").exists() and not (tmp_path / "g3.json").exists(), "nothing half-written"


def test_the_verification_miniature_spec_shares_its_rollouts_and_reports_test_and_ood():
    from conftest import REPO
    from flows.table_report import markdown
    from flows.table_spec import load_spec, workspace_params

    spec = load_spec(REPO / "benchmarks" / "terminaltraj.yaml")
    every = {name: workspace_params(spec, name, 2, None) for name in spec.workspaces}
    judge = every["judge-100"]["terminaltraj"]
    assert judge["filter"] == {"keep": "judge", "n": 100, "seed": 2} and every["judge-100"]["bc"]["seed"] == 2
    assert every["validator-50"]["terminaltraj"]["filter"]["keep"] == "validator"
    shared = {
        name: (p["env"], p["terminaltraj"]["generate"], p["terminaltraj"]["teacher"]) for name, p in every.items()
    }
    assert len({repr(v) for v in shared.values()}) == 1 and judge["generate"]["per_family"] == 30, (
        "one set of rollouts, from the run cache"
    )
    seeds = [
        {
            "test/success_rate": 0.5,
            "test/avg_reward": 0.5,
            "test/episodes": 12,
            "test_ood/success_rate": 0.0,
            "test_ood/avg_reward": 0.25,
            "test_ood/episodes": 20,
            "own_env_steps": 0,
            "generated_tokens": 10,
            "test/tokens_per_episode": 300.0,
        }
    ]
    head, _, line = markdown([{"row": "BC, 50 kept by the judge", "seeds": seeds}], None, spec.splits()).splitlines()[
        :3
    ]
    assert head.startswith(
        "| # | row | seeds | test success % | Δ test | test reward | test_ood success % | Δ test_ood | test_ood "
        "reward | env fail |"
    )
    assert "tokens per test episode" in head
    # Wilson: 6 of 12 is [25.4, 74.6], 0 of 20 is [0, 16.1]; a table of one row compares it with none
    assert line.startswith(
        "| 1 | BC, 50 kept by the judge | 1 | 50.0 [25.4, 74.6] (6/12) |  | 0.500 | 0.0 [0.0, 16.1] (0/20) |  | "
        "0.250 | 0 | 0 | 10 | 300 |"
    )


def test_base_mapping_and_content_addressed_tags(tmp_path):
    from qevolve.envs.task_images import context_digest, image_tag, map_base, parse_base

    base = parse_base(
        [
            "ghcr.io/laude-institute/t-bench/ubuntu-24-04=qevolve-base:bookworm",
            "python:3.11-slim=py:local",
            "*=fallback:1",
        ]
    )
    dockerfile = (
        "FROM ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624 AS build\nRUN make\n"
        "FROM --platform=linux/amd64 python:3.11-slim\nCOPY --from=build /out /out\nFROM build\nFROM alpine@sha256:ab\n"
    )
    assert map_base(dockerfile, base) == (
        "FROM qevolve-base:bookworm AS build\nRUN make\nFROM --platform=linux/amd64 py:local\n"
        "COPY --from=build /out /out\nFROM build\nFROM fallback:1\n"
    ), "untagged, exact, a stage left alone, *"
    assert map_base(dockerfile, ()) == dockerfile
    for bad in (["no-equals"], ["=x"], ["a= b"]):
        with pytest.raises(ValueError, match=r"--base .*expected ORIGINAL=LOCAL"):
            parse_base(bad)
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "sub").mkdir(parents=True)
    (a / "Dockerfile").write_text("FROM x\n")
    (a / "sub" / "run.sh").write_text("echo\n")
    shutil.copytree(a, b)
    tag = image_tag("Harbor Task_1!", a)
    assert tag == image_tag("Harbor Task_1!", b) and re.fullmatch(r"qevolve-task/harbor-task-1:[0-9a-f]{20}", tag), (
        "same content, same tag"
    )
    (b / "sub" / "run.sh").chmod(0o755)
    assert context_digest(b) != context_digest(a), "the executable bit counts"
    (b / "sub" / "run.sh").chmod(0o644)
    (b / "Dockerfile").write_text("FROM y\n")
    assert context_digest(b) != context_digest(a), "so does the Dockerfile"
    (b / "Dockerfile").write_text("FROM x\n")
    (b / "sub" / "link").symlink_to("run.sh")
    assert context_digest(b) != context_digest(a) and image_tag("..", a).startswith("qevolve-task/task:")
    from qevolve.cli import main

    _task(tmp_path / "src", "t", split=".")
    assert main(["terminal-import", str(tmp_path / "src"), str(tmp_path / "d"), "--base", "x=y"]) == 2, (
        "--base needs --build"
    )
    assert main(["terminal-import", str(tmp_path / "src"), str(tmp_path / "d"), "--build", "--base", "x"]) == 2
    assert not (tmp_path / "d").exists()


def _image_task(root, name, dockerfile):
    """A Harbor task run in its own image: data.txt comes in by COPY to the WORKDIR /srv/task."""
    t = root / name
    for d in ("environment", "tests", "solution"):
        (t / d).mkdir(parents=True)
    (t / "instruction.md").write_text("Write the number of lines of data.txt to count.txt.\n")
    (t / "task.toml").write_text(
        'version = "1.0"\n[metadata]\ncategory = "text"\n[environment]\nbuild_timeout_sec = 600.0\n'
    )
    (t / "environment" / "Dockerfile").write_text(dockerfile)
    (t / "environment" / "data.txt").write_text("a\nb\nc\n")
    (t / "tests" / "test_count.py").write_text(
        "from pathlib import Path\n\ndef test_count():\n"
        "    assert Path('/srv/task/count.txt').read_text().strip() == '3'\n"
    )
    (t / "solution" / "solve.sh").write_text("wc -l < data.txt > count.txt\n")
    return t


@needs_bwrap
def test_import_with_build_runs_each_task_in_its_image_built_once_and_reports_a_failed_build(tmp_path, fake_docker):
    from qevolve.envs.task_images import image_tag

    src = tmp_path / "src"
    good = (
        "FROM ghcr.io/acme/ubuntu-24-04:2025\nRUN apt-get update && apt-get install -y python3-pytest\nWORKDIR "
        "/srv/task\nCOPY data.txt /srv/task/data.txt\n"
    )
    _image_task(src, "count", good)
    _image_task(src, "broken", "FROM ghcr.io/acme/ubuntu-24-04:2025\nRUN false\n")
    _image_task(src, "in-tests", "FROM ghcr.io/acme/ubuntu-24-04:2025\nWORKDIR /tests\n")
    tb1 = (
        src / "tb1"
    )  # Terminal-Bench 1: its build context is the task's folder, less its tests, solution and task.yaml
    shutil.copytree(src / "count" / "tests", tb1 / "tests")
    (tb1 / "task.yaml").write_text("instruction: Write the number of lines of data.txt to count.txt.\ncategory: text\n")
    (tb1 / "Dockerfile").write_text(
        "FROM ghcr.io/acme/ubuntu-24-04:2025\nWORKDIR /srv/task\nCOPY data.txt /srv/task/data.txt\n"
    )
    (tb1 / "data.txt").write_text("a\nb\nc\n")
    (tb1 / "solution.sh").write_text("wc -l < data.txt > count.txt\n")
    cfg = TerminalConfig(command_timeout=5, build_network="host")
    counts = import_tasks(src, tmp_path / "tasks", "test", cfg, build=(("ghcr.io/acme/ubuntu-24-04", "local-base:1"),))
    assert counts == {"imported": 2, "build_failed": 1, "rejected_environment_fails": 1}
    report = json.loads((tmp_path / "tasks" / "test" / REPORT).read_text())
    tag = image_tag("count", tmp_path / "tasks" / "test" / "count" / "environment")
    assert report["count"].pop("image_s") > 0
    assert report["count"] == {
        "status": "imported",
        "oracle": True,
        "reason": "",
        "image": tag,
        "build_log": "count.build.log",
    }
    assert (
        report["broken"]["status"] == "build_failed"
        and "docker build exited with status 1" in report["broken"]["reason"]
    )
    assert (
        "returned a non-zero code" in report["broken"]["reason"]
        and not (tmp_path / "tasks" / "test" / "broken").exists()
    )
    assert "returned a non-zero code" in (tmp_path / "tasks" / "test" / "broken.build.log").read_text(), (
        "the log is kept"
    )
    assert "WORKDIR /tests is where the validators' files go" in report["in-tests"]["error"]
    assert report["tb1"]["status"] == "imported" and sorted(
        p.name for p in (tmp_path / "tasks" / "test" / "tb1" / "environment").iterdir()
    ) == ["Dockerfile", "data.txt"]
    imported = tmp_path / "tasks" / "test" / "count" / "environment" / "Dockerfile"
    assert imported.read_text() == good.replace("ghcr.io/acme/ubuntu-24-04:2025", "local-base:1"), (
        "built FROM the mapped base"
    )
    builds = [c for c in fake_docker() if c[0] == "build"]
    assert len(builds) == 4 and builds[0][1:3] == ["--network", "host"]
    runs = [c for c in fake_docker() if c[0] == "run" and tag in c]
    assert len(runs) == 6 and all(
        "--read-only" in r and "-w" in r and r[r.index("-w") + 1] == "/srv/task" for r in runs
    ), "the gate's three episodes and their validators ran in the task's image, at its working directory"

    import_tasks(
        src, tmp_path / "tasks", "again", cfg, build=(("ghcr.io/acme/ubuntu-24-04", "local-base:1"),), gate=False
    )
    assert len([c for c in fake_docker() if c[0] == "build"]) == 5, (
        "the same task's image is not built again; the failed one is"
    )
    env = TerminalEnv(
        str(tmp_path / "tasks"), TerminalConfig(command_timeout=5), 5
    )  # the default sandbox (bwrap): the image task runs in docker
    obs, steps = _play(
        env, Task("count", "test", "text"), ["cat data.txt | wc -l", "wc -l < data.txt > count.txt", SUBMIT]
    )
    assert "data.txt" in obs.text and "Dockerfile" not in obs.text, (
        "the image's working directory, not its build context"
    )
    assert steps[0].observation.startswith("3") and steps[-1].won
    env.close()
    with pytest.raises(TaskError, match=r"count/environment/Dockerfile: this task runs in its own image"):
        TerminalEnv(str(tmp_path / "tasks"), TerminalConfig(sandbox="local"), 5).reset(Task("count", "test", "text"))
    (tmp_path / "tasks" / "test" / "count" / "environment" / "data.txt").write_text("changed\n")
    env = TerminalEnv(str(tmp_path / "tasks"), TerminalConfig(command_timeout=5), 5)
    env.reset(Task("count", "test", "text"))
    env.close()
    assert len([c for c in fake_docker() if c[0] == "build"]) == 6, (
        "a changed context is a new image, built when its episode starts"
    )


@needs_bwrap
def test_the_build_funnel_goes_on_from_where_a_killed_run_stopped(tmp_path, fake_docker, capsys):
    from benchmarks.terminal_import import main

    for name in ("a_hard", "b_hard", "c_hard"):
        _image_task(
            tmp_path / "set",
            name,
            "FROM local-base:1\nWORKDIR /srv/task\nCOPY data.txt /srv/task/data.txt\n"
            if name != "b_hard"
            else "FROM local-base:1\nRUN false\n",
        )
    out, argv = tmp_path / "funnel.json", [str(tmp_path / "set"), "--sample", "3", "--build", "--build-network", "host"]
    assert main([*argv, "--out", str(out)]) == 0
    first = json.loads(out.read_text())
    assert {n: r["status"] for n, r in first["report"].items()} == {
        "a_hard": "imported",
        "b_hard": "build_failed",
        "c_hard": "imported",
    }
    images = [first["report"][n]["image"] for n in ("a_hard", "c_hard")]
    assert [c[0] if c[0] == "build" else c[-1] for c in fake_docker() if c[0] in ("build", "rmi")] == [
        "build",
        "build",
        "build",
        *images,
    ], "each image removed once the next task's is built (their shared layers stay cached), the last at the end"
    killed = {
        **first,
        "report": {"a_hard": first["report"]["a_hard"]},
        "build": {**first["build"], "seconds": {"a_hard": 9.5}},
    }
    out.write_text(json.dumps(killed))  # what a run killed during b_hard had written
    capsys.readouterr()
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        "1 of the 3 tasks done by an earlier run" in printed
        and "a_hard: " not in printed
        and "b_hard: build_failed" in printed
    )
    again = json.loads(out.read_text())
    assert again["report"].keys() == first["report"].keys() and again["build"]["seconds"]["a_hard"] == 9.5
    with pytest.raises(SystemExit, match="another sample"):
        main([str(tmp_path / "set"), "--sample", "2", "--build", "--out", str(out)])


def test_a_registry_shares_task_images_so_a_task_is_built_once_between_machines(tmp_path, fake_docker, monkeypatch):
    from qevolve.envs.task_images import REGISTRY_ENV, ensure, image_tag
    from tasks.scaleout import Scaleout

    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text("FROM local-base:1\nWORKDIR /app\n")
    tag, remote = image_tag("t", context), f"registry.lab:5000/qevolve/{image_tag('t', context)}"
    monkeypatch.setenv(REGISTRY_ENV, "registry.lab:5000/qevolve/")
    assert ensure(tag, context, tmp_path / "one.log") == ""
    calls = fake_docker()
    assert [c[0] for c in calls if c[0] in ("pull", "build", "push")] == ["pull", "build", "push"] and [
        "push",
        remote,
    ] in calls
    (tmp_path / "docker-state" / "images.json").write_text("{}")  # another machine: nothing built there
    assert ensure(tag, context, tmp_path / "two.log") == "" and not (tmp_path / "two.log").exists()
    assert [c[0] for c in fake_docker() if c[0] in ("pull", "build", "push")] == ["pull", "build", "push", "pull"], (
        "pulled, not built"
    )
    assert ["tag", remote, tag] in fake_docker()
    from qevolve.envs.task_images import export_workdir

    kept = next((tmp_path / "docker-state" / "fs").iterdir())  # what the fake image holds
    (kept / "data.txt").write_text("x\n")
    os.mkfifo(kept / "pipe")
    export_workdir(tag, "/app", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["data.txt"], (
        "a FIFO (or a device) the build made is not copied out"
    )
    assert (
        Scaleout.model_validate({"images": {"registry": "registry.lab:5000/qevolve"}}).images.registry
        == "registry.lab:5000/qevolve"
    )
    with pytest.raises(ValueError, match=r"images.registry: '-x' is not a registry"):
        Scaleout.model_validate({"images": {"registry": "-x"}})


HOSTILE = {
    "nul": "echo a\x00b > count.txt",
    "long": "echo " + "x" * 200_000,  # one argument past the kernel's 128 KiB
    "surrogate": "echo \udcff",
    # deeper than Python's recursion
    "deep": "python3 -c \"import os\nfor _ in range(1500): os.mkdir('d'); os.chdir('d')\"",
    "exit": "exit 3",
    "kill": "kill -9 $$",
    "binary": "head -c 3000 /dev/urandom",
    "escapes": "printf '\\033c\\033]0;x\\007\\033(0\\033#8'",
}


class _Script:
    """An agent that sends its task's hostile command, then submits."""

    def decide(self, episodes, greedy, slots):
        from qevolve.models.policy import Decision

        return [Decision(HOSTILE[e.task.id] if not e.outputs else SUBMIT, 0.0, 1) for e in episodes]

    def parse(self, output):
        return output

    def observed(self, moved):
        pass


@pytest.mark.parametrize("sandbox", ["local", "bwrap"])
def test_whatever_an_agent_sends_its_episode_is_counted_and_lost(tmp_path, sandbox):
    """Hostile commands (a NUL byte, 200 KB, a lone surrogate, a tree 1,500 deep, the shell's exit or death, binary and
    escape output) never fail the environment: each episode ends, lost, none restarted or dropped, and the next
    episode of the same environment resets cleanly after it."""
    if sandbox == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    from qevolve.rollout import play

    for name in HOSTILE:
        _task(tmp_path / "tasks", name)
    env = TerminalEnv(str(tmp_path / "tasks"), TerminalConfig(sandbox=sandbox), max_steps=3)
    try:
        trajs = play(
            lambda: env, env.tasks("train"), _Script(), max_steps=3, greedy=True, source="hostile", batch_size=1
        )
    finally:
        env.close()
    assert sorted(t.task_id for t in trajs) == sorted(HOSTILE)
    assert [(t.task_id, t.failure) for t in trajs if t.won or t.failure != "done"] == []  # each lost at its submit
    assert all(len(t.steps) == 2 and t.steps[-1].action == SUBMIT for t in trajs)
    assert not any(ch in t.steps[0].next_observation for t in trajs for ch in "\x1b\x00\x07")
    assert not list(tmp_path.glob("**/qevolve-terminal-*"))


def test_hand_over_and_removal_reach_any_depth(tmp_path):
    """A tree 10,000 folders deep (past PATH_MAX; Python's `os.walk` and `shutil.rmtree` recurse and fail at about
    1,000): given to the sandbox's user, then removed, with a folder the agent closed on the way."""
    from qevolve.envs.host import SANDBOX_UID, hand_over, remove_tree

    top = tmp_path / "app"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for i in range(10_000):
        os.mkdir("d", dir_fd=fd)
        below = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        if i == 5_000:
            os.chmod(below, 0)  # what a sandbox's `chmod 000` leaves
        os.close(fd)
        fd = below
    os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)
    hand_over(top)
    if os.geteuid() == 0:
        assert top.stat().st_uid == SANDBOX_UID and (top / "d" / "d").stat().st_uid == SANDBOX_UID
    remove_tree(top)
    assert not top.exists()
