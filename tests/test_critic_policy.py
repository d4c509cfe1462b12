"""The critic and the policy update on a fixed tiny dataset (tiny model, no environment)."""

import pytest
import torch

from qevolve.config import ModelConfig, PolicyConfig
from qevolve.data.store import StepRecord, Trajectory
from qevolve.methods.qevolve.config import CriticConfig
from qevolve.methods.qevolve.critic import critic_step, value_stats
from qevolve.models.critic import Critic, critic_items, critic_values
from qevolve.models.policy import load_policy
from qevolve.models.prompt import PromptBuilder
from qevolve.params import Params
from qevolve.policy_update import PolicyItem, policy_step, reference_pass
from qevolve.training import train

MODEL = ModelConfig(lora={"r": 8, "alpha": 16})


def trajectory(i: int, won: bool) -> Trajectory:
    """Won episodes find the book on the desk; lost ones keep opening an empty cabinet."""
    t = Trajectory(f"t{i}", f"task{i}", "pick", "train", "policy@0", "put some book on sidetable.", won=won)
    actions = (
        ["go to desk 1", "take book 1 from desk 1"] if won else ["open cabinet 1", "open cabinet 1", "open cabinet 1"]
    )
    seen = "You arrive at desk 1. On the desk 1, you see a book 1 and a pen 2." if won else "Nothing happens."
    obs = "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a desk 1."
    for step, a in enumerate(actions):
        last = step == len(actions) - 1
        t.steps.append(
            StepRecord(step, obs, f"Action: {a}", a, seen, float(won and last), won and last, won and last, True)
        )
        obs = seen
    return t


DATA = [trajectory(i, won=i % 2 == 0) for i in range(8)]


def test_critic_loss_falls_and_values_successful_steps_higher(tiny_base):
    torch.manual_seed(0)
    lm, tok = load_policy(tiny_base, MODEL)
    critic = Critic(lm)
    builder = PromptBuilder(tok, 512)
    items = critic_items(builder, DATA, weighted=True)
    cfg = CriticConfig(epochs=30, lr=3e-3, batch_size=8, micro_batch_size=4, warmup_ratio=0.0, gamma=0.9)
    q_head = critic.q.weight.detach().clone()
    curve = train(
        critic,
        items,
        cfg,
        lambda it: len(it.window.ids),
        lambda mb: critic_step(critic, mb, cfg.gamma, cfg.expectile, tok.pad_token_id),
        "test",
        after_step=lambda: critic.update_target(cfg.target_rate),
    )
    assert curve[-1]["loss"] < 0.5 * curve[0]["loss"]
    assert not torch.equal(critic.q.weight, q_head)
    assert not torch.equal(critic.q_target.weight, critic.q.weight)  # the target lags behind
    stats = value_stats(DATA, critic_values(critic, items, tok.pad_token_id, 4))
    assert stats["v_mean_won"] > stats["v_mean_lost"] + 0.1, stats


def test_critic_windows_see_the_next_state(tiny_base):
    _, tok = load_policy(tiny_base, MODEL)
    # A budget so small that every turn needs its own window: each still reads V at its next state.
    items = critic_items(PromptBuilder(tok, 80), DATA[:2], weighted=False)
    assert len(items) > 2
    for it in items:
        steps = [s for s, _, a, b in it.window.steps if b > a]
        have = {s for s, *_ in it.window.steps}
        assert all(s + 1 in have for s in steps)


@pytest.mark.parametrize("algo", ["bppo", "awr"])
def test_policy_step_moves_probability_with_the_advantage(tiny_base, algo):
    torch.manual_seed(0)
    model, tok = load_policy(tiny_base, MODEL, trainable=True)
    builder = PromptBuilder(tok, 512)
    items = []
    for t in DATA:
        for w in builder.windows(t.instruction, [s.observation for s in t.steps], [s.output for s in t.steps]):
            n = sum(1 for _, _, a, b in w.steps if b > a)
            items.append(PolicyItem(w, False, torch.full((n,), 1.0 if t.won else -1.0)))
    for it, ref in zip(items, reference_pass(model, items, tok.pad_token_id, 4)):
        it.reference, it.behavior = ref, torch.stack([r.sum() for r in ref])
    params = Params(
        policy=PolicyConfig(
            algo=algo, epochs=4, lr=5e-3, batch_size=16, micro_batch_size=8, warmup_ratio=0.0, kl_coef=0.01
        )
    )
    curve = train(
        model,
        items,
        params.policy,
        lambda it: len(it.window.ids),
        lambda mb: policy_step(model, mb, params, tok.pad_token_id),
        "test",
    )
    assert abs(curve[0]["ratio"] - 1.0) < 1e-4 and curve[0]["clip_fraction"] == 0.0  # reference = start
    assert curve[-1]["kl"] > 0
    after = reference_pass(model, items, tok.pad_token_id, 4)
    # Mean change of an action's log-prob, per window.
    delta = [float(torch.stack([r.sum() for r in new]).mean() - it.behavior.mean()) for it, new in zip(items, after)]
    won = [d for d, it in zip(delta, items) if it.advantages[0] > 0]
    lost = [d for d, it in zip(delta, items) if it.advantages[0] < 0]
    if algo == "bppo":  # negative advantages push probability down
        assert sum(won) / len(won) > 0 > sum(lost) / len(lost)
    else:  # AWR weights are positive: it can only pull, more towards high-advantage actions
        assert sum(won) / len(won) > sum(lost) / len(lost)


