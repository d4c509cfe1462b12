"""Annotators: a trajectory's steps -> subtasks, and the local progress after each step.

STEP-HRL (and Multi²) train on expert trajectories cut into subtasks, each step carrying a short "local
progress" text. The paper had an LLM write both (`llm_labels`, through any OpenAI-compatible URL); the
rule annotators here write them deterministically, one per environment, from the actions alone:

- ALFWorld: a subtask ends at each action that changes the world (take, move/put, use, heat, cool,
  clean, slice); searching for an object and carrying it somewhere are its phases, as in the handcoded
  expert. Progress: places checked while searching, the route while carrying.
- TextCraft: one subtask per crafted item, covering the `get`s that feed it; progress: what was gathered.
- WebShop: search / choose a product / select its options / buy; progress: the query, the product, the
  options picked.
- ScienceWorld: a run of navigation is one subtask ("go to the kitchen"), every other action that acts
  on the world ends one; progress: the route, the connections made, the last result.

Progress follows the paper's modes: `<status> || [Checked: a, b]` (search), `[Route: a -> b]`
(navigation), `[Connections: a - b]` (connections), `[Gathered: ...]`/`[Selected: ...]` (coverage).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from qevolve.data.store import Trajectory
from qevolve.errors import UserError
from qevolve.llm import chat, json_content

NONE = "None"
"""The progress before a subtask's first step (the paper's p_0)."""


@dataclass(frozen=True)
class Label:
    """What the annotator says about one step of a trajectory."""

    subtask_index: int
    subtask: str
    progress: str
    """The local progress after the step (p_{t+1})."""
    ends: bool
    """The step is its subtask's last."""


def _strip_number(name: str) -> str:
    return re.sub(r"\s+\d+$", "", name.strip())


# -- ALFWorld -------------------------------------------------------------------------------------

_ALF_EFFECT = re.compile(r"^(take|move|put|use|heat|cool|clean|slice)\s+(.*)$")


def _alfworld_subtask(action: str) -> str:
    verb, rest = _ALF_EFFECT.match(action).groups()
    if verb == "take":
        obj = rest.split(" from ")[0]
        return f"find and take the {_strip_number(obj)}"
    if verb in ("move", "put"):
        obj, _, place = re.split(r" (to|in/on|in|on) ", rest, maxsplit=1)
        return f"put the {_strip_number(obj)} in/on the {_strip_number(place)}"
    if verb == "use":
        return f"use the {_strip_number(rest)}"
    obj, _, tool = rest.partition(" with ")
    if verb == "slice":
        return f"slice the {_strip_number(obj)}"
    return f"{verb} the {_strip_number(obj)} with the {_strip_number(tool)}"


def _alfworld_progress(subtask: str, actions: list[str]) -> str:
    """Progress after `actions`, the subtask's steps so far (the last one just taken)."""
    last = actions[-1]
    if _ALF_EFFECT.match(last):
        return f"done: {last}"
    places = list(
        dict.fromkeys(
            a.removeprefix("go to ").removeprefix("open ") for a in actions if a.startswith(("go to ", "open "))
        )
    )
    if subtask.startswith("find and take"):
        status = f"searching for the {subtask.removeprefix('find and take the ')}"
        return f"{status} || [Checked: {', '.join(places)}]" if places else status
    return f"on the way || [Route: {' -> '.join(places)}]" if places else "on the way"


# -- TextCraft ------------------------------------------------------------------------------------


def _textcraft_subtask(action: str) -> str:
    return action.split(" using ")[0]  # "craft 4 oak planks"


def _textcraft_progress(subtask: str, actions: list[str]) -> str:
    if actions[-1].startswith("craft "):
        return f"done: {subtask.removeprefix('craft ')} crafted"
    gathered = [a.removeprefix("get ") for a in actions if a.startswith("get ")]
    return f"gathering ingredients || [Gathered: {', '.join(gathered)}]"


# -- WebShop --------------------------------------------------------------------------------------

_WEBSHOP_PHASES = {
    "search": "search for the product",
    "choose": "choose a matching product",
    "options": "select the options",
    "buy": "buy the product",
}


_WEBSHOP_NAV = ("click[< prev]", "click[next >]")


