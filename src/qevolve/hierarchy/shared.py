"""What the hierarchical stages share: the roles file saved with a policy, the prompts' token ids, the
agent. These stages (annotate, bc, collect, critic, evaluate) serve every hierarchical method (STEP-HRL,
Multi²), each reading the section named after its method (`qevolve.hierarchy.config.section`)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pyarrow as pa

from qevolve.data.atomic import atomic_dir
from qevolve.data.store import read_checked
from qevolve.errors import artifact
from qevolve.hierarchy.agent import HierarchicalAgent
from qevolve.hierarchy.config import section
from qevolve.hierarchy.roles import ROLES, RolePrompts
from qevolve.hierarchy.transitions import read_transitions
from qevolve.models.policy import load_policy, save_adapters, use_adapter
from qevolve.models.prompt import PromptBuilder

COLLECTED = "transitions"
"""The transition store inside a `collect@k` folder (beside `episodes`, its step store)."""
ADVANTAGES = "advantages.parquet"
"""The file in an `advantage@k` folder: A = Q - V of every transition `critic@k` trained on."""
ADVANTAGE_SCHEMA = pa.schema(
    [
        ("trajectory_id", pa.string()),
        ("level", pa.string()),
        ("step", pa.int32()),
        ("advantage", pa.float64()),
        ("v", pa.float64()),
        ("q", pa.float64()),
    ],
    metadata={b"qevolve.schema_version": b"1"},
)
ROLES_FILE = "roles.json"
"""Saved beside a policy's adapter: the environment, whether it keeps progress, whether its low level reads
the subtask's history, the subtasks its high level chooses among and whether its roles share one adapter,
so acting uses what training used."""


def role_builder(params, tokenizer) -> PromptBuilder:
    """The chat format around each role's single turn, and the observation clip (`prompt.max_observation_tokens`)."""
    return PromptBuilder(
        tokenizer, params.model.context_tokens, max_observation_tokens=params.prompt.max_observation_tokens, intro=""
    )


def role_prompts(
    params, builder: PromptBuilder, progress: bool | None = None, history: bool | None = None
) -> RolePrompts:
    """The roles' prompts for this environment: the method section's `progress` and `history`, unless given
    (acting reads them from the policy's roles file)."""
    cfg = section(params)
    return RolePrompts(
        params.env.name,
        cfg.progress if progress is None else progress,
        builder.clip,
        cfg.history if history is None else history,
    )


def write_roles(folder: Path, prompts: RolePrompts, subtasks: list[str], adapters: str) -> None:
    roles = {
        "env": prompts.env,
        "progress": prompts.progress,
        "history": prompts.history,
        "subtasks": subtasks,
        "adapters": adapters,
    }
    (folder / ROLES_FILE).write_text(json.dumps(roles, indent=1) + "\n")


def save_roles_policy(model, out: Path, previous_dir: Path) -> None:
    """Write the trained role adapter(s) to `out` atomically, with the roles file of the policy they came from."""
    with atomic_dir(out) as tmp:
        save_adapters(model, tmp)
        shutil.copy(Path(previous_dir) / ROLES_FILE, tmp / ROLES_FILE)


def read_roles(policy_dir: Path) -> dict:
    path = Path(policy_dir) / ROLES_FILE
    try:
        roles = json.loads(path.read_text())
        _ = roles["env"], roles["progress"], list(roles["subtasks"])
        if roles["adapters"] not in ("shared", "separate"):
            raise ValueError(f"adapters is {roles['adapters']!r}, expected 'shared' or 'separate'")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise artifact(
            path, f"cannot read the roles the policy was trained with ({type(err).__name__}: {err})"
        ) from None
    return roles


def role_names(adapters: str, progress: bool = True) -> tuple[str, ...]:
    """The adapters of a policy with `adapters` shared or separate (none for the progress role of a policy
    that keeps no progress): `load_policy`'s `names`."""
    return tuple(r for r in ROLES if progress or r != "progress") if adapters == "separate" else ()


def load_roles_policy(params, base_dir: Path, policy_dir: Path, trainable: bool = False):
    """(model, tokenizer, separate) of the policy at `policy_dir`, with the adapters its roles file names;
    with separate ones, `use_adapter(model, role)` picks a role's."""
    roles = read_roles(policy_dir)
    names = role_names(roles["adapters"], roles["progress"])
    model, tok = load_policy(base_dir, params.model, adapter=policy_dir, trainable=trainable, names=names)
    return model, tok, bool(names)


def role_groups(model, mb: list, separate: bool):
    """A micro-batch of (role, ...) items as the passes to run: all at once on a shared adapter; per role,
    with its adapter made active, on separate ones."""
    if not separate:
        yield mb
        return
    for role in ROLES:
        group = [it for it in mb if it[0] == role]
        if group:
            use_adapter(model, role)
            yield group


