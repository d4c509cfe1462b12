"""A step-level critic for a hierarchical policy: a backbone (the critic's own LoRA adapter, or a policy's
frozen features) and, per level, V and Q heads with a Polyak target Q. `critic@k` trains it (STEP-HRL's
levels, or Multi²'s System 2); Multi²'s actor scores sampled outputs with it (`advantages_of`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qevolve.data.atomic import atomic_dir
from qevolve.errors import artifact
from qevolve.hierarchy.roles import ROLES, encode
from qevolve.models.base import base_dtype_compute, causal_lm
from qevolve.models.device import model_device, pad_ids
from qevolve.models.policy import load_policy, save_adapters


class LevelCritic(nn.Module):
    """A backbone and, per level, V and Q heads and a target Q head (Polyak-averaged, no gradient)."""

    def __init__(self, lm, frozen: bool, levels: tuple[str, ...] = ROLES):
        super().__init__()
        self.lm, self.frozen = lm, frozen
        hidden = causal_lm(lm).config.hidden_size
        self.v = nn.ModuleDict({role: nn.Linear(hidden, 1) for role in levels})
        self.q = nn.ModuleDict({role: nn.Linear(hidden, 1) for role in levels})
        for head in [*self.v.values(), *self.q.values()]:
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        self.q_target = copy.deepcopy(self.q).requires_grad_(False)
        self.checkpoint_extra = tuple(n for n, _ in self.named_parameters() if n.startswith("q_target."))
        if frozen:
            lm.requires_grad_(False)
        self.to(next(lm.parameters()).device)

    def features(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        backbone = causal_lm(self.lm).base_model
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen), base_dtype_compute(self.lm):
            return backbone(input_ids=ids, attention_mask=attn).last_hidden_state.float()

    @torch.no_grad()
    def update_target(self, rate: float) -> None:
        for role in self.q:
            for t, p in zip(self.q_target[role].parameters(), self.q[role].parameters()):
                t.lerp_(p, rate)


@dataclass
class Item:
    role: str
    key: tuple[str, str, int]
    """(trajectory_id, role, step): which transition."""
    ids: list[int]
    """The state's prompt followed by the output."""
    state_end: int
    next_ids: list[int]
    reward: float
    done: bool
    output_start: int
    """Where the output starts in `ids`."""


def critic_items(builder, sets: dict[str, list[dict]], action_end: bool = False) -> list[Item]:
    """One item per transition: V(s) read at the state prompt's last token, V(s') at the next state's.
    `action_end` (Multi²'s public code): V read at the output's last token, so V(s) is a function of (s, a),
    and V(s') at the end of the next transition of the same segment (same trajectory and subtask, the next
    step among `rows`), or of the next state's prompt where `rows` hold none (the segment's end)."""
    items = []
    for role, rows in sets.items():
        encoded = [encode(builder, r["state_text"], r["output_text"]) for r in rows]
        following = _following(rows) if action_end else {}
        for i, (r, (ids, mask)) in enumerate(zip(rows, encoded)):
            nxt = following.get(i)
            next_ids = (
                encoded[nxt][0] if nxt is not None else builder.head_ids + builder.user_turn(r["next_state_text"])
            )
            state_end = len(ids) - 1 if action_end else mask.index(1) - 1
            items.append(
                Item(
                    role,
                    (r["trajectory_id"], role, r["step"]),
                    ids,
                    state_end,
                    next_ids,
                    r["reward"],
                    r["done"],
                    mask.index(1),
                )
            )
    return items


STEPS_TAKEN = "Steps taken: {}"


