"""STEP-HRL: the rule annotators, the three transition sets, the LLM annotator against a fake server, the
transition store, the losses, and the recipe end to end on TextCraft."""

import json

import pyarrow.parquet as pq
import pytest
import torch

from qevolve import paths
from qevolve.algos.losses import sequence_logprobs, token_logprobs
from qevolve.algos.rl import advantage_pg_loss
from qevolve.config import ConfigError
from qevolve.data.store import SchemaError, StepRecord, Trajectory
from qevolve.hierarchy.annotators import AnnotatorError, Label, llm_labels, rule_labels
from qevolve.hierarchy.critic import with_steps
from qevolve.hierarchy.roles import FAILED, FINISHED, RolePrompts, parse_low, transitions
from qevolve.hierarchy.shared import mix
from qevolve.hierarchy.transitions import read_transitions, write_transitions
from qevolve.models.policy import load_policy
from qevolve.params import parse_params
from qevolve.stages import iteration_stages, pipeline, run_stage
from tests.test_env_pipelines import _tiny


def _traj(actions, rewards=None, valid=None, won=True, env_obs="obs") -> Trajectory:
    rewards = rewards or [0.0] * (len(actions) - 1) + [1.0 if won else 0.0]
    valid = valid or [True] * len(actions)
    steps = [
        StepRecord(
            step=i,
            observation=f"{env_obs} {i}",
            output=f"Action: {a}",
            action=a,
            next_observation=f"{env_obs} {i + 1}",
            reward=r,
            done=won and i == len(actions) - 1,
            won=won and i == len(actions) - 1,
            valid=v,
        )
        for i, (a, r, v) in enumerate(zip(actions, rewards, valid))
    ]
    return Trajectory("t1", "task", "type", "train", "expert", "put a pen on the shelf.", won=won, steps=steps)


def _summary(labels):
    return [(lab.subtask_index, lab.subtask, lab.progress, lab.ends) for lab in labels]


def test_alfworld_rules_cut_at_each_world_change_and_track_checked_places_then_route():
    t = _traj(
        [
            "look",
            "go to drawer 1",
            "open drawer 1",
            "go to desk 1",
            "take pen 1 from desk 1",
            "go to shelf 1",
            "move pen 1 to shelf 1",
        ]
    )
    assert _summary(rule_labels("alfworld", t)) == [
        (0, "find and take the pen", "searching for the pen", False),
        (0, "find and take the pen", "searching for the pen || [Checked: drawer 1]", False),
        (0, "find and take the pen", "searching for the pen || [Checked: drawer 1]", False),
        (0, "find and take the pen", "searching for the pen || [Checked: drawer 1, desk 1]", False),
        (0, "find and take the pen", "done: take pen 1 from desk 1", True),
        (1, "put the pen in/on the shelf", "on the way || [Route: shelf 1]", False),
        (1, "put the pen in/on the shelf", "done: move pen 1 to shelf 1", True),
    ]
    lamp = _traj(["go to desk 1", "take book 2 from desk 1", "go to sidetable 1", "use desklamp 1"])
    assert [s for _, s, _, e in _summary(rule_labels("alfworld", lamp)) if e] == [
        "find and take the book",
        "use the desklamp",
    ]


