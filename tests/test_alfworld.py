import pytest

from qevolve.config import EnvConfig
from qevolve.envs import select_tasks
from qevolve.envs.alfworld import AlfworldEnv, split_observation
from qevolve.stages.experts import demonstrate


def test_standard_split_sizes(alfworld_data):
    env = AlfworldEnv(alfworld_data)
    assert {s: len(env.tasks(s)) for s in ("train", "valid_seen", "valid_unseen")} == {
        "train": 3553,
        "valid_seen": 140,
        "valid_unseen": 134,
    }


def test_task_type_filter_and_seeded_subset(alfworld_data):
    env = AlfworldEnv(alfworld_data)
    cfg = EnvConfig(task_types=["look_at_obj_in_light"])
    a = select_tasks(env, "valid_seen", cfg, 5, seed=1)
    assert a == select_tasks(env, "valid_seen", cfg, 5, seed=1)
    assert len(a) == 5 and all(t.type == "look_at_obj_in_light" for t in a)
    assert len(select_tasks(env, "valid_seen", cfg, 0, seed=1)) == 13


def test_train_tasks_set_aside_are_an_evaluation_split_no_draw_of_the_train_split_reaches(alfworld_data):
    import hashlib

    from qevolve.envs import heldout_tasks

    env = AlfworldEnv(alfworld_data)
    cfg = EnvConfig(task_types=["look_at_obj_in_light"], heldout=100)
    train = [t for t in env.tasks("train") if t.type == "look_at_obj_in_light"]
    aside = select_tasks(env, "heldout", cfg, 0, seed=0)
    # the first 100 of the 308 by their ids' SHA-1, whatever the seed; labelled `heldout`, read from the train games
    first = sorted(train, key=lambda t: hashlib.sha1(t.id.encode()).hexdigest())[:100]
    assert {t.id for t in aside} == {t.id for t in first} and heldout_tasks(env, cfg) == aside
    assert all((t.split, t.home) == ("heldout", "train") for t in aside)
    left = select_tasks(env, "train", cfg, 0, seed=0)
    assert len(left) == 208 and not {t.id for t in left} & {t.id for t in aside}
    assert all(
        not {t.id for t in select_tasks(env, "train", cfg, 150, seed=s)} & {t.id for t in aside} for s in range(5)
    )
    assert len(select_tasks(env, "train", EnvConfig(task_types=["look_at_obj_in_light"]), 0, seed=0)) == 308, (
        "off by default"
    )
    first_obs = env.reset(aside[0])  # its game is read from the train split's folder
    assert first_obs.instruction and first_obs.admissible
    with pytest.raises(ValueError, match="env.heldout: 308 is not fewer than the 308 train tasks"):
        select_tasks(env, "heldout", EnvConfig(task_types=["look_at_obj_in_light"], heldout=308), 0, seed=0)


def test_a_demonstration_does_not_move_when_something_else_draws_from_the_global_random(alfworld_data):
    import random

    # The handcoded expert breaks a tie at random on this game (a `look` then a random valid action). Another draw from
    # Python's global `random` between its steps, as a Prefect thread made in a flow that played it in-process, must
    # not change what it does.
    env = AlfworldEnv(alfworld_data, expert="handcoded")
    task = next(
        t
        for t in env.tasks("train")
        if t.id.startswith("pick_and_place_simple-TissueBox-None-Dresser-301/trial_T20190906_221513")
    )
    quiet = [s.action for s in demonstrate(env, task, 30, seed=0).steps]
    step = env.step

    def noisy(action):
        random.random()
        return step(action)

    env.step = noisy
    assert [s.action for s in demonstrate(env, task, 30, seed=0).steps] == quiet
    assert [s.action for s in demonstrate(env, task, 30, seed=1).steps] != quiet, "the key does seed it"


def test_split_observation():
    fb = "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in a room.\n\nYour task is to: put a book in sofa."
    assert split_observation(fb) == ("put a book in sofa.", "You are in a room.")


