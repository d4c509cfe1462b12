"""Every stage of an evolution runs on TextCraft and WebShop from their shipped profiles (tiny sizes).

ScienceWorld's whole pipeline is not in the test tiers: a JVM per worker per stage makes it minutes long.
Its environment, gold paths and splits are tested in test_envs.py, and its quickstart run is in
docs/environments.md. ALFWorld's is the end-to-end flow test in test_pipeline.py."""

import pytest
import yaml

from conftest import REPO
from qevolve import paths
from qevolve.config import ENVIRONMENTS
from qevolve.data.store import read_store
from qevolve.envs.webshop_data import write_synthetic
from qevolve.params import load_params, parse_params, resolve_params
from qevolve.stages import pipeline, run_stage

TINY_MODEL = {
    "embedded": {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab_size": 400},
    "context_tokens": 384,
    "lora": {"r": 8, "alpha": 16},
}


def test_every_profile_validates_and_the_alfworld_profile_is_params_yaml():
    for name in ENVIRONMENTS:
        assert load_params(REPO / "profiles" / f"{name}.yaml").env.name == name
    assert resolve_params(REPO / "profiles" / "alfworld.yaml") == yaml.safe_load((REPO / "params.yaml").read_text())


def _tiny(profile: str, tmp_path) -> dict:
    raw = resolve_params(REPO / "profiles" / f"{profile}.yaml")
    expert = next(iter(raw["experts"]["demos"]))
    raw["env"].update(max_steps=4)
    raw["experts"].update(demos={expert: 6})
    raw["model"].update(TINY_MODEL)
    raw["policy"].update(max_new_tokens=12, epochs=1, batch_size=4)
    raw["bc"].update(epochs=1, batch_size=4, micro_batch_size=4)
    raw["critic"].update(epochs=1, batch_size=4)
    raw["collect"].update(num_tasks=2, samples_per_task=2, batch_size=2)
    raw["evaluate"].update(splits={split: 2 for split in raw["evaluate"]["splits"]}, batch_size=2)
    raw["evolve"] = {"iterations": 1}
    if profile == "webshop":
        write_synthetic(tmp_path / "shop", products=40)
        raw["env"]["data_dir"] = str(tmp_path / "shop")
    return raw


def _run_everything(profile, tmp_path, monkeypatch):
    params = parse_params(_tiny(profile, tmp_path))
    monkeypatch.chdir(tmp_path)
    metrics = {f"{s}@{k}" if k is not None else s: run_stage(s, params, k) for s, k in pipeline(params, 1)}
    assert metrics["experts"]["success_rate"] == 1.0 and metrics["experts"]["env_failures"] == 0
    assert (
        metrics["experts"]["failures"] == {} and paths.details("experts").exists()
    )  # per-task details beside, not in, the metrics
    assert metrics["bc"]["loss"] < metrics["bc"]["first_loss"]
    hybrid = read_store(paths.hybrid(1))
    assert {t.source for t in hybrid} == {"expert", "policy@0"}
    for k in (0, 1):
        for split, m in metrics[f"evaluate@{k}"].items():
            assert m["episodes"] == 2 and m["env_failures"] == 0 and 1 <= m["avg_steps"] <= 4, (k, split)


@pytest.mark.parametrize("profile", ["textcraft", "webshop"])
def test_every_stage_runs_on_the_environment(profile, tmp_path, monkeypatch):
    _run_everything(profile, tmp_path, monkeypatch)