def make_agent(params, base_dir: Path, policy_dir: Path, temperature: float) -> HierarchicalAgent:
    """The hierarchical agent of the policy at `policy_dir` (a shared adapter merged into the base; separate
    ones switched between per role call), acting as its roles file says."""
    roles = read_roles(policy_dir)
    if roles["env"] != params.env.name:
        raise artifact(
            Path(policy_dir) / ROLES_FILE,
            f"the policy was trained on {roles['env']!r}, not env.name {params.env.name!r}",
        )
    model, tok, separate = load_roles_policy(params, base_dir, policy_dir)
    return agent_of(params, model, tok, separate, roles, temperature)


def agent_of(params, model, tok, separate: bool, roles: dict, temperature: float) -> HierarchicalAgent:
    """The hierarchical agent acting with `model` (its role adapters switched per call when `separate`) as
    the roles file `roles` says."""
    builder = role_builder(params, tok)
    cfg = section(params)
    return HierarchicalAgent(
        dict.fromkeys(ROLES, model),
        tok,
        builder,
        role_prompts(params, builder, roles["progress"], roles.get("history", False)),
        activate=(lambda role: use_adapter(model, role)) if separate else None,
        mode=params.policy.action_mode,
        high_mode=cfg.high_mode,
        subtasks=roles["subtasks"],
        temperature=temperature,
        max_new_tokens=params.policy.max_new_tokens,
        progress_tokens=cfg.progress_tokens,
        max_subtask_steps=cfg.max_subtask_steps,
    )


def mix(expert: list[dict], collected: list[dict], collected_per_expert: float, seed: int) -> list[dict]:
    """Every expert transition, and the collected ones subsampled (without replacement, with `seed`) to at most
    `collected_per_expert` per expert one (0: all of both). The experts are never cut to fit the ratio: the
    paper's 1 : 2 is reached by collecting enough (`collect`), and a shorter collection trains on fewer
    collected transitions, not on fewer demonstrations (the critic's metrics give the share reached)."""
    if collected_per_expert and expert and len(collected) > collected_per_expert * len(expert):
        collected = random.Random(seed).sample(collected, round(collected_per_expert * len(expert)))
    return expert + collected


def outcome_rewards(rows: list[dict]) -> list[dict]:
    """`reward: outcome` for one level's transitions of whole trajectories: 1 at a won trajectory's last step
    and 0 elsewhere, plus the rejection penalty a row carries (its negative reward), done only at the last step."""
    last: dict[str, int] = {}
    for r in rows:
        last[r["trajectory_id"]] = max(last.get(r["trajectory_id"], -1), r["step"])
    return [
        {
            **r,
            "reward": min(r["reward"], 0.0) + float(r["won"] and r["step"] == last[r["trajectory_id"]]),
            "done": r["step"] == last[r["trajectory_id"]],
        }
        for r in rows
    ]


def with_rewards(sets: dict[str, list[dict]], reward: str) -> dict[str, list[dict]]:
    """Transition sets with the low and progress levels' rewards of `<method>.reward` (they are stored as `subgoal`)."""
    return {
        role: outcome_rewards(rows) if reward == "outcome" and role != "high" else rows for role, rows in sets.items()
    }


def training_sets(params, data_dir: Path, collected_dir: Path) -> dict[str, list[dict]]:
    """Per level, the expert transitions (`annotate`) and the collected ones (`collect@k`), with the rewards of
    `<method>.reward`, mixed at `<method>.collected_per_expert`, drawn with `<method>.critic.seed` (no collected ones
    with `<method>.collected: false`): what `critic@k` and `policy@k` train on."""
    cfg = section(params)
    expert, collected = (
        with_rewards(read_transitions(d), cfg.reward) for d in (data_dir, Path(collected_dir) / COLLECTED)
    )
    if not cfg.collected:
        collected = {role: [] for role in ROLES}
    return {role: mix(expert[role], collected[role], cfg.collected_per_expert, cfg.critic.seed) for role in ROLES}


def read_advantages(folder: Path) -> dict[tuple[str, str, int], float]:
    """(trajectory_id, level, step) -> advantage, from an `advantage@k` folder."""
    rows = read_checked(Path(folder) / ADVANTAGES, ADVANTAGE_SCHEMA, "1").to_pylist()
    return {(r["trajectory_id"], r["level"], r["step"]): r["advantage"] for r in rows}


def advantage_of(advantages: dict, folder: Path, role: str, row: dict) -> float:
    """The advantage `critic@k` wrote (`read_advantages` of `folder`) for transition `row` of `role`."""
    key = (row["trajectory_id"], role, row["step"])
    if key not in advantages:
        raise artifact(
            Path(folder), f"no advantage for {role} transition {key[0]} step {key[2]}: it was written for other data"
        )
    return advantages[key]
