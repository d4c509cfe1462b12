"""The base causal LM: the embedded small model built offline, or any Hugging Face id or path.

`models/base/` is what the `base` stage writes. For the embedded default it is a complete Hugging Face
folder (tokenizer trained on environment text + randomly initialised Qwen2 weights). For a named model
it holds `base.json` pointing at the id or path, so a 7B model is not copied. Either way `load_base`
returns (model, tokenizer) through `from_pretrained`, the same code path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from qevolve.config import EmbeddedModelConfig

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
# Used for the embedded tokenizer, and for a base model whose tokenizer has no chat template.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
POINTER = "base.json"


class ModelLoadError(ValueError):
    pass


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


def write_pointer(base: str, out_dir: Path) -> dict:
    """Record a Hugging Face id or local path as the base, after checking that a local path exists."""
    looks_local = base.startswith((".", "/", "~")) or Path(base).exists()
    if looks_local and not Path(base).expanduser().exists():
        raise ModelLoadError(f"model.base: path {base!r} does not exist")
    (out_dir / POINTER).write_text(json.dumps({"base": base}) + "\n")
    return {"base": base}


def load_base(base_dir: Path | str, dtype: str = "float32"):
    """(model, tokenizer) from what the `base` stage wrote."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir = Path(base_dir)
    pointer = base_dir / POINTER
    source = json.loads(pointer.read_text())["base"] if pointer.exists() else str(base_dir)
    if source.startswith("~"):
        source = str(Path(source).expanduser())
    try:
        tok = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    except OSError as err:
        raise ModelLoadError(f"model.base: cannot load {source!r}: {err}") from None
    rows = model.get_input_embeddings().num_embeddings
    if len(tok) > rows:
        raise ModelLoadError(
            f"model.base: the tokenizer at {source!r} has {len(tok)} tokens but the model's embedding has {rows} rows; "
            "the tokenizer does not belong to this model"
        )
    if tok.chat_template is None:
        tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
        tok.chat_template = CHAT_TEMPLATE
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if len(tok) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tok))
    return model, tok


def causal_lm(model):
    """The transformers causal LM itself, whether `model` is wrapped by peft or not."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
