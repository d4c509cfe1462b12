"""Multi²: the executor's segment context, GLIDER's rewards, the critic's A(o, â), the anchored actor, and the
recipe end to end on TextCraft."""

import pytest
import torch

from qevolve import paths
from qevolve.config import ConfigError
from qevolve.data.store import StepRecord, Trajectory
from qevolve.hierarchy.annotators import Label
from qevolve.hierarchy.roles import FINISHED, RolePrompts, transitions
from qevolve.hierarchy.transitions import read_transitions
from qevolve.models.policy import load_policy
from qevolve.params import parse_params
from qevolve.rollout import episode_metrics
from qevolve.stages import iteration_stages, pipeline, run_stage
from tests.test_env_pipelines import _tiny

ONLINE = {
    "env_steps": 8,
    "episodes_per_round": 2,
    "updates_per_round": 2,
    "batch_size": 4,
    "lr": 1e-3,
    "critic_lr": 1e-3,
}


def _traj(actions, valid=None) -> Trajectory:
    valid = valid or [True] * len(actions)
    steps = [
        StepRecord(
            step=i,
            observation=f"obs {i}",
            output=f"Action: {a}",
            action=a,
            next_observation=f"obs {i + 1}",
            reward=1.0 if i == len(actions) - 1 else 0.0,
            done=i == len(actions) - 1,
            won=i == len(actions) - 1,
            valid=v,
        )
        for i, (a, v) in enumerate(zip(actions, valid))
    ]
    return Trajectory("t1", "goal", "depth2", "train", "expert", "craft a stick.", won=True, steps=steps)


def test_the_executor_reads_its_subgoals_turns_and_gets_glider_rewards():
    t = _traj(
        ["get 1 oak log", "craft 4 oak planks using 1 oak log", "look", "craft 4 stick using 2 oak planks"],
        valid=[True, True, False, True],
    )
    labels = [
        Label(0, "craft 4 oak planks", "p", False),
        Label(0, "craft 4 oak planks", "p", True),
        Label(1, "craft 4 stick", "p", False),
        Label(1, "craft 4 stick", "p", True),
    ]
    sets = transitions(t, labels, RolePrompts("textcraft", progress=False, history=True), rejected_penalty=0.0)
    low = sets["low"]
    assert not sets["progress"] and [x.reward for x in low] == [
        0.0,
        1.0,
        0.0,
        1.0,
    ]  # 1 at each subgoal's end, no rejection penalty
    assert [x.done for x in low] == [False, True, False, True] and low[3].next_state_text == FINISHED
    # the second step reads the first step's turn; a new subgoal starts with no turns
    assert "Observation: obs 0\nAction: get 1 oak log\nCurrent observation: obs 1" in low[1].state_text
    assert "Observation:" not in low[2].state_text and "Local progress" not in low[2].state_text
    assert "Observation: obs 2\nAction: look\nCurrent observation: obs 3" in low[3].state_text
    assert low[0].next_state_text == low[1].state_text  # the next state carries the turn just taken
    # STEP-HRL's prompts (no history) and its rewards (-1 for the rejected `look`) from the same labels
    step = transitions(t, labels, RolePrompts("textcraft", progress=False))["low"]
    assert "Observation:" not in step[1].state_text and [x.reward for x in step] == [0.0, 1.0, -1.0, 1.0]


def test_repeated_actions_and_successes_by_type_are_counted():
    a, b = _traj(["get 1 oak log", "get 1 oak log", "craft 4 oak planks using 1 oak log"]), _traj(["look"])
    b.task_type, b.won = "depth3", False
    m = episode_metrics([a, b])
    assert m["repeated_rate"] == pytest.approx(1 / 4) and m["by_type"] == {
        "depth2": {"episodes": 1, "won": 1},
        "depth3": {"episodes": 1, "won": 0},
    }


def test_multi2_settings_default_to_the_paper_and_are_checked():
    params = parse_params({"method": "multi2"})
    cfg = params.multi2
    assert (cfg.adapters, cfg.progress, cfg.history, cfg.high_mode, cfg.max_subtask_steps, cfg.rejected_penalty) == (
        "separate",
        False,
        True,
        "free",
        32,
        0.0,
    )
    assert (cfg.policy.beta, cfg.policy.max_weight, cfg.policy.lam, cfg.critic.gamma, cfg.critic.expectile) == (
        10.0,
        20.0,
        7.0,
        0.99,
        0.7,
    )
    with pytest.raises(ConfigError, match="multi2.llm_url: annotator `llm` needs the http"):
        parse_params({"method": "multi2", "multi2": {"annotator": "llm", "llm_url": "localhost:8000"}})
    with pytest.raises(ConfigError, match=r"multi2.adapters: the online phase .* `shared` gives it none"):
        parse_params({"method": "multi2", "multi2": {"adapters": "shared"}, "evolve": {"iterations": 2}})
    with pytest.raises(ConfigError, match=r"multi2.policy.lamb"):
        parse_params({"method": "multi2", "multi2": {"policy": {"lamb": 1.0}}})


