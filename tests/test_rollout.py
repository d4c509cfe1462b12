"""The rollout loop on a scripted environment: slots refill, format errors never reach the env."""

from qevolve.config import ModelConfig
from qevolve.envs.base import Observation, Step, Task
from qevolve.models.policy import Actor, load_policy
from qevolve.models.prompt import PromptBuilder
from qevolve.rollout import episode_seed, play


class Corridor:
    """Won by `go to door 1`; every other valid action is accepted and changes nothing."""

    def __init__(self):
        self.steps = []

    def tasks(self, split):
        return [Task(f"t{i}", split, "corridor") for i in range(3)]

    def reset(self, task):
        return Observation("leave the room.", "You are in a room. You see a door 1.", ["go to door 1", "look"])

    def step(self, action):
        self.steps.append(action)
        won = action == "go to door 1"
        return Step(
            "You are outside." if won else "Nothing happens.", float(won), won, won, won, ["go to door 1", "look"]
        )

    def expert_action(self):
        return "go to door 1"

    def close(self):
        pass


def test_admissible_rollout_fills_slots_and_records_steps(tiny_base):
    model, tok = load_policy(tiny_base, ModelConfig(lora={"r": 4, "alpha": 8}))
    actor = Actor(model, tok, PromptBuilder(tok, 256), "admissible", temperature=1.0, max_new_tokens=8)
    env = Corridor()
    tasks = env.tasks("valid_seen")
    trajs = play(lambda: env, tasks, actor, max_steps=4, greedy=True, source="policy@0", batch_size=2)
    assert [t.task_id for t in trajs] == ["t0", "t1", "t2"]
    for t in trajs:
        assert 1 <= len(t.steps) <= 4
        assert t.won == (t.steps[-1].action == "go to door 1")
        assert t.failure == ("" if t.won else "max_steps")
        assert all(s.output.startswith("Action: ") and s.logp <= 0 and s.prompt_tokens > 0 for s in t.steps)
    assert len(env.steps) == sum(len(t.steps) for t in trajs)


def test_free_text_format_errors_do_not_step_the_env(tiny_base):
    model, tok = load_policy(tiny_base, ModelConfig(lora={"r": 4, "alpha": 8}))
    actor = Actor(model, tok, PromptBuilder(tok, 256), "free", temperature=1.0, max_new_tokens=4)
    env = Corridor()
    [traj] = play(
        lambda: env, env.tasks("valid_seen")[:1], actor, max_steps=3, greedy=True, source="policy@0", batch_size=1
    )
    bad = [s for s in traj.steps if s.action is None]
    assert bad  # an untrained model writing 4 tokens does not produce an `Action:` line
    assert all(not s.valid and s.next_observation == s.observation for s in bad)
    assert len(env.steps) == len(traj.steps) - len(bad)


def test_an_episodes_draws_do_not_depend_on_what_it_is_batched_with(tiny_base):
    """Each episode samples from its own seed: the same sampled episodes one at a time and three at once."""
    model, tok = load_policy(tiny_base, ModelConfig(lora={"r": 4, "alpha": 8}))
    for mode in ("admissible", "free"):
        actor = Actor(model, tok, PromptBuilder(tok, 256), mode, temperature=50.0, max_new_tokens=6)
        env = Corridor()
        runs = [
            [
                [(s.output, round(s.logp, 4)) for s in t.steps]
                for t in play(
                    lambda: env,
                    env.tasks("train") * 2,
                    actor,
                    max_steps=4,
                    greedy=False,
                    source="p",
                    batch_size=b,
                    seed=3,
                )
            ]
            for b in (1, 3)
        ]
        assert runs[0] == runs[1]
        assert len({str(episode) for episode in runs[0]}) > 1  # the two episodes of a task draw differently


def test_episode_seeds_differ_by_stage_seed_place_task_and_attempt():
    seeds = {
        episode_seed(*key)
        for key in [(0, 0, "t0", 0), (1, 0, "t0", 0), (0, 1, "t0", 0), (0, 0, "t1", 0), (0, 0, "t0", 1)]
    }
    assert len(seeds) == 5 and all(0 <= s < 2**63 for s in seeds)
    assert episode_seed(0, 0, "t0", 0) == episode_seed(0, 0, "t0", 0)
