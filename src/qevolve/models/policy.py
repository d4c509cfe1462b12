"""The policy: base causal LM + LoRA adapter, and the two ways it acts.

- `admissible`: every valid action is scored by its log-likelihood as the next assistant turn, the
  candidates of the episodes batched into forward passes (`RolloutBackend.score`).
- `free`: batched generation of the assistant turn, stopped at the end of its `Action:` line and
  parsed afterwards (`RolloutBackend.generate`).

Both go through a `RolloutBackend` (`qevolve.models.backend`; `qevolve.models.engine.SlotEngine` by
default), which keeps each episode's KV cache across turns.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qevolve.config import ModelConfig
from qevolve.errors import artifact
from qevolve.models.backend import RolloutBackend, seeds_from
from qevolve.models.base import load_base
from qevolve.models.engine import SlotEngine, rollout_engine
from qevolve.models.prompt import PromptBuilder, format_action, parse_action

_ACTION_LINE = re.compile(r"^\s*action\s*:[^\n]*\S[^\n]*\n", re.IGNORECASE | re.MULTILINE)
"""An `Action:` line with a command, ended by a newline: nothing after it is read."""


def lora_model(model, cfg: ModelConfig, names: Sequence[str] = ("default",), seed: int | None = None):
    """`model` with a fresh LoRA adapter per name (the first active), all of them trainable. With `seed`, the
    adapters' initial weights depend on it alone: torch's global generator is seeded first (torch 2.13 seeds it
    differently in every process, and a flow's earlier stages move it). Without, they are drawn from its state."""
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
    if seed is not None:
        torch.manual_seed(seed)
    peft = get_peft_model(model, lora, adapter_name=names[0])
    for name in names[1:]:
        peft.add_adapter(name, lora)
    peft.set_requires_grad(list(names), True)
    return peft


def _embedding_module_names(model) -> list[str]:
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is model.get_input_embeddings()}
    names |= {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is model.get_output_embeddings()}
    return sorted(names)


def load_policy(
    base_dir: Path | str,
    cfg: ModelConfig,
    adapter: Path | str | None = None,
    trainable: bool = False,
    names: Sequence[str] = (),
    seed: int | None = None,
):
    """(model, tokenizer): a peft model with a fresh LoRA adapter (its initial weights set by `seed` alone when
    given: `lora_model`), or with the one saved at `adapter` when `trainable`; otherwise that adapter merged into
    the base weights (peft's `merge_and_unload`), a plain transformers model for inference. Merged, a forward pass
    skips the LoRA matrices: the embedded policy takes 1.4x less time per rollout step on a CPU
    (benchmarks/README.md, `rollout`), and its logits change by float rounding only.

    With `names`: one adapter per name on the one base (fresh, or each from the subfolder of `adapter`
    named after it, as peft saves several), never merged; `use_adapter` picks the one that acts."""
    from peft import PeftModel

    # Embeddings trained in full (the embedded base) keep float32: AdamW steps on bfloat16 weights round away.
    dtype = "float32" if cfg.dtype == "auto" and cfg.lora.train_embeddings else cfg.dtype
    model, tok = load_base(base_dir, dtype, cfg.device)
    if adapter is None:
        return lora_model(model, cfg, names or ("default",), seed), tok
    folders = {name: Path(adapter) / name for name in names} or {"default": Path(adapter)}
    for name, folder in folders.items():
        try:
            if isinstance(model, PeftModel):
                model.load_adapter(str(folder), adapter_name=name, is_trainable=trainable)
            else:
                model = PeftModel.from_pretrained(model, str(folder), adapter_name=name, is_trainable=trainable)
        except Exception as err:  # noqa: BLE001 - peft and safetensors raise many kinds for a missing or cut file
            raise artifact(folder, f"cannot load the LoRA adapter ({type(err).__name__}: {str(err)[:300]})") from err
    if names:
        use_adapter(model, names[0])
        return model, tok
    return (model if trainable else model.merge_and_unload()), tok


def save_adapters(model, folder, **kwargs) -> None:
    """peft's `save_pretrained`, with `adapter_config.json` the same bytes in every process: peft writes a set-valued
    field (`target_modules` once "all-linear" is resolved) in the set's order, which Python's string hashing changes
    from process to process, so DVC would hash one adapter two ways and rerun every stage after it. Such fields are
    made sorted lists first."""
    for config in getattr(model, "peft_config", {}).values():
        for key, value in vars(config).items():
            if isinstance(value, set):
                setattr(config, key, sorted(value, key=str))
    model.save_pretrained(folder, **kwargs)