def test_the_critic_scores_a_state_action_pair_as_q_minus_v():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qevolve.hierarchy.critic import LevelCritic, advantages_of
    from qevolve.models.base import causal_lm

    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=40,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    critic = LevelCritic(lm, frozen=True, levels=("low",))
    for head in (critic.v["low"], critic.q["low"]):
        torch.nn.init.normal_(head.weight)
    prompts, outputs = [[1, 2, 3], [4, 5]], [[6], [7, 8, 9]]
    adv = advantages_of(critic, "low", prompts, outputs, pad_id=0)
    for b, (p, o) in enumerate(zip(prompts, outputs)):
        h = causal_lm(lm).base_model(input_ids=torch.tensor([p + o])).last_hidden_state[0]
        expected = critic.q["low"](h[len(p) + len(o) - 1]) - critic.v["low"](h[len(p) - 1])
        assert torch.allclose(adv[b], expected.squeeze(), atol=1e-5)


def test_multi2_recipe_runs_end_to_end_on_textcraft(tmp_path, monkeypatch):
    raw = _tiny("textcraft", tmp_path)
    raw["method"] = "multi2"
    raw["multi2"] = {
        "critic": {"epochs": 1, "batch_size": 4},
        "policy": {"epochs": 2, "batch_size": 4, "lr": 1e-3},
        "online": ONLINE,
    }
    raw["evolve"] = {"iterations": 2}
    params = parse_params(raw)
    assert iteration_stages(params, 1) == ("collect", "critic", "policy", "diagnose", "evaluate")
    assert iteration_stages(params, 2) == ("online", "diagnose", "evaluate")
    assert [f"{s}@{k}" if k is not None else s for s, k in pipeline(params, 2)] == [
        "experts",
        "base",
        "annotate",
        "bc",
        "evaluate@0",
        "collect@1",
        "critic@1",
        "policy@1",
        "diagnose@1",
        "evaluate@1",
        "online@2",
        "diagnose@2",
        "evaluate@2",
    ]
    monkeypatch.chdir(tmp_path)
    metrics = {f"{s}@{k}" if k is not None else s: run_stage(s, params, k) for s, k in pipeline(params, 2)}
    assert (
        metrics["annotate"]["progress_transitions"] == 0
        and metrics["annotate"]["low_transitions"] == metrics["experts"]["cumulative_env_steps"]
    )
    assert metrics["bc"]["loss"] < metrics["bc"]["first_loss"] and metrics["bc"]["adapters"] == "separate"
    assert metrics["critic@1"]["q_loss"] > 0 and "high_v_mean" not in metrics["critic@1"], (
        "Multi² trains System 2's critic only"
    )
    # `reward: outcome`: one rewarded step per won episode (every demonstration won) instead of one per subgoal
    low = (
        read_transitions(tmp_path / "data" / "annotate")["low"]
        + read_transitions(tmp_path / "data" / "collect@1" / "transitions")["low"]
    )
    won = {r["trajectory_id"] for r in low if r["won"]}
    outcome = run_stage("critic", parse_params({**raw, "multi2": {**raw["multi2"], "reward": "outcome"}}), 1)
    assert (
        metrics["critic@1"]["low_rewarded_share"] == sum(r["reward"] > 0 for r in low) / len(low) > len(won) / len(low)
    )
    assert outcome["low_rewarded_share"] == len(won) / len(low) and outcome["reward"] == "outcome"
    run_stage("critic", params, 1)  # the subgoal critic back for the stages after
    p = metrics["policy@1"]
    assert p["logp"] > p["first_logp"] and p["anchored"] != 0 and 0 <= p["sampled_parsed"] <= 1
    names = ("high", "low")
    assert sorted(f.name for f in (tmp_path / paths.BC).iterdir() if f.is_dir()) == list(names)  # no progress adapter
    bc = load_policy(paths.BASE, params.model, adapter=paths.BC, trainable=True, names=names)[0].state_dict()
    updated = load_policy(paths.BASE, params.model, adapter=paths.policy(1), trainable=True, names=names)[
        0
    ].state_dict()
    changed = {name for name in names if any(not torch.equal(updated[n], bc[n]) for n in bc if f".{name}." in n)}
    assert changed == {"low"}, "policy@1 trains System 2 only; System 1 stays as cloned"
    for k in (1, 2):  # on evaluate@(k-1)'s calls: System 2 moved, System 1 (the same weights) did not, to the bit
        held = metrics[f"diagnose@{k}"]
        assert (
            held["low_kl_previous_new"] > 0
            and held["high_kl_previous_new"] == 0.0
            and held["high_kl_tokens"] > 0
            and held["no_op"] == 0
        )
    # online@2: the buffer starts with the won expert segments and keeps the new ones worth keeping; only System 2 moves
    o = metrics["online@2"]
    assert (
        o["rounds"] >= 1
        and o["env_steps"] >= ONLINE["env_steps"] // 2
        and o["kl"] >= 0
        and o["buffer_segments"] >= metrics["annotate"]["high_transitions"]
    )
    assert (
        metrics["evaluate@2"]["test"]["cumulative_env_steps"]
        == metrics["collect@1"]["cumulative_env_steps"] + o["env_steps"]
    )
    online = load_policy(paths.BASE, params.model, adapter=paths.policy(2), trainable=True, names=names)[0].state_dict()
    assert {
        name for name in names if any(not torch.equal(online[n], updated[n]) for n in updated if f".{name}." in n)
    } == {"low"}
    assert len(read_transitions(tmp_path / "data" / "online@2")["low"]) >= len(
        read_transitions(tmp_path / "data" / "annotate")["low"]
    )  # every demo won
    for k in (0, 1, 2):
        m = metrics[f"evaluate@{k}"]["test"]
        assert m["episodes"] == 2 and m["high_tokens_per_episode"] > 0 and m["progress_tokens_per_episode"] == 0
        assert sum(v["episodes"] for v in m["by_type"].values()) == 2 and 0 <= m["repeated_rate"] <= 1

    # A cut critic heads file names the file and the stage that wrote it; the policy already written stays.
    import shutil

    written = (tmp_path / paths.policy(1) / "low" / "adapter_model.safetensors").read_bytes()
    (tmp_path / paths.critic(1) / "heads.safetensors").write_bytes(b"cut")
    with pytest.raises(
        Exception, match=r"models/critic@1/heads.safetensors: cannot load the critic's heads .* stage `critic@1`"
    ):
        run_stage("policy", params, 1)
    assert (tmp_path / paths.policy(1) / "low" / "adapter_model.safetensors").read_bytes() == written
    # System 1's adapter missing: the error names its folder and the stage that wrote it.
    shutil.rmtree(tmp_path / paths.BC / "high")
    with pytest.raises(Exception, match=r"models/bc/high: cannot load the LoRA adapter .* stage `bc`"):
        run_stage("evaluate", params, 0)


