"""The policy: base causal LM + LoRA adapter, and the two ways it acts.

- `admissible`: every valid action is scored by its log-likelihood as the next assistant turn, all
  candidates of all episodes in one forward pass (see `score_candidates`).
- `free`: batched generation of the assistant turn, parsed afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qevolve.config import ModelConfig
from qevolve.models.base import load_base
from qevolve.models.prompt import PromptBuilder, format_action



def lora_model(model, cfg: ModelConfig):
    from peft import LoraConfig, get_peft_model

    extra = {}
    if cfg.lora.train_embeddings:
        extra["modules_to_save"] = _embedding_module_names(model)
    lora = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=cfg.lora.target_modules,
        task_type="CAUSAL_LM",
        **extra,
    )
    return get_peft_model(model, lora)


def _embedding_module_names(model) -> list[str]:
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is model.get_input_embeddings()}
    names |= {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is model.get_output_embeddings()}
    return sorted(names)


def load_policy(base_dir: Path | str, cfg: ModelConfig, adapter: Path | str | None = None, trainable: bool = False):
    """(peft model, tokenizer): a fresh LoRA adapter, or the one saved at `adapter`."""
    from peft import PeftModel

    model, tok = load_base(base_dir, cfg.dtype)
    if adapter is None:
        return lora_model(model, cfg), tok
    return PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable), tok


def _left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    return ids, mask


@torch.no_grad()
def score_candidates(model, prompts: list[list[int]], candidates: list[list[list[int]]], pad_id: int) -> list[torch.Tensor]:
    """Sum of log-probs of each candidate continuation after its prompt, in one forward pass.

    Each episode becomes one row: its prompt followed by all its candidates back to back. A 4-D
    attention mask lets every candidate token see the prompt and the earlier tokens of its own
    candidate only, and position ids restart after the prompt for each candidate, so each candidate is
    scored exactly as if it followed the prompt alone; the prompt is encoded once.

    prompts: B token lists; candidates[b]: token lists to score after prompts[b].
    Returns B tensors, tensor b of shape (len(candidates[b]),).
    """
    rows = [p + [t for c in cs for t in c] for p, cs in zip(prompts, candidates)]
    width = max(map(len, rows))
    B = len(rows)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    pos = torch.zeros((B, width), dtype=torch.long)
    segment = torch.full((B, width), -2, dtype=torch.long)  # -1 prompt, j candidate j, -2 padding
    for b, (p, cs) in enumerate(zip(prompts, candidates)):
        ids[b, : len(rows[b])] = torch.tensor(rows[b])
        pos[b, : len(p)] = torch.arange(len(p))
        segment[b, : len(p)] = -1
        start = len(p)
        for j, c in enumerate(cs):
            pos[b, start : start + len(c)] = torch.arange(len(p), len(p) + len(c))
            segment[b, start : start + len(c)] = j
            start += len(c)
    q, k = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal & (k != -2) & ((k == -1) | (k == q))
    allowed |= torch.eye(width, dtype=torch.bool)  # padding rows attend to themselves (no NaN)
    logits = model(input_ids=ids, attention_mask=allowed[:, None], position_ids=pos).logits
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, W, V)
    out = []
    for b, (p, cs) in enumerate(zip(prompts, candidates)):
        scores, start = torch.empty(len(cs)), len(p)
        for j, c in enumerate(cs):
            # token i of candidate j is predicted at the previous position: the prompt's last token for
            # i = 0, else the candidate's own previous token.
            at = torch.tensor([len(p) - 1] + list(range(start, start + len(c) - 1)))
            scores[j] = logp[b, at, torch.tensor(c)].sum()
            start += len(c)
        out.append(scores)
    return out


@dataclass
class Decision:
    output: str
    """What the policy wrote (`Action: ...` in admissible mode)."""
    logp: float
    """Behaviour log-prob of `output` under the distribution it was drawn from."""
    output_tokens: int


class Actor:
    """Chooses the next assistant turn for a batch of episodes."""

    def __init__(self, model, tokenizer, builder: PromptBuilder, mode: str, temperature: float, max_new_tokens: int):
        self.model, self.tok, self.builder = model.eval(), tokenizer, builder
        self.mode, self.temperature, self.max_new_tokens = mode, temperature, max_new_tokens

    def act(self, prompts: list[list[int]], admissible: list[list[str]], greedy: bool, generator: torch.Generator | None = None) -> list[Decision]:
        if self.mode == "admissible":
            return self._choose(prompts, admissible, greedy, generator)
        return self._generate(prompts, greedy, generator)

    def _choose(self, prompts, admissible, greedy, generator) -> list[Decision]:
        cand_ids = [[self.builder.action_ids(format_action(a)) for a in acts] for acts in admissible]
        scores = score_candidates(self.model, prompts, cand_ids, self.tok.pad_token_id)
        decisions = []
        for acts, ids, s in zip(admissible, cand_ids, scores):
            temperature = 1.0 if greedy else self.temperature
            logp = torch.log_softmax(s / temperature, dim=-1)
            k = int(logp.argmax()) if greedy else int(torch.multinomial(logp.exp(), 1, generator=generator))
            decisions.append(Decision(format_action(acts[k]), float(logp[k]), len(ids[k])))
        return decisions

    @torch.no_grad()
    def _generate(self, prompts, greedy, generator) -> list[Decision]:
        ids, mask = _left_pad(prompts, self.tok.pad_token_id)
        stop = self.builder.end_ids[0] if self.builder.end_ids else self.tok.eos_token_id
        if generator is not None:
            torch.manual_seed(int(torch.randint(2**31, (1,), generator=generator)))
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=self.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else self.temperature,
            top_k=None,
            top_p=None,
            eos_token_id=stop,
            pad_token_id=self.tok.pad_token_id,
            return_dict_in_generate=True,
            output_scores=True,
        )
        new = out.sequences[:, ids.shape[1] :]
        logps = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # (B, N, V)
        token_logp = logps.gather(-1, new[..., None]).squeeze(-1)
        decisions = []
        for b in range(len(prompts)):
            toks = new[b].tolist()
            n = toks.index(stop) + 1 if stop in toks else len(toks)
            text = self.tok.decode(toks[:n], skip_special_tokens=True)
            decisions.append(Decision(text.strip(), float(token_logp[b, :n].sum()), n))
        return decisions
