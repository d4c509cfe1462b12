"""The benchmark's comparison points: the GRPO online baseline, Best-of-N reranking with the critic, and
the table spec."""

import json
import logging

import pytest
import torch
import yaml

from conftest import REPO
from qevolve import paths
from qevolve.config import ConfigError, ModelConfig
from qevolve.data.store import StepRecord, Trajectory
from qevolve.methods.grpo.online import group_advantages
from qevolve.models.critic import Critic
from qevolve.models.device import pad_ids
from qevolve.models.policy import BestOfN, load_policy
from qevolve.models.prompt import PromptBuilder, format_action
from qevolve.params import parse_params
from qevolve.rollout import another_round
from qevolve.stages import iteration_stages, pipeline, run_stage
from tests.test_env_pipelines import _tiny


def _traj(tid: str, task: str, rewards: list[float]) -> Trajectory:
    steps = [
        StepRecord(
            step=i,
            observation="o",
            output="Action: look",
            action="look",
            next_observation="o",
            reward=r,
            done=False,
            won=False,
            valid=True,
        )
        for i, r in enumerate(rewards)
    ]
    return Trajectory(tid, task, "t", "train", "policy@0", "do it", steps=steps)


def test_group_advantages_match_hand_computed_values():
    # task a: returns 1, 0, 0, 0 -> mean 0.25, population std sqrt(0.1875) = 0.4330
    # task b: returns 0.5 and 0.5 -> all equal, advantage 0
    trajs = [
        _traj("a1", "a", [0, 1]),
        _traj("a2", "a", [0, 0]),
        _traj("a3", "a", [0]),
        _traj("a4", "a", [0, 0, 0]),
        _traj("b1", "b", [0.5]),
        _traj("b2", "b", [0.25, 0.25]),
    ]
    adv = group_advantages(trajs)
    assert adv[("a1", 0)] == adv[("a1", 1)] == pytest.approx(0.75 / 0.4330127, rel=1e-5)
    assert adv[("a2", 1)] == adv[("a4", 2)] == pytest.approx(-0.25 / 0.4330127, rel=1e-5)
    assert adv[("b1", 0)] == adv[("b2", 1)] == 0.0
    assert len(adv) == 2 + 2 + 1 + 3 + 1 + 2


def test_grpo_stops_at_the_round_boundary_nearest_its_budget():
    # The table's seed-0 GRPO rounds: 299, 587, 884, 1181 env steps against a budget of 1189.
    assert another_round(0, 1189, 0)
    assert another_round(884, 1189, 3)  # 305 left, half a round is 147.3
    assert not another_round(1181, 1189, 4)  # 8 left: stopping is 8 short, a fifth round ~287 over
    assert another_round(1000, 1189, 4) and not another_round(1100, 1189, 4)  # 189 > 125, 89 < 137.5
    assert not another_round(1200, 1189, 4)


def test_best_of_n_takes_the_action_the_critic_values_most(tiny_base):
    cfg = ModelConfig(lora={"r": 4, "alpha": 8})
    model, tok = load_policy(tiny_base, cfg)
    critic_lm, _ = load_policy(tiny_base, cfg)
    critic = Critic(critic_lm).eval()
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.q.weight)  # heads start at zero: give Q something to tell apart
    builder = PromptBuilder(tok, 256)
    prompts = [
        builder.prompt("put some book on shelf.", ["You arrive at desk 1. On the desk 1, you see a book 1."], []),
        builder.prompt("examine the pen.", ["You are in the middle of a room."], []),
    ]
    admissible = [
        ["look", "take book 1 from desk 1", "go to shelf 2", "inventory"],
        ["go to desk 1", "look", "examine pen 2"],
    ]
    # N far above the number of candidates, from a flattened distribution (an untrained policy gives long
    # actions tiny probabilities), draws every one of them: the choice is then argmax Q over all.
    actor = BestOfN(
        model, tok, builder, critic, n=200, temperature=1e3, batch_size=3, generator=torch.Generator().manual_seed(0)
    )
    chosen = actor.act(prompts, admissible, greedy=True)
    for p, acts, d in zip(prompts, admissible, chosen):
        seqs = [p + builder.action_ids(format_action(a)) for a in acts]
        ids, attn = pad_ids(seqs, tok.pad_token_id)
        with torch.no_grad():
            q = critic(ids, attn)[1]
        best = max(range(len(acts)), key=lambda i: float(q[i, len(seqs[i]) - 1]))
        assert d.output == format_action(acts[best])
    # With N = 1 the single draw is taken whatever the critic says: the policy's own sampling.
    one = BestOfN(
        model, tok, builder, critic, n=1, temperature=1e3, batch_size=3, generator=torch.Generator().manual_seed(1)
    )
    draws = {one.act(prompts[:1], admissible[:1], greedy=True)[0].output for _ in range(40)}
    assert len(draws) > 1