def _webshop_phases(actions: list[str]) -> list[str]:
    """search -> choose (paging, clicking a product) -> options (on the product page) -> buy."""
    phases, opened = [], False
    for a in actions:
        if a.startswith("search[") or a == "click[back to search]":
            phase, opened = "search", False
        elif a == "click[buy now]":
            phase = "buy"
        elif opened and a not in _WEBSHOP_NAV:
            phase = "options"
        else:
            phase, opened = "choose", a not in _WEBSHOP_NAV
        phases.append(phase)
    return phases


def _webshop_progress(subtask: str, actions: list[str]) -> str:
    last = actions[-1]
    if last.startswith("search["):
        return f"searched for {last[7:-1]}"
    if subtask == _WEBSHOP_PHASES["options"]:
        return f"picking options || [Selected: {', '.join(a[6:-1] for a in actions)}]"
    if subtask == _WEBSHOP_PHASES["buy"]:
        return "done: bought"
    return f"browsing || [Opened: {last[6:-1]}]"


# -- ScienceWorld ---------------------------------------------------------------------------------

_SW_NAV = re.compile(r"^(go to|teleport to|open door to)\s+(.*)$")
_SW_PASSIVE = ("look around", "look at", "inventory", "open ", "close ", "examine", "read ")


def _scienceworld_progress(subtask: str, actions: list[str]) -> str:
    route = [_SW_NAV.match(a).group(2) for a in actions if _SW_NAV.match(a)]
    if route and subtask.startswith("go to"):
        return f"moving || [Route: {' -> '.join(route)}]"
    last = actions[-1]
    if last.startswith("connect "):
        pairs = [a.removeprefix("connect ").replace(" to ", " - ") for a in actions if a.startswith("connect ")]
        return f"wiring || [Connections: {', '.join(pairs)}]"
    return f"done: {last}" if not last.startswith(_SW_PASSIVE) else f"looking || [Checked: {', '.join(actions)}]"


# -- segmentation ---------------------------------------------------------------------------------


def _segments(env: str, actions: list[str]) -> list[tuple[int, int, str, bool]]:
    """(first step, last step + 1, subtask, whether its last step finishes it) covering `actions` in order."""
    cuts: list[tuple[int, str]] = []  # (step that ends a subtask, its name)
    if env == "alfworld":
        cuts = [(i, _alfworld_subtask(a)) for i, a in enumerate(actions) if _ALF_EFFECT.match(a)]
    elif env == "textcraft":
        cuts = [(i, _textcraft_subtask(a)) for i, a in enumerate(actions) if a.startswith("craft ")]
    elif env == "webshop":
        phases = _webshop_phases(actions)
        cuts = [(i, _WEBSHOP_PHASES[p]) for i, p in enumerate(phases) if i + 1 == len(phases) or phases[i + 1] != p]
    elif env == "scienceworld":
        for i, a in enumerate(actions):
            nav, next_nav = _SW_NAV.match(a), i + 1 < len(actions) and _SW_NAV.match(actions[i + 1])
            if nav and not next_nav:
                cuts.append((i, f"go to the {nav.group(2)}"))
            elif not nav and not a.startswith(_SW_PASSIVE):
                cuts.append((i, a))
    else:
        raise ValueError(f"no rule annotator for environment {env!r}; expected one of {list(PROGRESS)}")
    segments, start = [], 0
    for end, name in cuts:
        segments.append((start, end + 1, name, True))
        start = end + 1
    if start < len(
        actions
    ):  # steps after the last cut (an episode cut off mid-subtask) join the last subtask, unfinished
        segments = (
            segments[:-1] + [(segments[-1][0], len(actions), segments[-1][2], False)]
            if segments
            else [(0, len(actions), actions[-1], False)]
        )
    return segments


PROGRESS: dict[str, Callable[[str, list[str]], str]] = {
    "alfworld": _alfworld_progress,
    "textcraft": _textcraft_progress,
    "webshop": _webshop_progress,
    "scienceworld": _scienceworld_progress,
}


def observed_subtasks(env: str, admissible: list[str]) -> list[str]:
    """The subtasks the rules would name for the valid actions an observation lists (TextCraft: one per
    listed craft, `craft 4 oak planks`); empty where the environment lists no such actions (the others:
    the actions that end their subtasks are not all visible from one place)."""
    if env == "textcraft":
        return list(dict.fromkeys(_textcraft_subtask(a) for a in admissible if a.startswith("craft ")))
    return []


