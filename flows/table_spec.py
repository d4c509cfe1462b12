"""A benchmark table's spec (`benchmarks/*.yaml`): its workspaces and rows, cut to some seeds or
workspaces, and each workspace's parameters for a seed (`flows.table` runs them)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flows.workspace import ROOT, get_dotted, set_dotted, spent_env_steps, steps_file
from qevolve.config import ConfigError
from qevolve.params import parse_params, resolve_params
from qevolve.recipe import load_recipe

SEED_KEYS = {"bc.seed": 1, "collect.seed": 100, "policy.seed": 1}
"""What a seed changes in every workspace: each key gets `base value + seed * step` (collect's seed steps by
100, since iteration k already adds k to it); each method adds its own (`Recipe.seed_keys`)."""
SPLITS = ("valid_seen", "valid_unseen")


class Workspace(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str
    """The method's name in plots."""
    iterations: int = Field(ge=0)
    seeds: int = Field(1, gt=0)
    """How many of the table's seeds run this workspace (the first n)."""
    set: dict[str, object] = Field(default_factory=dict)
    """Dotted parameter -> value, over the base profile."""
    match_env_steps: str | None = None
    """Another workspace: `env_steps_key` is set to the env steps its first seed's rollouts took over
    all its iterations (one iteration of the online baseline then spends what that workspace spent)."""
    env_steps_key: str = "online.env_steps"
    """The params key `match_env_steps` sets: the GRPO baseline's budget per iteration, or another online
    phase's (`multi2.online.env_steps`)."""


