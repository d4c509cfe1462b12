"""The device path: settings resolve to a device and dtype, stay out of lineage, and (where a GPU is
present) CUDA computes what the CPU computes."""

import os

import pytest
import torch

from qevolve import dvcfile
from qevolve.config import ConfigError, ModelConfig
from qevolve.lineage import lineage_dump
from qevolve.models.device import DeviceError, resolve_device, resolve_dtype
from qevolve.params import parse_params
from qevolve.recipe import load_recipe

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine (CPU/CUDA parity needs one)"
)


def test_device_settings_resolve(monkeypatch):
    monkeypatch.delenv("QEVOLVE_DEVICE", raising=False)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("QEVOLVE_DEVICE", "cpu")
    assert resolve_device("cuda") == torch.device("cpu")  # the environment variable wins
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) is torch.float16


def test_a_cuda_device_turns_tf32_on_and_the_cpu_leaves_it(monkeypatch):
    """On a GPU, float32 matmuls (the LoRA adapters beside a bfloat16 base) run on the tensor cores as TF32.
    Here CUDA's presence is stood in for; setting the flags initialises nothing."""
    monkeypatch.delenv("QEVOLVE_DEVICE", raising=False)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # flags monkeypatch cannot undo
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert resolve_device("cpu").type == "cpu" and not torch.backends.cuda.matmul.allow_tf32
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        assert resolve_device("auto") == torch.device("cuda", 0)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_asking_for_cuda_without_one_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("QEVOLVE_DEVICE", raising=False)
    with pytest.raises(DeviceError, match="model.device: 'cuda:1'.*no CUDA device"):
        resolve_device("cuda:1")


def test_bad_device_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"model.device: .*expected `auto`, `cpu`, `cuda` or `cuda:N`"):
        parse_params({"model": {"device": "gpu"}})


def test_where_a_stage_computes_is_not_part_of_its_lineage():
    cpu = parse_params({"model": {"device": "cpu", "dtype": "auto"}, "evolve": {"iterations": 1}})
    gpu = parse_params(
        {"model": {"device": "cuda:0", "dtype": "auto"}, "train": {"processes": 4}, "evolve": {"iterations": 1}}
    )
    assert lineage_dump(cpu) == lineage_dump(gpu)
    assert dvcfile.render(cpu) == dvcfile.render(gpu)
    assert "model.device" not in dvcfile.render(cpu) and "train" not in str(dvcfile.spec(cpu)["stages"]["bc"]["params"])
    assert "model.dtype" in dvcfile.spec(cpu)["stages"]["bc"]["params"]  # the dtype is: it changes the numbers


def test_pretrained_bases_keep_their_embeddings_unless_told():
    assert ModelConfig().lora.train_embeddings is True  # the embedded base is trained from scratch
    assert ModelConfig(base="smollm2").lora.train_embeddings is False
    assert ModelConfig(base="smollm2", lora={"train_embeddings": True}).lora.train_embeddings is True


def _backends(tiny_base, device: str, dtype: str = "float32"):
    from qevolve.models.backend import HFBackend
    from qevolve.models.policy import load_policy

    torch.manual_seed(0)
    model, tok = load_policy(tiny_base, ModelConfig(lora={"r": 4, "alpha": 8}, device=device, dtype=dtype))
    return HFBackend(model.eval(), tok.pad_token_id), tok


@CUDA
def test_cuda_scores_and_generates_as_the_cpu_does_with_kv_reuse(tiny_base):
    cpu, tok = _backends(tiny_base, "cpu")
    gpu, _ = _backends(tiny_base, "cuda")
    gpu.model.load_state_dict(cpu.model.state_dict())  # the same fresh adapter on both
    prompts = [
        tok.encode("Your task is to: put some book on sidetable."),
        tok.encode("You arrive at desk 1. On the desk 1, you see a book 1."),
    ]
    cands = [[tok.encode("Action: go to desk 1"), tok.encode("Action: look")]] * 2
    for _turn in range(3):  # later turns extend the prompts, so the slots' caches are reused
        a, b = cpu.score([0, 1], prompts, cands), gpu.score([0, 1], prompts, cands)
        assert all(torch.allclose(x, y, atol=1e-3) for x, y in zip(a, b))
        ga = cpu.generate([0, 1], prompts, max_new_tokens=6, stop=lambda t: False, greedy=True, temperature=1.0)
        gb = gpu.generate([0, 1], prompts, max_new_tokens=6, stop=lambda t: False, greedy=True, temperature=1.0)
        assert [t for t, _ in ga] == [t for t, _ in gb]
        assert all(abs(x - y) < 1e-3 for (_, x), (_, y) in zip(ga, gb))
        prompts = [p + t + tok.encode(" Nothing happens.") for p, (t, _) in zip(prompts, ga)]
    assert gpu.encoded_tokens < sum(map(len, prompts)) * 3  # reuse encoded less than every prompt in full


