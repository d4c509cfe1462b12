"""The critic: the policy's base model with its own LoRA adapter, plus Q and V heads.

One forward pass over a trajectory window gives every step's values: V(s_t) is read at the last token of
observation turn t (just before the action), Q(s_t, a_t) at the last token of action t. A slow-moving copy
of the Q head (`q_target`, Polyak-averaged after each optimiser step) gives IQL's target Q; it reads the
same backbone features, so keeping it costs one linear layer rather than a second model.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from qevolve.config import ModelConfig
from qevolve.models.base import causal_lm
from qevolve.models.policy import load_policy

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
        h = backbone(input_ids=ids, attention_mask=attn).last_hidden_state.float()
        return self.v(h).squeeze(-1), self.q(h).squeeze(-1), self.q_target(h).squeeze(-1)

    @torch.no_grad()
    def update_target(self, rate: float) -> None:
        for t, p in zip(self.q_target.parameters(), self.q.parameters()):
            t.lerp_(p, rate)

    def save(self, out: Path) -> None:
        from safetensors.torch import save_file

        self.lm.save_pretrained(out)
        heads = {f"{name}.{k}": v.detach().contiguous() for name in ("v", "q", "q_target") for k, v in getattr(self, name).state_dict().items()}
        save_file(heads, str(out / HEADS_FILE))


def load_critic(base_dir: Path, cfg: ModelConfig, adapter: Path, trainable: bool = False) -> tuple[Critic, object]:
    """(critic, tokenizer) with the LoRA adapter saved at `adapter`; heads too if saved there (a critic),
    zero-initialised otherwise (a policy adapter to start from)."""
    from safetensors.torch import load_file

    lm, tok = load_policy(base_dir, cfg, adapter=adapter, trainable=trainable)
    critic = Critic(lm)
    heads = Path(adapter) / HEADS_FILE
    if heads.exists():
        state = load_file(str(heads))
        for name in ("v", "q", "q_target"):
            getattr(critic, name).load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(name + ".")})
    return critic, tok