def test_textcraft_webshop_and_scienceworld_rules():
    craft = _traj(
        [
            "get 1 oak log",
            "craft 4 oak planks using 1 oak log",
            "get 2 stick",
            "craft 1 wooden sword using 2 oak planks, 1 stick",
        ]
    )
    assert _summary(rule_labels("textcraft", craft)) == [
        (0, "craft 4 oak planks", "gathering ingredients || [Gathered: 1 oak log]", False),
        (0, "craft 4 oak planks", "done: 4 oak planks crafted", True),
        (1, "craft 1 wooden sword", "gathering ingredients || [Gathered: 2 stick]", False),
        (1, "craft 1 wooden sword", "done: 1 wooden sword crafted", True),
    ]
    shop = _traj(["search[red shirt]", "click[next >]", "click[b01]", "click[red]", "click[large]", "click[buy now]"])
    assert [(i, s, e) for i, s, _, e in _summary(rule_labels("webshop", shop))] == [
        (0, "search for the product", True),
        (1, "choose a matching product", False),
        (1, "choose a matching product", True),
        (2, "select the options", False),
        (2, "select the options", True),
        (3, "buy the product", True),
    ]
    assert rule_labels("webshop", shop)[4].progress == "picking options || [Selected: red, large]"
    science = _traj(
        [
            "open door to kitchen",
            "go to kitchen",
            "pick up thermometer",
            "look around",
            "focus on water",
            "connect battery to wire",
        ]
    )
    assert [(i, s, e) for i, s, _, e in _summary(rule_labels("scienceworld", science))] == [
        (0, "go to the kitchen", False),
        (0, "go to the kitchen", True),
        (1, "pick up thermometer", True),
        (2, "focus on water", False),
        (2, "focus on water", True),
        (3, "connect battery to wire", True),
    ]
    assert rule_labels("scienceworld", science)[1].progress == "moving || [Route: kitchen -> kitchen]"
    assert rule_labels("scienceworld", science)[5].progress == "wiring || [Connections: battery - wire]"
    with pytest.raises(ValueError, match="no rule annotator for environment 'nowhere'"):
        rule_labels("nowhere", shop)


def test_transitions_carry_the_papers_rewards_done_flags_and_next_states():
    t = _traj(
        ["go to desk 1", "take pen 1 from desk 1", "go to shelf 1", "move pen 1 to shelf 1"],
        rewards=[0, 0, 0, 1.0],
        valid=[True, True, False, True],
    )
    labels = rule_labels("alfworld", t)
    sets = transitions(t, labels, RolePrompts("alfworld"))
    high, low, progress = sets["high"], sets["low"], sets["progress"]
    assert [h.output_text for h in high] == ["find and take the pen", "put the pen in/on the shelf"]
    assert [(h.reward, h.done, h.step) for h in high] == [(0.0, False, 0), (1.0, True, 2)]
    assert high[0].next_state_text == high[1].state_text and high[1].next_state_text == FINISHED
    assert (
        "Subtasks done: find and take the pen" in high[1].state_text
        and "Last subtask progress: done: take pen 1" in high[1].state_text
    )
    # low: +1 at each subtask's last step, -1 on the rejected step, done at the subtask's end
    assert [(x.reward, x.done) for x in low] == [(0.0, False), (1.0, True), (-1.0, False), (1.0, True)]
    assert [x.output_text for x in low] == [
        "go to desk 1; False",
        "take pen 1 from desk 1; True",
        "go to shelf 1; False",
        "move pen 1 to shelf 1; True",
    ]
    assert low[1].next_state_text == low[2].state_text and low[3].next_state_text == FINISHED
    assert "Local progress: None" in low[2].state_text  # a new subtask starts from no progress
    assert [x.output_text for x in progress] == [lab.progress for lab in labels] and [x.reward for x in progress] == [
        x.reward for x in low
    ]
    # the public code penalises only ScienceWorld's rejection text, so never on ALFWorld
    assert [x.reward for x in transitions(t, labels, RolePrompts("alfworld"), compat_converters=True)["low"]] == [
        0.0,
        1.0,
        0.0,
        1.0,
    ]
    # w/o LP: no progress in the low prompt, no progress transitions
    plain = transitions(t, labels, RolePrompts("alfworld", progress=False))
    assert plain["progress"] == [] and all("Local progress" not in x.state_text for x in plain["low"])
    lost = _traj(["go to desk 1", "go to shelf 1"], won=False)
    cut = transitions(lost, rule_labels("alfworld", lost), RolePrompts("alfworld"))
    assert (
        cut["high"][0].next_state_text == FAILED
        and not cut["low"][-1].done
        and "obs 2" in cut["low"][-1].next_state_text
    )
    # the episode's end string is no state to bootstrap: a lost episode's last high and progress transitions are
    # done (worth their reward, 0), the low level's cut-off subtask bootstraps where it stopped; the public
    # converters leave them to the environment's done, False at the step cap
    assert cut["high"][-1].done and cut["progress"][-1].done and cut["progress"][-1].next_state_text == FAILED
    assert [x.done for x in cut["progress"]] == [False, True] and cut["high"][-1].reward == 0.0
    compat = transitions(lost, rule_labels("alfworld", lost), RolePrompts("alfworld"), compat_converters=True)
    assert not compat["high"][-1].done and not any(x.done for x in compat["progress"])