def test_a_killed_multi2_actor_resumes_to_the_same_adapter(tmp_path, monkeypatch):
    import qevolve.methods.multi2.policy as policy_module

    raw = _tiny("textcraft", tmp_path)
    raw.update(
        method="multi2",
        multi2={
            "critic": {"epochs": 1, "batch_size": 4},
            "policy": {"epochs": 2, "batch_size": 4, "checkpoint_every": 1},
        },
    )
    params = parse_params(raw)
    monkeypatch.chdir(tmp_path)
    for stage, k in pipeline(params, 1)[:7]:  # up to critic@1
        run_stage(stage, params, k)
    run_stage("policy", params, 1)
    adapter = (tmp_path / paths.policy(1) / "low" / "adapter_model.safetensors").read_bytes()
    real, calls = policy_module.anchored_step, []

    def dies_at_step_three(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(policy_module, "anchored_step", dies_at_step_three)
    with pytest.raises(KeyboardInterrupt):
        run_stage("policy", params, 1)
    assert (tmp_path / "models" / ".policy@1.checkpoint").exists()
    monkeypatch.setattr(policy_module, "anchored_step", real)
    run_stage("policy", params, 1)
    assert (tmp_path / paths.policy(1) / "low" / "adapter_model.safetensors").read_bytes() == adapter, (
        "the resumed actor sampled or stepped differently"
    )


def test_a_killed_online_phase_resumes_to_the_same_adapter_critic_and_buffer(tmp_path, monkeypatch):
    import qevolve.methods.multi2.online as online_module

    raw = _tiny("textcraft", tmp_path)
    raw.update(
        method="multi2",
        evolve={"iterations": 2},
        multi2={
            "critic": {"epochs": 1, "batch_size": 4},
            "policy": {"epochs": 1, "batch_size": 4},
            "online": {**ONLINE, "env_steps": 16},
        },
    )
    params = parse_params(raw)
    monkeypatch.chdir(tmp_path)
    for stage, k in pipeline(params, 2)[:9]:  # up to evaluate@1
        run_stage(stage, params, k)
    outputs = (paths.policy(2) / "low" / "adapter_model.safetensors", paths.critic(2) / "heads.safetensors")

    def buffer():  # episodes get fresh ids when played again; everything else must be the same
        return [
            {k: v for k, v in r.items() if k != "trajectory_id"}
            for r in read_transitions(tmp_path / "data" / "online@2")["low"]
        ]

    first = run_stage("online", params, 2)
    assert first["rounds"] >= 2, "the test needs a kill between rounds"
    done, segments = {p: (tmp_path / p).read_bytes() for p in outputs}, buffer()
    real, calls = online_module.update, []

    def dies_in_round_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == ONLINE["updates_per_round"] + 1:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(online_module, "update", dies_in_round_two)
    with pytest.raises(KeyboardInterrupt):
        run_stage("online", params, 2)
    assert (tmp_path / "models" / ".policy@2.checkpoint").exists()
    monkeypatch.setattr(online_module, "update", real)
    again = run_stage("online", params, 2)
    assert {p: (tmp_path / p).read_bytes() for p in outputs} == done, (
        "the resumed online phase differs from the uninterrupted one"
    )
    assert buffer() == segments
    assert again["env_steps"] == first["env_steps"] and again["kept_segments"] == first["kept_segments"]


def test_the_replay_buffer_keeps_what_the_paper_keeps_and_a_corrupt_one_names_its_file(tmp_path):
    import random

    from qevolve.data.store import SchemaError
    from qevolve.hierarchy.transitions import write_transitions
    from qevolve.methods.multi2.online import load_buffer, push

    won = [{"reward": 0.0}, {"reward": 1.0}]
    failed = [{"reward": 0.0}, {"reward": 0.0}]
    buffer = [[{"reward": 1.0}]]
    assert push(buffer, [won, failed], size=10, keep_fail=0.0, rng=random.Random(0)) == 1 and buffer[-1] is won
    assert push(buffer, [failed], size=10, keep_fail=1.0, rng=random.Random(0)) == 1 and buffer[-1] is failed
    push(buffer, [won] * 9, size=10, keep_fail=0.0, rng=random.Random(0))
    assert len(buffer) == 10 and buffer[0] is failed, "the two oldest segments left first"
    # a buffer of an earlier iteration that lost a column
    t = transitions(
        _traj(["get 1 oak log", "craft 4 oak planks using 1 oak log"]),
        [Label(0, "craft 4 oak planks", "p", False), Label(0, "craft 4 oak planks", "p", True)],
        RolePrompts("textcraft"),
    )
    write_transitions(tmp_path / "online@2", {"low": t["low"]}, len)
    assert [len(seg) for seg in load_buffer(tmp_path / "online@2", 3, 10)] == [2]
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "online@2" / "low.parquet")
    pq.write_table(
        table.drop(["reward"]).replace_schema_metadata(table.schema.metadata), tmp_path / "online@2" / "low.parquet"
    )
    with pytest.raises(SchemaError, match=r"online@2/low.parquet: missing column 'reward'"):
        load_buffer(tmp_path / "online@2", 3, 10)