def test_grpo_and_rerank_stages_run_and_update(tmp_path, monkeypatch, caplog):
    """WebShop (fast, continuous rewards): `online@1` changes the policy and spends its env-step budget;
    `rerank@1` plays the evaluation episodes with the BC policy and critic@1."""
    raw = _tiny("webshop", tmp_path)
    raw["online"] = {"env_steps": 40, "tasks_per_round": 2, "group_size": 3, "batch_size": 4}
    raw["rerank"] = {"best_of": 3}
    qevolve = parse_params(raw)
    # Near-uniform sampling, so the episodes of a group differ (some buy something) and GRPO has a signal.
    grpo = parse_params(
        {
            **raw,
            "rerank": {},
            "policy": {**raw["policy"], "temperature": 50.0},
            "method": "grpo",
            "evolve": {"iterations": 1},
        }
    )
    assert iteration_stages(qevolve) == (
        "collect",
        "relabel",
        "critic",
        "advantage",
        "policy",
        "diagnose",
        "rerank",
        "evaluate",
    )
    assert iteration_stages(grpo) == ("online", "evaluate")
    monkeypatch.chdir(tmp_path)
    metrics = {f"{stage}@{k}": run_stage(stage, qevolve, k) for stage, k in pipeline(qevolve, 1)}
    for split, m in metrics["rerank@1"].items():  # collect@1's env steps trained critic@1
        assert m["episodes"] == 2 and m["cumulative_env_steps"] == metrics["evaluate@1"][split]["cumulative_env_steps"]
    bc = {
        n: t.clone()
        for n, t in load_policy(paths.BASE, qevolve.model, adapter=paths.BC, trainable=True)[0].state_dict().items()
    }
    online = run_stage("online", grpo, 1)
    # At most 6 x 4 = 24 steps a round, so a first round leaves more than half a round of 40 to spend.
    spent, rounds = online["env_steps"], online["rounds"]
    assert rounds >= 2 and spent - 40 < 24 and 40 - spent <= spent / rounds / 2
    curve = json.loads(paths.curve("online@1").read_text())
    assert len(curve) == online["rounds"] and any(r["updated_windows"] for r in curve), curve
    updated = load_policy(paths.BASE, grpo.model, adapter=paths.policy(1), trainable=True)[0].state_dict()
    assert any(not torch.equal(updated[n], bc[n]) for n in bc if "lora" in n), "GRPO left the adapter unchanged"
    assert not (tmp_path / "models" / ".policy@1.checkpoint").exists()

    # Killed in its second round, the stage resumes from the round checkpoint to the same adapter.
    import qevolve.methods.grpo.online as online_module

    real, calls = online_module.play_in, []

    def dies_in_round_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(online_module, "play_in", dies_in_round_two)
    with pytest.raises(KeyboardInterrupt):
        run_stage("online", grpo, 1)
    assert (tmp_path / "models" / ".policy@1.checkpoint").exists()
    monkeypatch.setattr(online_module, "play_in", real)
    assert run_stage("online", grpo, 1)["rounds"] == online["rounds"]
    resumed = load_policy(paths.BASE, grpo.model, adapter=paths.policy(1), trainable=True)[0].state_dict()
    assert all(torch.equal(resumed[n], updated[n]) for n in updated)

    # A checkpoint written under other settings is not resumed: the stage starts again from round 1.
    calls.clear()
    monkeypatch.setattr(online_module, "play_in", dies_in_round_two)
    with pytest.raises(KeyboardInterrupt):
        run_stage("online", grpo, 1)
    counted = []
    monkeypatch.setattr(online_module, "play_in", lambda *a, **k: counted.append(1) or real(*a, **k))
    other = parse_params(
        {
            **raw,
            "rerank": {},
            "policy": {**raw["policy"], "temperature": 50.0},
            "method": "grpo",
            "evolve": {"iterations": 1},
            "online": {**raw["online"], "seed": 7},
        }
    )
    with caplog.at_level(logging.WARNING, logger="qevolve.methods.grpo.online"):
        assert run_stage("online", other, 1)["rounds"] == len(counted)
    assert "ignoring checkpoint" in caplog.text


