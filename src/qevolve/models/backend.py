"""Rollout backends: how the policy's forward passes are run for a batch of concurrent episodes.

`RolloutBackend` is the seam: `score` (log-likelihood of candidate continuations, for `admissible` mode)
and `generate` (sampled or greedy continuations, for `free` mode), both for a batch of prompts, each
prompt tied to a `slot` (a place where episodes run one after another). Rollouts run on
`qevolve.models.engine.SlotEngine` (slot-resident keys and values), on vLLM (`vllm_backend`), or on
`HFBackend`, defined here.

`HFBackend` runs a Hugging Face causal LM through its own forward. With `reuse=True` it keeps each slot's KV
cache between calls and encodes only the tokens after the longest prefix the new prompt shares with the
cached one: across the turns of one episode that is just the last action and the new observation; after
history truncation or a new episode it is everything after the shared head. Slots of different lengths
are batched by left-padding their caches (a copy in and out per slot and layer every turn). With
`reuse=False` every call encodes every prompt in full: the reference path that the engine is tested
against, and the baseline the `rollout` benchmark compares with. Both share the token loop (`decode`) and
the sampler (`draw`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from qevolve.algos.losses import head_logprobs
from qevolve.models.base import causal_lm
from qevolve.models.device import placement


class RolloutBackend(Protocol):
    def score(
        self, slots: list[int], prompts: list[list[int]], candidates: list[list[list[int]]]
    ) -> list[torch.Tensor]:
        """Sum of token log-probs of each candidate after its prompt; tensor b has len(candidates[b]) entries."""

    def generate(
        self,
        slots: list[int],
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        stop: StopRule,
        greedy: bool,
        temperature: float,
        seeds: list[int] | None,
    ) -> list[tuple[list[int], float]]:
        """(new tokens, their summed log-prob) per prompt; each stops where `stop` says. Sampled (not
        `greedy`) prompt b draws from its own stream seeded by `seeds[b]`, whatever it is batched with."""

    def placement(self) -> dict:
        """Where the passes run, for a stage's metrics."""


class StopRule(Protocol):
    def __call__(self, tokens: list[int]) -> bool:
        """True once the generated `tokens` are complete."""


def seeds_from(generators: list[torch.Generator] | None) -> list[int] | None:
    """One seed for a backend call from each episode's generator (None: greedy, nothing drawn)."""
    return None if generators is None else [int(torch.randint(2**62, (1,), generator=g)) for g in generators]


def query_layout(
    reused: list[int], prompts: list[list[int]], extra: list[list[list[int]]]
) -> tuple[list[list[int]], list]:
    """What a pass encodes per prompt: its tokens after the `reused[b]` its cache holds, then the segments
    `extra[b]`; and the layout, (suffix length, each segment's start) in query positions."""
    queries, layout = [], []
    for n, p, segs in zip(reused, prompts, extra):
        q, starts = list(p[n:]), []
        for seg in segs:
            starts.append(len(q))
            q += seg
        queries.append(q)
        layout.append((len(p) - n, starts))
    return queries, layout


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


SCORE_ELEMENTS = 2**24
"""Logits (scored tokens x vocabulary) `score` makes at once: 64 MiB in float32, whatever the candidates."""