def rule_labels(env: str, traj: Trajectory) -> list[Label]:
    """One label per step of `traj` (an expert's: every action parses), from the environment's rules."""
    actions = [s.action or "" for s in traj.steps]
    labels = []
    for index, (start, end, subtask, finished) in enumerate(_segments(env, actions)):
        for t in range(start, end):
            labels.append(
                Label(index, subtask, PROGRESS[env](subtask, actions[start : t + 1]), finished and t == end - 1)
            )
    return labels


_TEXTCRAFT_SUBTASK = re.compile(r"^craft (?:\d+ )?(.+?)\s*$")


def check_subtasks(env: str, traj: Trajectory, labels: list[Label], source: str) -> None:
    """Refuse labels whose subtasks the environment cannot mean: on TextCraft, a subtask is one crafted item,
    `craft [N] <item>`, and the item must be one the recipes know. `source` names who labelled."""
    if env != "textcraft":
        return
    from qevolve.envs.textcraft import item_names

    for subtask in dict.fromkeys(lab.subtask for lab in labels):
        m = _TEXTCRAFT_SUBTASK.match(subtask.strip().lower())
        if not m or m.group(1) not in item_names():
            what = f"names the unknown item {m.group(1)!r}" if m else "is not `craft [N] <item>`"
            raise AnnotatorError(
                f"{source}: the subtask {subtask!r} of trajectory {traj.trajectory_id} {what}; a TextCraft subtask "
                "crafts one item the recipes know"
            )


# -- the LLM annotator ----------------------------------------------------------------------------


class AnnotatorError(UserError, RuntimeError):
    hint = (
        "<method>.llm_url (step_hrl.llm_url, multi2.llm_url) must be the base URL of an OpenAI-compatible "
        "server (…/v1) that answers /chat/completions"
    )


SEGMENT_PROMPT = (
    "Split this expert trajectory into subtasks. Reply with JSON only: a list of objects "
    '{{"subtask": <short imperative>, "steps": <how many consecutive actions it covers>}}, '
    "in order, covering all {n} actions. Then, for every action, the local progress of its subtask after it: "
    'add a key "progress": a list of one short text per action of the subtask. Keep facts until they are contradicted; '
    "never name places not yet checked. Use the forms `<status> || [Checked: a, b]`, `[Route: a -> b]`, "
    "`[Connections: a - b]`.\n\nTask: {instruction}\n\n{steps}"
)


def llm_labels(
    url: str, model: str, traj: Trajectory, timeout: float = 60.0, key: str = "step_hrl.llm_url"
) -> list[Label]:
    """Labels from a chat model behind an OpenAI-compatible `url` (`POST {url}/chat/completions`). The
    answer must cover every step exactly once; anything else is an `AnnotatorError` naming the trajectory
    and the params key `key` that set the URL."""
    steps = "\n".join(f"{i + 1}. {s.action}\n   -> {s.next_observation[:300]}" for i, s in enumerate(traj.steps))
    prompt = SEGMENT_PROMPT.format(n=len(traj.steps), instruction=traj.instruction, steps=steps)
    content = chat(url, model, [{"role": "user", "content": prompt}], key=key, timeout=timeout, error=AnnotatorError)
    try:
        parts = json_content(content)
        labels = []
        for index, part in enumerate(parts):
            n, progress = int(part["steps"]), [str(p) for p in part["progress"]]
            if n < 1 or len(progress) != n:
                raise ValueError(f"subtask {index}: {n} steps but {len(progress)} progress texts")
            labels += [Label(index, str(part["subtask"]), p, i == n - 1) for i, p in enumerate(progress)]
    except (ValueError, KeyError, TypeError) as err:
        raise AnnotatorError(
            f"{key} = {url!r}: the annotation of trajectory {traj.trajectory_id} is not the "
            f"JSON asked for ({err}): {content[:300]!r}"
        ) from None
    if len(labels) != len(traj.steps):
        raise AnnotatorError(
            f"{key} = {url!r}: the annotation of trajectory {traj.trajectory_id} covers "
            f"{len(labels)} steps, the trajectory has {len(traj.steps)}"
        )
    return labels
