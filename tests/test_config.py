import re

import pytest
import yaml

from conftest import REPO
from qevolve.config import ConfigError
from qevolve.params import load_params, methods


def test_repository_params_load():
    params = load_params(REPO / "params.yaml")
    assert params.policy.action_mode == "admissible"


def _write(tmp_path, raw):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"bc": {"lr": -1.0}}, "bc.lr"),
        ({"bc": {"epochs": "many"}}, "bc.epochs"),
        ({"bc": {"learning_rate": 0.1}}, "bc.learning_rate"),
        ({"polcy": {}}, "polcy"),
        ({"policy": {"action_mode": "guess"}}, "policy.action_mode"),
        ({"env": {"task_types": ["make_coffee"]}}, "env.task_types"),
        ({"evaluate": {"splits": {"valid_seen": -1}}}, "evaluate.splits"),
        ({"model": {"lora": {"dropout": 1.5}}}, "model.lora.dropout"),
        ({"critic": {"expectile": 1.0}}, "critic.expectile"),
        ({"critic": {"gamma": 1.2}}, "critic.gamma"),
        ({"advantage": {"lam": -0.1}}, "advantage.lam"),
        ({"policy": {"lr": -1e-4}}, "policy.lr"),
        ({"env": {"max_failure_ratio": 2}}, "env.max_failure_ratio"),
        ({"prompt": {"max_observation_tokens": 0}}, "prompt.max_observation_tokens"),
        ({"model": {"device": "gpu"}}, "model.device"),
        (
            {
                "env": {"name": "textcraft", "task_types": ["depth9"]},
                "policy": {"action_mode": "free"},
                "experts": {"demos": {"planner": 1}},
                "evaluate": {"splits": {"test": 0}},
            },
            "env.task_types",
        ),
    ],
)
def test_bad_values_fail_naming_file_and_key(tmp_path, raw, key):
    path = _write(tmp_path, raw)
    with pytest.raises(ConfigError) as err:
        load_params(path)
    assert str(path) in str(err.value)
    assert f"  {key}:" in str(err.value)


def test_unknown_key_is_called_unknown(tmp_path):
    with pytest.raises(ConfigError, match="bc.learning_rate: unknown key"):
        load_params(_write(tmp_path, {"bc": {"learning_rate": 0.1}}))


def test_non_mapping_file_fails(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_params(path)


def test_an_empty_file_is_refused(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=f"{path}: the file is empty"):
        load_params(path)


def test_a_key_given_twice_is_refused_naming_it(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("bc:\n  lr: 0.1\n  epochs: 2\n  lr: 0.5\n")
    with pytest.raises(ConfigError, match=rf"{path}: key 'lr' appears twice in one mapping \(lines 2 and 4\)"):
        load_params(path)


def test_a_cross_section_error_prints_its_message_not_the_whole_file(tmp_path):
    path = _write(tmp_path, {"method": "grpo", "policy": {"algo": "awr"}})
    with pytest.raises(ConfigError) as err:
        load_params(path)
    message = str(err.value)
    assert "policy.algo: the GRPO baseline" in message and "silently turn it into AWR" in message
    assert "got" not in message and "'env'" not in message  # not the whole parameters mapping


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"method": "qevolv"}, f"method: Value error, unknown method 'qevolv'; expected one of {methods()}"),
        (
            {"evolve": {"method": "grpo"}},
            "evolve.method: the method is now the top-level key `method` (e.g. `method: grpo`)",
        ),
    ],
)
def test_the_method_is_one_of_the_method_packages(tmp_path, raw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_params(_write(tmp_path, raw))


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"evaluate": {"splits": {"valid_seen": 2, "dev": 2}}}, "evaluate.splits: alfworld has no split(s) ['dev']"),
        ({"collect": {"split": "test"}}, "collect.split: alfworld has no split(s) ['test']"),
        (
            {"env": {"name": "textcraft"}, "policy": {"action_mode": "free"}, "experts": {"demos": {"planner": 1}}},
            "evaluate.splits: textcraft has no split(s) ['valid_seen', 'valid_unseen']",
        ),
    ],
)
def test_split_names_are_checked_against_the_environment(tmp_path, raw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_params(_write(tmp_path, raw))


def test_the_keys_a_stage_reads_are_recorded_and_checked_against_its_recipe():
    from qevolve.config import recorded_reads
    from qevolve.params import Params
    from qevolve.recipe import SETUP
    from qevolve.stages import UndeclaredParams, check_reads

    params = Params()
    with recorded_reads(params) as reads:
        _ = params.bc.lr, params.model.lora.r, params.model.device, params.evaluate.splits, params.model
    _ = params.critic.lr  # after the block: not recorded
    assert reads == {"bc.lr", "model.lora.r", "model.device", "evaluate.splits"}
    bc = next(s for s in SETUP if s.name == "bc")
    check_reads("bc", bc, reads - {"evaluate.splits"})  # bc, model.lora (a parent) and where it runs are declared
    with pytest.raises(
        UndeclaredParams, match=r"stage bc read params \['evaluate.splits'\], which its recipe does not list"
    ):
        check_reads("bc", bc, reads)
