"""The three roles of a hierarchical agent and the transitions each learns from.

STEP-HRL's three policies share one model and are told apart by their prompts, each a single user turn
of bounded size (no history):

- high: task + subtasks done + the last subtask's final progress + the current observation -> the next subtask;
- low: subtask + current observation + local progress -> `<action>; True|False` (True: the subtask is done);
- progress: subtask + previous progress + action + resulting observation -> the new local progress.

With `history` (Multi²'s executor) the low level also reads the subtask's earlier observation/action
turns, so its context is the subtask's segment, still bounded by the subtask's length.

`transitions` turns an annotated trajectory (an expert's labelled by `qevolve.hierarchy.annotators`, or one
the hierarchical agent played) into the three transition sets, with the rewards, done flags and next
states of the paper's table (../shared/research/step-hrl.md, section 1): the high level gets the
environment's reward summed over the subtask; the low and progress levels get +1 at a subtask's last
step and -`rejected_penalty` for a rejected action (STEP-HRL's 1; Multi²'s 0, GLIDER's [0, ..., 0, 1]).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from qevolve.data.store import Trajectory
from qevolve.environments import ENVIRONMENTS, REPLY
from qevolve.hierarchy.annotators import NONE, Label

ROLES = ("high", "low", "progress")
_INTROS = {
    "high": "Plan the task as a sequence of subtasks. Reply with the next subtask only.",
    "low": "Carry out the subtask. Reply with the next action and whether it completes the subtask: '<action>; "
    "True' or '<action>; False'.",
    "progress": "Keep track of the subtask's progress. Reply with the updated local progress in one line.",
}
FINISHED, PARTIAL, FAILED = "Task successfully finished.", "Task not fully completed.", "Task failed."
"""The next state after an episode's last step: how it ended."""
SCIENCEWORLD_REJECTED = "No known action matches that input."
"""The only rejection the public code's converters penalise (on ALFWorld too, where it never occurs)."""

_LOW_OUTPUT = re.compile(r"^\s*(.*?)\s*;\s*(true|false)\s*$", re.IGNORECASE | re.DOTALL)


def encode(builder, state_text: str, output_text: str) -> tuple[list[int], list[int]]:
    """(ids, mask) of one role call with `builder` (a `PromptBuilder`): its prompt, then its output (the
    mask's 1s) and end-of-turn marker."""
    prompt = builder.head_ids + builder.user_turn(state_text)
    output = builder.action_ids(output_text)
    return prompt + output, [0] * len(prompt) + [1] * len(output)


def low_output(action: str, ends: bool) -> str:
    return f"{action}; {ends}"


def parse_low(output: str) -> tuple[str | None, bool]:
    """(action, whether the subtask ends); (None, False) when `output` is not `<action>; True|False`."""
    m = _LOW_OUTPUT.match(output.strip().splitlines()[0] if output.strip() else "")
    if not m or not m.group(1):
        return None, False
    return m.group(1).lower(), m.group(2).lower() == "true"


@dataclass(frozen=True)
class RolePrompts:
    """The user turn of each role for environment `env`. `progress=False` is the paper's "w/o LP" ablation:
    the low level sees the subtask and the observation only, and no progress is kept. `clip` shortens an
    observation (`PromptBuilder.clip`). `history`: the low level also reads the subtask's earlier turns."""

    env: str
    progress: bool = True
    clip: Callable[[str], str] = lambda text: text
    history: bool = False

    def intro(self, role: str) -> str:
        return f"{ENVIRONMENTS[self.env].intro.replace(REPLY, '').strip()} {_INTROS[role]}"

    def high(self, instruction: str, done: list[str], last_progress: str, observation: str) -> str:
        lines = [self.intro("high"), f"Task: {instruction}", f"Subtasks done: {', '.join(done) or NONE}"]
        if self.progress:
            lines.append(f"Last subtask progress: {last_progress}")
        return "\n".join([*lines, f"Current observation: {self.clip(observation).strip()}"])

    def low(self, subtask: str, observation: str, progress: str, turns: list[tuple[str, str]] = ()) -> str:
        """`turns`: the subtask's earlier (observation, action) pairs, read with `history` only."""
        lines = [self.intro("low"), f"Subtask: {subtask}"]
        if self.history:
            for seen, action in turns:
                lines += [f"Observation: {self.clip(seen).strip()}", f"Action: {action}"]
        lines.append(f"Current observation: {self.clip(observation).strip()}")
        return "\n".join(lines + ([f"Local progress: {progress}"] if self.progress else []))

    def progress_state(self, subtask: str, previous: str, action: str, observation: str) -> str:
        return "\n".join(
            [
                self.intro("progress"),
                f"Subtask: {subtask}",
                f"Previous local progress: {previous}",
                f"Action: {action}",
                f"Resulting observation: {self.clip(observation).strip()}",
            ]
        )


