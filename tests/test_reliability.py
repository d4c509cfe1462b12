"""Faults and bad input: each fails loudly with a message naming what is wrong, or is survived, and
nothing already written is lost (see docs/reliability.md)."""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import REPO
from qevolve.config import ModelConfig
from qevolve.data.atomic import atomic_dir, write_json
from qevolve.data.store import Trajectory, read_store, write_store
from qevolve.envs import check_tasks
from qevolve.envs.base import EnvironmentFailures, Task
from qevolve.lock import WorkspaceBusy, workspace_lock
from qevolve.models.base import ModelLoadError, load_base
from qevolve.models.policy import Actor, Decision
from qevolve.models.prompt import PromptBuilder
from qevolve.rollout import play
from tests.test_rollout import Corridor


def test_a_second_process_on_the_workspace_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom qevolve.lock import workspace_lock\n"
            f"with workspace_lock({str(tmp_path)!r}, 'evolution'):\n    print('held', flush=True)\n    time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(
        WorkspaceBusy, match=rf"another qevolve process is using this workspace \(evolution, pid {holder.pid} on "
    ):
        with workspace_lock(tmp_path, "evolution"):
            pass
    holder.send_signal(signal.SIGKILL)  # the kernel releases the lock of a killed holder
    holder.wait()
    with workspace_lock(tmp_path, "evolution"):
        with workspace_lock(tmp_path, "stage bc"):  # re-entrant within one process
            pass


def test_cli_stage_refuses_while_an_evolution_holds_the_workspace(tmp_path):
    shutil.copy("params.yaml", tmp_path / "params.yaml")
    shutil.copy("dvc.yaml", tmp_path / "dvc.yaml")
    with workspace_lock(tmp_path, "evolution"):
        done = subprocess.run(
            [sys.executable, "-m", "qevolve.cli", "run", "bc", "--params", str(tmp_path / "params.yaml")],
            capture_output=True,
            text=True,
        )
    assert done.returncode == 2 and "another qevolve process is using this workspace (evolution, pid" in done.stderr


def test_a_kill_between_the_two_renames_of_a_folder_swap_loses_nothing(tmp_path):
    art = tmp_path / "bc"
    with atomic_dir(art) as tmp:
        (tmp / "weights").write_text("v1")
    # what a kill right after moving the old version aside leaves behind
    aside = tmp_path / ".bc.abc.old"
    aside.mkdir()
    os.replace(art, aside / "x")
    with atomic_dir(art) as tmp:
        assert (art / "weights").read_text() == "v1"  # restored before anything else happens
        (tmp / "weights").write_text("v2")
    assert (art / "weights").read_text() == "v2" and sorted(p.name for p in tmp_path.iterdir()) == ["bc"]


def test_json_artifacts_are_standard_json_with_a_rate_of_nothing_as_null(tmp_path):
    import json

    write_json(tmp_path / "m.json", {"precision": float("nan"), "rates": [0.5, float("inf")], "n": 0})

    def refuse(token):
        raise ValueError(f"not standard JSON: {token}")

    assert json.loads((tmp_path / "m.json").read_text(), parse_constant=refuse) == {
        "precision": None,
        "rates": [0.5, None],
        "n": 0,
    }


def test_a_tokenizer_that_does_not_fit_the_model_is_refused(tiny_base, tmp_path):
    from transformers import AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    tok = AutoTokenizer.from_pretrained(base)
    tok.add_tokens([f"extra{i}" for i in range(600)])
    tok.save_pretrained(base)
    with pytest.raises(
        ModelLoadError, match=r"model.base: the tokenizer at .* has \d+ tokens but the model's embedding has \d+ rows"
    ):
        load_base(base)


def test_the_embedded_base_counts_the_tokens_every_later_load_sees(tmp_path):
    """Regression: the count was read before config.json existed; later loads (Qwen2's tokenizer class)
    add `<|endoftext|>`, one token more, which broke a ScienceWorld run whose vocabulary was 21 x 64."""
    from transformers import AutoTokenizer

    from conftest import CORPUS
    from qevolve.config import EmbeddedModelConfig
    from qevolve.models.base import build_embedded

    cfg = EmbeddedModelConfig(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab_size=300)
    metrics = build_embedded(cfg, CORPUS, tmp_path, max_positions=64)
    model, tok = load_base(tmp_path)
    assert metrics["vocab_size"] == len(tok) == len(AutoTokenizer.from_pretrained(tmp_path))
    assert len(tok) <= model.get_input_embeddings().num_embeddings


