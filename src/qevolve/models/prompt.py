"""Multi-turn chat prompts, built turn by turn as token ids with an action-token mask.

The conversation is: one user turn with the instruction (plus an optional one-shot example) and the
first observation, then alternating assistant (action) and user (observation) turns. Pieces are
tokenised separately and concatenated, so the action tokens are known exactly, the mask needs no
re-alignment, and truncation works on whole turns. The glue around each turn comes from the tokenizer's
own chat template, so a Hugging Face chat model sees the format it was trained on.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qevolve.environments import ENVIRONMENTS
from qevolve.errors import artifact

if TYPE_CHECKING:
    from qevolve.data.store import Trajectory
    from qevolve.params import Params

log = logging.getLogger(__name__)

INSTRUCTION = ENVIRONMENTS["alfworld"].intro

_ACTION_RE = re.compile(r"^\s*action\s*:\s*(.*?)\s*$", re.IGNORECASE | re.MULTILINE)


def parse_action(text: str, keep_case: bool = False) -> tuple[str | None, str]:
    """Return (action, error). A valid output holds exactly one non-empty `Action:` line; the action is
    lower-cased unless `keep_case`."""
    found = [m for m in _ACTION_RE.findall(text) if m]
    if not found:
        return None, "no action"
    if len(found) > 1:
        return None, "several actions"
    return (found[0] if keep_case else found[0].lower()), ""


def clean_text(text: str) -> str:
    """`text` as valid UTF-8: what cannot be encoded (e.g. a lone surrogate from undecodable bytes) becomes '?'."""
    return text.encode("utf-8", "replace").decode("utf-8")


def format_action(action: str) -> str:
    return f"Action: {action}"


@dataclass(frozen=True)
class ChatFormat:
    """The strings a chat template puts around turns, read off the template with sentinels."""

    head: str
    user_start: str
    user_end: str
    """After a user turn, up to where the assistant's text begins (the generation prompt)."""
    assistant_end: str

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ChatFormat:
        u1, a1, u2 = "\x01U1\x01", "\x01A1\x01", "\x01U2\x01"
        msgs = [{"role": "user", "content": u1}, {"role": "assistant", "content": a1}, {"role": "user", "content": u2}]
        full = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        head, rest = full.split(u1)
        user_end, rest = rest.split(a1)
        between, tail = rest.split(u2)
        # `between` = assistant_end + user_start; the first user turn's start sits at the end of `head`.
        user_start = _common_suffix(head, between)
        return cls(head[: len(head) - len(user_start)], user_start, tail, between[: len(between) - len(user_start)])


def _common_suffix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n :]


