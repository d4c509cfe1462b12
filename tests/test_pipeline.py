"""The flow, dvc.yaml and MLflow agree; one end-to-end run of the flow on a tiny subset."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from conftest import REPO

DVC = str(Path(sys.executable).with_name("dvc"))  # the venv's dvc, whether or not the venv is activated

TINY = {
    "env": {"max_steps": 6},
    "experts": {"num_tasks": 3, "workers": 2},
    "model": {"embedded": {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab_size": 400}, "context_tokens": 256, "lora": {"r": 8, "alpha": 16}},
    "bc": {"epochs": 2, "batch_size": 4},
    "evaluate": {"splits": {"valid_seen": 2, "valid_unseen": 1}, "batch_size": 3},
}


def _dvc_stages(cwd) -> list[str]:
    out = subprocess.run([DVC, "stage", "list", "--name-only"], cwd=cwd, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_flow_and_dvc_yaml_describe_the_same_stages():
    from flows.evolve import pipeline
    from qevolve.stages import stage_name

    assert [stage_name(s, k) for s, k in pipeline()] == _dvc_stages(REPO)


def test_stages_do_not_import_orchestration():
    code = (
        "import sys, qevolve.stages, qevolve.stages.experts, qevolve.stages.base, qevolve.stages.bc, "
        "qevolve.stages.evaluate, qevolve.cli\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'mlflow', 'dvc'))\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _workspace(tmp_path):
    """A git checkout of the repository's tracked files, with tiny parameters."""
    ws = tmp_path / "ws"
    subprocess.run(["git", "clone", "-q", str(REPO), str(ws)], check=True)
    # Copy tracked files from the working tree too, so the test sees uncommitted edits.
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for rel in tracked:
        if (REPO / rel).is_file():
            shutil.copyfile(REPO / rel, ws / rel)
    params = yaml.safe_load((ws / "params.yaml").read_text())
    for section, values in TINY.items():
        params[section].update(values)
    (ws / "params.yaml").write_text(yaml.safe_dump(params))
    return ws


def _flow(ws, **kw):
    return subprocess.Popen([sys.executable, "-m", "flows.evolve"], cwd=ws, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONPATH": str(ws)}, **kw)


def _finish(proc) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def _stages_run(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("stages run:")).split(";")[0]


def test_flow_end_to_end_resumes_after_kill_and_leaves_dvc_clean(tmp_path, alfworld_data):
    ws = _workspace(tmp_path)
    # 1. Kill the flow once `base` is recorded in dvc.lock (bc is then running or about to).
    proc = _flow(ws)
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        lock = ws / "dvc.lock"
        if lock.exists() and "base" in (yaml.safe_load(lock.read_text()) or {}).get("stages", {}):
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (ws / "metrics" / "evaluate@0.json").exists()

    # 2. Re-run: resumes at bc.
    out = _finish(_flow(ws))
    assert _stages_run(out) == "stages run: bc, evaluate@0"
    assert "valid_seen" in out and "mlflow ui" in out and "dvc dag" in out and "prefect server start" in out
    status = subprocess.run([DVC, "status"], cwd=ws, capture_output=True, text=True, check=True).stdout
    assert "up to date" in status, status

    # 3. Again: no work at all.
    assert _stages_run(_finish(_flow(ws))) == "stages run: none (all up to date)"

    # MLflow holds the stage metrics, the adapter and readable trajectories.
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["qevolve"], output_format="list")
    finished = [r for r in runs if r.info.status == "FINISHED"]
    assert finished
    run = finished[-1]
    assert {"bc/loss", "evaluate/valid_seen/success_rate", "experts/success_rate"} <= set(run.data.metrics)
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"bc_adapter", "trajectories"} <= artifacts
    text = mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/trajectories/evaluate@0.md")
    assert "Action:" in text
