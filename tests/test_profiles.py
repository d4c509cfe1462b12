"""Profiles are overlays on params.yaml (`qevolve.params.resolve_params`): what they merge and replace, what a
workspace records, and that each shipped profile lists only what differs."""

import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from qevolve.config import ConfigError
from qevolve.params import find_profile, load_params, overlay, params_model, resolve_params, section_model


def test_a_section_merges_key_by_key_and_a_value_replaces_whole():
    base = {
        "env": {"name": "alfworld", "max_steps": 15},
        "experts": {"split": "train", "demos": {"walkthrough": 40, "handcoded": 10}},
        "model": {"base": "embedded", "lora": {"r": 64, "alpha": 128}},
        "evaluate": {"splits": {"valid_seen": 10, "valid_unseen": 10}},
    }
    changes = {
        "env": {"name": "textcraft"},
        "experts": {"demos": {"planner": 300}},
        "model": {"lora": {"r": 16}},
        "evaluate": {"splits": {"test": 0}},
        "method": "multi2",
    }
    before = yaml.safe_dump(base)
    assert overlay(base, changes) == {
        "env": {"name": "textcraft", "max_steps": 15},  # a section: its other keys stay
        "experts": {"split": "train", "demos": {"planner": 300}},  # a mapping that is a value: replaced, not merged
        "model": {"base": "embedded", "lora": {"r": 16, "alpha": 128}},  # a section inside a section: merged too
        "evaluate": {"splits": {"test": 0}},
        "method": "multi2",
    }
    assert yaml.safe_dump(base) == before  # the base is not changed
    # A method's own sections are sections too (`step_hrl.critic` merges into `step_hrl`).
    assert overlay({"step_hrl": {"critic": {"lr": 1e-4, "epochs": 3}}}, {"step_hrl": {"critic": {"lr": 5e-4}}}) == {
        "step_hrl": {"critic": {"lr": 5e-4, "epochs": 3}}
    }
    # A key the schema does not know replaces (validation then names it).
    assert overlay({"env": {"name": "alfworld"}}, {"nosuch": {"a": 1}}) == {
        "env": {"name": "alfworld"},
        "nosuch": {"a": 1},
    }


def _checkout(tmp_path, profile: str) -> None:
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "p.yaml").write_text(profile)


def test_a_profile_resolves_over_its_checkouts_params_yaml_and_bad_ones_name_their_file(tmp_path):
    _checkout(tmp_path, "# nothing changed\n")
    assert resolve_params(tmp_path / "profiles" / "p.yaml") == yaml.safe_load((REPO / "params.yaml").read_text())
    (tmp_path / "params.yaml").write_text(
        (REPO / "params.yaml").read_text().replace("max_steps: 15", "max_steps: 9", 1)
    )
    assert load_params(tmp_path / "profiles" / "p.yaml").env.max_steps == 9  # a new default reaches every profile
    (tmp_path / "profiles" / "p.yaml").write_text("bc:\n  lr: 1\n  lr: 2\n")
    with pytest.raises(ConfigError, match=r"p.yaml: key 'lr' appears twice"):
        resolve_params(tmp_path / "profiles" / "p.yaml")
    (tmp_path / "profiles" / "p.yaml").write_text("bc:\n  nosuch: 1\n")
    with pytest.raises(ConfigError, match=r"p.yaml: invalid parameters\n  bc.nosuch: unknown key"):
        load_params(tmp_path / "profiles" / "p.yaml")
    (tmp_path / "profiles" / "p.yaml").write_text("- a list\n")
    with pytest.raises(ConfigError, match="p.yaml: expected a mapping of sections"):
        resolve_params(tmp_path / "profiles" / "p.yaml")
    with pytest.raises(ConfigError, match=r"profile 'q': no .*q.yaml; expected one of \['p'\]"):
        find_profile(tmp_path, "q")
    (tmp_path / "profiles" / "p.yaml").write_text("bc:\n  lr: 0.1\n")
    (tmp_path / "params.yaml").unlink()
    with pytest.raises(ConfigError, match="lists what differs from the checkout's params.yaml, and there is no"):
        resolve_params(tmp_path / "profiles" / "p.yaml")


def test_each_shipped_profile_lists_only_what_differs_from_params_yaml():
    base = yaml.safe_load((REPO / "params.yaml").read_text())

    def same(b, p, model, where=""):
        found = []
        for key, value in p.items():
            section = section_model(model, key)
            if section is not None and isinstance(value, dict) and isinstance(b.get(key), dict):
                found += same(b[key], value, section, f"{where}{key}.")
            elif key in b and b[key] == value:
                found.append(where + key)
        return found

    profiles = sorted((REPO / "profiles").glob("*.yaml"))
    assert len(profiles) >= 9
    for path in profiles:
        assert same(base, yaml.safe_load(path.read_text()) or {}, params_model()) == [], path.name


def test_qevolve_profile_prints_the_resolved_parameters():
    out = subprocess.run(
        [sys.executable, "-m", "qevolve.cli", "profile", "textcraft", "--root", str(REPO)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert yaml.safe_load(out) == resolve_params(REPO / "profiles" / "textcraft.yaml")
    assert "max_steps: 30" in out and "context_tokens: 640" in out  # its own value and one params.yaml gives it
    bad = subprocess.run(
        [sys.executable, "-m", "qevolve.cli", "profile", "../params", "--root", str(REPO)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "is not a plain name" in bad.stderr