def _low_text(output: str, action: str | None, ends: bool) -> str:
    """What the low level wrote at a step: the policy's own output when it is one (`<action>; True|False`,
    or a format error), else (an expert's `Action: ...`) the action with the annotated flag."""
    return output if action is None or parse_low(output)[0] is not None else low_output(action, ends)


@dataclass
class Transition:
    trajectory_id: str
    task_id: str
    split: str
    source: str
    subtask_index: int
    step: int
    """The environment step the transition starts at (high: the subtask's first step)."""
    state_text: str
    output_text: str
    reward: float
    done: bool
    next_state_text: str
    won: bool


def transitions(
    traj: Trajectory,
    labels: list[Label],
    prompts: RolePrompts,
    compat_converters: bool = False,
    rejected_penalty: float = 1.0,
) -> dict[str, list[Transition]]:
    """The high, low and progress transitions of one annotated trajectory (progress: none when
    `prompts.progress` is off). The high and progress levels' last transition leads to the episode's end string
    (`FINISHED`, `PARTIAL`, `FAILED`), a state no one acts from, so it is done: a lost episode's last high
    transition is worth its reward and nothing after. `compat_converters`, as STEP-HRL's public converters do:
    count a rejected action only on ScienceWorld's rejection text (so never on ALFWorld) instead of every invalid
    step, and make the last transitions done only where the environment said so (an episode cut off at the step
    cap then bootstraps the critic's value of the end string, which no transition trains)."""
    if len(labels) != len(traj.steps):
        raise ValueError(f"trajectory {traj.trajectory_id}: {len(labels)} labels for {len(traj.steps)} steps")
    steps = traj.steps
    end = FINISHED if traj.won else PARTIAL if traj.reward > 0 else FAILED
    before = [NONE if t == 0 or labels[t - 1].ends else labels[t - 1].progress for t in range(len(steps))]
    row = dict(
        trajectory_id=traj.trajectory_id, task_id=traj.task_id, split=traj.split, source=traj.source, won=traj.won
    )

    def rejected(t: int) -> bool:
        return steps[t].next_observation.strip() == SCIENCEWORLD_REJECTED if compat_converters else not steps[t].valid

    starts = [t for t in range(len(steps)) if t == 0 or labels[t - 1].ends]
    segment_start = [max(s for s in starts if s <= t) for t in range(len(steps))]

    def turns(t: int, until: int) -> list[tuple[str, str]]:
        return [(steps[i].observation, steps[i].action or steps[i].output) for i in range(segment_start[t], until)]

    def low_state(t: int) -> str:
        return prompts.low(labels[t].subtask, steps[t].observation, before[t], turns(t, t))

    done_names: list[str] = []
    high_states = []
    for k, t in enumerate(starts):
        last_progress = NONE if k == 0 else labels[t - 1].progress
        high_states.append(prompts.high(traj.instruction, list(done_names), last_progress, steps[t].observation))
        done_names.append(labels[t].subtask)
    out: dict[str, list[Transition]] = {role: [] for role in ROLES}
    for k, t in enumerate(starts):
        last = (starts[k + 1] if k + 1 < len(starts) else len(steps)) - 1
        out["high"].append(
            Transition(
                **row,
                subtask_index=labels[t].subtask_index,
                step=t,
                state_text=high_states[k],
                output_text=labels[t].subtask,
                reward=float(sum(s.reward for s in steps[t : last + 1])),
                done=steps[last].done or (k + 1 == len(starts) and not compat_converters),
                next_state_text=high_states[k + 1] if k + 1 < len(starts) else end,
            )
        )
    for t, (s, label) in enumerate(zip(steps, labels)):
        reward = 1.0 if label.ends else 0.0 - rejected_penalty if rejected(t) else 0.0
        final = t + 1 == len(steps)
        if final and not label.ends:  # cut off inside a subtask: the next state is where it stopped
            next_low = prompts.low(label.subtask, s.next_observation, label.progress, turns(t, t + 1))
        else:
            next_low = end if final else low_state(t + 1)
        out["low"].append(
            Transition(
                **row,
                subtask_index=label.subtask_index,
                step=t,
                state_text=low_state(t),
                output_text=_low_text(s.output, s.action, label.ends),
                reward=reward,
                done=label.ends,
                next_state_text=next_low,
            )
        )
        if prompts.progress:
            state = prompts.progress_state(label.subtask, before[t], s.action or s.output, s.next_observation)
            nxt = (
                end
                if final
                else prompts.progress_state(
                    labels[t + 1].subtask,
                    before[t + 1],
                    steps[t + 1].action or steps[t + 1].output,
                    steps[t + 1].next_observation,
                )
            )
            out["progress"].append(
                Transition(
                    **row,
                    subtask_index=label.subtask_index,
                    step=t,
                    state_text=state,
                    output_text=label.progress,
                    reward=reward,
                    done=label.ends or (final and not compat_converters),
                    next_state_text=nxt,
                )
            )
    return out