class Row(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    workspace: str
    stage: str
    """The stage whose per-split metrics the row reports: `evaluate@k` or `rerank@k`."""
    against: str | None = None
    """The row this one is compared with, paired by task and seed (default: the table's first row, which
    is compared with none)."""


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    base: str
    """The params file every workspace starts from, relative to the repository root."""
    set: dict[str, object] = Field(default_factory=dict)
    """Dotted parameter -> value for every workspace (before the workspace's own)."""
    seeds: list[int] = Field(min_length=1)
    workspaces: dict[str, Workspace]
    rows: list[Row] = Field(min_length=1)
    pair: list[str] = Field(default_factory=lambda: list(SPLITS), min_length=1, max_length=3)
    """The splits the table reports side by side: ALFWorld's seen and unseen games by default, TerminalTraj's
    `test` and `test_ood`."""
    by_type: str | None = None
    """A split to report per task type instead of the seen/unseen pair (TextCraft's `test`, whose task types
    are the recipe depths): success per type over every seed's episodes with its task-clustered interval,
    tokens per episode by role, System 1 calls per episode, invalid and repeated-action rates."""

    def against(self, row: Row) -> str | None:
        """The row `row` is compared with: its own `against`, else the first row (none for the first row)."""
        return row.against or (None if row.name == self.rows[0].name else self.rows[0].name)

    def splits(self) -> tuple[str, ...]:
        return (self.by_type,) if self.by_type else tuple(self.pair)

    @model_validator(mode="after")
    def _consistent(self) -> Spec:
        names = list(self.workspaces)
        for name, ws in self.workspaces.items():
            if ws.seeds > len(self.seeds):
                raise ValueError(f"workspaces.{name}.seeds: {ws.seeds} but the table has {len(self.seeds)} seeds")
            if ws.match_env_steps is not None and ws.match_env_steps not in names[: names.index(name)]:
                raise ValueError(
                    f"workspaces.{name}.match_env_steps: expected a workspace listed before it, got "
                    f"{ws.match_env_steps!r}"
                )
        for i, row in enumerate(self.rows):
            ws = self.workspaces.get(row.workspace)
            if ws is None:
                raise ValueError(f"rows.{i}.workspace: unknown workspace {row.workspace!r}; expected one of {names}")
            stage, _, k = row.stage.partition("@")
            if stage not in ("evaluate", "rerank") or not k.isdigit() or int(k) > ws.iterations:
                raise ValueError(
                    f"rows.{i}.stage: expected evaluate@k or rerank@k with k <= {ws.iterations}, got {row.stage!r}"
                )
            if row.against is not None and row.against not in {r.name for r in self.rows} - {row.name}:
                raise ValueError(f"rows.{i}.against: expected the name of another row, got {row.against!r}")
        return self


def load_spec(path: Path) -> Spec:
    try:
        raw = yaml.safe_load(Path(path).read_text())
        return Spec.model_validate(raw)
    except FileNotFoundError:
        raise ConfigError(f"{path}: table spec not found") from None
    except ValidationError as err:
        lines = [f"{path}: invalid table spec"]
        for e in err.errors():
            where = ".".join(map(str, e["loc"]))
            lines.append(
                f"  {where}: {e['msg']} (got {e.get('input')!r})"
                if where
                else f"  {e['msg'].removeprefix('Value error, ')}"
            )
        raise ConfigError("\n".join(lines)) from None


def first_seeds(spec: Spec, n: int) -> Spec:
    """The spec cut to its first `n` seeds (every workspace runs at most `n`): a quick first table, or the
    table of what a stopped run has finished, since every finished stage is restored, not rerun."""
    if n < 1:
        raise ConfigError(f"--seeds: expected at least 1, got {n}")
    workspaces = {name: ws.model_copy(update={"seeds": min(ws.seeds, n)}) for name, ws in spec.workspaces.items()}
    return spec.model_copy(update={"seeds": spec.seeds[:n], "workspaces": workspaces})


def only_seeds(spec: Spec, wanted: list[int]) -> Spec:
    """The spec cut to the seeds in `wanted`: each workspace runs those of its seeds that are wanted, a
    workspace with none of them is left out with its rows (a table's seeds run on machines or in sessions
    of their own, their results joined by `merge`)."""
    unknown = sorted(set(wanted) - set(spec.seeds))
    if unknown:
        raise ConfigError(f"--seed: {unknown} not among the spec's seeds {spec.seeds}")
    workspaces = {}
    for name, ws in spec.workspaces.items():
        n = len(set(spec.seeds[: ws.seeds]) & set(wanted))  # a prefix of the wanted seeds, in the spec's order
        if n:
            workspaces[name] = ws.model_copy(update={"seeds": n})
    rows = [r for r in spec.rows if r.workspace in workspaces]
    return spec.model_copy(
        update={"seeds": [s for s in spec.seeds if s in wanted], "workspaces": workspaces, "rows": rows}
    )


def only_workspaces(spec: Spec, names: list[str]) -> Spec:
    """The spec cut to the workspaces `names` and their rows (a table's missing rows run on their own)."""
    unknown = [n for n in names if n not in spec.workspaces]
    if unknown:
        raise ConfigError(f"--workspace: {unknown} not among the spec's workspaces {list(spec.workspaces)}")
    rows = [r for r in spec.rows if r.workspace in names]
    return spec.model_copy(
        update={"workspaces": {n: ws for n, ws in spec.workspaces.items() if n in names}, "rows": rows}
    )


def budget(spec: Spec, name: str, out: Path, given: int | None) -> int | None:
    """The env steps workspace `name` is to spend (`match_env_steps`): `given`, or what the matched
    workspace's first seed spent in `out`."""
    ws = spec.workspaces[name]
    if not ws.match_env_steps:
        return None
    if given is not None:
        return given
    other, iterations = out / f"{ws.match_env_steps}-s{spec.seeds[0]}", spec.workspaces[ws.match_env_steps].iterations
    if not (other / "params.yaml").exists() or not steps_file(other, iterations).exists():
        raise ConfigError(
            f"workspaces.{name}.match_env_steps: {ws.match_env_steps}'s first seed has not run in {out}; run it first, "
            f"or pass --env-steps N (the `env_steps_budget` of the results.json of the run that did)"
        )
    return spent_env_steps(other, iterations)


def workspace_params(spec: Spec, name: str, seed: int, env_steps: int | None) -> dict:
    """The base profile with the workspace's changes, the seed's offsets and the matched env steps;
    validated, so a bad key fails before anything runs."""
    params = resolve_params(ROOT / spec.base)
    ws = spec.workspaces[name]
    for key, value in {**spec.set, **ws.set}.items():
        set_dotted(params, key, value)
    params.setdefault("evolve", {})["iterations"] = ws.iterations
    defaults = parse_params(params, f"{spec.name}/{name}").model_dump()
    for key, step in {**SEED_KEYS, **load_recipe(defaults["method"]).seed_keys}.items():
        set_dotted(params, key, get_dotted(defaults, key) + seed * step)
    if env_steps is not None:
        set_dotted(params, spec.workspaces[name].env_steps_key, env_steps)
    parse_params(params, f"{spec.name}/{name}-s{seed}")
    return params