def with_steps(sets: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """`<method>.critic.time_aware`: every state and next state of `sets` (the transitions of whole episodes, every
    level's) ends with the environment steps taken before it (`STEPS_TAKEN`): the low and progress levels' step t
    and t + 1, the high level's at its subtask's first step and at the next subtask's, or at the episode's end.
    The critic then sees the time an episode has left under its step cap, so a step that changes nothing costs
    what it costs in time, not one discount (Pardo et al. 2018, "Time Limits in Reinforcement Learning")."""
    ends: dict[str, int] = {}
    starts: dict[str, list[int]] = {}
    for role, rows in sets.items():
        for r in rows:
            ends[r["trajectory_id"]] = max(ends.get(r["trajectory_id"], 0), r["step"] + 1)
            if role == "high":
                starts.setdefault(r["trajectory_id"], []).append(r["step"])

    def after(role: str, r: dict) -> int:
        if role != "high":
            return r["step"] + 1
        return min((s for s in starts[r["trajectory_id"]] if s > r["step"]), default=ends[r["trajectory_id"]])

    return {
        role: [
            {
                **r,
                "state_text": f"{r['state_text']}\n{STEPS_TAKEN.format(r['step'])}",
                "next_state_text": f"{r['next_state_text']}\n{STEPS_TAKEN.format(after(role, r))}",
            }
            for r in rows
        ]
        for role, rows in sets.items()
    }


def _following(rows: list[dict]) -> dict[int, int]:
    """Row index -> the index of the next row of its segment (trajectory, subtask) by step, where there is one."""
    segments: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        segments.setdefault((r["trajectory_id"], r["subtask_index"]), []).append(i)
    out = {}
    for members in segments.values():
        members.sort(key=lambda i: rows[i]["step"])
        out.update(zip(members, members[1:]))
    return out


def values(critic: LevelCritic, mb: list[Item], pad_id: int) -> dict[str, torch.Tensor]:
    """V(s), Q(s, a), target Q(s, a) and V(s') of every item, from one pass over its two sequences."""
    device = model_device(critic)
    ids, attn = pad_ids([it.ids for it in mb] + [it.next_ids for it in mb], pad_id, device)
    h = critic.features(ids, attn)
    n = len(mb)
    rows = torch.arange(n, device=device)
    h_s = h[rows, torch.tensor([it.state_end for it in mb], device=device)]
    h_sa = h[rows, torch.tensor([len(it.ids) - 1 for it in mb], device=device)]
    h_next = h[rows + n, torch.tensor([len(it.next_ids) - 1 for it in mb], device=device)]
    out: dict[str, list] = {"v": [], "q": [], "q_target": [], "v_next": []}
    for b, it in enumerate(mb):
        out["v"].append(critic.v[it.role](h_s[b]))
        out["q"].append(critic.q[it.role](h_sa[b]))
        out["q_target"].append(critic.q_target[it.role](h_sa[b]))
        out["v_next"].append(critic.v[it.role](h_next[b]))
    return {k: torch.cat(v) for k, v in out.items()}


def advantages_of(
    critic: LevelCritic, level: str, prompts: list[list[int]], outputs: list[list[int]], pad_id: int
) -> torch.Tensor:
    """A(s, a) = Q(s, a) - V(s) of each (prompt, output) pair at `level`, from one pass over prompt + output."""
    device = model_device(critic)
    ids, attn = pad_ids([p + o for p, o in zip(prompts, outputs)], pad_id, device)
    h = critic.features(ids, attn)
    rows = torch.arange(len(prompts), device=device)
    h_s = h[rows, torch.tensor([len(p) - 1 for p in prompts], device=device)]
    h_sa = h[rows, torch.tensor([len(p) + len(o) - 1 for p, o in zip(prompts, outputs)], device=device)]
    return (critic.q[level](h_sa) - critic.v[level](h_s)).squeeze(-1)


def save_critic(critic: LevelCritic, folder: Path, adapter: bool = True) -> None:
    """Write `critic` to `folder` atomically: its LoRA adapter (unless its backbone is a policy's frozen
    features, `adapter=False`) and its heads (`heads.safetensors`), as `load_critic` reads them."""
    from safetensors.torch import save_file

    with atomic_dir(folder) as tmp:
        if adapter:
            save_adapters(critic.lm, tmp)
        save_file(
            {n: t.detach().contiguous() for n, t in critic.state_dict().items() if not n.startswith("lm.")},
            str(tmp / "heads.safetensors"),
        )


def load_critic(
    params, base_dir: Path, critic_dir: Path, levels: tuple[str, ...], trainable: bool = False
) -> LevelCritic:
    """The critic `critic@k` wrote at `critic_dir` (its adapter and heads): frozen with the adapter merged,
    for scoring, or `trainable` to train on."""
    lm, _ = load_policy(base_dir, params.model, adapter=critic_dir, trainable=trainable)
    model = load_heads(LevelCritic(lm, frozen=not trainable, levels=levels), critic_dir)
    return model if trainable else model.eval()


def load_heads(model: LevelCritic, critic_dir: Path) -> LevelCritic:
    """`model` with the heads `critic@k` wrote at `critic_dir` (`heads.safetensors`) loaded into it."""
    from safetensors.torch import load_file

    levels = tuple(model.v)
    heads = Path(critic_dir) / "heads.safetensors"
    try:
        missing, unexpected = model.load_state_dict(load_file(str(heads)), strict=False)
    except Exception as err:  # noqa: BLE001 - safetensors raises several kinds for a cut file
        raise artifact(heads, f"cannot load the critic's heads ({type(err).__name__}: {str(err)[:200]})") from err
    wrong = [n for n in missing if not n.startswith("lm.")] + list(unexpected)
    if wrong:
        raise artifact(heads, f"the critic's heads do not match levels {list(levels)}: {wrong[:4]}")
    return model