class HFBackend:
    """A Hugging Face causal LM (peft-wrapped or not) run in this process; see the module docstring."""

    def __init__(self, model, pad_id: int, reuse: bool = True, score_rows: int | None = None):
        self.model, self.pad_id, self.reuse = model, pad_id, reuse
        # Episodes whose candidates `score` runs through one pass. Each episode's row holds its prompt
        # suffix and all its 10-40 candidates, and rows of different widths and cache lengths pad each
        # other: on a CPU one episode per pass is faster (benchmarks/README.md, `rollout`); an
        # accelerator wants the whole batch.
        self.device = next(model.parameters()).device
        self.score_rows = score_rows if score_rows is not None else (1 if self.device.type == "cpu" else None)
        self.score_elements = SCORE_ELEMENTS
        # The transformer body and the LM head apart: logits are computed only where they are read.
        self.body, self.head = causal_lm(model).base_model, model.get_output_embeddings()
        self._cache: dict[int, tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.encoded_tokens = 0
        """Tokens run through the model so far (prompts, candidates and generated tokens)."""

    # -- the per-slot cache -------------------------------------------------------------------------

    def _reusable(self, slot: int, prompt: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """How many leading tokens of `prompt` the slot's cache holds (at least one token is left to encode)."""
        if not self.reuse or slot not in self._cache:
            return 0, None
        ids, kv = self._cache[slot]
        n = min(_common_prefix(ids, prompt), len(prompt) - 1)
        return (n, kv) if n > 0 else (0, None)

    def placement(self) -> dict:
        """Where the passes run (`qevolve.models.device.placement`), for a stage's metrics."""
        return placement(self.model)

    def forget(self, slot: int | None = None) -> None:
        """Drop one slot's cache, or every slot's."""
        if slot is None:
            self._cache.clear()
        else:
            self._cache.pop(slot, None)

    # -- one batched forward over (cached prefix, new tokens) ------------------------------------------

    @torch.no_grad()
    def _forward(self, slots: list[int], prompts: list[list[int]], extra: list[list[list[int]]]):
        """Encode each prompt's uncached suffix followed by the segments `extra[b]` (each sees the whole
        prompt and its own earlier tokens only) in one pass, and update the slots' caches to hold exactly
        their prompt.

        Returns (hidden states (B, Q, H), layout, cache, valid): layout[b] = (suffix length, segment starts) in
        query positions; `cache` holds the batch's keys and values (`past` padded cached positions, then
        the Q query positions) and `valid` (B, past + Q) marks the real prompt tokens in it.
        """
        from transformers import DynamicCache

        reused = [self._reusable(s, p) for s, p in zip(slots, prompts)]
        past = max(n for n, _ in reused)
        queries, layout = query_layout([n for n, _ in reused], prompts, extra)
        B, Q = len(prompts), max(map(len, queries))
        # Built on the CPU (many small writes), then moved to the model's device in one copy each.
        ids = torch.full((B, Q), self.pad_id, dtype=torch.long)
        pos = torch.zeros((B, Q), dtype=torch.long)
        segment = torch.full((B, Q), -2, dtype=torch.long)  # -1 prompt suffix, j segment j, -2 padding
        valid = torch.zeros((B, past + Q), dtype=torch.bool)
        for b, (q, (n, _), (s, starts)) in enumerate(zip(queries, reused, layout)):
            ids[b, : len(q)] = torch.tensor(q, dtype=torch.long)
            pos[b, :s] = torch.arange(n, n + s)
            segment[b, :s] = -1
            valid[b, past - n : past + s] = True
            for j, (start, seg) in enumerate(zip(starts, extra[b])):
                pos[b, start : start + len(seg)] = torch.arange(n + s, n + s + len(seg))
                segment[b, start : start + len(seg)] = j
        ids, pos, segment, valid = (t.to(self.device) for t in (ids, pos, segment, valid))
        qs, ks = segment[:, :, None], segment[:, None, :]
        own = torch.ones(Q, Q, dtype=torch.bool, device=self.device).tril() & (ks != -2) & ((ks == -1) | (ks == qs))
        own |= torch.eye(Q, dtype=torch.bool, device=self.device)  # padding queries attend to themselves (no NaN)
        mask = torch.cat([valid[:, None, :past].expand(B, Q, past), own], dim=-1)[:, None]  # (B, 1, Q, past + Q)
        cache = DynamicCache()
        if past:
            first = next(kv for _, kv in reused if kv is not None)
            layers = []
            for layer, (k0, _) in enumerate(first):
                k = k0.new_zeros((B, k0.shape[1], past, k0.shape[3]))
                v = torch.zeros_like(k)
                for b, (n, kv) in enumerate(reused):
                    if n:
                        k[b, :, past - n :] = kv[layer][0][0, :, :n]
                        v[b, :, past - n :] = kv[layer][1][0, :, :n]
                layers.append((k, v))
            cache = DynamicCache(ddp_cache_data=layers)
        out = self.body(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        self.encoded_tokens += sum(map(len, queries))
        if self.reuse:
            for b, (slot, p, (n, _), (s, _)) in enumerate(zip(slots, prompts, reused, layout)):
                kv = [
                    (
                        layer.keys[b : b + 1, :, past - n : past + s].clone(),
                        layer.values[b : b + 1, :, past - n : past + s].clone(),
                    )
                    for layer in cache.layers
                ]
                self._cache[slot] = (list(p), kv)
        return out.last_hidden_state, layout, cache, valid

    def score(
        self, slots: list[int], prompts: list[list[int]], candidates: list[list[list[int]]]
    ) -> list[torch.Tensor]:
        n = self.score_rows or len(prompts)
        out: list[torch.Tensor] = []
        for i in range(0, len(prompts), n):
            out += self._score(slots[i : i + n], prompts[i : i + n], candidates[i : i + n])
        return out

    @torch.no_grad()
    def _score(
        self, slots: list[int], prompts: list[list[int]], candidates: list[list[list[int]]]
    ) -> list[torch.Tensor]:
        hidden, layout, _, _ = self._forward(slots, prompts, candidates)
        rows, at, targets, owner = [], [], [], []  # owner: (row, candidate) of each scored token
        for b, ((s, starts), cands) in enumerate(zip(layout, candidates)):
            for j, (start, c) in enumerate(zip(starts, cands)):
                # token i of a candidate is predicted at the position before it: the prompt's last token
                # for i = 0, else the candidate's own previous token
                at += [s - 1] + list(range(start, start + len(c) - 1))
                rows += [b] * len(c)
                targets += c
                owner += [(b, j)] * len(c)
        index = lambda xs: torch.tensor(xs, device=self.device)  # noqa: E731
        # the head's logits a chunk of positions at a time, never (tokens, vocabulary) float32 for all of them
        token_logp = head_logprobs(hidden[index(rows), index(at)], self.head, index(targets), self.score_elements)
        sums = [[0.0] * len(cands) for cands in candidates]
        for (b, j), lp in zip(owner, token_logp.tolist()):
            sums[b][j] += lp
        return [torch.tensor(x) for x in sums]

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
        hidden, layout, cache, valid = self._forward(slots, prompts, [[] for _ in prompts])
        last = self.head(torch.stack([hidden[b, s - 1] for b, (s, _) in enumerate(layout)]))  # (B, V)
        pos = torch.tensor([len(p) for p in prompts], device=self.device)

        def feed(nxt: torch.Tensor, running: list[bool]) -> torch.Tensor:
            nonlocal valid, pos
            valid = torch.cat([valid, torch.tensor(running, device=self.device)[:, None]], dim=-1)
            mask = valid[:, None, None, :] | (
                torch.arange(valid.shape[1], device=self.device) == valid.shape[1] - 1
            )  # (B, 1, 1, L)
            out = self.body(
                input_ids=nxt[:, None], attention_mask=mask, position_ids=pos[:, None], cache=cache, use_cache=True
            )
            self.encoded_tokens += sum(running)
            pos = pos + 1
            return self.head(out.last_hidden_state[:, -1])

        return decode(
            last, feed, max_new_tokens=max_new_tokens, stop=stop, greedy=greedy, temperature=temperature, seeds=seeds
        )


def decode(
    last: torch.Tensor,
    feed,
    *,
    max_new_tokens: int,
    stop: StopRule,
    greedy: bool,
    temperature: float,
    seeds: list[int] | None,
) -> list[tuple[list[int], float]]:
    """The token loop every local backend shares: draw from `last` (B, V), check each row's stop rule, and
    `feed(tokens (B,), running)` the draws back for the next logits, until every row stopped or
    `max_new_tokens` were drawn. Rows that stopped are still fed (their draws are dropped), so the batch keeps
    its shape for the whole turn. (new tokens, summed log-prob) per row."""
    B = last.shape[0]
    seed_t = None if greedy else torch.tensor(seeds, dtype=torch.long, device=last.device)
    tokens: list[list[int]] = [[] for _ in range(B)]
    logps = [0.0] * B
    running = [True] * B
    for step in range(max_new_tokens):
        nxt, chosen = draw(last, greedy, temperature, seed_t, step)
        nxt_list, chosen = nxt.tolist(), chosen.tolist()
        for b in range(B):
            if running[b]:
                tokens[b].append(nxt_list[b])
                logps[b] += chosen[b]
                running[b] = not stop(tokens[b])
        if not any(running) or step + 1 == max_new_tokens:
            break
        last = feed(nxt, running)
    return list(zip(tokens, logps))


_M32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 tensors, exact on every device: the
    multipliers are below 2**31, so no product of two 32-bit values leaves int64."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """One uniform draw in (0, 1) per seed for decoding step `step`: a counter-based stream, a function of
    (seed, step) alone, so a row draws the same whatever it is batched with and on whatever device, and
    nothing is drawn on the host or synchronised for it."""
    h = _mix(_mix(seeds) ^ (seeds >> 32))
    h = _mix(h + step * 0x9E3779B1)
    return ((h >> 8).to(torch.float64) + 0.5) / 2**24


def draw(
    logits: torch.Tensor, greedy: bool, temperature: float, seeds: torch.Tensor | None, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its log-prob) per row of `logits` (B, V): the argmax when `greedy`, else a draw from the
    softmax at `temperature` by inverse transform sampling with `uniforms(seeds, step)`. The log-prob is
    the sampling distribution's (after the temperature)."""
    logp = torch.log_softmax(logits.float() / (1.0 if greedy else temperature), dim=-1)
    if greedy:
        nxt = logp.argmax(-1)
    else:
        cdf = logp.exp().cumsum(-1)
        total = cdf[:, -1:]
        # at < total, so the first position whose cumulative mass exceeds it is a token of mass > 0. The
        # uniform is below 1, but its largest values round to 1.0 in float32 (1 - 2**-25 does): the cap keeps
        # such a draw on the last token that has mass rather than on the vocabulary's last token.
        at = torch.minimum(
            uniforms(seeds, step).to(cdf.dtype)[:, None] * total, torch.nextafter(total, torch.zeros_like(total))
        )
        nxt = torch.searchsorted(cdf, at.contiguous(), right=True)[:, 0]
    return nxt, logp.gather(-1, nxt[:, None])[:, 0]