def test_outcome_rewards_mark_only_a_won_episodes_end_and_the_buffer_keeps_its_every_segment():
    import random

    from qevolve.hierarchy.shared import outcome_rewards, with_rewards
    from qevolve.methods.multi2.online import push, succeeded

    def row(traj, step, reward, won):
        return {
            "trajectory_id": traj,
            "step": step,
            "reward": reward,
            "won": won,
            "done": reward == 1.0,
            "subtask_index": step // 2,
        }

    # subgoal rewards as stored: +1 where the policy declared a subtask done, -0.5 at a rejected step
    won = [row("w", 0, 0.0, True), row("w", 1, 1.0, True), row("w", 2, -0.5, True), row("w", 3, 1.0, True)]
    lost = [row("l", 1, 1.0, False), row("l", 0, 0.0, False), row("l", 2, 0.0, False)]
    got = outcome_rewards(won + lost)
    assert [(r["reward"], r["done"]) for r in got] == [
        (0.0, False),
        (0.0, False),
        (-0.5, False),
        (1.0, True),
        (0.0, False),
        (0.0, False),
        (0.0, True),
    ]
    sets = {"high": won, "low": won, "progress": won}
    assert with_rewards(sets, "subgoal") == sets
    assert with_rewards(sets, "outcome")["high"] is won and with_rewards(sets, "outcome")["progress"] == got[:4]
    # under `outcome` the won episode's first segment (return 0) is a success, the lost one's (return 1) is not
    first_won, first_lost = got[:2], got[4:6]
    assert succeeded(first_won, True) and not succeeded(first_lost, True)
    assert not succeeded(first_won) and succeeded(won[:2])
    buffer: list = []
    assert push(
        buffer, [first_won, first_lost], size=10, keep_fail=0.0, rng=random.Random(0), outcome=True
    ) == 1 and buffer == [first_won]


def test_the_miniature_spec_validates_and_its_table_counts_successes_by_depth():
    from conftest import REPO
    from flows.table_report import markdown
    from flows.table_spec import load_spec, workspace_params

    spec = load_spec(REPO / "benchmarks" / "multi2.yaml")
    every = {
        name: workspace_params(spec, name, spec.seeds[-1], 100 if ws.match_env_steps else None)
        for name, ws in spec.workspaces.items()
    }
    params = every["multi2"]
    assert (
        params["method"] == "multi2"
        and params["multi2"]["online"]["env_steps"] == 100
        and params["multi2"]["critic"]["seed"] == 2
    )
    assert params["multi2"]["online"]["seed"] == 201, "the online phase's episodes differ by seed too"
    assert params["multi2"]["high_mode"] == "observed" and every["free"]["multi2"]["high_mode"] == "free"
    assert (
        every["free"]["bc"] == params["bc"] and every["free"]["model"] == params["model"]
    )  # the same SFT, from the run cache
    assert every["compat"]["multi2"]["repo_compat"] is True and not params["multi2"].get("repo_compat")
    assert (
        every["compat"]["bc"] == params["bc"] and every["compat"]["collect"] == params["collect"]
    )  # the same SFT and data
    seeds = [
        {
            "test/by_type": {"depth2": {"episodes": 4, "won": 3}, "depth3": {"episodes": 2, "won": 0}},
            "test/high_tokens_per_episode": 100.0,
            "test/low_tokens_per_episode": 300.0,
            "test/subtasks_per_episode": 2.0,
            "test/invalid_rate": 0.1,
            "test/repeated_rate": 0.0,
            "critic_auc": 0.625,
        },
        {
            "test/by_type": {"depth2": {"episodes": 4, "won": 1}, "depth3": {"episodes": 2, "won": 1}},
            "test/high_tokens_per_episode": 120.0,
            "test/low_tokens_per_episode": 280.0,
            "test/subtasks_per_episode": 3.0,
            "test/invalid_rate": 0.3,
            "test/repeated_rate": 0.5,
        },
    ]
    line = markdown([{"row": "Multi²", "seeds": seeds}], "test").splitlines()[2]
    # Without per-task outcomes each episode counts alone: depth2 4 of 8, Wilson: z²/n = 0.48018, centre 0.5, half-width
    # 1.96·√(0.03125 + 0.015006) / 1.48018 = 0.28479; depth3 1 of 4: centre 0.37247, half-width 0.32689; all: 5 of 12
    assert (
        "| 50.0 [21.5, 78.5] (4/8) | 25.0 [4.6, 69.9] (1/4) | 41.7 [19.3, 68.0] (5/12) |  | 0 | 110 ± 14 / 290 ± "
        "14 | 2.50 ± 0.71 | 20.0 ± 14.1 | 25.0 ± 35.4 |" in line
    )
    assert line.endswith("| 25.0 ± 35.4 | 0.62 / n/a |"), "each seed's held-out AUC, n/a where it has none"
    seeds[0]["critic_auc"] = None  # diagnosed, but no held-out episode won
    assert markdown([{"row": "Multi²", "seeds": seeds}], "test").splitlines()[2].endswith("| n/a / n/a |")


