"""The benchmark table's smoke version, end to end (slow tier): every kind of row, DVC's run cache
shared across workspaces, the MLflow parent and children, and the rendered plots."""

import json
import os
import subprocess
import sys

import mlflow
import pytest
import yaml

from conftest import REPO


@pytest.mark.slow
def test_smoke_table_runs_every_row_and_reuses_shared_stages(tmp_path):
    out = tmp_path / "table"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "flows.table", "benchmarks/table-smoke.yaml", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    spec = yaml.safe_load((REPO / "benchmarks" / "table-smoke.yaml").read_text())
    results = json.loads((out / "results.json").read_text())
    assert [r["row"] for r in results["rows"]] == [r["name"] for r in spec["rows"]]
    assert results["machine"]["cpus"] >= 1 and results["machine"]["cpu_capability"], "the machine the table computed on"
    for r in results["rows"]:
        assert len(r["seeds"]) == 1 and 0 <= r["seeds"][0]["valid_unseen/success_rate"] <= 1
    assert all(
        sum(t["episodes"] for t in r["seeds"][0]["valid_seen/tasks"].values()) == r["seeds"][0]["valid_seen/episodes"]
        for r in results["rows"]
    ), "each row's outcome on each task, to pair rows by"
    # each row with a critic of its iteration carries its held-out AUC (diagnose@k; None where the held-out episodes
    # had one outcome only): none for BC or GRPO, which have no critic
    auc = {r["row"]: r["seeds"][0].get("critic_auc", "none") for r in results["rows"]}
    assert (
        auc["SFT (BC only)"] == auc["GRPO, equal env steps"] == "none"
        and auc["critic rerank only (Best-of-2)"] == auc["Q-Evolve, iteration 1"]
    )
    assert all(
        auc[row] is None or 0 <= auc[row] <= 1
        for row in ("Q-Evolve, iteration 1", "Q-Evolve, iteration 2", "without relabeling")
    )
    table = (out / "table.md").read_text()
    lines = table.splitlines()
    assert len(lines) == 2 + len(spec["rows"]) + 2 and lines[-1].startswith("success %: pooled over seeds")
    assert all(line.count(" vs #1 |") == 2 for line in lines[3:-2]), (
        "every row after the first compared with it, seen and unseen"
    )
    # The ablation reuses Q-Evolve's BC and collect@1 (same code, params and inputs): checked out from the
    # run cache, so its lock entries are Q-Evolve's.
    log = run.stdout + run.stderr
    for stage in ("bc", "evaluate@0", "collect@1"):
        assert f"Stage '{stage}' is cached - skipping run" in log
        locks = [
            yaml.safe_load((out / ws / "dvc.lock").read_text())["stages"][stage]["outs"]
            for ws in ("qevolve-s0", "no-relabel-s0")
        ]
        assert locks[0] == locks[1]
    # GRPO's iteration spends what Q-Evolve's two iterations spent.
    steps = {r["row"]: r["seeds"][0]["own_env_steps"] for r in results["rows"]}
    grpo = yaml.safe_load((out / "grpo-s0" / "params.yaml").read_text())
    assert grpo["online"]["env_steps"] == steps["Q-Evolve, iteration 2"] <= steps["GRPO, equal env steps"]
    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("table-smoke").experiment_id])
    assert [r.info.run_id for r in runs if "mlflow.parentRunId" not in r.data.tags] == [results["mlflow_parent_run_id"]]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == results["mlflow_parent_run_id"]]
    assert sorted(r.data.tags["qevolve.row"] for r in children) == sorted(r["name"] for r in spec["rows"])
    for image in ("success_by_iteration.png", "success_by_env_steps.png"):
        assert (out / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
