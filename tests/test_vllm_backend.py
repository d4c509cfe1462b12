"""The vLLM rollout backend against a fake engine (vLLM needs a GPU; real runs happen only there): what it
asks the engine for, how it cuts a turn at the actor's stop rule, and that a free-mode actor plays on it."""

from types import SimpleNamespace

import pytest
import torch
import yaml

from qevolve.models.policy import Actor
from qevolve.models.prompt import PromptBuilder
from qevolve.models.vllm_backend import VLLMBackend


class FakeEngine:
    """`vllm.LLM.generate`'s shape: per prompt, one completion of `reply` tokens with log-prob -0.5 each."""

    def __init__(self, reply: list[int]):
        self.reply, self.calls = reply, []

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        self.calls.append((prompts, params, lora_request))
        steps = [{t: SimpleNamespace(logprob=-0.5)} for t in self.reply]
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=tuple(self.reply), logprobs=steps)]) for _ in prompts
        ]


def params(**kw):
    return SimpleNamespace(**kw)


def test_generate_sends_one_seeded_request_per_prompt_with_the_adapter_and_cuts_at_the_stop_rule():
    engine = FakeEngine([5, 6, 7, 8, 9])
    backend = VLLMBackend(engine, "adapter-request", params)
    stop_at_7 = lambda tokens: tokens[-1] == 7  # noqa: E731
    out = backend.generate(
        [0, 1], [[1, 2], [3]], max_new_tokens=5, stop=stop_at_7, greedy=False, temperature=0.7, seeds=[11, 12]
    )
    assert out == [([5, 6, 7], -1.5), ([5, 6, 7], -1.5)]  # the tokens after the stop and their log-probs dropped
    prompts, sent, lora = engine.calls[0]
    assert prompts == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}] and lora == "adapter-request"
    assert [(p.max_tokens, p.temperature, p.logprobs) for p in sent] == [(5, 0.7, 0), (5, 0.7, 0)]
    assert [p.seed for p in sent] == [11, 12]  # each prompt its own episode's seed, whatever the batch
    greedy = backend.generate([0], [[1]], max_new_tokens=5, stop=lambda t: False, greedy=True, temperature=0.7)
    assert greedy == [([5, 6, 7, 8, 9], -2.5)] and (engine.calls[1][1][0].temperature, engine.calls[1][1][0].seed) == (
        0.0,
        None,
    )
    assert backend.encoded_tokens == 3 + 6 + 1 + 5


def test_scoring_runs_on_the_hf_scorer_and_without_one_is_refused():
    class Scorer:
        def score(self, slots, prompts, candidates):
            return [torch.tensor([-1.0] * len(c)) for c in candidates]

    assert VLLMBackend(FakeEngine([]), None, params, scorer=Scorer()).score([0], [[1]], [[[2], [3]]])[0].tolist() == [
        -1.0,
        -1.0,
    ]
    with pytest.raises(ValueError, match="admissible scoring runs on the HF backend"):
        VLLMBackend(FakeEngine([]), None, params).score([0], [[1]], [[[2]]])


def test_a_free_mode_actor_plays_on_it(tiny_tokenizer):
    builder = PromptBuilder(tiny_tokenizer, 256)
    reply = builder.action_ids("Action: inventory")
    engine = FakeEngine(reply + tiny_tokenizer.encode(" and more", add_special_tokens=False))
    actor = Actor(None, tiny_tokenizer, builder, "free", 1.0, 40, backend=VLLMBackend(engine, None, params))
    episode = SimpleNamespace(
        traj=SimpleNamespace(instruction="craft a stick"), observations=["You have nothing."], outputs=[], admissible=[]
    )
    [decision] = actor.decide([episode], greedy=True, slots=[0])
    assert decision.output.startswith("Action: inventory") and actor.parse(decision.output) == "inventory"
    assert decision.prompt_tokens == len(engine.calls[0][0][0]["prompt_token_ids"])


def test_vllm_needs_adapters_without_trained_embeddings_and_is_no_part_of_lineage():
    from conftest import REPO
    from qevolve import dvcfile
    from qevolve.config import ConfigError
    from qevolve.params import parse_params

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    with pytest.raises(ConfigError, match=r"policy.backend: vLLM refuses LoRA adapters that train the embeddings"):
        parse_params({**raw, "policy": {**raw.get("policy", {}), "backend": "vllm"}})
    raw["model"]["lora"]["train_embeddings"] = False
    on_vllm = parse_params({**raw, "policy": {**raw.get("policy", {}), "backend": "vllm"}})
    assert dvcfile.render(on_vllm) == dvcfile.render(parse_params(raw))


def test_the_engine_gets_the_real_model_its_length_and_memory_share_and_free_mode_loads_nothing_else(
    tiny_base, tmp_path, monkeypatch
):
    """`local_backend` with `policy.backend: vllm`, through a stand-in `vllm` module: the engine is given the model the
    base stage resolved (not the folder holding its pointer), the context budget plus a turn as its maximum length and
    the configured memory share; in free mode the HF model is never loaded, in admissible mode it scores."""
    import json
    import sys
    from types import ModuleType

    import qevolve.models.policy as policy
    from qevolve.models.base import POINTER
    from qevolve.models.engine import SlotEngine
    from qevolve.params import parse_params

    built = []
    fake = ModuleType("vllm")
    fake.LLM = lambda **kw: built.append(kw) or FakeEngine([])
    fake.SamplingParams = params
    lora = ModuleType("vllm.lora.request")
    lora.LoRARequest = lambda name, id_, path: (name, id_, path)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.lora", ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora)
    pointer_base = tmp_path / "base"  # a named base: the folder holds only the pointer
    pointer_base.mkdir()
    (pointer_base / POINTER).write_text(json.dumps({"base": str(tiny_base)}))
    raw = {
        "model": {"context_tokens": 300, "lora": {"train_embeddings": False}},
        "policy": {"backend": "vllm", "action_mode": "free", "max_new_tokens": 24, "gpu_memory": 0.3},
    }
    loads = []
    real_load = policy.load_policy
    monkeypatch.setattr(policy, "load_policy", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    backend, tok = policy.local_backend(parse_params(raw), pointer_base, tmp_path / "adapter")
    assert (
        built[0]["model"] == str(tiny_base)
        and built[0]["max_model_len"] == 324
        and built[0]["gpu_memory_utilization"] == 0.3
    )
    assert backend.lora_request == ("policy", 1, str(tmp_path / "adapter")) and backend.scorer is None and loads == []
    assert tok.pad_token_id is not None
    real_load(tiny_base, parse_params(raw).model)[0].save_pretrained(
        tmp_path / "adapter"
    )  # a fresh adapter to score with
    raw["policy"]["action_mode"] = "admissible"
    backend, _ = policy.local_backend(parse_params(raw), pointer_base, tmp_path / "adapter")
    assert isinstance(backend.scorer, SlotEngine) and len(loads) == 1