def test_the_ablation_spec_trains_each_role_choice_and_the_kl_anchor_on_the_miniatures_settings():
    from conftest import REPO
    from flows.table_spec import load_spec, workspace_params

    spec = load_spec(REPO / "benchmarks" / "multi2-ablations.yaml")
    every = {name: workspace_params(spec, name, spec.seeds[ws.seeds - 1], None) for name, ws in spec.workspaces.items()}
    assert {n: tuple(parse_params(p).multi2.rl_roles) for n, p in every.items()} == {
        "system2": ("low",),
        "swapped": ("high",),
        "both": ("high", "low"),
        "kl": ("low",),
        "no-kl": ("low",),
    }
    assert (parse_params(every["kl"]).multi2.online.eta, parse_params(every["no-kl"]).multi2.online.eta) == (0.02, 0.0)
    # The KL row is the miniature's Multi² row at its measured budget, to the params.yaml DVC reads, so run in
    # that table's folder its stages come from DVC's run cache.
    mini = load_spec(REPO / "benchmarks" / "multi2.yaml")
    for seed in mini.seeds:
        assert workspace_params(spec, "kl", seed, None) == workspace_params(mini, "multi2", seed, 942)
    # The role rows' seed is one the miniature ran, and System 2's RL row is its offline one (one iteration).
    seed = spec.seeds[0]
    assert seed in mini.seeds
    assert workspace_params(spec, "system2", seed, None) == {
        **workspace_params(mini, "multi2", seed, 942),
        "evolve": {"iterations": 1},
    }


