"""Scale-out on loopback: a stage run by a Prefect work pool's worker, its artifacts handed over through a DVC
remote on S3 (moto's server), and a second clone restoring every stage from the remote's run cache. Each
test starts and stops its own services."""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from flows.workspace import prepare
from tests.test_env_pipelines import _tiny

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer in {timeout} s: {log.read_text()[-3000:]}")


class Services:
    """Processes started for a test, each logging to a file, all stopped at its end."""

    def __init__(self, tmp: Path):
        self.tmp, self.procs, self.cleanup = tmp, [], []

    def start(self, name: str, args: list[str], env: dict, url: str | None = None) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        proc = subprocess.Popen(
            args, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=self.tmp, start_new_session=True
        )
        self.procs.append(proc)
        if url:
            _wait(url, proc, log)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
        for step in self.cleanup:
            step()


@pytest.fixture
def services(tmp_path):
    s = Services(tmp_path)
    yield s
    s.stop()


def _workspace(root: Path, tmp_path: Path, settings: dict) -> Path:
    raw = _tiny("textcraft", tmp_path)
    raw["evolve"] = {"iterations": 0}
    prepare(root, raw)
    (root / "scaleout.yaml").write_text(yaml.safe_dump(settings))
    return root


def _evolve(root: Path, env: dict) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "flows.evolve", "--root", str(root)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out.stdout + out.stderr