def test_expert_data_about_unknown_tasks_is_refused_naming_file_and_field():
    env = Corridor()
    good = Trajectory("a", "t1", "corridor", "train", "expert", "leave.")
    bad = Trajectory("b", "no-such-game", "corridor", "train", "expert", "leave.")
    check_tasks(env, [good], "data/experts")
    with pytest.raises(
        ValueError, match=r"data/experts: task_id 'no-such-game' \(split 'train'\) is not a task of this environment"
    ):
        check_tasks(env, [good, bad], "data/experts")


class ScriptedActor(Actor):
    """Writes the given outputs in turn, whatever it is shown."""

    mode, max_new_tokens = "free", 8

    def __init__(self, builder, outputs):
        self.builder, self.outputs = builder, list(outputs)

    def act(self, prompts, admissible, greedy, generators=None, slots=None):
        return [Decision(self.outputs.pop(0), -1.0, 3) for _ in prompts]


def test_malformed_model_output_takes_the_format_error_path(tiny_tokenizer, tmp_path):
    outputs = [
        "I think I should look around.",
        "Action: look\nAction: go to door 1",
        "Action: go to \udcff\x00 door",
        "Action: go to door 1",
    ]
    env = Corridor()
    [traj] = play(
        lambda: env,
        env.tasks("valid_seen")[:1],
        ScriptedActor(PromptBuilder(tiny_tokenizer, 256), outputs),
        max_steps=6,
        greedy=True,
        source="policy@0",
        batch_size=1,
    )
    # undecodable bytes become '?': the action is sent, and the environment rejects it
    assert [s.action for s in traj.steps] == [None, None, "go to ?\x00 door", "go to door 1"] and traj.won
    assert [s.valid for s in traj.steps] == [False, False, False, True]
    assert env.steps == ["go to ?\x00 door", "go to door 1"]  # format errors never reach the environment
    write_store(tmp_path / "s", [traj])
    assert len(read_store(tmp_path / "s")[0].steps) == 4


class Flaky(Corridor):
    """Crashes on the step (or reset) numbers given."""

    def __init__(self, crash_steps=(), crash_resets=()):
        super().__init__()
        self.crash_steps, self.crash_resets, self.resets = set(crash_steps), set(crash_resets), 0

    def reset(self, task):
        self.resets += 1
        if self.resets in self.crash_resets:
            raise RuntimeError("simulator died on reset")
        return super().reset(task)

    def step(self, action):
        if len(self.steps) + 1 in self.crash_steps:
            self.steps.append(action)
            raise ConnectionError("simulator pipe closed")
        return super().step(action)


def _play_flaky(tiny_tokenizer, env, ratio, n=4):
    actor = ScriptedActor(PromptBuilder(tiny_tokenizer, 256), ["Action: look", "Action: go to door 1"] * 20)
    tasks = [Task(f"t{i}", "valid_seen", "corridor") for i in range(n)]
    return play(lambda: env, tasks, actor, max_steps=4, greedy=True, source="p", batch_size=1, max_failure_ratio=ratio)


def test_environment_crashes_fail_only_their_episode_up_to_the_failure_ratio(tiny_tokenizer):
    trajs = _play_flaky(tiny_tokenizer, Flaky(crash_steps=[1], crash_resets=[3]), ratio=0.5)
    failures = [t.failure for t in trajs]
    assert failures[0] == "env_error: ConnectionError: simulator pipe closed"
    assert sum(f.startswith("env_error") for f in failures) == 2 and sum(t.won for t in trajs) == 2
    with pytest.raises(EnvironmentFailures, match=r"failed 2 of 4 episodes, more than env.max_failure_ratio = 0.25"):
        _play_flaky(tiny_tokenizer, Flaky(crash_steps=[1], crash_resets=[3]), ratio=0.25)


def test_a_model_base_path_that_does_not_exist_is_refused(tmp_path):
    from qevolve.models.base import write_pointer

    with pytest.raises(ModelLoadError, match=r"model.base: path '/no/such/model' does not exist"):
        write_pointer("/no/such/model", tmp_path)


