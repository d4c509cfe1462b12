"""Generated terminal tasks: eight template families (a miniature of TerminalTraj's domains, arXiv
2602.01244), each a seeded generator of a task folder in the layout `qevolve.envs.terminal` reads, and
the sanity gate every task passes before any rollout (../shared/research/terminaltraj.md, section 2).

A family is `(rng) -> Spec`: the instruction, the starting files (and a setup script), validators that
check the end state only (files, contents, a running service; never the commands used), the oracle's
commands, and per oracle command the plausible mistakes a noisy teacher may make instead (a wrong path,
column, flag, delimiter or file). The same family and seed give the same task.

The gate (`gate`): the oracle passes, a do-nothing agent (`submit` at once) fails, and the oracle passes a
second time (the validators are deterministic). A task that fails a check is rejected with its reason:
`oracle_fails`, `noop_passes` (the released TerminalTraj instances' defect: free accuracy), `flaky`.
"""

from __future__ import annotations

import json
import random
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from qevolve.envs.terminal import ORACLE, SUBMIT, has_oracle, oracle_steps

WORDS = [
    "alpha",
    "bravo",
    "cedar",
    "delta",
    "ember",
    "fjord",
    "gamma",
    "harbor",
    "indigo",
    "juniper",
    "kepler",
    "lumen",
    "maple",
    "nectar",
    "onyx",
    "pixel",
    "quartz",
    "raven",
    "sierra",
    "tundra",
    "umber",
    "velvet",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
]


@dataclass
class Spec:
    family: str
    instruction: str
    files: dict[str, str]
    tests: str
    solution: list[str]
    mistakes: list[list[str]]
    """Per solution command, wrong commands a teacher may run in its place."""
    setup: str = ""
    difficulty: str = "easy"
    extra: dict = field(default_factory=dict)


def _tests(body: str) -> str:
    return (
        "import json\nimport os\nimport subprocess\nimport time\nfrom pathlib import Path\n\n"
        + textwrap.dedent(body).lstrip()
    )


def files(rng: random.Random) -> Spec:
    ext, other = rng.sample(["txt", "csv", "log", "md"], 2)
    names = rng.sample(WORDS, 6)
    wanted, rest = sorted(names[: rng.randint(2, 4)]), names[4:]
    contents = {f"src/{n}.{ext}": f"{n} {rng.randint(0, 999)}\n" for n in wanted} | {
        f"src/{n}.{other}": f"{n}\n" for n in rest
    }
    dest = rng.choice(["out", "backup", "keep", "selected"])
    expected = {f"{n}.{ext}": contents[f"src/{n}.{ext}"] for n in wanted}
    return Spec(
        "files",
        f"Copy every .{ext} file from src/ into a new directory {dest}/, keeping their names and contents. Leave "
        f"src/ as it is.",
        contents,
        _tests(f"""
            EXPECTED = {expected!r}

            def test_copied():
                out = Path({dest!r})
                assert out.is_dir() and {{p.name: p.read_text() for p in out.iterdir()}} == EXPECTED

            def test_source_kept():
                assert len(list(Path("src").iterdir())) == {len(contents)}
            """),
        [f"mkdir -p {dest}", f"cp src/*.{ext} {dest}/"],
        [
            [f"mkdir -p {dest}s", f"mkdir -p src/{dest}"],
            [f"cp src/*.{other} {dest}/", f"mv src/*.{ext} {dest}/", f"cp src/* {dest}/"],
        ],
    )


def text(rng: random.Random) -> Spec:
    levels = ["INFO", "WARN", "ERROR", "DEBUG"]
    messages = [
        "disk usage checked",
        "request served",
        "cache refreshed",
        "user signed in",
        "job queued",
        "backup finished",
        "token renewed",
    ]
    lines = [
        f"2026-11-{rng.randint(1, 30):02d} {rng.choice(levels)} {rng.choice(messages)}"
        for _ in range(rng.randint(20, 60))
    ]
    word = rng.choice(levels)
    count = sum(word in ln for ln in lines)
    out = rng.choice(["count.txt", "result.txt", f"{word.lower()}s.txt"])
    return Spec(
        "text",
        f"Count the lines of app.log that contain {word} and write the number alone to {out}.",
        {"app.log": "\n".join(lines) + "\n"},
        _tests(f"""
            def test_count():
                assert Path({out!r}).read_text().strip() == "{count}"
            """),
        [f"grep -c '{word}' app.log > {out}"],
        [
            [
                f"grep -c '{word.lower()}' app.log > {out}",
                f"grep '{word}' app.log > {out}",
                f"grep -c '{word}' app.log > {out}.txt",
                f"wc -l app.log > {out}",
            ]
        ],
    )


