"""`SlotEngine`: a rollout backend whose keys and values stay where they are, one fixed place per slot.

`HFBackend` keeps each slot's cache as its own tensors and, every turn, pads them into one batch cache and
splits them back out: thousands of small copies, and a new padded length and mask at every decode step,
which on a GPU made reuse slower than re-encoding (benchmarks/README.md, "GPU check"). Here every layer
owns one buffer of keys and one of values, (slots, kv heads, capacity, head dim); slot s's tokens live in
row s at positions 0..n-1, for good. A turn

1. finds how many leading tokens of each prompt the slot already holds (as `HFBackend` does), and encodes
   the rest in one pass that attends to the row's cached positions (`_forward`); their keys and values are
   written into the row in place. `score` runs candidates in that same pass (each sees the prompt and its
   own tokens; they are never written), so admissible scoring uses the same cache;
2. decodes with one step of fixed shapes for the whole turn (`_step`): each row's new key and value is
   written at its own position with one indexed write per layer, and attention runs over a fixed window
   of the buffer with a mask built from the rows' lengths. A row that has stopped writes to the last
   position of the buffer, kept free for that.

With `compile` (a dict of `torch.compile` options; `policy.compile`), every decode step runs over all slots
and the whole buffer, so its shapes never change between steps, turns or calls: it compiles once, and
with `mode="reduce-overhead"` on a GPU it replays as a CUDA graph. Without it, each turn attends to the
window it needs and decodes only its own rows, which is what a CPU wants.

It runs the decoder layers itself, from the model's own modules (norms, projections, rotary embedding,
MLP; a peft adapter left unmerged acts as usual), for the Llama-shaped decoders this project loads: Qwen2
(the embedded model), Llama (SmolLM2), Mistral without a sliding window, and Qwen3. `rollout_engine` falls
back to `HFBackend` for any other model. Sampling and log-probs are `HFBackend`'s (`qevolve.models.backend.decode`).
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.nn.functional as F

from qevolve.models.backend import HFBackend, RolloutBackend, StopRule, _common_prefix, decode, query_layout
from qevolve.models.base import causal_lm

log = logging.getLogger(__name__)

LAYERS = ("Qwen2DecoderLayer", "LlamaDecoderLayer", "MistralDecoderLayer", "Qwen3DecoderLayer")
"""Decoder layers `SlotEngine` runs: pre-norm attention with rotary embeddings and an MLP, no sliding window."""
BLOCK = 256
"""The buffer grows in steps of this many positions (and never shrinks)."""


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, fold: bool | None = None
) -> torch.Tensor:
    """Grouped-query attention with a boolean `mask` (B, 1, Q, L): queries (B, heads, Q, d), keys and values
    (B, kv heads, L, d) -> (B, heads, Q, d), as `scaled_dot_product_attention(..., enable_gqa=True)`.

    With `fold` (the default on CUDA), each key-value head's query heads are folded into the query length (heads
    h = j * G + g, g < G, share kv head j) and the mask repeated to match, so attention runs with as many heads
    as keys: a masked call with `enable_gqa` can fall back to the math kernel on CUDA (float32 upcast, keys
    repeated per query head), one without it runs on the fused kernels that take a mask. The CPU's fused
    kernel takes both, and there the repeated mask makes a prefill slower (benchmarks/gpu_check.py, `sdpa`)."""
    B, H, Q, d = q.shape
    groups = H // k.shape[1]
    if not (q.is_cuda if fold is None else fold):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    folded = q.reshape(B, k.shape[1], groups * Q, d)
    out = F.scaled_dot_product_attention(
        folded, k, v, attn_mask=mask.expand(B, 1, Q, k.shape[2]).repeat(1, 1, groups, 1), scale=scale
    )
    return out.reshape(B, H, Q, d)


def unsupported(model) -> str | None:
    """Why `SlotEngine` cannot run `model`, or None when it can."""
    body = causal_lm(model).base_model
    layers = getattr(body, "layers", None)
    if layers is None or not hasattr(body, "rotary_emb"):
        return f"{type(body).__name__} has no decoder layers and rotary embedding of the Llama shape"
    for layer in layers:
        if type(layer).__name__ not in LAYERS:
            return f"{type(layer).__name__} is not one of {', '.join(LAYERS)}"
        if getattr(layer.self_attn, "sliding_window", None):
            return "its attention uses a sliding window"
    return None


def rollout_engine(model, pad_id: int, *, reuse: bool = True, compile: dict | None = None) -> RolloutBackend:
    """The backend a local rollout runs on: `SlotEngine` for the models it supports (with `reuse`), else
    `HFBackend`."""
    why = unsupported(model) if reuse else "the cache is not reused"
    if why is None:
        return SlotEngine(model, pad_id, compile=compile)
    log.info("rollouts run on HFBackend: %s", why)
    return HFBackend(model, pad_id, reuse=reuse)


class SlotEngine(HFBackend):
    """See the module docstring. `score`, `placement`, `forget` and the counters are `HFBackend`'s."""

    def __init__(self, model, pad_id: int, compile: dict | None = None, score_rows: int | None = None):
        super().__init__(model, pad_id, reuse=True, score_rows=score_rows)
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"SlotEngine cannot run this model: {why}")
        self.layers = list(self.body.layers)
        self.rope = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.compile_options = compile
        self._compiled = None
        self.slots_held: dict[int, list[int]] = {}
        """The tokens each slot's row holds, from position 0."""

    # -- the buffers ----------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Positions per slot, the last kept free for the writes of rows that have stopped."""
        return self.keys[0].shape[2] if self.keys else 0

    def reserve(self, slots: int, positions: int) -> None:
        """Grow the buffers to at least `slots` rows of `positions` usable positions, keeping their contents.

        A rollout stage calls it before its first turn with its batch and `context_tokens + max_new_tokens`
        (`qevolve.models.policy.local_backend`), so the compiled step is traced once. A prompt longer than
        that (a first observation past the context budget) grows them later; compiled, they then at least
        double, so a process sees few shapes (dynamo's recompile limit is 8)."""
        have_slots = self.keys[0].shape[0] if self.keys else 0
        if slots <= have_slots and positions < self.capacity:
            return
        slots, length = max(slots, have_slots), max(self.capacity, -(-(positions + 1) // BLOCK) * BLOCK)
        if self.compile_options is not None and self.keys:
            length = max(length, 2 * self.capacity)
            log.warning(
                "SlotEngine: the key-value buffer grows to %d slots x %d positions; the compiled decode step "
                "compiles again",
                slots,
                length,
            )
        p = next(self.model.parameters())
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            shape = (slots, attn.k_proj.out_features // attn.head_dim, length, attn.head_dim)
            for store in (self.keys, self.values):
                grown = torch.zeros(shape, dtype=p.dtype, device=self.device)
                if i < len(store):
                    old = store[i]
                    grown[: old.shape[0], :, : old.shape[2]] = old
                    store[i] = grown
                else:
                    store.append(grown)
                if self.compile_options is not None:  # written in place by a CUDA graph: its address must not move
                    torch._dynamo.mark_static_address(store[i])
        self._compiled = None  # new buffers: a compiled step is traced again

    def forget(self, slot: int | None = None) -> None:
        if slot is None:
            self.slots_held.clear()
        else:
            self.slots_held.pop(slot, None)

    def _held(self, slot: int, prompt: list[int]) -> int:
        """How many leading tokens of `prompt` the slot's row holds (at least one token is left to encode)."""
        return min(_common_prefix(self.slots_held.get(slot, []), prompt), len(prompt) - 1)

    # -- the layers ------------------------------------------------------------------------------------

    def _qkv(self, layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries, keys and values (B, heads, Q, head dim) of the normed hidden states `h` (B, Q, H)."""
        attn = layer.self_attn
        shape = (*h.shape[:2], -1, attn.head_dim)
        q, k = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3 norms each head
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, attn.v_proj(h).view(shape).transpose(1, 2)

    def _layer(self, layer, x: torch.Tensor, cos, sin, attend) -> torch.Tensor:
        q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
        o = attend(q, k, v, layer.self_attn.scaling)
        x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(*x.shape[:2], -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    @staticmethod
    def _rows(store: torch.Tensor, rows: torch.Tensor | slice, window: int) -> torch.Tensor:
        return store[rows, :, :window] if isinstance(rows, slice) else store[:, :, :window].index_select(0, rows)

    # -- a pass over each prompt's uncached tokens (and candidates) ------------------------------------------

    @torch.no_grad()
    def _forward(self, slots: list[int], prompts: list[list[int]], extra: list[list[list[int]]], reserve: int = 0):
        """As `HFBackend._forward` (the same layout and hidden states), on the slots' rows: each prompt's
        uncached suffix is written into its row, which then holds the prompt (and room for `reserve` more)."""
        reused = [self._held(s, p) for s, p in zip(slots, prompts)]
        self.reserve(max(slots) + 1, max(map(len, prompts)) + reserve)
        past = max(reused)
        queries, layout = query_layout(reused, prompts, extra)
        B, Q = len(prompts), max(map(len, queries))
        # Built as lists and made tensors in one call each: the operators a turn dispatches do not grow with its rows.
        ids, pos, segment, written = [], [], [], []  # segment: -1 prompt suffix, j candidate j, -2 padding
        for b, (q, n, (s, starts), slot) in enumerate(zip(queries, reused, layout, slots)):
            ids.append(q + [self.pad_id] * (Q - len(q)))
            pos.append(list(range(n, n + s)) + [0] * (Q - s))
            segment.append([-1] * s + [-2] * (Q - s))
            written += [(b, i, slot, n + i) for i in range(s)]
            for j, (start, seg) in enumerate(zip(starts, extra[b])):
                pos[b][start : start + len(seg)] = range(n + s, n + s + len(seg))
                segment[b][start : start + len(seg)] = [j] * len(seg)
        at = torch.tensor(written, dtype=torch.long, device=self.device).T
        ids, pos, segment = (torch.tensor(t, dtype=torch.long, device=self.device) for t in (ids, pos, segment))
        cached = (
            torch.arange(past, device=self.device)[None, :] < torch.tensor(reused, device=self.device)[:, None]
        )  # (B, past)
        qs, ks = segment[:, :, None], segment[:, None, :]
        own = torch.ones(Q, Q, dtype=torch.bool, device=self.device).tril() & (ks != -2) & ((ks == -1) | (ks == qs))
        own |= torch.eye(Q, dtype=torch.bool, device=self.device)  # padding queries attend to themselves (no NaN)
        mask = torch.cat([cached[:, None, :].expand(B, Q, past), own], dim=-1)[:, None]  # (B, 1, Q, past + Q)
        rows = self._row_index(slots)
        index = (at[2][:, None], torch.arange(self.keys[0].shape[1], device=self.device)[None, :], at[3][:, None])

        def attend(i):
            def run(q, k, v, scale):
                K = torch.cat([self._rows(self.keys[i], rows, past), k], dim=2)
                V = torch.cat([self._rows(self.values[i], rows, past), v], dim=2)
                out = attention(q, K, V, mask, scale)
                self.keys[i].index_put_(index, k.transpose(1, 2)[at[0], at[1]])
                self.values[i].index_put_(index, v.transpose(1, 2)[at[0], at[1]])
                return out

            return run

        x = self.body.embed_tokens(ids)
        cos, sin = self.body.rotary_emb(x, pos)
        for i, layer in enumerate(self.layers):
            x = self._layer(layer, x, cos, sin, attend(i))
        self.encoded_tokens += sum(map(len, queries))
        for slot, p in zip(slots, prompts):
            self.slots_held[slot] = list(p)
        return self.body.norm(x), layout, None, None

    def _row_index(self, slots: list[int]) -> torch.Tensor | slice:
        """The buffer rows of `slots`: a slice (a view) when they are consecutive, else an index."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return slice(slots[0], slots[0] + len(slots))
        return torch.tensor(slots, device=self.device)

    # -- decoding ----------------------------------------------------------------------------------------

    def _step(
        self, ids: torch.Tensor, pos: torch.Tensor, write_at: torch.Tensor, rows: torch.Tensor | slice, window: int
    ) -> torch.Tensor:
        """One decode step for `rows` of the buffers: token `ids` (R,) at positions `pos` (R,), their keys and
        values written at `write_at` (R,); attention over the first `window` positions. Logits (R, V)."""
        seen = torch.arange(window, device=ids.device)[None, :]
        mask = ((seen < pos[:, None]) | (seen == write_at[:, None]) | (seen == 0))[
            :, None, None, :
        ]  # (R, 1, 1, window)
        slots, heads = self.keys[0].shape[:2]
        index = (
            torch.arange(slots, device=ids.device)[rows][:, None],
            torch.arange(heads, device=ids.device)[None, :],
            write_at[:, None],
        )

        def attend(i):
            def run(q, k, v, scale):
                self.keys[i].index_put_(index, k[:, :, 0])
                self.values[i].index_put_(index, v[:, :, 0])
                K, V = self._rows(self.keys[i], rows, window), self._rows(self.values[i], rows, window)
                return attention(q, K, V, mask, scale)

            return run

        x = self.body.embed_tokens(ids[:, None])
        cos, sin = self.body.rotary_emb(x, pos[:, None])
        for i, layer in enumerate(self.layers):
            x = self._layer(layer, x, cos, sin, attend(i))
        return self.head(self.body.norm(x)[:, 0])

    def _full_step(self, ids: torch.Tensor, pos: torch.Tensor, write_at: torch.Tensor) -> torch.Tensor:
        """`_step` over every slot and the whole buffer: the same shapes for every call (what is compiled)."""
        return self._step(ids, pos, write_at, slice(None), self.capacity)

    @torch.no_grad()
    def generate(
        self,
        slots: list[int],
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        stop: StopRule,
        greedy: bool,
        temperature: float,
        seeds: list[int] | None = None,
    ) -> list[tuple[list[int], float]]:
        hidden, layout, _, _ = self._forward(slots, prompts, [[] for _ in prompts], reserve=max_new_tokens)
        last = self.head(
            hidden[
                torch.arange(len(prompts), device=self.device),
                torch.tensor([s - 1 for s, _ in layout], device=self.device),
            ]
        )
        length = torch.tensor([len(p) for p in prompts], device=self.device)
        free = self.capacity - 1  # where stopped rows write
        if self.compile_options is not None:
            if self._compiled is None:
                self._compiled = torch.compile(self._full_step, fullgraph=True, dynamic=False, **self.compile_options)
            at = torch.tensor(slots, device=self.device)
            n_slots = self.keys[0].shape[0]
            every = torch.zeros(n_slots, dtype=torch.long, device=self.device)

            def step(
                nxt, pos, write_at
            ):  # the call's rows scattered into all slots; the others write to the free position
                ids, p, w = every.clone(), every.clone(), torch.full_like(every, free)
                ids[at], p[at], w[at] = nxt, pos, write_at
                return self._compiled(ids, p, w)[at]
        else:
            rows, window = self._row_index(slots), int(length.max()) + max_new_tokens

            def step(nxt, pos, write_at):
                return self._step(nxt, pos, write_at, rows, window)

        def feed(nxt: torch.Tensor, running: list[bool]) -> torch.Tensor:
            nonlocal length
            live = torch.tensor(running, device=self.device)
            logits = step(nxt, length, torch.where(live, length, free))
            length = length + live
            self.encoded_tokens += sum(running)
            return logits

        out = decode(
            last, feed, max_new_tokens=max_new_tokens, stop=stop, greedy=greedy, temperature=temperature, seeds=seeds
        )
        for slot, p, (tokens, _) in zip(slots, prompts, out):  # the row holds the turn too, but for its last token
            self.slots_held[slot] = list(p) + tokens[:-1]
        return out
