"""Environment worker processes: a killed or hung worker costs one episode attempt, never the run."""

import os
import signal

import pytest

from qevolve.config import EnvConfig
from qevolve.envs import make_env
from qevolve.envs.base import Task
from qevolve.envs.worker import EnvWorkerError
from qevolve.models.prompt import PromptBuilder
from qevolve.rollout import play
from tests.test_reliability import ScriptedActor

CFG = EnvConfig(name="textcraft", step_timeout=3, start_timeout=120)


def _rollout(tiny_tokenizer, sabotage, *, retries, episodes=4, ratio=0.0):
    """Play `episodes` TextCraft games of 4 `inventory` steps on 2 workers; on the policy's 2nd turn,
    `sabotage` the first worker's process."""
    workers = []

    def factory():
        workers.append(make_env(CFG, worker=True))
        return workers[-1]

    actor = ScriptedActor(PromptBuilder(tiny_tokenizer, 256), ["Action: inventory"] * 200)
    act, turns = actor.act, []

    def act_and_sabotage(*args, **kwargs):
        turns.append(1)
        if len(turns) == 2:
            sabotage(workers[0].process.pid)
        return act(*args, **kwargs)

    actor.act = act_and_sabotage
    tasks = make_env(CFG).tasks("train")[:episodes]
    trajs = play(factory, tasks, actor, max_steps=4, greedy=True, source="p", batch_size=2, retries=retries,
                 parallel=True, max_failure_ratio=ratio)
    assert all(not w.process.is_alive() for w in workers)  # every worker is gone after the rollout
    return trajs, workers


def test_a_killed_worker_restarts_its_episode_on_a_fresh_worker(tiny_tokenizer):
    trajs, workers = _rollout(tiny_tokenizer, lambda pid: os.kill(pid, signal.SIGKILL), retries=1)
    assert [t.task_id for t in trajs] == [t.id for t in make_env(CFG).tasks("train")[:4]]
    assert all(t.failure == "max_steps" and len(t.steps) == 4 for t in trajs)  # the restarted episode is whole
    assert all(s.observation.startswith(("Crafting commands", "Inventory")) for t in trajs for s in t.steps)
    assert len(workers) == 3  # two, and the one that replaced the killed worker


def test_a_hung_worker_is_killed_after_its_timeout_and_the_episode_restarted(tiny_tokenizer):
    trajs, workers = _rollout(tiny_tokenizer, lambda pid: os.kill(pid, signal.SIGSTOP), retries=1)
    assert all(t.failure == "max_steps" and len(t.steps) == 4 for t in trajs)
    assert workers[0].process.exitcode == -signal.SIGKILL


def test_without_retries_the_episode_is_recorded_as_failed_with_the_reason(tiny_tokenizer):
    trajs, _ = _rollout(tiny_tokenizer, lambda pid: os.kill(pid, signal.SIGKILL), retries=0, ratio=0.5)
    failed = [t for t in trajs if t.failure.startswith("env_error")]
    assert len(failed) == 1 and "EnvWorkerError: environment worker" in failed[0].failure and "died during step" in failed[0].failure
    assert sum(t.failure == "max_steps" for t in trajs) == 3  # the others ran on


def test_worker_errors_name_the_call_and_environment_errors_pass_through():
    worker = make_env(CFG, worker=True)
    try:
        with pytest.raises(RuntimeError, match="unknown TextCraft goal 'minecraft:nothing'"):
            worker.reset(Task("minecraft:nothing", "train", "depth2"))
        assert worker.process.is_alive()  # an error inside the environment does not end the worker
        os.kill(worker.process.pid, signal.SIGSTOP)
        with pytest.raises(EnvWorkerError, match=r"step took longer than 3 s; killed it"):
            worker.step("inventory")
        with pytest.raises(EnvWorkerError, match=r"is not running"):
            worker.step("inventory")
    finally:
        worker.close()