def test_rejected_action_and_handcoded_expert_wins(alfworld_data):
    env = AlfworldEnv(alfworld_data, expert="handcoded")
    task = next(t for t in env.tasks("valid_seen") if t.type == "pick_and_place_simple")
    first = env.reset(task)
    assert first.instruction and "go to" in " ".join(first.admissible)
    rejected = env.step("open nonexistent 1")
    assert rejected.observation == "Nothing happens." and not rejected.valid and not rejected.done
    traj = demonstrate(env, task, max_steps=60)
    env.close()
    assert traj.won and traj.reward == 1.0 and traj.steps[-1].won
    assert all(s.valid for s in traj.steps[1:])
    assert any(s.action.startswith(("open ", "go to ")) for s in traj.steps)


def test_walkthrough_expert_follows_the_gold_path(alfworld_data):
    env = AlfworldEnv(alfworld_data, expert="walkthrough")
    task = next(t for t in env.tasks("valid_seen") if t.type == "pick_and_place_simple")
    traj = demonstrate(env, task, max_steps=60)
    assert traj.won and len(traj.steps) <= 8 and traj.steps[0].action.startswith("go to ")
    assert env.expert_action() is None  # the path is used up
    env.close()
    with pytest.raises(ValueError, match="unknown ALFWorld expert"):
        AlfworldEnv(alfworld_data, expert="planner")


def test_translations_are_kept_on_disk_for_later_processes(alfworld_data, tmp_path, monkeypatch):
    """A reset in a new process reads the game's PDDL-to-SAS translation from disk instead of redoing it."""
    import fast_downward

    monkeypatch.setenv("QEVOLVE_SAS_CACHE", str(tmp_path))
    env = AlfworldEnv(alfworld_data, expert="walkthrough")
    task = next(t for t in env.tasks("valid_seen") if t.type == "pick_and_place_simple")
    getattr(fast_downward.pddl2sas, "cache", {}).clear()  # earlier tests' games are held in memory
    first = env.reset(task)
    files = {f: f.stat().st_ino for f in tmp_path.glob("*.pkl")}
    assert len(files) == 1
    fast_downward.pddl2sas.cache.clear()  # as a new process would start
    assert env.reset(task) == first
    assert {f: f.stat().st_ino for f in tmp_path.glob("*.pkl")} == files  # read, not written again
    [file] = files
    file.write_bytes(b"written by another fast_downward")  # unreadable: translated again and replaced
    fast_downward.pddl2sas.cache.clear()
    with pytest.warns(UserWarning, match=f"{file}: unreadable kept PDDL translation"):
        assert env.reset(task) == first
    assert file.stat().st_ino != files[file]
    while (action := env.expert_action()) is not None:
        won = env.step(action).won
    assert won


def test_shallow_context_copies_change_no_observation(alfworld_data):
    """Text generation with shallow context copies gives the deep copies' observations and commands, step
    for step, on games of every task type played by a mix of expert and random actions."""
    from textworld.envs.pddl import textgen

    from benchmarks.alfworld import play

    env = AlfworldEnv(alfworld_data)
    tasks = env.tasks("valid_unseen")
    games = [next(t for t in tasks if t.type == kind) for kind in sorted({t.type for t in tasks})]

    *_, shallow = play(env, games, 8)  # a digest of every observation, command list and reward
    assert textgen.copy_context._qevolve_shallow
    copy_context, textgen.copy_context = textgen.copy_context, textgen.copy_context.deep
    try:
        assert play(env, games, 8)[2] == shallow
    finally:
        textgen.copy_context = copy_context


def test_two_environments_on_the_same_game_stay_independent(alfworld_data):
    """Resets share TextWorld's PDDL grounding through a cache; the games' states must not be shared."""
    import fast_downward

    walker, idler = AlfworldEnv(alfworld_data, expert="walkthrough"), AlfworldEnv(alfworld_data)
    task = next(t for t in walker.tasks("valid_seen") if t.type == "pick_and_place_simple")
    first = walker.reset(task)
    assert idler.reset(task) == first and fast_downward.pddl2sas._qevolve_cached
    path = []
    while (action := walker.expert_action()) is not None:
        path.append(action)
        won = walker.step(action).won
        assert not idler.step("look").won
    assert won
    # the same game again, served from the cache: the same start, and the same path wins again
    assert walker.reset(task) == first
    assert [walker.step(a).won for a in path][-1]
    walker.close()
    idler.close()
