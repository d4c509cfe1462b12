"""Environment workers, as processes and as Ray actors: a killed or hung worker costs one episode attempt,
never the run, and both serve the same trajectories."""

import os
import re
import signal
import time

import pytest

from qevolve.config import EnvConfig
from qevolve.envs import make_env
from qevolve.envs.base import Task
from qevolve.envs.worker import EnvWorker, EnvWorkerError
from qevolve.models.prompt import PromptBuilder
from qevolve.rollout import play
from tests.test_reliability import ScriptedActor

CFG = EnvConfig(name="textcraft", step_timeout=3, start_timeout=120)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster on loopback for the module's Ray tests (about 25 s to start on 2 cores)."""
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=2**28,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(params=["process", "ray"])
def cfg(request):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return CFG.model_copy(update={"worker": request.param})


def _gone(worker, wait: float = 30) -> bool:
    """Whether the worker's process (or actor) has ended, or ends within `wait` seconds (`ray.kill` and a
    process's exit take effect asynchronously; on a loaded machine that can take seconds)."""
    deadline = time.time() + wait
    while True:
        if isinstance(worker, EnvWorker):
            if not worker.process.is_alive():
                return True
        else:
            import ray
            from ray.exceptions import GetTimeoutError, RayActorError

            try:
                ray.get(worker.actor.pid.remote(), timeout=10)
            except RayActorError:
                return True
            except GetTimeoutError:
                pass
        if time.time() >= deadline:
            return False
        time.sleep(0.5)


def _rollout(cfg, tiny_tokenizer, sabotage, *, retries, episodes=4, ratio=0.0):
    """Play `episodes` TextCraft games of 4 `inventory` steps on 2 workers; on the policy's 2nd turn,
    `sabotage` the first worker's process."""
    workers = []

    def factory():
        workers.append(make_env(cfg, worker=True))
        return workers[-1]

    actor = ScriptedActor(PromptBuilder(tiny_tokenizer, 256), ["Action: inventory"] * 200)
    act, turns = actor.act, []

    def act_and_sabotage(*args, **kwargs):
        turns.append(1)
        if len(turns) == 2:
            sabotage(workers[0].pid)
        return act(*args, **kwargs)

    actor.act = act_and_sabotage
    tasks = make_env(CFG).tasks("train")[:episodes]
    trajs = play(
        factory,
        tasks,
        actor,
        max_steps=4,
        greedy=True,
        source="p",
        batch_size=2,
        retries=retries,
        parallel=True,
        max_failure_ratio=ratio,
    )
    assert all(_gone(w) for w in workers)  # every worker is gone after the rollout
    return trajs, workers


def test_a_killed_worker_restarts_its_episode_on_a_fresh_worker(cfg, tiny_tokenizer):
    trajs, workers = _rollout(cfg, tiny_tokenizer, lambda pid: os.kill(pid, signal.SIGKILL), retries=1)
    assert [t.task_id for t in trajs] == [t.id for t in make_env(CFG).tasks("train")[:4]]
    assert all(t.failure == "max_steps" and len(t.steps) == 4 for t in trajs)  # the restarted episode is whole
    assert all(s.observation.startswith(("Crafting commands", "Inventory")) for t in trajs for s in t.steps)
    assert len(workers) == 3  # two, and the one that replaced the killed worker


def test_a_hung_worker_is_killed_after_its_timeout_and_the_episode_restarted(cfg, tiny_tokenizer):
    trajs, workers = _rollout(cfg, tiny_tokenizer, lambda pid: os.kill(pid, signal.SIGSTOP), retries=1)
    assert all(t.failure == "max_steps" and len(t.steps) == 4 for t in trajs)
    assert len(workers) == 3 and _gone(workers[0])
    if cfg.worker == "process":
        assert workers[0].process.exitcode == -signal.SIGKILL


def test_without_retries_the_episode_is_recorded_as_failed_with_the_reason(cfg, tiny_tokenizer):
    trajs, _ = _rollout(cfg, tiny_tokenizer, lambda pid: os.kill(pid, signal.SIGKILL), retries=0, ratio=0.5)
    failed = [t for t in trajs if t.failure.startswith("env_error")]
    # the kill lands while the step runs, or (on a loaded machine) before it is sent
    assert len(failed) == 1 and re.search(
        r"EnvWorkerError: environment (worker \d+|actor) (died during step|is not running)", failed[0].failure
    )
    assert sum(t.failure == "max_steps" for t in trajs) == 3  # the others ran on