@pytest.mark.parametrize("spec", sorted(p.name for p in (REPO / "benchmarks").glob("*.yaml")))
def test_every_workspace_of_every_table_spec_validates(spec):
    """A spec that runs for hours must not stop at its last workspace on a key that does not parse."""
    from flows.table_spec import load_spec, workspace_params

    table = load_spec(REPO / "benchmarks" / spec)
    for name, ws in table.workspaces.items():
        workspace_params(table, name, table.seeds[ws.seeds - 1], 100 if ws.match_env_steps else None)


def test_table_spec_errors_name_the_field(tmp_path):
    from flows.table_spec import first_seeds, load_spec, workspace_params

    spec = yaml.safe_load((REPO / "benchmarks" / "table-smoke.yaml").read_text())
    assert load_spec(REPO / "benchmarks" / "table-smoke.yaml").name == "smoke"
    full = load_spec(REPO / "benchmarks" / "table.yaml")
    one = first_seeds(full, 1)
    assert one.seeds == full.seeds[:1] and {ws.seeds for ws in one.workspaces.values()} == {1}
    assert max(ws.seeds for ws in full.workspaces.values()) > 1  # the cut changed something
    with pytest.raises(ConfigError, match="--seeds: expected at least 1, got 0"):
        first_seeds(full, 0)
    cases = [
        (
            {"rows": [{"name": "x", "workspace": "nope", "stage": "evaluate@0"}]},
            "rows.0.workspace: unknown workspace 'nope'",
        ),
        ({"rows": [{"name": "x", "workspace": "qevolve", "stage": "evaluate@3"}]}, "rows.0.stage"),
        (
            {"workspaces": {"grpo": {**spec["workspaces"]["grpo"], "match_env_steps": "later"}}},
            "workspaces.grpo.match_env_steps",
        ),
    ]
    for change, message in cases:
        path = tmp_path / "spec.yaml"
        path.write_text(yaml.safe_dump({**spec, **change}, sort_keys=False))
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            load_spec(path)
    path.write_text(yaml.safe_dump({**spec, "set": {"bc.epochs": -1}}, sort_keys=False))
    with pytest.raises(ConfigError, match="bc.epochs"):
        workspace_params(load_spec(path), "qevolve", 0, None)


def test_auc_matches_hand_computed_values():
    from benchmarks.diagnose import auc

    # pairs: 0.9>0.4, 0.9>0.1, 0.4=0.4 (half), 0.4>0.1 -> 3.5 of 4
    assert auc([0.9, 0.4], [0.4, 0.1]) == 0.875
    assert auc([0.1], [0.2, 0.3]) == 0.0
    assert auc([], [0.1]) != auc([], [0.1])  # NaN: no positives