def csv(rng: random.Random) -> Spec:
    regions = rng.sample(["north", "south", "east", "west", "central"], 3)
    rows = [(i + 1, rng.choice(regions), rng.randint(1, 500)) for i in range(rng.randint(10, 30))]
    region = rows[0][1]
    total = sum(a for _, r, a in rows if r == region)
    body = "id,region,amount\n" + "".join(f"{i},{r},{a}\n" for i, r, a in rows)
    return Spec(
        "csv",
        f"data.csv has a header row. Sum the amount column over the rows whose region is {region}, and write the "
        f"total alone to total.txt.",
        {"data.csv": body},
        _tests(f"""
            def test_total():
                assert Path("total.txt").read_text().strip() == "{total}"
            """),
        [f"awk -F, 'NR>1 && $2==\"{region}\" {{s+=$3}} END {{print s}}' data.csv > total.txt"],
        [
            [
                f"awk -F';' 'NR>1 && $2==\"{region}\" {{s+=$3}} END {{print s}}' data.csv > total.txt",
                f"awk -F, 'NR>1 && $2==\"{region}\" {{s+=$1}} END {{print s}}' data.csv > total.txt",
                "awk -F, 'NR>1 {s+=$3} END {print s}' data.csv > total.txt",
                f"grep -c {region} data.csv > total.txt",
            ]
        ],
    )


def json_edit(rng: random.Random) -> Spec:
    config = {
        "name": rng.choice(WORDS),
        "port": rng.randint(1000, 9000),
        "debug": rng.random() < 0.5,
        "workers": rng.randint(1, 8),
    }
    key = rng.choice(["port", "debug", "workers"])
    value = {
        "port": config["port"] + rng.randint(1, 99),
        "debug": not config["debug"],
        "workers": config["workers"] + rng.randint(1, 8),
    }[key]
    literal = json.dumps(value)
    expected = {**config, key: value}
    return Spec(
        "json",
        f"Set {key} to {literal} in config.json, keeping the other settings as they are. The file must stay valid "
        f"JSON.",
        {"config.json": json.dumps(config, indent=2) + "\n"},
        _tests(f"""
            def test_config():
                assert json.loads(Path("config.json").read_text()) == {expected!r}
            """),
        [f"jq '.{key} = {literal}' config.json > config.new", "mv config.new config.json"],
        [
            [
                f"jq '.{key} = \"{literal}\"' config.json > config.new",
                f"jq '.{key}s = {literal}' config.json > config.new",
                f"jq '{{{key}: {literal}}}' config.json > config.new",
            ],
            ["cp config.new config.json.bak", "mv config.json config.new"],
        ],
    )


def archive(rng: random.Random) -> Spec:
    names = rng.sample(WORDS, 4)
    contents = {n: f"{n} {rng.randint(0, 9999)}\n" for n in names}
    member = f"bundle/{names[0]}.txt"
    setup = (
        "mkdir -p bundle\n"
        + "".join(f"printf '%s' '{c}' > bundle/{n}.txt\n" for n, c in contents.items())
        + "tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - bundle | gzip -n > "
        "bundle.tar.gz\nrm -r bundle\n"
    )
    return Spec(
        "archive",
        f"Extract only {member} from bundle.tar.gz, keeping its path, and leave the archive in place.",
        {},
        _tests(f"""
            def test_member():
                assert Path({member!r}).read_text() == {contents[names[0]]!r}

            def test_only_that_member():
                assert sorted(p.name for p in Path("bundle").iterdir()) == [{names[0] + ".txt"!r}]

            def test_archive_kept():
                assert Path("bundle.tar.gz").is_file()
            """),
        [f"tar -xzf bundle.tar.gz {member}"],
        [
            [
                "tar -xzf bundle.tar.gz",
                f"tar -xzf bundle.tar.gz bundle/{names[1]}.txt",
                f"tar -tzf bundle.tar.gz {member}",
            ]
        ],
        setup=setup,
    )


def python_fix(rng: random.Random) -> Spec:
    n, power = rng.randint(5, 40), rng.choice([2, 3])
    what = {2: "squares", 3: "cubes"}[power]
    expected = sum(i**power for i in range(1, n + 1))
    script = f"def total(n):\n    return sum(i ** {power} for i in range(1, n))\n\n\nprint(total({n}))\n"
    return Spec(
        "python",
        f"calc.py should print the sum of the {what} of 1 to {n}, but it prints a wrong number. Fix calc.py so "
        f"that `python3 calc.py` prints the right one.",
        {"calc.py": script},
        _tests(f"""
            def test_prints_the_sum():
                done = subprocess.run(["python3", "calc.py"], capture_output=True, text=True, timeout=20)
                assert done.stdout.strip() == "{expected}"
            """),
        ["sed -i 's/range(1, n)/range(1, n + 1)/' calc.py"],
        [
            [
                "sed -i 's/range(1, n)/range(0, n)/' calc.py",
                "sed 's/range(1, n)/range(1, n + 1)/' calc.py",
                "sed -i 's/range(1, n)/range(2, n + 1)/' calc.py",
            ]
        ],
    )


