"""A vLLM rollout backend (`policy.backend: vllm`, the `vllm` extra, GPU machines) for `free` mode.

vLLM generates the turns, with the stage's adapter directory as the LoRA request (the adapter DVC tracks
is what vLLM loads; nothing is merged or exported) and its prefix cache in place of `HFBackend`'s per-slot
KV cache. Each prompt is sampled with its own seed (from its episode's generator), so a stage's draws do
not depend on how vLLM batches them. A turn ends where the actor's stop rule says: vLLM generates up to
`max_new_tokens` (or its end-of-sequence token) and the tokens after the first prefix that `stop` accepts
are dropped, their log-probs with them. Log-probs are the sampling distribution's (`processed_logprobs`,
after the temperature), as `HFBackend` reports them.

`admissible` scoring stays on `HFBackend` (`scorer`): vLLM computes prompt log-probs without its prefix
cache, so every candidate would encode the whole prompt again. vLLM refuses adapters that train the
embeddings (`modules_to_save`), so it needs `model.lora.train_embeddings: false`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from qevolve.models.backend import HFBackend, StopRule


class VLLMBackend:
    """`RolloutBackend.generate` on a vLLM engine (`vllm.LLM`, or anything with its `generate`), `score` on
    `scorer`. `sampling_params` builds one request's parameters (`vllm.SamplingParams`)."""

    def __init__(self, engine, lora_request, sampling_params: Callable, scorer: HFBackend | None = None):
        self.engine, self.lora_request, self.sampling_params, self.scorer = (
            engine,
            lora_request,
            sampling_params,
            scorer,
        )
        self.encoded_tokens = 0
        """Prompt and generated tokens sent to the engine (its prefix cache decides what it encodes)."""

    def score(
        self, slots: list[int], prompts: list[list[int]], candidates: list[list[list[int]]]
    ) -> list[torch.Tensor]:
        if self.scorer is None:
            raise ValueError("policy.backend vllm generates only; admissible scoring runs on the HF backend (`scorer`)")
        return self.scorer.score(slots, prompts, candidates)

    def placement(self) -> dict:
        """vLLM's engine, and where the scorer (if any) runs."""
        return {"backend": "vllm", **(self.scorer.placement() if self.scorer else {})}

    def forget(self, slot: int | None = None) -> None:
        """Nothing is kept per slot (vLLM's prefix cache is keyed by content)."""

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
        params = [
            self.sampling_params(
                max_tokens=max_new_tokens,
                temperature=0.0 if greedy else temperature,
                seed=None if greedy else seeds[b],
                logprobs=0,
            )
            for b in range(len(prompts))
        ]
        outputs = self.engine.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], params, lora_request=self.lora_request, use_tqdm=False
        )
        results = []
        for out in outputs:
            turn = out.outputs[0]
            tokens = list(turn.token_ids)
            logps = [step[token].logprob for step, token in zip(turn.logprobs, tokens)]
            n = next((i for i in range(1, len(tokens) + 1) if stop(tokens[:i])), len(tokens))
            results.append((tokens[:n], float(sum(logps[:n]))))
        self.encoded_tokens += sum(map(len, prompts)) + sum(len(t) for t, _ in results)
        return results


def vllm_backend(base_dir: Path, adapter_dir: Path, params, scorer: HFBackend | None) -> VLLMBackend:
    """A vLLM engine on the base model the `base` stage chose (`qevolve.models.base.model_source`: the embedded
    model's folder, a Hugging Face id or path, or a GGUF file's converted folder), with the adapter at
    `adapter_dir` as its LoRA request. Its context is a prompt's budget (`model.context_tokens`) plus a turn
    (`policy.max_new_tokens`); it takes `policy.gpu_memory` of the GPU's memory."""
    try:
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
    except ImportError as err:
        raise ImportError(
            "policy.backend: `vllm` needs vLLM installed (pip install -e '.[vllm]' on a GPU machine)"
        ) from err
    from qevolve.models.base import model_source

    cfg = params.model
    engine = LLM(
        model=model_source(base_dir),
        dtype=cfg.dtype,
        enable_lora=True,
        max_lora_rank=cfg.lora.r,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        max_model_len=cfg.context_tokens + params.policy.max_new_tokens,
        gpu_memory_utilization=params.policy.gpu_memory,
        seed=0,
    )
    return VLLMBackend(engine, LoRARequest("policy", 1, str(adapter_dir)), SamplingParams, scorer)