class PromptBuilder:
    """Turns (instruction, observations, actions) into token ids, with a mask over action tokens."""

    def __init__(
        self,
        tokenizer,
        context_tokens: int,
        one_shot: str = "",
        repeat_task: bool = False,
        max_observation_tokens: int = 0,
        intro: str = INSTRUCTION,
        keep_case: bool = False,
    ):
        self.tok = tokenizer
        self.intro, self.keep_case = intro, keep_case
        self.max_observation_tokens = max_observation_tokens
        self.truncated: set[int] = set()
        """Hashes of the observations cut to `max_observation_tokens` (their count goes to metrics)."""
        self.fmt = ChatFormat.from_tokenizer(tokenizer)
        self.context_tokens = context_tokens
        self.one_shot = one_shot
        self.repeat_task = repeat_task
        self._enc = lambda s: tokenizer.encode(clean_text(s), add_special_tokens=False) if s else []
        self.head_ids = self._enc(self.fmt.head)
        self.user_start_ids = self._enc(self.fmt.user_start)
        self.gen_prompt_ids = self._enc(self.fmt.user_end)
        self.end_ids = self._enc(self.fmt.assistant_end)

    def first_user_text(self, instruction: str, observation: str) -> str:
        example = f"\nHere is an example.\n{self.one_shot}\n" if self.one_shot else ""
        return f"{self.intro}{example}\n{observation.strip()}\n\nYour task is to: {instruction}"

    def clip(self, observation: str) -> str:
        """The observation, cut to `max_observation_tokens` tokens (0 = no limit) with a marker."""
        if (
            not self.max_observation_tokens or len(observation) <= self.max_observation_tokens
        ):  # a token holds >= 1 char
            return observation
        ids = self._enc(observation)
        if len(ids) <= self.max_observation_tokens:
            return observation
        key = hash(observation)
        if key not in self.truncated:
            self.truncated.add(key)
            log.warning(
                "an observation of %d tokens (%d characters) was cut to %d tokens (prompt.max_observation_tokens)",
                len(ids),
                len(observation),
                self.max_observation_tokens,
            )
        return self.tok.decode(ids[: self.max_observation_tokens]) + " [...]"

    def user_turn(self, text: str) -> list[int]:
        return self.user_start_ids + self._enc(text) + self.gen_prompt_ids

    def action_ids(self, output: str) -> list[int]:
        """Tokens of one assistant turn, its closing marker included (the model learns to stop)."""
        return self._enc(output) + self.end_ids

    def turns(self, instruction: str, observations: list[str], outputs: list[str]) -> list[tuple[list[int], list[int]]]:
        """(user ids, assistant ids) per turn; the last turn's assistant ids are empty if not yet acted."""
        task = f"\n\nYour task is to: {instruction}" if self.repeat_task else ""
        observations = [self.clip(o) for o in observations]
        users = [self.first_user_text(instruction, observations[0])] + [o.strip() + task for o in observations[1:]]
        return [
            (self.user_turn(u), self.action_ids(outputs[i]) if i < len(outputs) else []) for i, u in enumerate(users)
        ]

    def fit(self, turns: list[tuple[list[int], list[int]]], reserve: int = 0) -> list[tuple[list[int], list[int]]]:
        """Keep the first turn and the latest turns that fit in the context budget minus `reserve`.

        The latest turn is kept even when it alone exceeds the budget."""
        budget = self.context_tokens - reserve - len(self.head_ids) - sum(map(len, turns[0]))
        kept: list[tuple[list[int], list[int]]] = []
        for turn in reversed(turns[1:]):
            size = len(turn[0]) + len(turn[1])
            if size > budget and kept:  # the latest turn is always kept: it holds the current observation
                break
            kept.append(turn)
            budget -= size
        return [turns[0]] + kept[::-1]

    def prompt(self, instruction: str, observations: list[str], outputs: list[str], reserve: int = 0) -> list[int]:
        """Ids of the conversation so far, ending with the generation prompt for the next action."""
        assert len(observations) == len(outputs) + 1
        ids = list(self.head_ids)
        for user, assistant in self.fit(self.turns(instruction, observations, outputs), reserve):
            ids += user + assistant
        return ids

    def training_examples(
        self, instruction: str, observations: list[str], outputs: list[str]
    ) -> list[tuple[list[int], list[int]]]:
        """(ids, mask) windows covering every action of a trajectory; mask is 1 on action tokens only."""
        return [(w.ids, w.mask) for w in self.windows(instruction, observations[: len(outputs)], outputs)]

    def windows(
        self, instruction: str, observations: list[str], outputs: list[str], lookahead: bool = False
    ) -> list[Window]:
        """Cut a trajectory into windows that fit the context budget, each step in exactly one window.

        A trajectory that fits is one window. A longer one is cut into windows that each start with the
        first turn (as context) followed by consecutive later turns, as the policy sees them when acting
        with a truncated history. `observations` may hold one more entry than `outputs` (the state after
        the last action, for a critic's bootstrap value); it becomes a final turn without an action.
        `lookahead` appends to each window the next window's first observation (not trained), so every
        step's next state is in its own window.
        """
        turns = self.turns(instruction, observations, outputs)
        first = turns[0]
        budget = self.context_tokens - len(self.head_ids) - sum(map(len, first))
        windows, i = [], 1
        while True:
            w = Window(list(self.head_ids), [0] * len(self.head_ids), [])
            w.add(0, first, trained=i == 1)
            used = 0
            while i < len(turns) and (used == 0 or used + sum(map(len, turns[i])) <= budget):
                w.add(i, turns[i], trained=True)
                used += sum(map(len, turns[i]))
                i += 1
            if lookahead and i < len(turns):
                w.add(i, (turns[i][0], []), trained=False)
                w.steps.append((i, len(w.ids) - 1, len(w.ids), len(w.ids)))
            windows.append(w)  # a single turn longer than the budget is kept whole
            if i >= len(turns):
                return windows


@dataclass
class Window:
    """Token ids of consecutive turns, with where each trained step's observation and action sit."""

    ids: list[int]
    mask: list[int]
    """1 on the action tokens of the steps this window trains."""
    steps: list[tuple[int, int, int, int]]
    """(step, obs_end, act_start, act_end): ids[obs_end] is the last token before step's action (where a
    critic reads V(s)), ids[act_start:act_end] the action's tokens (Q(s, a) is read at act_end - 1). A final
    observation without an action has act_start == act_end."""

    def add(self, step: int, turn: tuple[list[int], list[int]], trained: bool) -> None:
        user, assistant = turn
        self.ids += user
        obs_end = len(self.ids) - 1
        self.ids += assistant
        self.mask += [0] * len(user) + [int(trained)] * len(assistant)
        if trained:
            self.steps.append((step, obs_end, obs_end + 1, len(self.ids)))


PROMPT_FILE = "prompt.json"  # saved beside the adapter so acting uses the prompt BC trained with


def make_builder(params: Params, tokenizer, policy_dir: Path) -> PromptBuilder:
    try:
        saved = json.loads((Path(policy_dir) / PROMPT_FILE).read_text())
    except (OSError, ValueError) as err:
        raise artifact(
            Path(policy_dir) / PROMPT_FILE, f"cannot read the prompt the policy was trained with ({err})"
        ) from None
    return PromptBuilder(
        tokenizer,
        params.model.context_tokens,
        saved["one_shot"],
        saved["repeat_task"],
        params.prompt.max_observation_tokens,
        saved.get("intro", INSTRUCTION),
        saved.get("keep_case", False),
    )


def build_examples(builder: PromptBuilder, trajs: list[Trajectory]) -> list[tuple[list[int], list[int]]]:
    examples = []
    for t in trajs:
        observations = [s.observation for s in t.steps]
        examples += builder.training_examples(t.instruction, observations, [format_action(s.action) for s in t.steps])
    return examples