def sqlite(rng: random.Random) -> Spec:
    statuses = ["shipped", "pending", "cancelled", "returned"]
    rows = [(i + 1, rng.choice(WORDS), rng.choice(statuses), rng.randint(5, 300)) for i in range(rng.randint(8, 25))]
    status = rows[0][2]
    out = rng.choice(["answer.txt", f"{status}.txt"])
    values = ", ".join(f"({i}, '{c}', '{s}', {t})" for i, c, s, t in rows)
    setup = (
        f'sqlite3 shop.db "CREATE TABLE orders(id INTEGER, customer TEXT, status TEXT, total INTEGER); INSERT '
        f'INTO orders VALUES {values};"\n'
    )
    counts = {s: sum(r[2] == s for r in rows) for s in statuses}
    count = counts[status]
    other = next((s for s in statuses if counts[s] != count), next(s for s in statuses if s != status))
    return Spec(
        "sqlite",
        f"shop.db is a SQLite database with a table orders(id, customer, status, total). Write the number of "
        f"orders whose status is "
        f"'{status}' alone to {out}.",
        {},
        _tests(f"""
            def test_count():
                assert Path({out!r}).read_text().strip() == "{count}"
            """),
        [f"sqlite3 shop.db \"SELECT COUNT(*) FROM orders WHERE status = '{status}';\" > {out}"],
        [
            [
                f"sqlite3 shop.db \"SELECT COUNT(*) FROM orders WHERE status = '{other}';\" > {out}",
                f"sqlite3 shop.db \"SELECT SUM(total) FROM orders WHERE status = '{status}';\" > {out}",
                f'sqlite3 shop.db "SELECT COUNT(*) FROM orders;" > {out}',
            ]
        ],
        setup=setup,
    )


def service(rng: random.Random) -> Spec:
    """A service the validators start themselves: every process of the agent's ends before they run (the
    environment's trust boundary), so what the agent leaves is a script that serves, not a running server."""
    port, token = rng.randint(8000, 8999), f"{rng.choice(WORDS)}-{rng.randint(0, 99999)}"
    serve = f"python3 -m http.server {port} --bind 127.0.0.1 --directory www"
    return Spec(
        "service",
        f"Write an executable script serve.sh that, when run, serves the www/ directory over HTTP on 127.0.0.1 "
        f"port {port} "
        f"and keeps running in the foreground.",
        {"www/index.html": f"<p>{token}</p>\n"},
        _tests(f"""
            import urllib.request

            def test_serves_www():
                assert os.access("serve.sh", os.X_OK), "serve.sh is not executable"
                server = subprocess.Popen(["./serve.sh"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                try:
                    for _ in range(50):
                        try:
                            with urllib.request.urlopen("http://127.0.0.1:{port}/index.html", timeout=2) as r:
                                assert {token!r} in r.read().decode()
                            assert server.poll() is None, "serve.sh does not keep running in the foreground"
                            return
                        except OSError:
                            assert server.poll() is None, "serve.sh exited"
                            time.sleep(0.1)
                    raise AssertionError("nothing answers on port {port}")
                finally:
                    os.killpg(server.pid, 9)
            """),  # noqa: E501 - the task's test file as written
        [f"printf '#!/bin/bash\\nexec {serve}\\n' > serve.sh", "chmod +x serve.sh"],
        [
            [
                f"printf '#!/bin/bash\\nexec python3 -m http.server {port + 1} --bind 127.0.0.1 --directory "
                f"www\\n' > serve.sh",
                f"printf '#!/bin/bash\\nexec python3 -m http.server {port} --bind 127.0.0.1\\n' > serve.sh",
                f"printf '#!/bin/bash\\n{serve} &\\n' > serve.sh",
            ],
            ["chmod 644 serve.sh"],
        ],
    )


FAMILIES = {
    f.__name__.removesuffix("_edit").removesuffix("_fix"): f
    for f in (files, text, csv, json_edit, archive, python_fix, sqlite, service)
}
"""Family name -> generator: files, text, csv, json, archive, python, sqlite, service."""


def make(family: str, seed: int) -> Spec:
    if family not in FAMILIES:
        raise ValueError(f"unknown terminal task family {family!r}; expected one of {list(FAMILIES)}")
    return FAMILIES[family](random.Random(f"{family}:{seed}"))


