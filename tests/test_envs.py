"""ScienceWorld, WebShop and TextCraft behind the TextEnv protocol: reset/step, rejected actions, success,
splits and expert replays (the long replays are in the slow tier)."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from qevolve.envs import scienceworld, textcraft, webshop
from qevolve.envs.base import Task, splits_dir
from qevolve.envs.webshop_data import write_synthetic


def replay(env, task: Task, cap: int = 200, admissible: bool = False):
    """Play the environment's expert on `task`; the last step, the number of steps, whether all were valid
    (and, with `admissible`, each among the actions the environment listed before it)."""
    listed = env.reset(task).admissible
    steps, valid, r = 0, True, None
    while (action := env.expert_action()) is not None and steps < cap:
        valid = valid and (not admissible or action in listed)
        r = env.step(action)
        steps, valid, listed = steps + 1, valid and r.valid, r.admissible
        if r.done:
            break
    return r, steps, valid


def _standard(env: str) -> Path:
    try:
        return splits_dir(env)
    except FileNotFoundError as err:
        pytest.skip(str(err))


# ---- TextCraft ----


def test_textcraft_splits_are_fixed_disjoint_and_cover_every_goal():
    train, test = textcraft.list_tasks("train"), textcraft.list_tasks("test")
    assert (len(train), len(test)) == (345, 74)
    assert not {t.id for t in train} & {t.id for t in test}
    assert {t.type for t in train + test} == {"depth2", "depth3", "depth4"}
    with pytest.raises(ValueError, match="unknown TextCraft split 'valid'"):
        textcraft.list_tasks("valid")


def test_textcraft_depth_split_is_stratified_and_reached_through_the_config():
    from collections import Counter

    from qevolve.config import EnvConfig
    from qevolve.envs import make_env

    def by_depth(tasks):
        return Counter(t.type for t in tasks)

    hashed = textcraft.list_tasks("test")
    env = make_env(EnvConfig(name="textcraft", processes=False, textcraft={"split": "depth"}))
    train, test = env.tasks("train"), env.tasks("test")
    assert by_depth(hashed) == {"depth2": 48, "depth3": 24, "depth4": 2}
    # ceil(0.2 * 291), ceil(0.4 * 117), ceil(0.5 * 11) of the goals of each depth
    assert by_depth(test) == {"depth2": 59, "depth3": 47, "depth4": 6} and len(train) == 307
    assert not {t.id for t in train} & {t.id for t in test} and len({t.id for t in train + test}) == 419
    assert test == textcraft.list_tasks("test", "depth")  # fixed: the same on every call
    with pytest.raises(ValidationError, match="textcraft.split"):
        EnvConfig(name="textcraft", textcraft={"split": "random"})


def test_textcraft_reset_step_rejection_and_success():
    env = textcraft.TextCraftEnv()
    first = env.reset(Task("minecraft:crafting_table", "train", "depth2"))
    assert first.instruction == "craft crafting table." and "craft 1 crafting table using 4 planks" in first.text
    got = env.step("get 1 oak logs")
    assert got.observation == "Got 1 oak logs"
    bad = [env.step(a) for a in ("craft 1 crafting table using 4 oak planks", "get 1 crafting table", "dance")]
    assert [s.valid for s in bad] == [False, False, False]
    env.step("craft 4 oak planks using 1 oak logs")
    done = env.step("craft 1 crafting table using 4 oak planks")  # a tagged ingredient (planks) met by oak planks
    assert done.won and done.done and done.reward == 1.0


def test_textcraft_admissible_actions_come_from_the_listing_and_the_inventory():
    env = textcraft.TextCraftEnv()
    first = env.reset(Task("minecraft:crafting_table", "train", "depth2"))
    listed = first.text.splitlines()[1:]
    crafts = [a for a in first.admissible if a.startswith("craft ")]
    assert len(crafts) == len(listed) and first.admissible[-1] == "inventory"
    # nothing held: the tag `planks` stands for its shallowest member; a listed line without tags is shown as is
    assert "craft 1 crafting table using 4 acacia planks" in crafts and "craft 4 oak planks using 1 oak logs" in crafts
    assert "get 1 oak logs" in first.admissible and not any(
        a.startswith("get") and "planks" in a for a in first.admissible
    )
    env.step("get 1 oak logs")
    held = env.step("craft 4 oak planks using 1 oak logs").admissible
    assert "craft 1 crafting table using 4 oak planks" in held  # the member held now names the tag


def test_textcraft_planner_handles_tags_variants_and_shared_ingredients():
    # sticks and the sign both need planks: each craft fetches what it lacks, in the count its recipe uses
    assert textcraft.plan("minecraft:oak_sign") == [
        "get 1 oak logs",
        "craft 4 oak planks using 1 oak logs",
        "get 1 oak logs",
        "craft 4 oak planks using 1 oak logs",
        "get 2 bamboo",
        "craft 1 stick using 2 bamboo",
        "craft 3 oak sign using 6 oak planks, 1 stick",
    ]
    env = textcraft.TextCraftEnv()
    for goal in ("minecraft:crafting_table", "minecraft:red_banner", "minecraft:white_bed"):
        r, _, valid = replay(env, Task(goal, "train", ""), admissible=True)
        assert r.won and valid, goal


def test_textcraft_planner_replays_a_sample_of_goals():
    env = textcraft.TextCraftEnv()
    tasks = textcraft.list_tasks("train")[::12]
    assert all(r.won and valid for r, _, valid in (replay(env, t, admissible=True) for t in tasks))


@pytest.mark.slow
def test_textcraft_planner_solves_every_goal():
    env = textcraft.TextCraftEnv()
    results = [replay(env, t, admissible=True) for t in textcraft.list_tasks("train") + textcraft.list_tasks("test")]
    assert sum(r.won and valid for r, _, valid in results) == 419


# ---- ScienceWorld ----


def _sciworld_splits(tmp_path, monkeypatch, entries):
    folder = tmp_path / "sciworld"
    folder.mkdir()
    (folder / "train_indices.json").write_text(json.dumps(entries))
    (folder / "max_steps.json").write_text(json.dumps({name: 30 for name, _ in entries}))
    monkeypatch.setenv("QEVOLVE_SPLITS", str(tmp_path))


def test_sciworld_standard_split_counts_follow_eto():
    _standard("sciworld")
    counts = {s: len(scienceworld.list_tasks(s)) for s in ("train", "valid_seen", "valid_unseen")}
    assert counts == {"train": 1483, "valid_seen": 194, "valid_unseen": 211}
    types = [{t.type for t in scienceworld.list_tasks(s)} for s in counts]
    assert types[0] == types[1] == types[2] and len(types[0]) == 24
    limits = {t.type: t.max_steps for t in scienceworld.list_tasks("train")}
    assert limits["task-1-boil"] == 100 and limits["task-10-use-thermometer"] == 30


def test_sciworld_bad_split_files_name_the_file(tmp_path, monkeypatch):
    _sciworld_splits(tmp_path, monkeypatch, [["task-1-boil", "seven"]])
    with pytest.raises(
        ValueError,
        match=r"train_indices.json: entry 0 is \['task-1-boil', 'seven'\]; expected \[task name, variation\]",
    ):
        scienceworld.list_tasks("train")
    monkeypatch.setenv("QEVOLVE_SPLITS", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="set QEVOLVE_SPLITS"):
        scienceworld.list_tasks("train")


def test_sciworld_task_types_are_checked_against_its_data(tmp_path, monkeypatch):
    from qevolve.config import EnvConfig
    from qevolve.envs import check_data

    _sciworld_splits(tmp_path, monkeypatch, [["task-1-boil", 0], ["task-3-find-non-living-thing", 1]])
    check_data(EnvConfig(name="scienceworld", task_types=["task-1-boil"]))
    with pytest.raises(
        ValueError,
        match=r"env.task_types: scienceworld has no task type\(s\) "
        r"\['task-1-boil-water'\].*'task-3-find-non-living-thing'",
    ):
        check_data(EnvConfig(name="scienceworld", task_types=["task-1-boil-water"]))


def test_every_environment_spec_names_a_module_that_builds_and_checks_it():
    from qevolve.config import EnvConfig
    from qevolve.environments import ENVIRONMENTS, REPLY, adapter

    assert list(EnvConfig.model_fields["name"].annotation.__args__) == list(ENVIRONMENTS)
    for name, spec in ENVIRONMENTS.items():
        module = adapter(name)
        assert callable(module.create) and callable(module.check_data), name
        assert spec.intro.endswith(REPLY), (
            name
        )  # every prompt asks for actions alike (the hierarchy's roles cut it off)


def test_missing_environment_data_is_a_user_error_saying_where_it_is_read_from(tmp_path, monkeypatch):
    """`check_data` names the environment and the missing path; the hint is its `EnvSpec.data`."""
    from qevolve.config import EnvConfig
    from qevolve.envs import MissingData, check_data

    monkeypatch.setenv("QEVOLVE_SPLITS", str(tmp_path / "nowhere"))
    with pytest.raises(
        MissingData, match=rf"env.name scienceworld: {tmp_path}/nowhere/sciworld: no sciworld split files here"
    ) as err:
        check_data(EnvConfig(name="scienceworld"))
    assert (
        err.value.hint
        == "scienceworld reads the `scienceworld` package, and its split files in $QEVOLVE_SPLITS/sciworld"
    )


@pytest.fixture(scope="module")
def sciworld_env():
    env = scienceworld.ScienceWorldEnv(expert="gold")
    yield env
    env.close()


def test_sciworld_reset_step_rejection_and_gold_success(sciworld_env):
    task = Task("task-3-find-non-living-thing/73", "train", "task-3-find-non-living-thing", 15)
    first = sciworld_env.reset(task)
    assert first.instruction.startswith("find a(n) non-living thing") and "This room is called" in first.text
    assert "look around" in first.admissible
    rejected = sciworld_env.step("fly to the moon")
    # the first step's reward carries the points ScienceWorld gives for the starting state
    assert not rejected.valid and rejected.reward == pytest.approx(0.08) and not rejected.done
    looked = sciworld_env.step("look around")
    assert looked.valid and looked.reward == 0 and "This room is called" in looked.observation
    r, steps, valid = replay(sciworld_env, task)
    assert r.won and r.done and valid and steps == 5


def test_sciworld_rewards_are_normalised_score_changes(sciworld_env):
    task = Task("task-1-boil/7", "train", "task-1-boil", 100)
    sciworld_env.reset(task)
    total, won = 0.0, False
    while (action := sciworld_env.expert_action()) is not None:
        r = sciworld_env.step(action)
        total += r.reward
        won = r.won
        if r.done:
            break
    assert won and total == pytest.approx(1.0)


@pytest.mark.slow
def test_sciworld_gold_paths_win_variations_of_every_third_task_type(sciworld_env):
    """8 of the 24 types (all 24: `python -m benchmarks.envs` plays 50 train tasks, 100% won)."""
    _standard("sciworld")
    first_of_type = {}
    for t in scienceworld.list_tasks("train"):
        first_of_type.setdefault(t.type, t)
    results = [replay(sciworld_env, t) for t in sorted(first_of_type.values(), key=lambda t: t.type)[::3]]
    assert len(results) == 8 and all(r.won and valid for r, _, valid in results)


# ---- WebShop ----


@pytest.fixture(scope="module")
def shop(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("webshop")
    assert write_synthetic(folder, products=60, seed=3) == {"products": 60, "goals": 93, "train": 74, "test": 19}
    return folder


def test_webshop_synthetic_catalogue_loads_with_its_own_splits(shop):
    env = webshop.WebShopEnv(shop)
    train, test = env.tasks("train"), env.tasks("test")
    assert (len(train), len(test)) == (74, 19) and not {t.id for t in train} & {t.id for t in test}
    assert {t.type for t in train} <= {"beauty", "electronics", "fashion", "food", "furniture"}


def test_webshop_standard_split_counts_and_a_mismatched_catalogue(shop, tmp_path):
    folder = _standard("webshop")
    assert [len(json.loads((folder / f"{s}_indices.json").read_text())) for s in ("train", "test")] == [1824, 200]
    for name in webshop.FILES:  # the synthetic catalogue without its own splits: standard indices do not fit
        (tmp_path / name).write_text((shop / name).read_text())
    with pytest.raises(
        webshop.WebShopDataError,
        match=r"are outside the 93 goals of .*the standard splits index the goals of the official files",
    ):
        webshop.WebShopEnv(tmp_path).tasks("test")


def test_webshop_pages_rejections_and_the_expert(shop):
    env = webshop.WebShopEnv(shop)
    task = env.tasks("test")[0]
    first = env.reset(task)
    assert first.text.startswith("WebShop [SEP] Instruction:") and first.admissible == [f"search[{first.instruction}]"]
    assert not env.step("click[buy now]").valid and not env.step("buy it").valid
    results = env.step(first.admissible[0])
    assert (
        results.valid
        and "Page 1 (Total results:" in results.observation
        and "click[back to search]" in results.admissible
    )
    assert not env.step("search[again]").valid  # no search bar on a results page
    r, steps, valid = replay(env, task)
    assert r.won and r.reward == 1.0 and valid and steps >= 3
    assert r.observation == "Thank you for shopping with us! Your score: 1.00"


def test_webshop_expert_buys_every_synthetic_goal(shop):
    env = webshop.WebShopEnv(shop)
    results = [replay(env, t) for t in env.tasks("train") + env.tasks("test")]
    assert all(r.won and valid for r, _, valid in results)


def _product(**kw):
    base = dict(
        asin="B1",
        title="Acme Protein Bar - Gluten Free",
        category="food",
        query="protein bar",
        product_category="Grocery › Snacks › Protein Bar",
        bullets=["Gluten free."],
        description="A protein bar.",
        pricing=[20.0],
        price=20.0,
        options={"flavor": ["vanilla", "honey"], "size": ["pack of 12"]},
        attributes=["gluten free", "low carb"],
    )
    return webshop.Product(**{**base, **kw})


GOAL = {
    "asin": "B1",
    "query": "protein bar",
    "name": "Acme Protein Bar - Gluten Free",
    "product_category": "Grocery › Snacks › Protein Bar",
    "attributes": ["gluten free", "low carb"],
    "goal_options": ["vanilla", "pack of 12"],
    "price_upper": 30.0,
}


@pytest.mark.parametrize(
    "product, options, expected",
    [
        # all 2 attributes, 2 options and the price: 5/5
        (_product(), {"flavor": "vanilla", "size": "pack of 12"}, 1.0),
        # one option missing: (2 + 1 + 1) / 5
        (_product(), {"flavor": "vanilla"}, 0.8),
        # over the price ceiling and no options: (2 + 0 + 0) / 5
        (_product(price=35.0), {}, 0.4),
        # title score 1/5 ("bar"), saved by the category path (factor 1): 1 attribute, no option, price too high: 1/5
        (
            _product(
                title="Nova Trail Mix Bar",
                query="trail mix",
                product_category="Grocery › Snacks › Trail Mix",
                attributes=["gluten free"],
                bullets=[],
                description="",
                price=40.0,
            ),
            {},
            0.2,
        ),
        # shares only the brand word (title score 1/5, not above 0.2, no query or category match: factor 0.5); price
        # only: 0.5 * 1/5
        (
            _product(
                title="Acme Office Chair",
                query="office chair",
                product_category="Home › Furniture",
                attributes=["metal frame"],
                bullets=[],
                description="",
            ),
            {},
            0.1,
        ),
        # nothing of the title in common: factor 0
        (
            _product(title="Zenith Desk Lamp", query="desk lamp", product_category="Home › Lighting"),
            {"flavor": "vanilla"},
            0.0,
        ),
    ],
)
def test_webshop_reward_matches_hand_computed_values(product, options, expected):
    assert webshop.reward(product, GOAL, options) == pytest.approx(expected)


def test_webshop_colour_options_compare_by_base_colour():
    product = _product(options={"color": ["navy blue", "red"]})
    goal = {**GOAL, "goal_options": ["dark navy"]}  # both normalise to the first listed colour they contain
    assert webshop._normalize_color("navy blue") == "blue" and webshop._normalize_color("dark navy") == "dark"
    assert webshop.reward(product, goal, {"color": "navy blue"}) == pytest.approx(3 / 4)


def test_webshop_loads_a_record_in_the_official_schema(tmp_path):
    """One product, written by hand with the fields of WebShop's items_shuffle_1000.json."""
    product = {
        "asin": "B07XYZ1234",
        "name": "Organic Green Tea Bags, 100 Count",
        "category": "grocery",
        "query": "green tea",
        "product_category": "Grocery & Gourmet Food › Beverages › Tea › Green",
        "pricing": "$12.99$18.50",
        "small_description": "USDA organic\n100 tea bags ",
        "full_description": "Smooth organic green tea.",
        "customization_options": {
            "Size": [{"value": "100 Count", "image": None}, {"value": "50/Pack", "image": None}],
            "Flavor Name": None,
        },
        "images": ["https://example.invalid/1.jpg"],
        "average_rating": 4.5,
        "total_reviews": 12,
        "Reviews": [],
    }
    (tmp_path / "items_shuffle_1000.json").write_text(json.dumps([product, {**product}]))  # a duplicate asin is skipped
    (tmp_path / "items_ins_v2_1000.json").write_text(
        json.dumps({"B07XYZ1234": {"attributes": ["organic", "tea bags"]}})
    )
    (tmp_path / "items_human_ins.json").write_text(
        json.dumps(
            {
                "B07XYZ1234": [
                    {
                        "asin": "B07XYZ1234",
                        "instruction": "i want organic green tea bags in 100 count.",
                        "instruction_attributes": ["organic"],
                        "instruction_options": ["100 count"],
                    },
                    {
                        "asin": "B07XYZ1234",
                        "instruction": "no attributes",
                        "instruction_attributes": [],
                        "instruction_options": [],
                    },
                ]
            }
        )
    )
    catalogue = webshop.load_catalogue(str(tmp_path))
    p = catalogue.products["B07XYZ1234"]
    assert len(catalogue.products) == 1 and p.pricing == [12.99, 18.5] and p.price_tag == "$12.99 to $18.5"
    assert 12.99 <= p.price <= 18.5 and p.options == {"size": ["100 count", "50 | pack"]}
    assert p.bullets == ["USDA organic", "100 tea bags"] and p.attributes == ["organic", "tea bags"]
    [goal] = catalogue.goals  # the instruction without attributes is not a goal, as in WebShop
    assert goal["instruction_text"].startswith("i want organic green tea bags in 100 count, and price lower than ")
    assert goal["price_upper"] > p.price and goal["goal_options"] == ["100 count"]


def test_webshop_bad_data_names_the_file_and_field(tmp_path):
    for name in webshop.FILES:
        (tmp_path / name).write_text("{}")
    (tmp_path / "items_shuffle_1000.json").write_text(json.dumps([{"asin": "B1", "category": "x", "query": "q"}]))
    with pytest.raises(webshop.WebShopDataError, match=r"items_shuffle_1000.json: product 0: missing field 'name'"):
        webshop.load_catalogue(str(tmp_path))
    with pytest.raises(webshop.WebShopDataError, match="missing items_shuffle_1000.json"):
        webshop.data_dir(tmp_path / "empty")