@CUDA
def test_cuda_gives_the_cpus_first_training_loss(tiny_base):
    from qevolve.models.policy import load_policy
    from qevolve.models.prompt import PromptBuilder
    from qevolve.stages.bc import bc_step

    losses = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model, tok = load_policy(tiny_base, ModelConfig(lora={"r": 4, "alpha": 8}, device=device, dtype="float32"))
        ex = PromptBuilder(tok, 512).training_examples(
            "find a key.", ["You are in the middle of a room."], ["Action: look"]
        )
        losses.append(bc_step(model, [ex], tok.pad_token_id)["loss"])
    assert losses[0] == pytest.approx(losses[1], abs=1e-4)


def test_no_model_ever_runs_hub_kernels(tiny_base, tmp_path, monkeypatch):
    """transformers 5.25 turns Hub kernels on by default and `model.train()` then downloads and runs kernel code
    (offline it raises): every model the project loads, in every role, switches modes without `kernelize`."""
    import torch.distributed as dist
    import transformers.modeling_utils
    from torch.distributed.fsdp import fully_shard

    from qevolve.models.critic import Critic, load_critic
    from qevolve.models.policy import load_policy

    calls = []
    monkeypatch.setattr(
        transformers.modeling_utils, "kernelize", lambda model, **kw: calls.append(type(model).__name__)
    )
    cfg = ModelConfig(lora={"r": 4, "alpha": 8})
    policy, _ = load_policy(tiny_base, cfg)  # fresh adapter, trainable (bc, policy@k)
    policy.save_pretrained(tmp_path / "adapter")
    Critic(policy).save(tmp_path / "critic")
    models = {
        "trainable": policy,
        "merged": load_policy(tiny_base, cfg, adapter=tmp_path / "adapter")[0],  # rollouts, reference
        "reloaded": load_policy(tiny_base, cfg, adapter=tmp_path / "adapter", trainable=True)[0],
        "roles": load_policy(tiny_base, cfg, names=("high", "low"))[0],  # the hierarchies' two adapters
        "critic": load_critic(tiny_base, cfg, tmp_path / "critic", trainable=True)[0],
    }
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        models["sharded"] = fully_shard(load_policy(tiny_base, cfg)[0])
        for model in models.values():
            model.train()
            model.eval()
            model.train()
    finally:
        dist.destroy_process_group()
    assert calls == []


def test_the_bf16_peak_is_read_off_the_gpus_exact_model(monkeypatch):
    from qevolve.models import device as device_module

    names = {
        "NVIDIA H100 PCIe": 756.0,
        "NVIDIA H100 NVL": 835.0,
        "NVIDIA H100 80GB HBM3": 989.0,
        "NVIDIA H200": 989.0,
        "NVIDIA A100-SXM4-80GB": 312.0,
        "NVIDIA GeForce RTX 4090": 0.0,
    }
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d, name=name: name)
        assert device_module.peak_tflops(torch.device("cuda", 0)) == peak, name
    assert device_module.peak_tflops(torch.device("cpu")) == 0.0


def test_stages_that_never_compute_on_a_device_run_with_cuda_hidden(tmp_path, monkeypatch):
    """`qevolve run experts` (base, relabel) hides CUDA from its process before any stage code runs, so on a GPU host
    it neither initialises CUDA nor holds a context there; a stage that computes (bc) sees the devices as set."""
    import shutil

    import qevolve.cli as cli

    shutil.copy("params.yaml", tmp_path / "params.yaml")
    shutil.copy("dvc.yaml", tmp_path / "dvc.yaml")
    seen = {}
    monkeypatch.setattr(
        cli, "run_stage", lambda stage, *a: seen.update({stage: os.environ.get("CUDA_VISIBLE_DEVICES")}) or {}
    )
    for stage, iteration in (("bc", []), ("experts", []), ("relabel", ["--iteration", "1"])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
        assert cli.main(["run", stage, *iteration, "--params", str(tmp_path / "params.yaml")]) == 0
    assert seen == {"bc": "0,1", "experts": "", "relabel": ""}
    assert {s.name for s in load_recipe("qevolve").stages(parse_params({})) if not s.accelerated} == {
        "experts",
        "base",
        "relabel",
    }