def test_a_time_aware_critic_reads_the_steps_taken_before_each_state_and_after_it():
    t = _traj(["go to desk 1", "take pen 1 from desk 1", "go to shelf 1", "move pen 1 to shelf 1"])
    sets = {
        role: [{**vars(x), "level": role} for x in rows]
        for role, rows in transitions(t, rule_labels("alfworld", t), RolePrompts("alfworld")).items()
    }
    timed = with_steps(sets)

    def taken(text):
        return int(text.rsplit("\nSteps taken: ", 1)[1])

    # low and progress: step t before, t + 1 after; high: its subtask's first step, then the next subtask's, and
    # the episode's length after the last
    for role in ("low", "progress"):
        assert [(taken(r["state_text"]), taken(r["next_state_text"])) for r in timed[role]] == [
            (0, 1),
            (1, 2),
            (2, 3),
            (3, 4),
        ]
    assert [(taken(r["state_text"]), taken(r["next_state_text"])) for r in timed["high"]] == [(0, 2), (2, 4)]
    # only the texts change, and a state the paper's critic reads is the same text with the count after it
    for role, rows in sets.items():
        for r, s in zip(rows, timed[role]):
            assert s["state_text"].startswith(r["state_text"] + "\n") and s["next_state_text"].startswith(
                r["next_state_text"] + "\n"
            )
            assert {k: v for k, v in s.items() if not k.endswith("state_text")} == {
                k: v for k, v in r.items() if not k.endswith("state_text")
            }


def test_low_outputs_parse_into_action_and_flag():
    assert parse_low("open drawer 1; True") == ("open drawer 1", True)
    assert parse_low(" Go To Desk 1 ; false\nmore") == ("go to desk 1", False)
    assert (
        parse_low("open drawer 1") == (None, False)
        and parse_low("; True") == (None, False)
        and parse_low("") == (None, False)
    )


def test_llm_annotator_reads_an_openai_compatible_answer_and_refuses_a_bad_one(fake_chat):
    t = _traj(["go to desk 1", "take pen 1 from desk 1", "move pen 1 to shelf 1"])
    answer = {}
    server = fake_chat(lambda body: answer["text"])
    fake_llm = server.url
    answer["text"] = json.dumps(
        [
            {"subtask": "get the pen", "steps": 2, "progress": ["at desk", "holding pen"]},
            {"subtask": "place it", "steps": 1, "progress": ["placed"]},
        ]
    )
    assert llm_labels(fake_llm, "m", t) == [
        Label(0, "get the pen", "at desk", False),
        Label(0, "get the pen", "holding pen", True),
        Label(1, "place it", "placed", True),
    ]
    assert server.requests[0]["messages"][0]["content"].startswith("Split this expert trajectory")
    answer["text"] = (
        "```json\n" + json.dumps([{"subtask": "get the pen", "steps": 2, "progress": ["a", "b"]}]) + "\n```"
    )
    with pytest.raises(AnnotatorError, match="covers 2 steps, the trajectory has 3"):
        llm_labels(fake_llm, "m", t)
    answer["text"] = "I would split it like this: ..."
    with pytest.raises(AnnotatorError, match="not the JSON asked for"):
        llm_labels(fake_llm, "m", t)
    with pytest.raises(AnnotatorError, match=r"step_hrl.llm_url = 'http://127.0.0.1:9/v1': no usable answer"):
        llm_labels("http://127.0.0.1:9/v1", "m", t, timeout=5)
    with pytest.raises(ConfigError, match="step_hrl.llm_url: annotator `llm` needs the http"):
        parse_params({"method": "step_hrl", "step_hrl": {"annotator": "llm", "llm_url": "localhost:8000"}})