def test_a_tables_seeds_run_apart_and_their_results_join_into_one_table(tmp_path):
    import json

    from conftest import REPO
    from flows.table import main
    from flows.table_report import merge
    from flows.table_spec import budget, load_spec, only_seeds, only_workspaces

    spec = load_spec(REPO / "benchmarks" / "multi2.yaml")
    one = only_seeds(spec, [1])
    assert one.seeds == [1] and {n: ws.seeds for n, ws in one.workspaces.items()} == {
        "flat": 1,
        "multi2": 1,
        "balanced": 1,
    }, "Q-Evolve, free and compat run seed 0 only"
    assert {r.workspace for r in one.rows} == {"flat", "multi2", "balanced"}
    assert {n: ws.seeds for n, ws in only_seeds(spec, [0, 2]).workspaces.items()} == {
        "flat": 2,
        "qevolve": 1,
        "multi2": 2,
        "balanced": 2,
        "free": 1,
        "compat": 1,
    }
    with pytest.raises(ConfigError, match=r"--seed: \[7\] not among the spec's seeds \[0, 1, 2\]"):
        only_seeds(spec, [7])
    with pytest.raises(
        ConfigError,
        match=r"workspaces.multi2.match_env_steps: qevolve's first seed has not run in .*pass --env-steps N",
    ):
        budget(spec, "multi2", tmp_path, None)
    assert budget(spec, "multi2", tmp_path, 1234) == 1234 and budget(spec, "flat", tmp_path, 1234) is None
    rest = only_workspaces(only_seeds(spec, [0]), ["multi2", "free"])
    assert list(rest.workspaces) == ["multi2", "free"] and [r.workspace for r in rest.rows] == [
        "multi2",
        "free",
        "multi2",
        "multi2",
    ]
    with pytest.raises(ConfigError, match=r"--workspace: \['nosuch'\] not among the spec's workspaces"):
        only_workspaces(spec, ["nosuch"])

    def seed(k, won):
        return {
            "seed": k,
            "workspace": f"flat-s{k}",
            "test/by_type": {"depth2": {"episodes": 4, "won": won}},
            "test/tokens_per_episode": 900.0,
            "test/invalid_rate": 0.1,
            "test/repeated_rate": 0.0,
        }

    files = []
    for k, won in ((0, 1), (1, 3)):
        rows = [{"row": "flat BC", "workspace": "flat", "stage": "evaluate@0", "seeds": [seed(k, won)]}]
        files.append(tmp_path / f"s{k}.json")
        files[-1].write_text(
            json.dumps({"spec": {"name": spec.name}, "rows": rows, "git_commit": "c0", "wall_s": 10.0 + k})
        )
    rows, sources = merge(spec, files[::-1])
    assert (
        [s["seed"] for s in rows[0]["seeds"]] == [0, 1]
        and [s["wall_s"] for s in sources] == [11.0, 10.0]
        and len(rows) == 1
    )
    other_code = tmp_path / "s1-c1.json"
    other_code.write_text(files[1].read_text().replace('"c0"', '"c1"'))
    with pytest.raises(
        ConfigError,
        match=r"s1-c1.json: git_commit/packages_sha256: its runs' code differs .*\['c0', 'c1'\].*--mixed-code",
    ):
        merge(spec, [files[0], other_code])
    assert (
        main(
            [
                str(REPO / "benchmarks" / "multi2.yaml"),
                "--merge",
                str(files[0]),
                str(other_code),
                "--out",
                str(tmp_path / "mixed"),
            ]
        )
        == 2
    )
    assert (
        main(
            [
                str(REPO / "benchmarks" / "multi2.yaml"),
                "--merge",
                str(files[0]),
                str(other_code),
                "--mixed-code",
                "--out",
                str(tmp_path / "mixed"),
            ]
        )
        == 0
    )
    assert (
        "**Joined from runs of different code** (`--mixed-code`): commits c0, c1"
        in (tmp_path / "mixed" / "table.md").read_text()
    )
    again, _ = merge(spec, [files[0], files[0]])
    assert again[0]["seeds"] == [seed(0, 1)], "a seed given twice with the same figures is kept once"
    files.append(tmp_path / "s0-other.json")
    files[-1].write_text(
        json.dumps({"spec": {"name": spec.name}, "rows": [{**rows[0], "seeds": [seed(0, 2)]}], "git_commit": "c0"})
    )
    with pytest.raises(
        ConfigError,
        match=r"s0-other.json: rows: row 'flat BC' has seed\(s\) \[0\] that an earlier file gave with other figures",
    ):
        merge(spec, [files[0], files[2]])
    kept, sources = merge(spec, [files[0], files[2]], replace=True)
    assert (
        kept[0]["seeds"] == [seed(0, 2)]
        and sources[1]["replaced"] == [{"row": "flat BC", "seed": 0}]
        and "replaced" not in sources[0]
    )
    (tmp_path / "other.json").write_text(json.dumps({"spec": {"name": "smoke"}, "rows": []}))
    with pytest.raises(
        ConfigError, match=r"other.json: spec.name: results of table 'smoke', expected 'textcraft-multi2'"
    ):
        merge(spec, [tmp_path / "other.json"])
    assert (
        main(
            [
                str(REPO / "benchmarks" / "multi2.yaml"),
                "--merge",
                *map(str, files[:2]),
                "--out",
                str(tmp_path / "joined"),
            ]
        )
        == 0
    )
    table = (tmp_path / "joined" / "table.md").read_text()
    assert "| 1 | flat BC | 2 | 50.0 [21.5, 78.5] (4/8) |" in table and "different code" not in table, (
        "4 of 8 episodes pooled over both seeds"
    )
    assert json.loads((tmp_path / "joined" / "results.json").read_text())["merged_from"][1]["wall_s"] == 11.0
    _, sources = merge(spec, [tmp_path / "joined" / "results.json", files[0]])
    assert [s["wall_s"] for s in sources[0]["merged_from"]] == [10.0, 11.0] and "git_commit" not in sources[0], (
        "a joined table's runs are kept"
    )
    with pytest.raises(ConfigError, match="code differs"):
        merge(spec, [tmp_path / "joined" / "results.json", other_code]), "a joined table's commits are its runs'"


def test_the_swapped_roles_ablation_trains_system_1_and_leaves_system_2_as_cloned(tmp_path, monkeypatch):
    raw = _tiny("textcraft", tmp_path)
    raw.update(
        method="multi2",
        multi2={
            "rl_roles": ["high"],
            "critic": {"epochs": 1, "batch_size": 4},
            "policy": {"epochs": 2, "batch_size": 4, "lr": 1e-3},
        },
    )
    params = parse_params(raw)
    with pytest.raises(ConfigError, match=r"multi2.rl_roles: the online phase .* refines System 2"):
        parse_params({**raw, "evolve": {"iterations": 2}})
    monkeypatch.chdir(tmp_path)
    metrics = {
        f"{s}@{k}" if k is not None else s: run_stage(s, params, k) for s, k in pipeline(params, 1)[:8]
    }  # up to policy@1
    assert "high_v_mean" in metrics["critic@1"] and "low_v_mean" not in metrics["critic@1"]
    assert metrics["policy@1"]["high_examples"] == metrics["policy@1"]["examples"] > 0
    names = ("high", "low")
    bc = load_policy(paths.BASE, params.model, adapter=paths.BC, trainable=True, names=names)[0].state_dict()
    updated = load_policy(paths.BASE, params.model, adapter=paths.policy(1), trainable=True, names=names)[
        0
    ].state_dict()
    assert {name for name in names if any(not torch.equal(updated[n], bc[n]) for n in bc if f".{name}." in n)} == {
        "high"
    }