def use_adapter(model, name: str) -> None:
    """Make the adapter `name` the one that acts; which parameters train stays as it was (peft's
    `set_adapter` alone would freeze the other adapters)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.set_adapter(name)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in trainable:
        p.requires_grad_(True)


def local_backend(params, base_dir: Path, policy_dir: Path, slots: int = 0) -> tuple[RolloutBackend, object]:
    """(backend, tokenizer) for `policy.backend` in this process: `rollout_engine` on the policy at `policy_dir`,
    or vLLM with that adapter (scoring, in admissible mode, on `rollout_engine`; in free mode nothing else
    loads the model). `slots`: the stage's episodes at once, for which the engine's buffer is sized ahead."""
    if params.policy.backend == "vllm":
        from qevolve.models.base import load_tokenizer
        from qevolve.models.vllm_backend import vllm_backend

        scorer, tok = None, None
        if params.policy.action_mode == "admissible":
            model, tok = load_policy(base_dir, params.model, adapter=policy_dir)
            scorer = _engine(params, model, tok, slots)
        return vllm_backend(base_dir, policy_dir, params, scorer), tok or load_tokenizer(base_dir)
    model, tok = load_policy(base_dir, params.model, adapter=policy_dir)
    return _engine(params, model, tok, slots), tok


def _engine(params, model, tok, slots: int) -> RolloutBackend:
    """`rollout_engine` with `policy.compile`; a `SlotEngine`'s buffer sized for `slots` episodes of the
    context budget plus one action, before its first call (a compiled step is traced for that shape)."""
    backend = rollout_engine(model.eval(), tok.pad_token_id, compile=compile_options(params, model))
    if isinstance(backend, SlotEngine) and slots:
        backend.reserve(slots, params.model.context_tokens + params.policy.max_new_tokens)
    return backend


def compile_options(params, model) -> dict | None:
    """`torch.compile`'s options for the decode step, or None for an eager one: `policy.compile` true or
    false, or "auto" (the default): compiled on CUDA, as CUDA graphs (`mode="reduce-overhead"`)."""
    cuda = next(model.parameters()).device.type == "cuda"
    if params.policy.compile is False or (params.policy.compile == "auto" and not cuda):
        return None
    return {"mode": "reduce-overhead"} if cuda else {}


class ActionLineStop:
    """`Actor`'s stop rule: a turn ends at the chat template's end-of-turn marker or with its `Action:`
    line. A plain object, so that it can be sent to policy replicas."""

    def __init__(self, tokenizer, end: list[int]):
        self.tok, self.end = tokenizer, end

    def __call__(self, tokens: list[int]) -> bool:
        if tokens[-len(self.end) :] == self.end:
            return True
        return bool(_ACTION_LINE.search(self.tok.decode(tokens, skip_special_tokens=True)))


@dataclass
class Decision:
    output: str
    """What the policy wrote (`Action: ...` in admissible mode)."""
    logp: float
    """Behaviour log-prob of `output` under the distribution it was drawn from."""
    output_tokens: int
    prompt_tokens: int = 0
    """Tokens of the prompt(s) the decision read."""


class Actor:
    """Chooses the next assistant turn for a batch of episodes.

    `slots` name where each episode runs (a rollout slot), so the backend can keep its KV cache from
    one turn to the next; `reuse_cache=False` re-encodes every prompt in full (the baseline). `model` may
    be None when a `backend` is given."""

    def __init__(
        self,
        model,
        tokenizer,
        builder: PromptBuilder,
        mode: str,
        temperature: float,
        max_new_tokens: int,
        reuse_cache: bool = True,
        backend: RolloutBackend | None = None,
    ):
        self.tok, self.builder = tokenizer, builder
        self.mode, self.temperature, self.max_new_tokens = mode, temperature, max_new_tokens
        self.backend: RolloutBackend = backend or rollout_engine(
            model.eval(), tokenizer.pad_token_id, reuse=reuse_cache
        )
        self.stop = ActionLineStop(tokenizer, builder.end_ids or [tokenizer.eos_token_id])

    def decide(self, episodes: list, greedy: bool, slots: list[int]) -> list[Decision]:
        """The next turn of each episode (`qevolve.rollout`'s: instruction, observations and outputs so
        far, valid actions, its generator), from its whole history as one chat (truncated to the context budget)."""
        reserve = self.max_new_tokens if self.mode == "free" else 0  # room for the generated turn
        prompts = [self.builder.prompt(e.traj.instruction, e.observations, e.outputs, reserve) for e in episodes]
        generators = None if greedy else [e.generator for e in episodes]
        decisions = self.act(prompts, [e.admissible for e in episodes], greedy, generators, slots=slots)
        for d, p in zip(decisions, prompts):
            d.prompt_tokens = len(p)
        return decisions

    def parse(self, output: str) -> str | None:
        """The action in an output, or None on a format error."""
        return parse_action(output, self.builder.keep_case)[0]

    def observed(self, episodes: list) -> None:
        """Called after each round with the episodes that just took a step; a flat actor keeps no state."""

    def act(
        self,
        prompts: list[list[int]],
        admissible: list[list[str]],
        greedy: bool,
        generators: list[torch.Generator] | None = None,
        slots: list[int] | None = None,
    ) -> list[Decision]:
        """`generators`: one per prompt, what it samples from (not needed when `greedy`)."""
        slots = list(range(len(prompts))) if slots is None else slots
        if self.mode == "admissible":
            return self._choose(slots, prompts, admissible, greedy, generators)
        return self._generate(slots, prompts, greedy, generators)

    def _choose(self, slots, prompts, admissible, greedy, generators) -> list[Decision]:
        cand_ids = [[self.builder.action_ids(format_action(a)) for a in acts] for acts in admissible]
        scores = self.backend.score(slots, prompts, cand_ids)
        decisions = []
        for b, (acts, ids, s) in enumerate(zip(admissible, cand_ids, scores)):
            temperature = 1.0 if greedy else self.temperature
            logp = torch.log_softmax(s / temperature, dim=-1)
            k = int(logp.argmax()) if greedy else int(torch.multinomial(logp.exp(), 1, generator=generators[b]))
            decisions.append(Decision(format_action(acts[k]), float(logp[k]), len(ids[k])))
        return decisions

    def _generate(self, slots, prompts, greedy, generators) -> list[Decision]:
        out = self.backend.generate(
            slots,
            prompts,
            max_new_tokens=self.max_new_tokens,
            stop=self.stop,
            greedy=greedy,
            temperature=self.temperature,
            seeds=None if greedy else seeds_from(generators),
        )
        return [
            Decision(self.tok.decode(toks, skip_special_tokens=True).strip(), logp, len(toks)) for toks, logp in out
        ]


class BestOfN(Actor):
    """Best-of-N with a critic (admissible mode): draw `n` actions from the policy's distribution over the
    valid actions (at `temperature`, with `generator`), and take the one the critic's Q(s, a) rates
    highest. The choice is the same whether the caller asks for greedy or sampled actions."""

    def __init__(
        self,
        model,
        tokenizer,
        builder: PromptBuilder,
        critic,
        n: int,
        temperature: float,
        batch_size: int,
        generator: torch.Generator,
    ):
        super().__init__(model, tokenizer, builder, "admissible", temperature, 1)
        self.critic, self.n, self.batch_size, self.generator = critic, n, batch_size, generator

    def act(self, prompts, admissible, greedy, generators=None, slots=None) -> list[Decision]:
        slots = list(range(len(prompts))) if slots is None else slots
        cand_ids = [[self.builder.action_ids(format_action(a)) for a in acts] for acts in admissible]
        scores = self.backend.score(slots, prompts, cand_ids)
        drawn = []
        for s in scores:
            logp = torch.log_softmax(s / self.temperature, dim=-1)
            drawn.append(
                (
                    logp,
                    sorted(
                        set(torch.multinomial(logp.exp(), self.n, replacement=True, generator=self.generator).tolist())
                    ),
                )
            )
        pairs = [(e, k) for e, (_, ks) in enumerate(drawn) for k in ks]
        q = self.q_values([prompts[e] + cand_ids[e][k] for e, k in pairs])
        best: dict[int, tuple[float, int]] = {}
        for (e, k), v in zip(pairs, q):
            if e not in best or v > best[e][0]:
                best[e] = (v, k)
        return [
            Decision(
                format_action(admissible[e][best[e][1]]), float(drawn[e][0][best[e][1]]), len(cand_ids[e][best[e][1]])
            )
            for e in range(len(prompts))
        ]

    @torch.no_grad()
    def q_values(self, seqs: list[list[int]]) -> list[float]:
        """The critic's Q at the last token of each sequence (a prompt followed by one action turn)."""
        from qevolve.models.device import pad_ids

        out = []
        for i in range(0, len(seqs), self.batch_size):
            chunk = seqs[i : i + self.batch_size]
            ids, attn = pad_ids(chunk, self.tok.pad_token_id, self.backend.device)
            _, q, _ = self.critic(ids, attn)
            out += [float(q[b, len(s) - 1]) for b, s in enumerate(chunk)]
        return out