def write_task(spec: Spec, folder: Path) -> None:
    """The Harbor-layout folder of `spec` (the folder must not exist yet)."""
    folder = Path(folder)
    (folder / "environment").mkdir(parents=True)
    for rel, content in spec.files.items():
        (folder / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / "environment" / rel).write_text(content)
    if spec.setup:
        (folder / "environment" / "setup.sh").write_text(spec.setup)
    (folder / "tests").mkdir()
    (folder / "tests" / "test_task.py").write_text(spec.tests)
    (folder / "solution").mkdir()
    (folder / "solution" / "solve.sh").write_text("#!/bin/bash\n" + "".join(c + "\n" for c in spec.solution))
    (folder / "solution" / "mistakes.json").write_text(json.dumps(spec.mistakes, indent=1) + "\n")
    (folder / "instruction.md").write_text(spec.instruction + "\n")
    (folder / "task.toml").write_text(
        f'version = "1.0"\n\n[metadata]\ncategory = "{spec.family}"\ndifficulty = "{spec.difficulty}"\n\n'
        "[agent]\ntimeout_sec = 120\n\n[verifier]\ntimeout_sec = 30\n"
    )


def _episode(env, task, actions: list[str]) -> bool:
    env.reset(task)
    for a in actions:
        step = env.step(a)
        if step.done:
            return step.won
    return False


def gate(env, task) -> str:
    """'' when `task` passes the sanity gate on `env` (a `TerminalEnv`), else the reason it is rejected: the oracle
    passes, a do-nothing agent fails, the oracle passes again. A validator-only task (no oracle) is checked for
    what can be checked without one (`validator_gate`)."""
    folder = env.root / (task.home or task.split) / task.id
    if not has_oracle(folder):
        return validator_gate(env, task)
    oracle = oracle_steps((folder / ORACLE).read_text()) + [SUBMIT]
    if not _episode(env, task, oracle):
        return "oracle_fails"
    if _episode(env, task, [SUBMIT]):
        return "noop_passes"
    if not _episode(env, task, oracle):
        return "flaky"
    return ""


def validator_gate(env, task) -> str:
    """The gate of a task without an oracle: the untouched environment, submitted twice, must fail the validators
    both times and the same way, test by test ('' when it does). Whether the task can be solved at all cannot be
    checked. Reasons: `validators_broken` (they did not run: a missing package, a crash; every episode would be
    lost), `noop_passes`, `flaky` (two untouched runs judged apart)."""
    verdicts = []
    for _ in range(2):
        won = _episode(env, task, [SUBMIT])
        if env.info.get("validation_error") or not env.info.get("tests"):
            return "validators_broken"
        if won:
            return "noop_passes"
        verdicts.append(env.info["tests"])
    return "flaky" if verdicts[0] != verdicts[1] else ""


def teacher_plan(
    solution: list[str], mistakes: list[list[str]], rng: random.Random, p_err: float = 0.3, p_fix: float = 0.5
) -> list[str]:
    """The noisy scripted teacher's commands for one rollout: each oracle command, or with probability
    `p_err` one of its mistakes in its place, after which with probability `p_fix` the teacher looks
    (`ls -la`) and runs the right command; then `submit`, always (a teacher that believes it is done)."""
    plan = []
    for i, command in enumerate(solution):
        wrong = mistakes[i] if i < len(mistakes) else []
        if wrong and rng.random() < p_err:
            plan.append(rng.choice(wrong))
            if rng.random() < p_fix:
                plan += ["ls -la", command]
        else:
            plan.append(command)
    return plan + [SUBMIT]


ERROR_MARKERS = ("error", "no such file", "traceback", "command not found", "cannot", "permission denied", "invalid")


def transcript_judge(observations: list[str], actions: list[str], window: int = 3) -> tuple[bool, str]:
    """The offline stand-in for an LLM judge (it is a rule, not an LLM): it reads the transcript only and
    accepts when the agent submitted, its last command before that exited 0, and none of the last
    `window` outputs shows an error marker. Like a transcript-only judge, it believes a confident wrong
    ending. (accepted, reason) with reason one of accepted, not_submitted, last_command_failed, error_seen."""
    if not actions or actions[-1].strip() != SUBMIT:
        return False, "not_submitted"
    commands = observations[: len(actions) - 1]
    if commands and not commands[-1].rstrip().endswith("[exit status 0]"):
        return False, "last_command_failed"
    if any(m in o.lower() for o in commands[-window:] for m in ERROR_MARKERS):
        return False, "error_seen"
    return True, "accepted"