def test_one_pass_critic_values_equal_one_pass_per_step(tiny_base):
    from benchmarks.critic import max_difference, per_step_values

    torch.manual_seed(0)
    lm, tok = load_policy(tiny_base, MODEL)
    critic = Critic(lm)
    for head in (critic.v, critic.q):
        torch.nn.init.normal_(head.weight)
    items = critic_items(PromptBuilder(tok, 120), DATA[:3], weighted=True)  # small budget: several windows
    assert len(items) > 3
    fast, slow = critic_values(critic, items, tok.pad_token_id, 4), per_step_values(critic, items, tok.pad_token_id, 4)
    assert max_difference(fast, slow) < 1e-4
    assert max_difference(fast, {t: {s: (v + 1, q) for s, (v, q) in steps.items()} for t, steps in slow.items()}) > 0.5


OBJECTS = ("book", "pen", "key", "mug", "apple", "bowl", "cd", "box")


def varied(i: int, desk: bool, won: bool) -> Trajectory:
    """An episode that looks for one of eight objects at the desk or in a cabinet; `won` is set apart from what
    it did, so a test can give outcomes that follow the episode's content or none of it."""
    thing = OBJECTS[i % len(OBJECTS)]
    t = Trajectory(f"v{i}", f"task{i}", "pick", "train", "policy@0", f"put some {thing} on sidetable.", won=won)
    actions = ["go to desk 1", f"take {thing} 1 from desk 1"] if desk else ["open cabinet 1"] * (2 + i % 3)
    seen = f"On the desk 1, you see a {thing} 1." if desk else "Nothing happens."
    obs = f"You are in the middle of a room. You see a cabinet 1, a desk 1 and a {OBJECTS[(i + 3) % 8]} 2."
    for step, a in enumerate(actions):
        last = step == len(actions) - 1
        t.steps.append(
            StepRecord(step, obs, f"Action: {a}", a, seen, float(won and last), won and last, won and last, True)
        )
        obs = seen
    return t


def diagnosed(tmp_path, tiny_base, signal: bool, moved: bool) -> dict:
    """`diagnose@1` of a critic trained on 32 episodes, on 32 held-out ones whose outcome is where they searched
    (`signal`) or a coin flip, the same rule in both sets; the new policy's adapter moved from the previous or not."""
    import json
    import random

    from qevolve.data.store import write_store
    from qevolve.methods.qevolve.diagnose import diagnose
    from qevolve.models.prompt import PROMPT_FILE
    from qevolve.params import parse_params

    rng = random.Random(0)
    episodes = []
    for i in range(64):
        desk = i % 2 == 0
        episodes.append(varied(i, desk, won=desk if signal else rng.random() < 0.5))
    train_set, heldout = episodes[:32], episodes[32:]
    torch.manual_seed(0)
    lm, tok = load_policy(tiny_base, MODEL, trainable=True)
    prompt = json.dumps({"one_shot": "", "repeat_task": False})
    for name in ("previous", "new"):
        if name == "new" and moved:
            with torch.no_grad():
                for n, p in lm.named_parameters():
                    if "lora_B" in n:
                        p.add_(0.05 * torch.randn_like(p))
        lm.save_pretrained(tmp_path / name)
        (tmp_path / name / PROMPT_FILE).write_text(prompt)
    critic = Critic(load_policy(tiny_base, MODEL)[0])
    items = critic_items(PromptBuilder(tok, 512), train_set, weighted=False)
    cfg = CriticConfig(epochs=20, lr=3e-3, batch_size=8, micro_batch_size=8, warmup_ratio=0.0, gamma=0.9)
    train(
        critic,
        items,
        cfg,
        lambda it: len(it.window.ids),
        lambda mb: critic_step(critic, mb, cfg.gamma, cfg.expectile, tok.pad_token_id),
        "test",
        after_step=lambda: critic.update_target(cfg.target_rate),
    )
    critic.save(tmp_path / "critic")
    (tmp_path / "critic" / PROMPT_FILE).write_text(prompt)
    write_store(tmp_path / "heldout", heldout)
    params = parse_params(
        {
            "model": {"lora": {"r": 8, "alpha": 16}, "context_tokens": 512},
            "critic": {"micro_batch_size": 8},
            "policy": {"micro_batch_size": 8},
        }
    )
    return diagnose(
        params,
        tiny_base,
        tmp_path / "previous",
        tmp_path / "new",
        tmp_path / "critic",
        tmp_path / "heldout",
        tmp_path / "diagnose@1.json",
    )