def test_transition_store_round_trips_and_fails_loudly_on_a_schema_mismatch(tmp_path):
    t = _traj(["go to desk 1", "take pen 1 from desk 1"])
    sets = transitions(t, rule_labels("alfworld", t), RolePrompts("alfworld"))
    write_transitions(tmp_path / "s", sets, len)
    back = read_transitions(tmp_path / "s")
    assert [r["output_text"] for r in back["low"]] == [x.output_text for x in sets["low"]]
    assert back["high"][0]["prompt_tokens"] == len(sets["high"][0].state_text)
    table = pq.read_table(tmp_path / "s" / "low.parquet")
    pq.write_table(
        table.drop(["reward"]).replace_schema_metadata(table.schema.metadata), tmp_path / "s" / "low.parquet"
    )
    with pytest.raises(SchemaError, match=r"low.parquet: missing column 'reward'"):
        read_transitions(tmp_path / "s")
    pq.write_table(table.replace_schema_metadata({b"qevolve.schema_version": b"0"}), tmp_path / "s" / "low.parquet")
    with pytest.raises(SchemaError, match=r"low.parquet: schema version '0', expected '1'"):
        read_transitions(tmp_path / "s")


def test_length_normalised_logprob_and_the_repos_actor_loss_match_hand_computed_values():
    # vocabulary of 2, logits 0 everywhere except where given: log p = log softmax
    logits = torch.zeros(1, 4, 2)
    logits[0, 1] = torch.tensor([0.0, torch.log(torch.tensor(3.0))])  # p(token 1) = 3/4 at position 2
    ids = torch.tensor([[0, 0, 1, 0]])
    mask = torch.tensor([[0, 0, 1, 1]])  # targets: ids[2] = 1 (p 3/4), ids[3] = 0 (p 1/2)
    expected = (torch.log(torch.tensor(0.75)) + torch.log(torch.tensor(0.5))) / 2
    assert torch.allclose(sequence_logprobs(token_logprobs(logits, ids), mask), expected.reshape(1))
    logp, adv = torch.tensor([-1.0, -2.0]), torch.tensor([0.5, -1.0])
    assert torch.isclose(advantage_pg_loss(logp, adv), torch.tensor(-(0.5 * -1.0 + -1.0 * -2.0) / 2))  # = -0.75


def test_standardize_scales_each_roles_advantages_to_mean_zero_and_spread_one():
    from qevolve.methods.step_hrl.policy import standardized

    items = [("high", [1], [1], 1.0), ("low", [2], [1], 5.0), ("high", [3], [1], 3.0), ("low", [4], [1], 5.0)]
    out = standardized(items)
    # high: mean 2, sample standard deviation sqrt(2); low: all equal, so 0 rather than a division by zero
    assert [a for *_, a in out] == pytest.approx([-(2**-0.5), 0.0, 2**-0.5, 0.0])
    assert [x[:3] for x in out] == [x[:3] for x in items]


def test_mix_keeps_every_expert_transition_and_at_most_two_collected_per_expert():
    expert, collected = [{"e": i} for i in range(10)], [{"c": i} for i in range(8)]
    mixed = mix(expert, collected, 2.0, seed=0)
    assert sum("e" in r for r in mixed) == 10 and sum("c" in r for r in mixed) == 8, (
        "a short collection does not cut the experts"
    )
    mixed = mix(expert, [{"c": i} for i in range(50)], 2.0, seed=0)
    assert sum("e" in r for r in mixed) == 10 and sum("c" in r for r in mixed) == 20
    assert len({r["c"] for r in mixed if "c" in r}) == 20, "drawn without replacement"
    assert len(mix(expert, collected, 0.0, seed=0)) == 18 and len(mix([], collected, 2.0, seed=0)) == 8


