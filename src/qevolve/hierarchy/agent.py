"""The hierarchical agent: three roles on one model, played by `qevolve.rollout.play` like a flat actor.

Each round, for the batch of running episodes: the high role picks a subtask for the episodes that have
none (at the start, after a subtask ended), the low role picks every episode's action and whether it
ends the subtask, the environments step, and the progress role rewrites each episode's local progress.
Each role's calls are batched across episodes and keep their own KV cache per slot (`rollout_engine`). What
the agent decided per step is kept as `Label`s (`labels[trajectory_id]`), so its episodes become the same
three transition sets as annotated expert data (`qevolve.hierarchy.roles.transitions`), and the tokens
each role read and wrote per episode in `role_tokens[trajectory_id]`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qevolve.hierarchy.annotators import NONE, Label, observed_subtasks
from qevolve.hierarchy.roles import ROLES, RolePrompts, low_output, parse_low
from qevolve.models.backend import RolloutBackend, seeds_from
from qevolve.models.engine import rollout_engine
from qevolve.models.policy import Decision
from qevolve.models.prompt import PromptBuilder


class RoleStop:
    """A role's turn ends at the end-of-turn marker `end` or at the end of its first line."""

    def __init__(self, tokenizer, end: list[int]):
        self.tok, self.end = tokenizer, end

    def __call__(self, tokens: list[int]) -> bool:
        return (
            tokens[-len(self.end) :] == self.end or "\n" in self.tok.decode(tokens, skip_special_tokens=True).lstrip()
        )