def test_gguf_bases_fail_naming_the_file(tmp_path, monkeypatch):
    from qevolve.models.base import write_pointer

    monkeypatch.setenv("QEVOLVE_MODEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="GGUF file '/no/such.gguf' does not exist"):
        write_pointer("/no/such.gguf", tmp_path)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not a gguf file")
    base = tmp_path / "base"
    base.mkdir()
    write_pointer(str(gguf), base)
    with pytest.raises(ModelLoadError, match=f"cannot read GGUF file {gguf}"):
        load_base(base)
    gguf.write_bytes(b"another file")  # changed since the base stage recorded it
    with pytest.raises(ModelLoadError, match=r"is not the file the base stage recorded .*dvc repro base"):
        load_base(base)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing half-converted left


def test_missing_alfworld_games_name_the_three_ways_and_why_each_failed(tmp_path, monkeypatch):
    from qevolve.envs import alfworld

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    monkeypatch.setattr(alfworld.sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "games"))
    monkeypatch.delenv("QEVOLVE_ALFWORLD_ARCHIVE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(alfworld.AlfworldDataError) as err:
        alfworld.ensure_alfworld_data()
    message = str(err.value)
    assert f"1. ALFWORLD_DATA naming a folder that holds them: {tmp_path / 'games'} holds no games" in message
    assert "2. QEVOLVE_ALFWORLD_ARCHIVE naming a local copy of json_2.1.1_all_splits.tar.xz: not set" in message
    assert "neither beside" in message and "nor on PATH" in message
    # The venv's own script is found without the venv on PATH; here it fails as it does offline.
    script = bin_dir / "alfworld-download"
    script.write_text("#!/bin/sh\necho 'no network' >&2\nexit 3\n")
    script.chmod(0o755)
    with pytest.raises(
        alfworld.AlfworldDataError, match=rf"3. ALFWorld's own download \(needs internet\): {script} exited with 3"
    ):
        alfworld.ensure_alfworld_data()


def test_known_errors_print_message_and_hint_without_a_traceback_unless_debugging(tmp_path):
    import shutil

    shutil.copyfile(REPO / "params.yaml", tmp_path / "params.yaml")
    cli = [sys.executable, "-m", "qevolve.cli"]
    stale = subprocess.run([*cli, "run", "bc"], cwd=tmp_path, capture_output=True, text=True)
    assert (
        stale.returncode == 2
        and "dvc.yaml does not match params.yaml" in stale.stderr
        and "hint: `qevolve dvc-yaml` writes it" in stale.stderr
    )
    subprocess.run([*cli, "dvc-yaml"], cwd=tmp_path, check=True, capture_output=True)
    done = subprocess.run([*cli, "run", "bc"], cwd=tmp_path, capture_output=True, text=True)  # no expert data yet
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        "error: data/experts/trajectories.parquet: missing" in done.stderr
        and "hint: a stage's data is missing" in done.stderr
    )
    assert "dvc checkout <stage>" in done.stderr
    debug = subprocess.run([*cli, "--debug", "run", "bc"], cwd=tmp_path, capture_output=True, text=True)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "SchemaError" in debug.stderr


def test_a_damaged_adapter_or_prompt_file_names_the_artifact_its_stage_and_the_recovery(tiny_base, tmp_path):
    from qevolve.errors import DamagedArtifact
    from qevolve.models.policy import load_policy
    from qevolve.models.prompt import make_builder
    from qevolve.params import Params

    cfg = ModelConfig(lora={"r": 4, "alpha": 8})
    model, tok = load_policy(tiny_base, cfg)
    policy = tmp_path / "models" / "policy@2"
    model.save_pretrained(policy)
    weights = policy / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short, as by a full disk or a bad copy
    with pytest.raises(
        DamagedArtifact, match=r"models/policy@2: cannot load the LoRA adapter .*the output of stage `policy@2`"
    ) as err:
        load_policy(tiny_base, cfg, adapter=policy)
    assert "dvc checkout <stage>" in err.value.hint
    with pytest.raises(
        DamagedArtifact, match=r"models/policy@2/prompt.json: cannot read the prompt .*stage `policy@2`"
    ):
        make_builder(Params(), tok, policy)
