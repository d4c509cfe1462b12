"""Each environment's facts, in one place: its adapter's module, splits, experts, whether it lists the valid
actions, its task types where they are fixed, the first words of its prompts, whether its actions keep
their case, and where its data comes from. params.yaml is checked against these (`qevolve.config`), the
adapter is built from its module (`qevolve.envs.make_env`) and only that module is a code dependency of a
stage that plays it (`qevolve.dvcfile`). A new environment is a module under `qevolve.envs` plus one entry
here (docs/architecture.md)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

REPLY = (
    "At each turn, reply with one action as 'Action: <command>' (you may think first on a line "
    "'Thought: ...'). The environment answers with what you observe."
)
"""How every prompt asks for an action (the end of each environment's `intro`)."""
HELDOUT = "heldout"
"""The split of train tasks that `env.heldout` sets aside for evaluation (`qevolve.envs.select_tasks`)."""


@dataclass(frozen=True)
class EnvSpec:
    name: str
    """`env.name` in params.yaml."""
    module: str
    """The adapter's module: its `create(cfg, expert)` builds the environment in this process, its
    `check_data(cfg, generated)` fails before any compute when the data is missing."""
    splits: tuple[str, ...]
    experts: tuple[str, ...]
    """What `experts.demos` may name."""
    intro: str
    """The first words of every prompt."""
    data: str
    """Where its data comes from (shown when it is missing)."""
    lists_actions: bool = True
    """It lists the valid actions, which `policy.action_mode: admissible` scores."""
    task_types: tuple[str, ...] = ()
    """Its task types where they are fixed, checked when params.yaml is read; empty: they come from the data
    and are checked when it is read (ScienceWorld's task names, WebShop's categories, terminal families)."""
    keep_case: bool = False
    """Its actions are case-sensitive (shell commands): parsed as written, the others' lower-cased."""


ENVIRONMENTS = {
    spec.name: spec
    for spec in (
        EnvSpec(
            "alfworld",
            "qevolve.envs.alfworld",
            ("train", "valid_seen", "valid_unseen", "valid_train"),
            ("handcoded", "walkthrough"),
            f"Interact with a household to solve a task. {REPLY}",
            "ALFWorld's game files in $ALFWORLD_DATA (prepared by `make setup`)",
            task_types=(
                "pick_and_place_simple",
                "look_at_obj_in_light",
                "pick_clean_then_place_in_recep",
                "pick_heat_then_place_in_recep",
                "pick_cool_then_place_in_recep",
                "pick_two_obj_and_place",
            ),
        ),
        EnvSpec(
            "scienceworld",
            "qevolve.envs.scienceworld",
            ("train", "valid_seen", "valid_unseen"),
            ("gold",),
            f"Carry out a science experiment in a simulated world to solve a task. {REPLY}",
            "the `scienceworld` package, and its split files in $QEVOLVE_SPLITS/sciworld",
        ),
        EnvSpec(
            "webshop",
            "qevolve.envs.webshop",
            ("train", "test"),
            ("gold",),
            f"Shop on a web store for the product you are asked for. Use search[query] on the search page and "
            f"click[button] to click a listed button. {REPLY}",
            "the catalogue and goals in env.data_dir or $WEBSHOP_DATA, the split files in $QEVOLVE_SPLITS/webshop",
        ),
        EnvSpec(
            "textcraft",
            "qevolve.envs.textcraft",
            ("train", "test"),
            ("planner",),
            f"Craft an item in Minecraft. Use 'get N item' for base items, 'craft N item using N item, ...' "
            f"with the listed recipes, and 'inventory'. {REPLY}",
            "the recipes the `textcraft` package ships",
            task_types=("depth2", "depth3", "depth4"),
        ),
        EnvSpec(
            "terminal",
            "qevolve.envs.terminal",
            ("train", "test", "test_ood"),
            ("oracle",),
            f"Complete a task in a Linux shell, one bash command per turn; the command 'submit' ends the task. {REPLY}",
            "the task folders env.data_dir/<split>/<task id>/ (TerminalTraj's `generate` writes them)",
            keep_case=True,
        ),
    )
}


def adapter(name: str) -> ModuleType:
    """The adapter module of environment `name`, imported by name: a stage's code deps hold only its own
    environment's module (`qevolve.dvcfile.code_deps`), and a worker process builds it with `create`."""
    return importlib.import_module(ENVIRONMENTS[name].module)
