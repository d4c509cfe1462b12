"""A Docker engine for the slow tier, where one runs: whether it answers, the local base image (images cannot be
pulled here), and an image for running terminal tasks in (bash, python3 and pytest)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

DOCKER = Path(__file__).resolve().parents[1] / "docker"
NO_ENGINE = "no Docker engine runs here (install docker.io and start dockerd to run this test)"


def engine() -> bool:
    return (
        shutil.which("docker") is not None and subprocess.run(["docker", "info"], capture_output=True).returncode == 0
    )


def base_image() -> str:
    """The base: $QEVOLVE_DOCKER_BASE, else qevolve-base:bookworm (made by docker/base.sh if missing and
    debootstrap is at hand)."""
    base = os.environ.get("QEVOLVE_DOCKER_BASE", "qevolve-base:bookworm")
    if subprocess.run(["docker", "image", "inspect", base], capture_output=True).returncode != 0:
        if base != "qevolve-base:bookworm" or not shutil.which("debootstrap"):
            pytest.skip(f"no base image {base} and no debootstrap to make one")
        subprocess.run([str(DOCKER / "base.sh"), base], check=True)
    return base


def task_runner_image(tmp_path: Path) -> str:
    """The base with Debian's pytest: what `env.terminal.sandbox: docker` needs of an image. Built once (Docker's
    layer cache keeps it), from the Debian mirror (`--network host`: this machine's dockerd has no bridge)."""
    base = base_image()
    (tmp_path / "Dockerfile").write_text(
        f"FROM {base}\nRUN apt-get update && apt-get install -y --no-install-recommends python3-pytest "
        "&& rm -rf /var/lib/apt/lists/*\n"
    )
    tag = "qevolve-task-runner:bookworm"
    subprocess.run(["docker", "build", "--network", "host", "-q", "-t", tag, str(tmp_path)], check=True)
    return tag