@pytest.mark.slow
def test_a_stage_runs_on_a_work_pool_and_a_second_clone_restores_every_stage_from_the_remote(tmp_path, services):
    env = {
        **os.environ,
        **S3_ENV,
        "PYTHONPATH": str(REPO),
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_TO_API_ENABLED": "true",
    }
    s3 = f"http://127.0.0.1:{_port()}"
    services.start("moto", [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", s3.rsplit(":", 1)[1]], env, url=s3)
    import boto3

    boto3.client(
        "s3",
        endpoint_url=s3,
        **{k.lower(): v for k, v in S3_ENV.items() if k != "AWS_DEFAULT_REGION"},
        region_name="us-east-1",
    ).create_bucket(Bucket="qevolve")
    api = f"http://127.0.0.1:{_port()}/api"
    server_env = {
        **env,
        "PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://" + _postgres(services, env, "prefect"),
    }
    env["PREFECT_API_URL"] = api

    def start_prefect():
        return services.start(
            "prefect",
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", api.split(":")[2].split("/")[0]],
            server_env,
            url=f"{api}/health",
        )

    server = start_prefect()
    subprocess.run(
        [sys.executable, "-m", "flows.scaleout", "deploy", "gpu", "--silence", "45"],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    worker_env = {**env, "QEVOLVE_WORKER_DIR": str(tmp_path / "worker")}
    worker = services.start("worker", [str(BIN / "prefect"), "worker", "start", "--pool", "gpu"], worker_env)

    def evolving():
        return subprocess.Popen(
            [sys.executable, "-m", "flows.evolve", "--root", str(a)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def until_bc_starts(attempt, log: str, count: int) -> None:
        deadline = time.time() + 600
        while (tmp_path / log).read_text().count("Beginning subflow run 'bc'") < count and time.time() < deadline:
            assert attempt.poll() is None, attempt.communicate()[0][-3000:]
            time.sleep(0.2)

    remote = {"url": "s3://qevolve/dvc", "endpointurl": s3}
    a = _workspace(tmp_path / "a", tmp_path, {"remote": remote, "pools": {"bc": "gpu"}})
    # The orchestrator's code edited: the worker refuses to run other code, and the flow says so.
    edited = a / "src" / "qevolve" / "paths.py"
    original = edited.read_text()
    edited.write_text(original + "# edited\n")
    failed = subprocess.run(
        [sys.executable, "-m", "flows.evolve", "--root", str(a)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert failed.returncode != 0
    assert re.search(
        r"bc: its run on work pool 'gpu' ended Failed .*this worker's code .* is not the orchestrator's",
        failed.stdout + failed.stderr,
    )
    edited.write_text(original)
    # The worker's machine dies mid-stage (the worker and the stage's processes killed): its silent run is
    # marked Crashed, and the orchestrator stops with that.
    attempt = evolving()
    until_bc_starts(attempt, "worker.log", 2)
    import psutil

    for proc in [*psutil.Process(worker.pid).children(recursive=True), psutil.Process(worker.pid)]:
        proc.kill()
    out = attempt.communicate(timeout=600)[0]
    assert attempt.returncode != 0 and re.search(
        r"bc: its run on work pool 'gpu' ended Crashed .*no heartbeat for 45 s", out
    ), out[-3000:]
    services.start("worker2", [str(BIN / "prefect"), "worker", "start", "--pool", "gpu"], worker_env)
    # A new attempt (a new flow run on the pool); the Prefect server restarted while the worker runs bc.
    attempt = evolving()
    until_bc_starts(attempt, "worker2.log", 1)
    os.killpg(server.pid, 15)
    server.wait(30)
    server = start_prefect()
    out = attempt.communicate(timeout=900)[0]
    assert attempt.returncode == 0, out[-4000:]
    # bc ran on the worker, in its own workspace; the orchestrator restored it and wrote dvc.lock alone.
    [worker_ws] = (tmp_path / "worker").iterdir()
    assert (worker_ws / "models" / "bc" / "adapter_model.safetensors").exists() and not (
        worker_ws / "metrics" / "evaluate@0.json"
    ).exists()
    assert (a / "models" / "bc" / "adapter_model.safetensors").read_bytes() == (
        worker_ws / "models" / "bc" / "adapter_model.safetensors"
    ).read_bytes()
    status = subprocess.run(
        [sys.executable, "-m", "dvc", "status"], cwd=a, capture_output=True, text=True, check=True
    ).stdout
    assert "up to date" in status, status
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("qevolve-stage/gpu")
        runs = [r for r in client.read_flow_runs() if r.deployment_id == deployment.id]
    runs = sorted(runs, key=lambda r: r.start_time)
    assert [(r.name, r.state.type.value) for r in runs] == [("bc", "FAILED"), ("bc", "CRASHED"), ("bc", "COMPLETED")]
    assert runs[2].parent_task_run_id is not None  # a sub-flow of the evolution, in the Prefect UI
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{a / 'mlflow.db'}")
    [parent] = mlflow.search_runs(experiment_names=["qevolve"], output_format="list")
    lock = yaml.safe_load((a / "dvc.lock").read_text())["stages"]
    # The MLflow run joins the Prefect flow run that computed bc, where, and the content hash DVC records.
    assert "bc/loss" in parent.data.metrics and parent.data.tags["qevolve.git_commit"]
    assert parent.data.tags["qevolve.pool.bc"] == "gpu" and parent.data.tags["qevolve.prefect_flow_run.bc"] == str(
        runs[2].id
    )
    assert parent.data.tags["qevolve.dvc.bc.models/bc"] == next(
        o["md5"] for o in lock["bc"]["outs"] if o["path"] == "models/bc"
    )

    # A second clone, with its own DVC cache and no pool: every stage comes from the remote, none runs.
    b = _workspace(tmp_path / "b", tmp_path, {"remote": remote})
    out = _evolve(b, {k: v for k, v in env.items() if k != "PREFECT_API_URL"})
    assert "stages run: none (all up to date)" in out, out[-3000:]
    assert yaml.safe_load((b / "dvc.lock").read_text())["stages"] == lock
    assert json.loads((b / "metrics" / "bc.json").read_text()) == json.loads((a / "metrics" / "bc.json").read_text())


def test_scaleout_settings_are_validated_naming_the_file_and_key(tmp_path, monkeypatch):
    from qevolve.config import ConfigError
    from tasks.scaleout import load_settings

    monkeypatch.delenv("QEVOLVE_SCALEOUT", raising=False)
    assert (
        load_settings(tmp_path).pools == {} and load_settings(tmp_path).remote is None
    )  # no file: all here, no remote
    cases = [
        ({"pools": {"bc": "gpu"}}, r"pools: a stage on a work pool hands its artifacts over through a DVC remote"),
        ({"remote": {"url": "s3://b/p", "endpoint": "x"}}, r"remote.endpoint: Extra inputs are not permitted"),
        (
            {"remote": {"url": "s3://b/p"}, "pools": {"bcc": "gpu"}},
            r"pools: no stage \['bcc'\] in this method; expected some of \['bc', 'evaluate'\]",
        ),
    ]
    for settings, message in cases:
        (tmp_path / "scaleout.yaml").write_text(yaml.safe_dump(settings))
        with pytest.raises(ConfigError, match=rf"{tmp_path}/scaleout.yaml: .*{message}"):
            load_settings(tmp_path, ["bc", "evaluate"])
    monkeypatch.setenv("QEVOLVE_SCALEOUT", str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match=r"nope.yaml: not found \(QEVOLVE_SCALEOUT names it\)"):
        load_settings(tmp_path)


def test_an_unreachable_remote_is_an_error_naming_it_and_nothing_computed_is_lost(tmp_path, monkeypatch):
    from dvc.repo import Repo

    from tasks import RemoteUnreachable, push_stage, restore_from_run_cache
    from tasks.scaleout import Remote, use_remote

    for key, value in {**S3_ENV, "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(key, value)
    root = tmp_path / "ws"
    root.mkdir()
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
    closed = f"http://127.0.0.1:{_port()}"
    use_remote(root, Remote(url="s3://qevolve/dvc", endpointurl=closed))
    (root / "in.txt").write_text("hello\n")
    (root / "dvc.yaml").write_text(
        "stages:\n  gen:\n    cmd: cp in.txt out.txt\n    deps: [in.txt]\n    outs: [out.txt]\n"
    )
    monkeypatch.chdir(root)
    with pytest.raises(
        RemoteUnreachable,
        match=r"gen: looking for it in the remote's run cache: the DVC remote s3://qevolve/dvc failed \(.*127.0.0.1",
    ):
        restore_from_run_cache(root, "gen", "s3://qevolve/dvc")
    with Repo(str(root)) as repo:
        repo.reproduce("gen")
    with pytest.raises(
        RemoteUnreachable,
        match=r"gen: pushing its outputs \(kept here, recorded in dvc.lock\): the DVC remote s3://qevolve/dvc failed",
    ):
        push_stage(root, "gen", "s3://qevolve/dvc")
    assert (root / "out.txt").read_text() == "hello\n" and "gen" in yaml.safe_load((root / "dvc.lock").read_text())[
        "stages"
    ]


def test_a_tracking_server_that_fails_at_a_stages_end_is_an_error_naming_it(tmp_path, monkeypatch):
    import mlflow

    from flows.tracking import TrackingUnavailable, log_stage
    from qevolve.recipe import SETUP

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    mlflow.set_tracking_uri(f"http://127.0.0.1:{_port()}")
    try:
        with pytest.raises(
            TrackingUnavailable,
            match=r"bc: logging to MLflow at http://127.0.0.1:\d+ failed .*nothing computed is lost",
        ):
            log_stage({"stage": "bc", "metrics": {"loss": 1.0}}, SETUP[-1])
    finally:
        mlflow.set_tracking_uri(None)


def _postgres(services: Services, env: dict, database: str) -> str:
    """A PostgreSQL 15 cluster on loopback (as the `postgres` user, which initdb needs), with `database`;
    its address (`postgres@127.0.0.1:port/database`)."""
    import shutil
    import tempfile

    bin_dir = Path("/usr/lib/postgresql/15/bin")
    if not bin_dir.exists() or shutil.which("runuser") is None:
        pytest.skip("PostgreSQL 15 is not installed")
    data = Path(tempfile.mkdtemp(prefix="qevolve-pg-", dir="/tmp"))
    shutil.chown(data, "postgres")
    data.chmod(0o700)
    as_pg = ["runuser", "-u", "postgres", "--"]
    subprocess.run(
        [*as_pg, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
        check=True,
        capture_output=True,
    )
    port = _port()
    services.start(
        "postgres",
        [
            *as_pg,
            str(bin_dir / "postgres"),
            "-D",
            str(data),
            "-p",
            str(port),
            "-k",
            str(data),
            "-c",
            "listen_addresses=127.0.0.1",
        ],
        env,
    )
    for _ in range(120):
        if (
            subprocess.run(
                [str(bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)], capture_output=True
            ).returncode
            == 0
        ):
            break
        time.sleep(0.5)
    subprocess.run(
        [str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", database], check=True
    )
    services.cleanup.append(lambda: shutil.rmtree(data, ignore_errors=True))
    return f"postgres@127.0.0.1:{port}/{database}"


@pytest.mark.slow
def test_mlflow_on_postgresql_keeps_the_evolution_and_its_artifacts_go_to_s3_through_the_server(tmp_path, services):
    env = {**os.environ, **S3_ENV, "PYTHONPATH": str(REPO), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    s3 = f"http://127.0.0.1:{_port()}"
    services.start("moto", [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", s3.rsplit(":", 1)[1]], env, url=s3)
    import boto3

    s3_client = boto3.client(
        "s3", endpoint_url=s3, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )
    s3_client.create_bucket(Bucket="qevolve")
    database = "postgresql+psycopg://" + _postgres(services, env, "mlflow")
    port = _port()

    def start_mlflow():
        return services.start(
            "mlflow",
            [
                str(BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                database,
                "--artifacts-destination",
                "s3://qevolve/mlflow",
            ],
            {**env, "MLFLOW_S3_ENDPOINT_URL": s3},
            url=f"http://127.0.0.1:{port}/health",
        )

    server = start_mlflow()
    # The flow holds no S3 credentials: artifacts go through the server (proxied).
    client_env = {k: v for k, v in env.items() if not k.startswith("AWS_")} | {
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"
    }
    ws = _workspace(tmp_path / "ws", tmp_path, {})
    _evolve(ws, client_env)
    import mlflow

    mlflow.set_tracking_uri(f"http://127.0.0.1:{port}")
    try:
        [parent] = mlflow.search_runs(experiment_names=["qevolve"], output_format="list")
        assert "bc/loss" in parent.data.metrics and parent.info.status == "FINISHED"
        assert "bc_adapter" in {a.path for a in mlflow.MlflowClient().list_artifacts(parent.info.run_id)}
        keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket="qevolve", Prefix="mlflow/")["Contents"]]
        assert any(k.endswith("bc_adapter/adapter_model.safetensors") for k in keys)

        # The server down, then back (the same database): the rerun resumes the same MLflow run.
        os.killpg(server.pid, 15)
        server.wait(30)
        params = yaml.safe_load((ws / "params.yaml").read_text())
        params["evolve"]["iterations"] = 1
        (ws / "params.yaml").write_text(yaml.safe_dump(params))
        down = subprocess.run(
            [sys.executable, "-m", "flows.evolve", "--root", str(ws)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
            env={**client_env, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"},
        )
        assert down.returncode != 0 and f"127.0.0.1:{port}" in down.stdout + down.stderr
        start_mlflow()
        _evolve(ws, client_env)
        [again] = mlflow.search_runs(
            experiment_names=["qevolve"], output_format="list", filter_string="tags.mlflow.parentRunId IS NULL"
        )
        assert (
            again.info.run_id == parent.info.run_id
            and again.info.status == "FINISHED"
            and "evaluate/test/success_rate" in again.data.metrics
        )
    finally:
        mlflow.set_tracking_uri(None)


def test_a_worker_writes_only_the_files_a_stage_carries_into_a_workspace_id_it_checked(tmp_path, monkeypatch):
    """`remote_stage`'s parameters come from whoever can create a flow run: a workspace that is not the 16 hex digits
    `dispatch` sends, or a file name other than params.yaml, dvc.yaml, dvc.lock and metrics/*.json, is refused before
    anything is written."""
    from flows.scaleout import remote_stage
    from qevolve.errors import BadName
    from tasks.scaleout import ROOT as REPO_ROOT
    from tasks.scaleout import SRC, carried_path, code_digest, worker_root

    monkeypatch.setenv("QEVOLVE_WORKER_DIR", str(tmp_path / "workers"))
    code = code_digest(REPO_ROOT / SRC)
    for workspace in ("../../x", "/tmp", "0123456789abcdeF", "0123456789abcde", "..", ""):
        with pytest.raises(BadName, match="is not a workspace id"):
            remote_stage.fn("bc", None, {"params.yaml": ""}, code, {}, workspace)
    for name in (
        "/etc/passwd",
        "../evil.pth",
        "src/qevolve/__init__.py",
        "metrics/../../x.json",
        "metrics/a/b.json",
        "dvc.yaml/x",
        ".dvc/config",
        "metrics/.json",
    ):
        with pytest.raises(BadName, match="is not a file a stage carries"):
            remote_stage.fn("bc", None, {"params.yaml": "", name: "x"}, code, {}, "0123456789abcdef")
    for registry in (
        "--insecure-registry",
        "reg istry",
        "host/Upper",
        "host:port/x",
    ):  # a registry never reaches `docker pull` as an option
        with pytest.raises(BadName, match="is not a registry"):
            remote_stage.fn("bc", None, {"params.yaml": ""}, code, {}, "0123456789abcdef", registry)
    assert not (tmp_path / "workers").exists()  # nothing written
    root = worker_root("0123456789abcdef")
    assert root == tmp_path / "workers" / "0123456789abcdef"
    assert [
        carried_path(root, n).relative_to(root).as_posix()
        for n in ("params.yaml", "dvc.lock", "metrics/evaluate@0.json", "metrics/bc_curve.json")
    ] == ["params.yaml", "dvc.lock", "metrics/evaluate@0.json", "metrics/bc_curve.json"]