def test_the_diagnosis_warns_of_a_critic_without_contrast_and_an_update_that_did_nothing(tmp_path, tiny_base):
    blind = diagnosed(tmp_path / "blind", tiny_base, signal=False, moved=False)
    assert blind["no_contrast"] == 1 and blind["critic_auc_p"] >= 0.05, blind
    assert blind["no_op"] == 1 and blind["kl_previous_new"] == pytest.approx(0.0, abs=1e-6)
    assert [w.split(":")[0] for w in blind["warnings"]] == ["the critic carries no contrast", "the update is a no-op"]
    seeing = diagnosed(tmp_path / "seeing", tiny_base, signal=True, moved=True)
    assert seeing["no_contrast"] == 0 and seeing["critic_auc_p"] < 0.05 and seeing["heldout_won"] == 16, seeing
    # Won episodes saw the desk at step 1, lost ones "Nothing happens.": compared at the same step, the critic ranks
    # them
    assert (
        seeing["critic_auc_matched"] > 0.8
        and seeing["critic_matched_pairs"] > 0
        and seeing["critic_auc_s0_p"] is not None
    )
    assert seeing["kl_previous_new"] > 1e-4 and seeing["kl_tokens"] > 0 and seeing["warnings"] == []


def test_a_critic_that_ranks_lost_above_won_or_sees_no_outcome_is_warned_of():
    from qevolve.algos.stats import auc
    from qevolve.stages.diagnosis import contrast_warning, useless

    low, high = [0.1 + i / 100 for i in range(20)], [0.6 + i / 100 for i in range(20)]
    inverted, right = auc(low, high), auc(high, low)
    assert useless(inverted) == 1 and contrast_warning(inverted, 40) == (
        "the critic ranks lost above won: its AUC for won against lost held-out episodes is 0.00 (exact p 1.5e-11, "
        "20 won, 20 lost), "
        "below chance (0.5)"
    )
    assert useless(right) == 0 and contrast_warning(right, 40) is None
    assert (
        contrast_warning(auc([], [0.2]), 1)
        == "no held-out episode was won (of 1): the critic's contrast cannot be measured"
    )
    assert useless(auc([], [0.2])) == 1
    few = auc([0.9, 0.8, 0.7], [0.1] * 30)  # ties: only the top three are as extreme, p = 1 / C(33, 3)
    assert useless(few) == 1 and contrast_warning(few, 33) == (
        "the critic's contrast cannot be told from chance: its AUC for won against lost held-out episodes is 1.00 "
        "(exact p 0.00018, "
        "3 won, 30 lost), and at least 5 of each are needed"
    )


def test_credit_assignment_is_read_where_episodes_are_alike():
    from qevolve.stages.diagnosis import credit_aucs

    # V falls with t and is the same for every episode at each step: the mean V ranks the short (won) episodes
    # above the long (lost) ones, but V(s0) and V compared at the same step cannot
    falling = [[1.0, 0.8], [1.0, 0.8], [1.0, 0.8, 0.6, 0.4], [1.0, 0.8, 0.6, 0.4, 0.2]]
    won = [True, True, False, False]
    got = credit_aucs(falling, won)
    assert (got["auc_s0"], got["auc_matched"], got["matched_pairs"]) == (0.5, 0.5, 4) and got["auc_s0_p"] == 1.0
    # One that knows: won episodes' V rises at step 1, lost ones' falls; steps 2-3 have no won episode left
    knowing = [[0.5, 0.9], [0.5, 0.8], [0.5, 0.2, 0.1, 0.1], [0.5, 0.3, 0.2]]
    assert credit_aucs(knowing, won) == {"auc_s0": 0.5, "auc_s0_p": 1.0, "auc_matched": 1.0, "matched_pairs": 4}
