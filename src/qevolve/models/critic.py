"""The critic: the policy's base model with its own LoRA adapter, plus Q and V heads.

One forward pass over a trajectory window gives every step's values: V(s_t) is read at the last token of
observation turn t (just before the action), Q(s_t, a_t) at the last token of action t. A slow-moving copy
of the Q head (`q_target`, Polyak-averaged after each optimiser step) gives IQL's target Q; it reads the
same backbone features, so keeping it costs one linear layer rather than a second model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qevolve.algos.rl import step_weights
from qevolve.config import ModelConfig
from qevolve.data.store import Trajectory
from qevolve.errors import artifact
from qevolve.models.base import base_dtype_compute, causal_lm
from qevolve.models.device import is_main, model_device, pad_ids
from qevolve.models.policy import load_policy, save_adapters
from qevolve.models.prompt import PromptBuilder, Window

HEADS_FILE = "heads.safetensors"


class Critic(nn.Module):
    checkpoint_extra = ("q_target.weight", "q_target.bias")
    """Changed by `update_target`, not by the optimiser: in-stage checkpoints must save it too."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        hidden = causal_lm(lm).config.hidden_size
        self.v = nn.Linear(hidden, 1)
        self.q = nn.Linear(hidden, 1)
        for head in (self.v, self.q):
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        self.q_target = copy.deepcopy(self.q).requires_grad_(False)
        self.to(next(lm.parameters()).device)  # the heads stay float32 whatever the backbone's dtype

    def forward(self, ids: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(V, Q, target Q) at every position, each (B, T)."""
        backbone = causal_lm(self.lm).base_model  # the transformer without its LM head
        with base_dtype_compute(self.lm):
            h = backbone(input_ids=ids, attention_mask=attn).last_hidden_state.float()
        return self.v(h).squeeze(-1), self.q(h).squeeze(-1), self.q_target(h).squeeze(-1)

    @torch.no_grad()
    def update_target(self, rate: float) -> None:
        for t, p in zip(self.q_target.parameters(), self.q.parameters()):
            t.lerp_(p, rate)

    def save(self, out: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """Adapter and heads into `out`; from `state` (`qevolve.training.full_state`) for a sharded critic."""
        from safetensors.torch import save_file

        state = state if state is not None else {n: t.detach() for n, t in self.state_dict().items()}
        save_adapters(
            self.lm, out, state_dict={n.removeprefix("lm."): t for n, t in state.items() if n.startswith("lm.")}
        )
        heads = {n: t.contiguous() for n, t in state.items() if n.split(".", 1)[0] in ("v", "q", "q_target")}
        save_file(heads, str(out / HEADS_FILE))


def load_critic(base_dir: Path, cfg: ModelConfig, adapter: Path, trainable: bool = False) -> tuple[Critic, object]:
    """(critic, tokenizer) with the LoRA adapter saved at `adapter`; heads too if saved there (a critic),
    zero-initialised otherwise (a policy adapter to start from)."""
    from safetensors.torch import load_file

    lm, tok = load_policy(base_dir, cfg, adapter=adapter, trainable=trainable)
    critic = Critic(lm)
    heads = Path(adapter) / HEADS_FILE
    if heads.exists():
        try:
            state = load_file(str(heads))
        except Exception as err:  # noqa: BLE001 - safetensors' own error type
            raise artifact(heads, f"cannot read the critic's heads ({err})") from None
        for name in ("v", "q", "q_target"):
            getattr(critic, name).load_state_dict(
                {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(name + ".")}
            )
    return critic, tok


@dataclass
class CriticItem:
    """One window of one trajectory, with the per-step quantities the critic's losses need."""

    traj: int
    """Index of the trajectory in the dataset."""
    window: Window
    rewards: torch.Tensor
    """Per step of the trajectory: environment reward plus auxiliary reward."""
    weights: torch.Tensor
    done: bool
    """Whether the trajectory ended in a terminal state (no bootstrap after its last step)."""


def trajectory_windows(builder: PromptBuilder, t: Trajectory) -> list[Window]:
    """Windows over all steps plus the final observation, each with its next state (see `windows`)."""
    observations = [s.observation for s in t.steps] + [t.steps[-1].next_observation]
    return builder.windows(t.instruction, observations, [s.output for s in t.steps], lookahead=True)


def critic_items(builder: PromptBuilder, trajs: list[Trajectory], weighted: bool) -> list[CriticItem]:
    items = []
    for i, t in enumerate(trajs):
        if not t.steps:
            continue
        rewards = torch.tensor([s.reward + s.aux_reward for s in t.steps])  # aux rewards enter the critic's targets
        T = len(t.steps)
        weights = step_weights(T, t.won) if weighted else torch.ones(T)
        # A window holding only the final observation adds nothing: the previous window's lookahead has it.
        windows = [w for w in trajectory_windows(builder, t) if any(b > a for _, _, a, b in w.steps)]
        items += [CriticItem(i, w, rewards, weights, t.steps[-1].done) for w in windows]
    return items


def read_positions(item: CriticItem) -> dict[int, tuple[int, int]]:
    """step -> (position of V(s_step), position of Q(s_step, a_step), or -1 for a state without action)."""
    return {
        step: (obs_end, act_end - 1 if act_end > act_start else -1)
        for step, obs_end, act_start, act_end in item.window.steps
    }


@torch.no_grad()
def critic_values(
    critic: Critic, items: list[CriticItem], pad_id: int, batch_size: int
) -> dict[int, dict[int, tuple[float, float]]]:
    """trajectory index -> step -> (V(s_step), Q(s_step, a_step) or NaN), read in each step's own window."""
    from tqdm import tqdm

    critic.eval()
    out: dict[int, dict[int, tuple[float, float]]] = {}
    for i in tqdm(range(0, len(items), batch_size), desc="critic values", unit="batch", disable=not is_main()):
        mb = items[i : i + batch_size]
        ids, attn = pad_ids([it.window.ids for it in mb], pad_id, model_device(critic))
        v, q = (x.cpu() for x in critic(ids, attn)[:2])
        for b, it in enumerate(mb):
            values = out.setdefault(it.traj, {})
            for step, (vp, qp) in read_positions(it).items():
                if qp >= 0 or step not in values:  # a lookahead state is read in its own window when it has one
                    values[step] = (float(v[b, vp]), float(q[b, qp]) if qp >= 0 else float("nan"))
    return out
