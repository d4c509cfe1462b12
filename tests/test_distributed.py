"""Data-parallel training: 2 gloo processes under torchrun compute the same updates as one process, and
the children of a workspace-lock holder inherit its lock."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from qevolve.lock import WorkspaceBusy, inherit_env, workspace_lock

WORKER = REPO / "benchmarks" / "ddp_train.py"


def _train(tiny_base, out: Path, processes: int, *options: str, status: int = 0) -> dict | None:
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        if processes > 1
        else [sys.executable]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*launcher, str(WORKER), str(tiny_base), str(out), *options],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode == 0) == (status == 0), done.stderr[-3000:]
    return torch.load(out) if status == 0 else None


def _assert_same_training(one: dict, two: dict, params_within: float = 1e-6) -> None:
    assert len(one["curve"]) == len(two["curve"]) == 4  # 2 epochs of 2 batches (6 windows, 3 per batch)
    for a, b in zip(one["curve"], two["curve"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert one["curve"][-1]["loss"] < one["curve"][0]["loss"]
    assert one["params"].keys() == two["params"].keys()
    worst = max(float((one["params"][n] - two["params"][n]).abs().max()) for n in one["params"])
    assert worst < params_within, worst


@pytest.fixture(scope="module")
def one_process(tiny_base, tmp_path_factory) -> dict:
    return _train(tiny_base, tmp_path_factory.mktemp("one") / "one.pt", 1)


def test_two_processes_compute_the_same_updates_as_one(tiny_base, tmp_path, one_process):
    _assert_same_training(one_process, _train(tiny_base, tmp_path / "two.pt", 2))


def test_a_model_sharded_across_two_processes_computes_the_same_updates_as_one(tiny_base, tmp_path, one_process):
    # 3 micro-batches per step: rank 1 reruns one with weight 0, since a sharded model's passes are collective.
    # A sharded model's loss makes the full logits (its root unit gathers the head); one process makes them at the
    # targets alone (`target_logprobs`): another order of float rounding, 1.2e-6 at most after 4 steps here.
    _assert_same_training(one_process, _train(tiny_base, tmp_path / "two.pt", 2, "--shard"), params_within=5e-6)


def test_a_killed_sharded_run_resumes_from_its_checkpoint_to_the_same_result(tiny_base, tmp_path, one_process):
    checkpoint = tmp_path / "checkpoint.pt"
    _train(
        tiny_base, tmp_path / "killed.pt", 2, "--shard", "--checkpoint", str(checkpoint), "--stop-after", "2", status=3
    )
    assert len(torch.load(checkpoint, weights_only=False)["curve"]) == 1  # saved after step 1, killed in step 2
    _assert_same_training(
        one_process,
        _train(tiny_base, tmp_path / "resumed.pt", 2, "--shard", "--checkpoint", str(checkpoint)),
        params_within=5e-6,
    )


def _child_takes_lock(root: Path, env: dict) -> subprocess.CompletedProcess:
    code = f"from qevolve.lock import workspace_lock\nwith workspace_lock({str(root)!r}, 'child'):\n    print('inside')"
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )


def test_a_lock_holders_children_inherit_its_lock_and_no_one_else_does(tmp_path):
    with workspace_lock(tmp_path, "parent"):
        token = inherit_env(tmp_path)
        assert _child_takes_lock(tmp_path, token).stdout.strip() == "inside"
        refused = _child_takes_lock(tmp_path, {})
        assert "WorkspaceBusy" in refused.stderr and "parent" in refused.stderr
        forged = {"QEVOLVE_LOCK_HELD": f"{os.getpid() + 999999}:{token['QEVOLVE_LOCK_HELD'].split(':', 1)[1]}"}
        assert "WorkspaceBusy" in _child_takes_lock(tmp_path, forged).stderr  # not an ancestor
    with pytest.raises(RuntimeError, match="does not hold"):
        inherit_env(tmp_path)
    with workspace_lock(tmp_path, "again"):
        pass  # released after the parent's block


def test_lock_is_not_inherited_by_a_process_that_is_not_a_child(tmp_path, monkeypatch):
    with workspace_lock(tmp_path, "parent"):
        token = inherit_env(tmp_path)
    # The token names this process itself, which is no ancestor of itself: another thread of work here
    # holding a stale token does not get in while a different process holds the lock.
    monkeypatch.setenv("QEVOLVE_LOCK_HELD", token["QEVOLVE_LOCK_HELD"])
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from qevolve.lock import workspace_lock\nimport time\nwith workspace_lock({str(tmp_path)!r}, "
            f"'other'):\n    print('held', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "QEVOLVE_LOCK_HELD"},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkspaceBusy):
            with workspace_lock(tmp_path, "stale token"):
                pass
    finally:
        holder.kill()
        holder.wait()


RANK = """
import os, time
from pathlib import Path
from qevolve.lock import under_torchrun
under_torchrun()  # what `qevolve.cli.main` does first in a rank
Path(os.environ["BEATS"], os.environ["RANK"]).write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


def test_a_sigkilled_orchestrator_takes_torchrun_and_its_ranks_with_it(tmp_path):
    """Killing the stage's process alone (not its process group: a SIGKILL to one pid, as an OOM killer or a
    `kill -9` does) once left the ranks training into the workspace after the lock was released."""
    import signal

    (tmp_path / "rank.py").write_text(RANK)
    orchestrator = (
        "import os, sys; from qevolve.stages import run_ranks; "
        f"run_ranks([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', "
        f"{str(tmp_path / 'rank.py')!r}], "
        "dict(os.environ))"
    )
    env = {**os.environ, "BEATS": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-c", orchestrator], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len([p for p in tmp_path.iterdir() if p.name.isdigit()]) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not start"
            time.sleep(0.2)
        ranks = [int((tmp_path / r).read_text()) for r in ("0", "1")]
        assert all(_alive(p) for p in ranks)
        os.kill(proc.pid, signal.SIGKILL)  # the orchestrator alone
        proc.wait()
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in ranks), "a rank outlived the killed orchestrator"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
