"""A method as a recipe: the stages of its iterations, as data.

Every method starts with its setup stages, run once (by default `experts`, `base`, `bc`), then
`evaluate@0`, and ends each iteration k >= 1 with `evaluate@k`; its recipe lists the stages in between.
From the recipe come the stage runner that `qevolve run` calls (`qevolve.stages.run_stage`), dvc.yaml
(`qevolve.dvcfile`) and the Prefect flow's order of tasks (`flows.evolve`), and with them the MLflow
child runs and the table's rows.

A method is a package `qevolve.methods.<name>` whose `RECIPE` is its `Recipe`, picked by `method:` in
params.yaml; nothing else registers it (docs/adding-a-method.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qevolve import paths
from qevolve.errors import UserError
from qevolve.params import methods

MODEL_PARAMS = ("model.base", "model.embedded", "model.lora", "model.context_tokens", "model.dtype")
"""The `model` section less `model.device`: where a stage computes is not part of its lineage (nor is
the `train` section, how many processes train)."""
BUILDER_PARAMS = ("prompt.max_observation_tokens",)
"""What `make_builder` reads beside the prompt saved with the policy."""
ACTING_PARAMS = ("env", *MODEL_PARAMS, *BUILDER_PARAMS, "policy.action_mode", "policy.max_new_tokens")
"""What playing a saved policy in the environment reads."""


@dataclass(frozen=True)
class Logged:
    """What the evolution logs to MLflow for a stage beside its metrics (`flows.tracking.log_stage`)."""

    curve: tuple[str, ...] = ()
    """Keys of its curve (`Stage.curve`) logged as per-step metrics `<stage>/train_<key>`, against the curve's x."""
    artifact: tuple[str, str] | None = None
    """(argument of its `writes`, MLflow folder): an output folder logged whole (a trained adapter)."""
    trajectories: str | None = None
    """The argument of its `writes` that holds a step store: a sample rendered as `trajectories/<stage>.md`."""
    histogram: bool = False
    """Its curve is a histogram (x, count), logged as a figure."""


TRAINED_POLICY = Logged(("loss", "pg_loss", "kl", "clip_fraction", "ratio", "logp"), ("out", "policy_adapter"))
"""An RL policy update's logs: its loss terms and the adapter."""
TRAINED_CRITIC = Logged(("loss", "v_loss", "q_loss"), ("out", "critic_adapter"))
ONLINE_LOGGED = Logged(("success_rate", "loss", "kl", "clip_fraction", "env_steps"), ("out", "policy_adapter"))
"""An online RL stage's logs: its rounds' success and update terms, and the adapter."""
PLAYED = Logged(trajectories="out")
"""A rollout stage's logs: a sample of its episodes."""


class UnknownStage(UserError, ValueError):
    hint = "`dvc dag` (or dvc.yaml) lists this workspace's stages; `method:` in params.yaml picks the method"


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline. `qevolve run NAME [--iteration K]` calls the function NAME of `module`
    as `fn(params, **reads(k), **writes(k), metrics_path=..., [curve_path=...], [details_path=...],
    [iteration=k])`; dvc.yaml lists `reads` and the module's code as its deps, `writes` as its outs and
    `params` as its params deps."""

    name: str
    module: str
    reads: Callable[[int], dict[str, Path]]
    """Iteration k -> the function's argument -> the artifact or metrics file it reads."""
    writes: Callable[[int], dict[str, Path]]
    """Iteration k -> the function's argument -> the artifact it writes (a DVC out)."""
    params: tuple[str, ...]
    """The params.yaml keys (or whole sections) it reads."""
    once: bool = False
    """Runs once before the iterations (`experts`, `base`, `bc`) rather than in each."""
    curve: tuple[str, ...] | None = None
    """Axes x, y of its per-step curve (`metrics/<stage>_curve.json`, a DVC plot), passed as `curve_path`; a
    third item names DVC's plot template (`bar_horizontal`) where the default line plot does not fit."""
    details: bool = False
    """Writes per-item details (`metrics/<stage>_details.json`), passed as `details_path`."""
    takes_iteration: bool = False
    """Passed `iteration=k`."""
    trainer: bool = False
    """Trains a model: `train.processes` > 1 runs it data-parallel under torchrun."""
    accelerated: bool = True
    """Computes on `model.device`. False (`experts`, `base`, `relabel`): it never does, and `qevolve run` starts
    it with CUDA hidden (`CUDA_VISIBLE_DEVICES` empty), so on a GPU host it neither initialises CUDA nor
    holds a context on the device."""
    path_params: tuple[str, ...] = ()
    """params keys naming a file or folder the stage reads (TerminalTraj's `terminaltraj.generate.sources`):
    where one is set, its path is a DVC dep too."""
    at: Callable[[int], bool] | None = None
    """The iterations it runs in (None: every one), for a method whose first iterations differ from the
    later ones (Multi²: offline in iteration 1, online after)."""
    logged: Logged = Logged()
    """What MLflow gets of it beside its metrics."""

    def runs_at(self, k: int) -> bool:
        return self.at is None or self.at(k)


