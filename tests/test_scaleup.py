"""Slow tier: the GPU check's CPU dry run, a real pretrained model (SmolLM2 from its GGUF file), and
multi-process trainers run by `dvc repro` and by the flow under the workspace lock."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from test_pipeline import DVC, _finish, _flow, _workspace

from conftest import REPO


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_check.py",
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--scale",
            "tiny",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["parity"]["ok"] and results["parity"]["float32_compiled"]["max_abs_logp_diff"] < 1e-3
    assert results["inventory"]["missing_imports"] == "none" and set(results["sdpa"]) == {
        f"{shape}_{call}" for shape in ("decode", "prefill") for call in ("folded", "gqa_masked")
    }
    assert all(s < 480 for s in results["section_seconds"].values())  # each within the default --budget
    stages = results["pipeline"]["stages"]
    assert list(stages) == [
        "experts",
        "base",
        "bc",
        "evaluate@0",
        "collect@1",
        "relabel@1",
        "critic@1",
        "advantage@1",
        "policy@1",
        "diagnose@1",
        "evaluate@1",
    ]
    assert all(
        s["device"] == "cpu" for name, s in stages.items() if name in ("bc", "critic@1", "policy@1", "evaluate@1")
    )
    assert results["hub_kernels"]["ok"] and results["training"]["train_tokens_s"] > 0
    assert results["scoring"]["engine_40x12"]["candidates_s"] > 0 and results["vllm"] == {
        "skipped": "vllm is not installed"
    }
    generation = results["generation"]
    assert set(generation) == {
        f"{e}_{n}" for e in ("hf_reencode", "hf_reuse", "engine", "engine_compiled") for n in (8, 16)
    }
    assert all("error" not in row and row["tokens_s"] > 0 for row in generation.values()), generation
    # the compiled step is one graph: far fewer operators per decode step than the eager engines
    assert (
        generation["engine_compiled_16"]["launches_per_decode_step"]
        < generation["engine_16"]["launches_per_decode_step"] / 2
    )
    dist = results["distributed"]
    assert all(dist[k]["ok"] for k in ("one_rank_on_device", "cpu_one_process", "cpu_two_ranks"))
    assert dist["two_ranks_max_loss_diff"] < 1e-5
    assert "## generation" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
def test_smollm2_loads_from_its_gguf_file_once_and_trains(tmp_path, monkeypatch):
    from qevolve.config import BCConfig, ModelConfig
    from qevolve.models.base import write_pointer
    from qevolve.models.policy import load_policy
    from qevolve.models.prompt import PromptBuilder
    from qevolve.stages.bc import bc_step
    from qevolve.training import train

    monkeypatch.setenv("QEVOLVE_MODEL_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "base"
    base.mkdir()
    pointer = write_pointer("smollm2", base)
    assert len(pointer["gguf_sha256"]) == 64
    cfg = ModelConfig(base="smollm2", lora={"r": 8, "alpha": 16}, device="cpu")
    assert cfg.lora.train_embeddings is False
    torch.manual_seed(0)
    model, tok = load_policy(base, cfg)
    [converted] = (tmp_path / "cache").iterdir()
    assert converted.name == f"gguf-{pointer['gguf_sha256'][:16]}"
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n) == 134_515_008  # SmolLM2-135M
    assert not any("modules_to_save" in n for n, _ in model.named_parameters())
    builder = PromptBuilder(tok, 256)
    prompt = tok.decode(builder.prompt("put some book on sidetable.", ["You are in the middle of a room."], []))
    assert "<|im_start|>user" in prompt and prompt.rstrip().endswith("<|im_start|>assistant")  # its own chat template
    examples = builder.training_examples(
        "put some book on sidetable.", ["You are in the middle of a room."], ["Action: go to desk 1"]
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    curve = train(
        model,
        examples * 2,
        BCConfig(epochs=3, lr=1e-3, batch_size=2, micro_batch_size=2, warmup_ratio=0.0),
        lambda e: len(e[0]),
        lambda micro: bc_step(model, micro, tok.pad_token_id),
        "smollm2",
    )
    assert curve[-1]["loss"] < curve[0]["loss"]
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)
    mtime = converted.stat().st_mtime_ns
    load_policy(base, cfg)  # a second load reads the converted copy, nothing is converted again
    assert converted.stat().st_mtime_ns == mtime and len(list((tmp_path / "cache").iterdir())) == 1


@pytest.mark.slow
def test_multi_process_trainers_copied_and_sharded_run_from_dvc_repro_and_from_the_flow(tmp_path, alfworld_data):
    ws = _workspace(tmp_path, train={"processes": 2})
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([DVC, "repro", "bc"], cwd=ws, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "another qevolve process" not in done.stdout + done.stderr
    assert json.loads((ws / "metrics" / "bc.json").read_text())["processes"] == 2
    # The iteration's trainers shard their model across the 2 processes (FSDP); how a stage trains is not
    # part of its lineage, so bc stays current.
    params = yaml.safe_load((ws / "params.yaml").read_text())
    params["train"]["shard"] = True
    (ws / "params.yaml").write_text(yaml.safe_dump(params))
    out = _finish(_flow(ws))
    ran = out.split("stages run:")[1].split(";")[0].strip().split(", ")
    assert "critic@1" in ran and "bc" not in ran, ran
    for stage in ("critic@1", "policy@1"):
        placed = json.loads((ws / "metrics" / f"{stage}.json").read_text())
        assert placed["processes"] == 2 and placed["sharded"] is True, stage
    status = subprocess.run([DVC, "status"], cwd=ws, capture_output=True, text=True, check=True).stdout
    assert "up to date" in status, status
    # The sharded policy@1 (a reference pass before training, a collective one) is the one-process update.
    from safetensors.torch import load_file

    sharded = load_file(str(ws / "models" / "policy@1" / "adapter_model.safetensors"))
    params["train"] = {"processes": 1}
    (ws / "params.yaml").write_text(yaml.safe_dump(params))
    shutil.rmtree(ws / "models" / "policy@1")
    done = subprocess.run(
        [sys.executable, "-m", "qevolve.cli", "run", "policy", "--iteration", "1"],
        cwd=ws,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    single = load_file(str(ws / "models" / "policy@1" / "adapter_model.safetensors"))
    assert single.keys() == sharded.keys()
    assert max(float((single[k] - sharded[k]).abs().max()) for k in single) < 1e-5


@pytest.mark.slow
def test_the_gpu_study_profile_runs_at_a_tiny_size_on_the_cpu(tmp_path, monkeypatch, alfworld_data):
    """profiles/study-gpu.yaml (issue 57's study, sized for one GPU) with only its sizes cut: SmolLM2 in free mode on
    all six task types, both iterations, every stage, on the CPU."""
    from qevolve.params import parse_params, resolve_params
    from qevolve.stages import pipeline, run_stage

    raw = resolve_params(REPO / "profiles" / "study-gpu.yaml")
    assert raw["model"]["base"] == "smollm2" and raw["policy"]["action_mode"] == "free" and not raw["env"]["task_types"]
    assert raw["collect"]["num_tasks"] * raw["collect"]["samples_per_task"] >= 2000 and raw["evolve"]["iterations"] == 2
    raw["env"].update(max_steps=3, processes=False)
    raw["experts"].update(demos={"walkthrough": 3, "handcoded": 1}, workers=1)
    raw["model"].update(context_tokens=384, device="cpu")
    raw["policy"].update(compile=False, max_new_tokens=12, batch_size=4, micro_batch_size=4)
    raw["bc"].update(batch_size=4, micro_batch_size=4, epochs=1)
    raw["critic"].update(batch_size=4, micro_batch_size=4)
    raw["collect"].update(num_tasks=1, samples_per_task=2, batch_size=2)
    raw["relabel"].update(max_expert=2)
    raw["evaluate"].update(splits={"valid_seen": 1, "valid_unseen": 1}, batch_size=2)
    params = parse_params(raw, "study-gpu (tiny)")
    monkeypatch.setenv("QEVOLVE_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    metrics = {f"{s}@{k}" if k is not None else s: run_stage(s, params, k) for s, k in pipeline(params, 2)}
    assert list(metrics)[-1] == "evaluate@2" and "diagnose@2" in metrics and metrics["experts"]["won"] >= 3
    assert metrics["bc"]["loss"] < metrics["bc"]["first_loss"] and metrics["bc"]["device"] == "cpu"
    assert metrics["experts"]["episodes"] == 4 and set(metrics["evaluate@2"]) == {"valid_seen", "valid_unseen"}
    assert all(m["episodes"] >= 1 for m in metrics["evaluate@2"].values())