def test_separate_adapters_train_each_role_on_its_own_outputs_and_round_trip(tmp_path, monkeypatch):
    from qevolve.hierarchy.roles import ROLES
    from qevolve.models.policy import use_adapter
    from qevolve.stages.hierarchical.bc import weighted_nll_step

    raw = _tiny("textcraft", tmp_path)
    raw.update(method="step_hrl", step_hrl={"adapters": "separate"})
    params = parse_params(raw)
    with pytest.raises(ConfigError, match=r"step_hrl.adapters: `separate` .* train.shard"):
        parse_params({**raw, "train": {"shard": True}})
    monkeypatch.chdir(tmp_path)
    for stage in ("experts", "base"):  # the embedded base's vocabulary is built from the experts' text
        run_stage(stage, params, None)
    one = sum(p.numel() for p in load_policy(paths.BASE, params.model)[0].parameters() if p.requires_grad)
    model, _ = load_policy(paths.BASE, params.model, names=ROLES)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 3 * one
    before = {n: t.clone() for n, t in model.state_dict().items()}
    ids = list(range(5, 25))
    item = ("high", ids, [0] * 15 + [1] * 5, 1.0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        losses.append(weighted_nll_step(model, [[item]], 0, separate=True)["loss"])
        optimizer.step()
    assert losses[-1] < losses[0]
    changed = {n.split(".")[-2] for n, t in model.state_dict().items() if not torch.equal(t, before[n])}
    assert changed == {"high"}, "only the role whose outputs were trained may change"
    assert all(p.requires_grad for n, p in model.named_parameters() if ".low." in n), (
        "switching adapters froze the others"
    )
    x = torch.tensor([ids])
    logits = {}
    for role in ("high", "low"):
        use_adapter(model, role)
        logits[role] = model(input_ids=x).logits
    assert not torch.allclose(logits["high"], logits["low"])
    model.save_pretrained(tmp_path / "roles")
    loaded, _ = load_policy(paths.BASE, params.model, adapter=tmp_path / "roles", names=ROLES)
    use_adapter(loaded, "high")
    assert torch.allclose(loaded(input_ids=x).logits, logits["high"], atol=1e-5)


@pytest.mark.parametrize("adapters", ["shared", "separate"])
def test_step_hrl_recipe_runs_end_to_end_on_textcraft(tmp_path, monkeypatch, adapters):
    raw = _tiny("textcraft", tmp_path)
    raw["method"] = "step_hrl"
    raw["step_hrl"] = {
        "critic": {"epochs": 1, "batch_size": 4},
        "policy": {"epochs": 1, "batch_size": 4, "lr": 1e-3},
        "progress_tokens": 8,
        "adapters": adapters,
    }
    params = parse_params(raw)
    assert iteration_stages(params) == ("collect", "critic", "policy", "diagnose", "evaluate")
    assert [s for s, _ in pipeline(params, 1)][:5] == ["experts", "base", "annotate", "bc", "evaluate"]
    monkeypatch.chdir(tmp_path)
    metrics = {f"{s}@{k}" if k is not None else s: run_stage(s, params, k) for s, k in pipeline(params, 1)}
    assert (
        metrics["annotate"]["high_transitions"] >= 6
        and metrics["annotate"]["low_transitions"] == metrics["experts"]["cumulative_env_steps"]
    )
    assert metrics["bc"]["loss"] < metrics["bc"]["first_loss"]
    assert (
        metrics["collect@1"]["low_transitions"] == metrics["collect@1"]["env_steps"]
        and metrics["collect@1"]["high_transitions"] >= 4
    )
    assert metrics["critic@1"]["q_loss"] > 0 and metrics["policy@1"]["logp"] > metrics["policy@1"]["first_logp"]
    held = metrics["diagnose@1"]  # each level's critic scored on evaluate@0's episodes, which it never trained on
    assert {f"{lv}_critic_auc" for lv in ("high", "low", "progress")} <= set(held) and held[
        "low_heldout_episodes"
    ] == metrics["evaluate@0"]["test"]["episodes"]
    assert all(
        held[f"{role}_kl_previous_new"] > 0 and held[f"{role}_kl_tokens"] > 0 for role in ("high", "low", "progress")
    ), "the actor moved every role"
    names = ("high", "low", "progress") if adapters == "separate" else ()
    assert all((tmp_path / paths.BC / name / "adapter_model.safetensors").exists() for name in names)
    bc = load_policy(paths.BASE, params.model, adapter=paths.BC, trainable=True, names=names)[0].state_dict()
    updated = load_policy(paths.BASE, params.model, adapter=paths.policy(1), trainable=True, names=names)[
        0
    ].state_dict()
    for name in names or ("default",):
        assert any(not torch.equal(updated[n], bc[n]) for n in bc if f"lora_B.{name}." in n), (
            f"the actor left the {name} adapter unchanged"
        )
    for k in (0, 1):
        m = metrics[f"evaluate@{k}"]["test"]
        assert m["episodes"] == 2 and m["high_tokens_per_episode"] > 0 and m["low_prompt_tokens_per_call"] > 0
        assert m["prompt_tokens_per_episode"] == pytest.approx(
            sum(m[f"{r}_tokens_per_episode"] for r in ("high", "low", "progress")) - m["output_tokens_per_episode"]
        )

    # An unreachable annotator is an error naming the key; the annotations already written stay as they were.
    before = {f.name: f.read_bytes() for f in (tmp_path / "data" / "annotate").iterdir()}
    unreachable = parse_params(
        {**raw, "step_hrl": {**raw["step_hrl"], "annotator": "llm", "llm_url": "http://127.0.0.1:9/v1"}}
    )
    with pytest.raises(AnnotatorError, match=r"step_hrl.llm_url = 'http://127.0.0.1:9/v1'"):
        run_stage("annotate", unreachable, None)
    assert {f.name: f.read_bytes() for f in (tmp_path / "data" / "annotate").iterdir()} == before
    if adapters == "separate":  # a role's adapter missing: the error names its folder and the stage that wrote it
        import shutil

        shutil.rmtree(tmp_path / paths.BC / "progress")
        with pytest.raises(Exception, match=r"models/bc/progress: cannot load the LoRA adapter .* stage `bc`"):
            run_stage("evaluate", params, 0)
    # A policy without its roles file names the file and the stage that wrote it.
    (tmp_path / paths.BC / "roles.json").unlink()
    with pytest.raises(
        Exception, match=r"models/bc/roles.json: cannot read the roles the policy was trained with .* stage `bc`"
    ):
        run_stage("evaluate", params, 0)


def test_a_killed_step_hrl_critic_resumes_from_its_checkpoint_to_the_same_critic(tmp_path, monkeypatch):
    import qevolve.stages.hierarchical.critic as critic_module

    raw = _tiny("textcraft", tmp_path)
    raw.update(
        method="step_hrl",
        step_hrl={"critic": {"epochs": 2, "batch_size": 4, "checkpoint_every": 1}, "progress_tokens": 4},
    )
    params = parse_params(raw)
    monkeypatch.chdir(tmp_path)
    for stage, k in pipeline(params, 1)[:6]:  # up to collect@1
        run_stage(stage, params, k)
    run_stage("critic", params, 1)
    heads = (tmp_path / paths.critic(1) / "heads.safetensors").read_bytes()
    advantages = (tmp_path / paths.advantages(1) / "advantages.parquet").read_bytes()
    real, calls = critic_module.critic_step, []

    def dies_at_step_three(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(critic_module, "critic_step", dies_at_step_three)
    with pytest.raises(KeyboardInterrupt):
        run_stage("critic", params, 1)
    assert (tmp_path / "models" / ".critic@1.checkpoint").exists()
    monkeypatch.setattr(critic_module, "critic_step", real)
    run_stage("critic", params, 1)
    assert (tmp_path / paths.critic(1) / "heads.safetensors").read_bytes() == heads
    assert (tmp_path / paths.advantages(1) / "advantages.parquet").read_bytes() == advantages


def test_collected_low_transitions_keep_what_the_policy_wrote():
    t = _traj(["go to desk 1", "take pen 1 from desk 1"])
    t.steps[0].output, t.steps[1].output = "go to desk 1; False", "take pen 1 from desk 1; false"
    t.steps.append(
        StepRecord(
            step=2,
            observation="o",
            output="I am done",
            action=None,
            next_observation="o",
            reward=0.0,
            done=False,
            won=False,
            valid=False,
        )
    )
    labels = [
        Label(0, "get the pen", "p1", False),
        Label(0, "get the pen", "p2", True),
        Label(1, "put it", "p3", False),
    ]
    low = transitions(t, labels, RolePrompts("alfworld"))["low"]
    assert [x.output_text for x in low] == ["go to desk 1; False", "take pen 1 from desk 1; false", "I am done"]
    assert [x.reward for x in low] == [0.0, 1.0, -1.0]