BC_LOGGED = Logged(("loss",), ("out", "bc_adapter"))
SETUP = (
    Stage(
        "experts",
        "qevolve.stages.experts",
        lambda k: {},
        lambda k: {"out": paths.EXPERTS},
        ("env", "experts"),
        once=True,
        details=True,
        logged=PLAYED,
        accelerated=False,
    ),
    Stage(
        "base",
        "qevolve.stages.base",
        lambda k: {"experts_dir": paths.EXPERTS},
        lambda k: {"out": paths.BASE},
        ("env.name", "model.base", "model.embedded", "model.context_tokens"),
        once=True,
        accelerated=False,
    ),
    Stage(
        "bc",
        "qevolve.stages.bc",
        lambda k: {"base_dir": paths.BASE, "experts_dir": paths.EXPERTS},
        lambda k: {"out": paths.BC},
        ("env", *MODEL_PARAMS, "prompt", "bc"),
        once=True,
        curve=("step", "loss"),
        trainer=True,
        logged=BC_LOGGED,
    ),
)
"""The stages every method starts with, once."""


@dataclass(frozen=True)
class Recipe:
    """A method: what happens in each of its iterations k >= 1 before `evaluate@k`."""

    name: str
    iteration: Callable[[object, Recipe], tuple[Stage, ...]]
    """(params, the recipe it runs in) -> the stages of every iteration, in run order, before `evaluate@k`.
    The recipe is passed so that a method can run another's iteration after setup stages of its own
    (TerminalTraj runs Q-Evolve's): the stages read `recipe.steps_before`, not their own method's."""
    plays: str | Callable[[int], str]
    """The stage that plays train episodes in each iteration (or iteration k -> its name): its metrics
    carry the cumulative env-step count that the evaluations report."""
    setup: tuple[Stage, ...] = SETUP
    """The stages run once before `evaluate@0`; the last writes the policy of iteration 0 (`paths.BC`)."""
    evaluate_module: str = "qevolve.stages.evaluate"
    """Where `evaluate` (playing `paths.policy(k)` greedily on the evaluation splits) lives."""
    evaluate_params: tuple[str, ...] = ()
    """The params keys that this method's `evaluate` reads beside `ACTING_PARAMS` and `evaluate`."""
    demonstrations: str = "experts"
    """The setup stage that played the demonstrations: its metrics carry the env steps policy 0 cost."""
    seed_keys: dict[str, int] = field(default_factory=dict)
    """The seeds of its own sections: a benchmark table's seed s sets each to its default + s * step
    (`flows.table_spec`; the shared sections' seeds are set for every method)."""
    smoke: dict = field(default_factory=dict)
    """Parameters (over the defaults, with `evolve.iterations: 1`) under which every stage of its recipe is in
    dvc.yaml: what the tests of dvc.yaml's deps and of the flow's order check it with."""

    def steps_before(self, k: int) -> Path:
        """The metrics file with the env steps spent to train policy k: the experts' for k = 0, else
        this recipe's stage that played iteration k's episodes."""
        if k == 0:
            return paths.metrics(self.demonstrations)
        return paths.metrics(f"{self.plays(k) if callable(self.plays) else self.plays}@{k}")

    def evaluate(self) -> Stage:
        return Stage(
            "evaluate",
            self.evaluate_module,
            lambda k: {"base_dir": paths.BASE, "policy_dir": paths.policy(k), "env_steps_path": self.steps_before(k)},
            lambda k: {"out": paths.evaluation(k)},
            (*ACTING_PARAMS, "evaluate", *self.evaluate_params),
            takes_iteration=True,
            logged=PLAYED,
        )

    def iteration_stages(self, params) -> tuple[Stage, ...]:
        """The stages of its iterations with these parameters, in run order, before `evaluate@k`."""
        return self.iteration(params, self)

    def stages(self, params) -> tuple[Stage, ...]:
        """Every stage this method can run with these parameters: setup, evaluation and its iterations'."""
        return (*self.setup, self.evaluate(), *self.iteration_stages(params))

    def stage(self, name: str, params) -> Stage:
        found = {s.name: s for s in self.stages(params)}
        if name not in found:
            raise UnknownStage(
                f"stage {name!r} is not a stage of method {self.name!r} with these parameters; expected one of "
                f"{list(found)}"
            )
        return found[name]

    def order(self, params, iterations: int) -> list[tuple[Stage, int | None]]:
        """(stage, iteration) in run order for `iterations` iterations (None for a once-only stage)."""
        each = (*self.iteration_stages(params), self.evaluate())
        return (
            [(s, None) for s in self.setup]
            + [(self.evaluate(), 0)]
            + [(s, k) for k in range(1, iterations + 1) for s in each if s.runs_at(k)]
        )


def build_on(method: str) -> Recipe:
    """Another method's recipe, for a method that runs its iterations with a setup of its own (TerminalTraj runs
    Q-Evolve's): the declared way for one method to depend on another (tests/test_architecture.py lets this one
    arrow between methods through and no other)."""
    return load_recipe(method)


def load_recipe(method: str) -> Recipe:
    if method not in methods():
        raise ValueError(f"method {method!r}: no package qevolve.methods.{method}; expected one of {methods()}")
    return importlib.import_module(f"qevolve.methods.{method}").RECIPE