class HierarchicalAgent:
    """`models[role]` acts for each role (one merged model for all three with a shared adapter; one model
    with an adapter per role and `activate(role)` to switch to a role's, with separate ones).

    With `prompts.history` the low role also reads the subtask's earlier (observation, action) turns.

    `mode` is the low role's (`admissible`: every valid action is scored twice, ending the subtask or not; `free`:
    generated). The high role chooses among `subtasks` when `high_mode` is `admissible`, among the subtasks the
    observation's valid actions name (`observed_subtasks`; `subtasks` where it names none) when it is `observed`, else
    writes one; the progress role always writes. `max_subtask_steps` ends a subtask the low role does not."""

    def __init__(
        self,
        models: dict,
        tokenizer,
        builder: PromptBuilder,
        prompts: RolePrompts,
        *,
        mode: str,
        high_mode: str,
        subtasks: list[str],
        temperature: float,
        max_new_tokens: int,
        progress_tokens: int,
        max_subtask_steps: int,
        activate: Callable[[str], None] | None = None,
    ):
        self.tok, self.builder, self.prompts = tokenizer, builder, prompts
        self.mode, self.high_mode, self.subtasks = mode, high_mode, subtasks
        self.temperature, self.max_new_tokens, self.progress_tokens = temperature, max_new_tokens, progress_tokens
        self.max_subtask_steps, self.activate = max_subtask_steps, activate
        self.backends = {role: rollout_engine(models[role].eval(), tokenizer.pad_token_id) for role in ROLES}
        self.backend = self.backends["low"]
        self._stop = RoleStop(tokenizer, builder.end_ids or [tokenizer.eos_token_id])
        self.labels: dict[str, list[Label]] = {}
        self.role_tokens: dict[str, dict[str, int]] = {}
        self.role_calls: dict[str, dict[str, int]] = {}
        self._greedy = True

    def _prompt(self, text: str) -> list[int]:
        return self.builder.head_ids + self.builder.user_turn(text)

    def _count(self, traj_id: str, role: str, prompt: int, output: int) -> None:
        tokens = self.role_tokens.setdefault(traj_id, dict.fromkeys(ROLES, 0))
        calls = self.role_calls.setdefault(traj_id, dict.fromkeys(ROLES, 0))
        tokens[role] += prompt + output
        calls[role] += 1

    def _backend(self, role: str) -> RolloutBackend:
        if self.activate is not None:
            self.activate(role)
        return self.backends[role]

    def _write(
        self, role: str, episodes: list, prompts: list[list[int]], max_new_tokens: int
    ) -> list[tuple[str, float, int]]:
        seeds = None if self._greedy else seeds_from([e.generator for e in episodes])
        out = self._backend(role).generate(
            [e.state["slot"] for e in episodes],
            prompts,
            max_new_tokens=max_new_tokens,
            stop=self._stop,
            greedy=self._greedy,
            temperature=self.temperature,
            seeds=seeds,
        )
        return [
            ((self.tok.decode(t, skip_special_tokens=True).strip().splitlines() or [""])[0].strip(), lp, len(t))
            for t, lp in out
        ]

    def _choose(
        self, role: str, episodes: list, prompts: list[list[int]], candidates: list[list[str]]
    ) -> list[tuple[str, float, int]]:
        ids = [[self.builder.action_ids(c) for c in cands] for cands in candidates]
        out = []
        scored = self._backend(role).score([e.state["slot"] for e in episodes], prompts, ids)
        for e, cands, cand_ids, scores in zip(episodes, candidates, ids, scored):
            logp = torch.log_softmax(scores / (1.0 if self._greedy else self.temperature), dim=-1)
            k = int(logp.argmax()) if self._greedy else int(torch.multinomial(logp.exp(), 1, generator=e.generator))
            out.append((cands[k], float(logp[k]), len(cand_ids[k])))
        return out

    def decide(self, episodes: list, greedy: bool, slots: list[int]) -> list[Decision]:
        self._greedy = greedy
        for s, e in zip(slots, episodes):
            if not e.state:
                e.state.update(done=[], subtask=None, progress=NONE, last=NONE, steps=0, index=-1, turns=[])
                self.labels[e.traj.trajectory_id] = []
            e.state["slot"] = s
        planning = [(s, e) for s, e in zip(slots, episodes) if e.state["subtask"] is None]
        high_cost = {}
        if planning:
            texts = [
                self.prompts.high(e.traj.instruction, e.state["done"], e.state["last"], e.observations[-1])
                for _, e in planning
            ]
            prompts = [self._prompt(t) for t in texts]
            if self.high_mode == "admissible":
                chosen = self._choose("high", [e for _, e in planning], prompts, [self.subtasks] * len(planning))
            elif self.high_mode == "observed":
                candidates = [observed_subtasks(self.prompts.env, e.admissible) or self.subtasks for _, e in planning]
                chosen = self._choose("high", [e for _, e in planning], prompts, candidates)
            else:
                chosen = self._write("high", [e for _, e in planning], prompts, self.max_new_tokens)
            for (s, e), prompt, (subtask, _, n) in zip(planning, prompts, chosen):
                e.state.update(subtask=subtask or NONE, progress=NONE, steps=0, index=e.state["index"] + 1, turns=[])
                high_cost[s] = (len(prompt), n)
                self._count(e.traj.trajectory_id, "high", len(prompt), n)
        prompts = [
            self._prompt(
                self.prompts.low(e.state["subtask"], e.observations[-1], e.state["progress"], e.state["turns"])
            )
            for e in episodes
        ]
        if self.mode == "admissible":
            chosen = self._choose(
                "low",
                episodes,
                prompts,
                [[low_output(a, f) for a in e.admissible for f in (False, True)] for e in episodes],
            )
        else:
            chosen = self._write("low", episodes, prompts, self.max_new_tokens)
        decisions = []
        for s, e, prompt, (output, logp, n) in zip(slots, episodes, prompts, chosen):
            self._count(e.traj.trajectory_id, "low", len(prompt), n)
            hp, hn = high_cost.get(s, (0, 0))
            decisions.append(Decision(output, logp, n + hn, len(prompt) + hp))
        return decisions

    def parse(self, output: str) -> str | None:
        return parse_low(output)[0]

    def observed(self, episodes: list) -> None:
        """After the environments stepped: the new local progress of each episode, then whether its subtask ended."""
        steps = [e.traj.steps[-1] for e in episodes]
        if self.prompts.progress and episodes:
            texts = [
                self.prompts.progress_state(
                    e.state["subtask"], e.state["progress"], s.action or s.output, s.next_observation
                )
                for e, s in zip(episodes, steps)
            ]
            prompts = [self._prompt(t) for t in texts]
            written = self._write("progress", episodes, prompts, self.progress_tokens)
        else:
            written, prompts = [(NONE, 0.0, 0)] * len(episodes), [[]] * len(episodes)
        for e, step, prompt, (progress, _, n) in zip(episodes, steps, prompts, written):
            if self.prompts.progress:
                step.prompt_tokens += len(prompt)
                step.output_tokens += n
                self._count(e.traj.trajectory_id, "progress", len(prompt), n)
            state = e.state
            state["steps"] += 1
            state["turns"].append((step.observation, step.action or step.output))
            ends = parse_low(step.output)[1] or state["steps"] >= self.max_subtask_steps
            state["progress"] = progress or NONE
            self.labels[e.traj.trajectory_id].append(Label(state["index"], state["subtask"], state["progress"], ends))
            if ends:
                state["done"].append(state["subtask"])
                state.update(subtask=None, last=state["progress"])