def test_dvc_yaml_and_the_flow_agree_on_the_phases(tmp_path):
    import subprocess

    from qevolve import dvcfile
    from tests.test_pipeline import DVC, _dvc_stages

    params = parse_params(
        {
            "method": "multi2",
            "env": {"name": "textcraft"},
            "experts": {"demos": {"planner": 2}},
            "evaluate": {"splits": {"test": 2}},
            "evolve": {"iterations": 3},
        }
    )
    subprocess.run([DVC, "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text(dvcfile.render(params))
    flow = [f"{s}@{k}" if k is not None else s for s, k in pipeline(params)]
    assert flow[-8:] == [
        "diagnose@1",
        "evaluate@1",
        "online@2",
        "diagnose@2",
        "evaluate@2",
        "online@3",
        "diagnose@3",
        "evaluate@3",
    ]
    assert sorted(flow) == sorted(_dvc_stages(tmp_path))
    online = dvcfile.spec(params)["stages"]["online"]
    assert (
        online["foreach"]["2"]["seed_dir"] == "data/annotate" and online["foreach"]["3"]["seed_dir"] == "data/online@2"
    )
    assert (
        online["foreach"]["3"]["anchor_dir"] == "models/policy@1"
        and online["foreach"]["3"]["critic_dir"] == "models/critic@2"
    )


def test_a_textcraft_subgoal_naming_an_unknown_item_is_refused():
    from qevolve.hierarchy.annotators import AnnotatorError, check_subtasks, rule_labels

    t = _traj(["get 1 oak log", "craft 4 oak planks using 1 oak log"])
    check_subtasks("textcraft", t, rule_labels("textcraft", t), "the rule annotator")  # the rules name what was crafted
    check_subtasks(
        "textcraft", t, [Label(0, "craft oak planks", "p", False), Label(0, "Craft 4 Oak Planks", "p", True)], "x"
    )
    for subtask, why in (
        ("craft 4 golden widget", "names the unknown item 'golden widget'"),
        ("gather wood", r"is not `craft \[N\] <item>`"),
    ):
        with pytest.raises(
            AnnotatorError, match=rf"multi2.llm_url = 'http://h/v1': the subtask '{subtask}' of trajectory t1 {why}"
        ):
            check_subtasks(
                "textcraft",
                t,
                [Label(0, subtask, "p", False), Label(0, subtask, "p", True)],
                "multi2.llm_url = 'http://h/v1'",
            )
    check_subtasks("alfworld", t, [Label(0, "gather wood", "p", True)] * 2, "x")  # other environments: any text


def test_system_1_can_choose_among_the_crafts_the_listing_shows(tmp_path, monkeypatch):
    from qevolve.envs import make_env, select_tasks
    from qevolve.hierarchy.annotators import observed_subtasks
    from qevolve.hierarchy.shared import make_agent
    from qevolve.rollout import play_in

    assert observed_subtasks(
        "textcraft",
        ["get 1 oak log", "craft 4 oak planks using 1 oak log", "craft 1 stick using 2 bamboo", "inventory"],
    ) == ["craft 4 oak planks", "craft 1 stick"]
    assert observed_subtasks("alfworld", ["take pen 1 from desk 1"]) == []
    raw = _tiny("textcraft", tmp_path)
    raw.update(method="multi2", multi2={"high_mode": "observed"})
    params = parse_params(raw)
    monkeypatch.chdir(tmp_path)
    for stage, k in pipeline(params, 0)[:4]:  # up to bc
        run_stage(stage, params, k)
    agent = make_agent(params, paths.BASE, paths.BC, temperature=1.0)
    env = make_env(params.env)
    [task] = select_tasks(env, "test", params.env, 1, 0)
    [traj] = play_in(params.env, [task], agent, greedy=True, source="policy@0", batch_size=1, seed=0)
    listed = observed_subtasks("textcraft", env.reset(task).admissible)
    chosen = {label.subtask for label in agent.labels[traj.trajectory_id]}
    assert listed and chosen and chosen <= set(listed), (chosen, listed)


def test_repo_compat_centres_online_advantages_per_segment_and_draws_whole_segments():
    import random

    from qevolve.hierarchy.critic import _following
    from qevolve.methods.multi2.online import segment_batch, segment_centred

    rows = [
        {"trajectory_id": t, "subtask_index": s, "step": step}
        for t, s, step in [("a", 0, 1), ("a", 0, 0), ("b", 1, 5), ("b", 1, 6), ("a", 1, 2)]
    ]
    # segment (a, 0) holds rows 1 then 0 by step; (b, 1) rows 2 then 3; (a, 1) has no next row
    assert _following(rows) == {1: 0, 2: 3}
    q = torch.tensor([1.0, 2.0, 3.0, 10.0, 4.0])
    # segment means: (a, 0) 1.5, (b, 1) 6.5, (a, 1) 4
    assert segment_centred(q, rows).tolist() == [-0.5, 0.5, -3.5, 3.5, 0.0]
    buffer = [[{"i": 0}, {"i": 1}], [{"i": 2}], [{"i": 3}, {"i": 4}, {"i": 5}]]
    batch = segment_batch(buffer, 3, random.Random(0))
    assert len(batch) >= 3 and all(seg[0] not in batch or all(x in batch for x in seg) for seg in buffer), (
        "whole segments only"
    )
    assert sorted(x["i"] for x in segment_batch(buffer, 100, random.Random(0))) == list(range(6))


def test_a_model_can_train_its_heads_at_their_own_learning_rate():
    from qevolve.training import by_rate

    model = torch.nn.ModuleDict({"lm": torch.nn.Linear(2, 2), "v": torch.nn.Linear(2, 1)})
    assert [g["lr"] for g in by_rate(model, 1e-4)] == [1e-4]
    model.lr_by_prefix = {"v.": 1e-5}
    groups = by_rate(model, 1e-4)
    assert [(g["lr"], len(g["params"])) for g in groups] == [(1e-4, 2), (1e-5, 2)]


def test_repo_compat_trains_system_2_and_its_critic_in_one_loop_then_online(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from qevolve import dvcfile

    raw = _tiny("textcraft", tmp_path)
    raw.update(
        method="multi2",
        evolve={"iterations": 2},
        multi2={
            "repo_compat": True,
            "policy": {"epochs": 2, "batch_size": 4, "lr": 1e-3},
            "critic": {"lr": 1e-3},
            "online": ONLINE,
        },
    )
    params = parse_params(raw)
    with pytest.raises(
        ConfigError, match=r"multi2.rl_roles: repo_compat reproduces the public code, which trains System 2 only"
    ):
        parse_params({**raw, "evolve": {"iterations": 1}, "multi2": {"repo_compat": True, "rl_roles": ["high", "low"]}})
    assert iteration_stages(params, 1) == ("collect", "policy", "diagnose", "evaluate"), (
        "the joint loop replaces critic@1"
    )
    policy_deps = dvcfile.spec(params)["stages"]["policy"]["foreach"]["1"]
    assert "critic_dir" not in policy_deps and policy_deps["critic_out"] == "models/critic@1"
    monkeypatch.chdir(tmp_path)
    metrics = {f"{s}@{k}" if k is not None else s: run_stage(s, params, k) for s, k in pipeline(params, 2)}
    p = metrics["policy@1"]
    assert p["expectile"] == 0.5 and p["q_loss"] > 0 and p["logp"] > p["first_logp"]
    critic = tmp_path / paths.critic(1)
    assert sorted(f.name for f in critic.iterdir()) == ["heads.safetensors"], (
        "heads only: they read System 2's own features"
    )
    heads = load_file(str(critic / "heads.safetensors"))
    assert any(t.abs().sum() > 0 for n, t in heads.items() if n.startswith(("v.", "q."))), "the heads trained"
    names = ("high", "low")
    bc = load_policy(paths.BASE, params.model, adapter=paths.BC, trainable=True, names=names)[0].state_dict()
    offline = load_policy(paths.BASE, params.model, adapter=paths.policy(1), trainable=True, names=names)[
        0
    ].state_dict()
    assert {name for name in names if any(not torch.equal(offline[n], bc[n]) for n in bc if f".{name}." in n)} == {
        "low"
    }
    o = metrics["online@2"]
    assert o["rounds"] >= 1 and "kl" in o
    online = load_policy(paths.BASE, params.model, adapter=paths.policy(2), trainable=True, names=names)[0].state_dict()
    assert {
        name for name in names if any(not torch.equal(online[n], offline[n]) for n in offline if f".{name}." in n)
    } == {"low"}
    assert sorted(f.name for f in (tmp_path / paths.critic(2)).iterdir()) == ["heads.safetensors"]
    assert load_file(str(tmp_path / paths.critic(2) / "heads.safetensors")).keys() == heads.keys()


def test_under_repo_compat_the_critics_loss_reaches_system_2s_adapter():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qevolve.hierarchy.critic import Item
    from qevolve.methods.multi2.compat import joint_step, on_actor

    torch.manual_seed(0)
    lm = get_peft_model(
        Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=40,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
            )
        ),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    joint = on_actor(lm, ("low",), 1e-5)
    for head in (joint.v["low"], joint.q["low"]):
        torch.nn.init.normal_(head.weight)

    def lora_grads(reward: float) -> list[torch.Tensor]:
        items = [Item("low", ("t", "low", 0), [1, 2, 3, 4], 3, [1, 2, 3, 4, 5, 6], reward, False, 3)]
        joint.zero_grad(set_to_none=True)
        joint_step(joint, [items], beta=10.0, max_weight=20.0, gamma=0.99, pad_id=0)
        return [p.grad.clone() for n, p in joint.named_parameters() if "lora_B" in n]

    # the actor's AWR term is the same for both rewards (A = Q - V does not read r): the difference is the critic's
    assert any(not torch.allclose(a, b) for a, b in zip(lora_grads(0.0), lora_grads(1.0)))