def test_worker_errors_name_the_call_and_environment_errors_pass_through(cfg):
    worker = make_env(cfg, worker=True)
    try:
        with pytest.raises(RuntimeError, match="unknown TextCraft goal 'minecraft:nothing'"):
            worker.reset(Task("minecraft:nothing", "train", "depth2"))
        assert not _gone(worker, wait=0)  # an error inside the environment does not end the worker
        os.kill(worker.pid, signal.SIGSTOP)
        with pytest.raises(EnvWorkerError, match=r"step took longer than 3 s; killed it"):
            worker.step("inventory")
        with pytest.raises(EnvWorkerError, match=r"is not running|died during step"):
            worker.step("inventory")
    finally:
        worker.close()


def test_ray_actors_serve_the_same_expert_trajectories_as_worker_processes(tmp_path, monkeypatch, ray_cluster):
    from qevolve import paths
    from qevolve.data.store import read_store
    from qevolve.params import parse_params
    from qevolve.stages import run_stage
    from tests.test_env_pipelines import _tiny

    trajectories = {}
    for kind in ("process", "ray"):
        raw = _tiny("textcraft", tmp_path)
        raw["env"].update(processes=True, worker=kind)
        (tmp_path / kind).mkdir()
        monkeypatch.chdir(tmp_path / kind)
        run_stage("experts", parse_params(raw), None)
        trajectories[kind] = [
            (t.task_id, t.won, [(s.action, s.observation, s.reward) for s in t.steps])
            for t in read_store(paths.EXPERTS)
        ]
    assert len(trajectories["ray"]) == 6 and trajectories["ray"] == trajectories["process"]


@pytest.mark.parametrize(
    "section, moved", [("env", {"worker": "ray", "ray_cpus": 1.0}), ("policy", {"replicas": 4, "replica_cpus": 2.0})]
)
def test_where_environments_and_policy_replicas_run_is_not_part_of_a_stages_lineage(section, moved):
    import yaml

    from qevolve import dvcfile
    from qevolve.params import parse_params
    from tests.test_pipeline import REPO

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    spread = {**raw, section: {**raw[section], **moved}}
    assert dvcfile.render(parse_params(spread)) == dvcfile.render(parse_params(raw))
    assert f"- {section}." in dvcfile.render(parse_params(raw))  # the rest of the section stays a dep, key by key


def _wait_dead(actor, seconds: float = 30.0) -> None:
    """Until `actor` answers no more (a killed Ray actor dies asynchronously)."""
    import ray
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=seconds)
        except RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the actor still answers {seconds:g} s after ray.kill")


def test_policy_replicas_play_the_same_episodes_as_the_stages_process(tmp_path, tiny_base, ray_cluster):
    """R = 2 replicas (slot s on replica s % 2) and the stage's own process: the same sampled episodes, in
    both action modes, since each episode samples from its own seed."""
    from qevolve.models.policy import Actor, load_policy
    from qevolve.models.ray_policy import rollout_backend
    from qevolve.params import parse_params
    from tests.test_env_pipelines import _tiny
    from tests.test_rollout import Corridor

    raw = _tiny("webshop", tmp_path)
    model, _ = load_policy(tiny_base, parse_params(raw).model)
    model.save_pretrained(tmp_path / "policy")
    backends = {}
    for replicas in (0, 2):
        raw["policy"].update(replicas=replicas, replica_cpus=0.5)
        backends[replicas] = rollout_backend(parse_params(raw), tiny_base, tmp_path / "policy")
    for mode in ("admissible", "free"):
        runs = {}
        for replicas, (backend, tok) in backends.items():
            actor = Actor(None, tok, PromptBuilder(tok, 256), mode, 50.0, 6, backend=backend)
            env = Corridor()
            trajs = play(
                lambda: env, env.tasks("train") * 2, actor, max_steps=4, greedy=False, source="p", batch_size=3, seed=1
            )
            runs[replicas] = [[(s.output, round(s.logp, 3)) for s in t.steps] for t in trajs]
        assert runs[2] == runs[0] and len({str(r) for r in runs[0]}) > 1
    here, there = backends[0][0].placement(), backends[2][0].placement()
    assert there.pop("replicas") == 2 and there.pop("threads") >= 1  # a replica's torch threads: its own CPUs'
    assert there == {k: v for k, v in here.items() if k != "threads"}
    import ray

    ray.kill(backends[2][0].replicas[1])  # a dead replica fails the stage, naming it
    _wait_dead(backends[2][0].replicas[1])  # ray.kill only asks: a call sent at once can still be answered
    with pytest.raises(RuntimeError, match="policy replica 1 of 2 died during score"):
        backends[2][0].score([0, 1], [[1, 2], [1, 2]], [[[3]], [[3]]])
