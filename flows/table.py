"""The benchmark table: the paper's comparison, ablations and online baseline, run in miniature.

A spec (`benchmarks/table.yaml`, `benchmarks/table-smoke.yaml`) names workspaces, each a set of parameter
changes over a base profile run for some iterations and seeds, and rows, each one stage's evaluation in
one workspace. Every workspace and seed is an evolution of its own (`flows.evolve`) in
`<out>/<workspace>-s<seed>/`, and all of them share one DVC cache: a stage whose code, parameters and
inputs match one already run anywhere in the table (BC per seed, `collect@1` for the ablations) is
checked out from DVC's run cache instead of being computed again. A killed table resumes the same way.

    python -m flows.table benchmarks/table.yaml                 # into runs/<name>/
    python -m flows.table benchmarks/table-smoke.yaml --out /tmp/smoke
    python -m flows.table benchmarks/table.yaml --seeds 1       # the first seed only
    python -m flows.table benchmarks/multi2.yaml --seed 1 --env-steps N --out runs/s1   # one seed, elsewhere
    python -m flows.table benchmarks/multi2.yaml --seed 0 --workspace multi2 --env-steps N --out runs/s0b   # one workspace
    python -m flows.table benchmarks/multi2.yaml --merge runs/s0/results.json runs/s1/results.json

It writes `<out>/table.md` (mean and std over seeds per row), `<out>/results.json`, `<out>/curves/`
and their DVC plots rendered to `<out>/success_by_iteration.png` and `success_by_env_steps.png`, and logs one MLflow parent run for the table with one
child run per row and seed (`<out>/mlflow.db`).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from prefect import flow
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from qevolve.config import ConfigError, parse_params
from qevolve.data.atomic import atomic_path, write_json
from qevolve.errors import inside
from qevolve.recipe import methods

ROOT = Path(__file__).resolve().parent.parent
SEED_KEYS = {"bc.seed": 1, "collect.seed": 100, "critic.seed": 1, "policy.seed": 1, "online.seed": 100,
             "step_hrl.critic.seed": 1, "step_hrl.policy.seed": 1, "multi2.critic.seed": 1, "multi2.policy.seed": 1, "multi2.online.seed": 100,
             "terminaltraj.filter.seed": 1}
"""What a seed changes: each key gets `base value + seed * step` (collect and online seeds step by 100, since
iteration k already adds k to them). A key in a section named after a method (`step_hrl`, `multi2`) is set only in
that method's workspaces."""
SPLITS = ("valid_seen", "valid_unseen")
BY_TYPE_KEYS = ("high_tokens_per_episode", "low_tokens_per_episode", "subtasks_per_episode", "invalid_rate", "repeated_rate")
"""What a per-type table reads of an evaluation beside its successes per type (the role keys only a
hierarchical method's evaluation has)."""


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
    pair: list[str] = Field(default_factory=lambda: list(SPLITS), min_length=1, max_length=2)
    """The splits the table reports side by side: ALFWorld's seen and unseen games by default, TerminalTraj's
    `test` and `test_ood`."""
    by_type: str | None = None
    """A split to report per task type instead of the seen/unseen pair (TextCraft's `test`, whose task types
    are the recipe depths): success per type with its binomial standard error over every seed's episodes,
    tokens per episode by role, System 1 calls per episode, invalid and repeated-action rates."""

    def splits(self) -> tuple[str, ...]:
        return (self.by_type,) if self.by_type else tuple(self.pair)

    @model_validator(mode="after")
    def _consistent(self) -> "Spec":
        names = list(self.workspaces)
        for name, ws in self.workspaces.items():
            if ws.seeds > len(self.seeds):
                raise ValueError(f"workspaces.{name}.seeds: {ws.seeds} but the table has {len(self.seeds)} seeds")
            if ws.match_env_steps is not None and ws.match_env_steps not in names[: names.index(name)]:
                raise ValueError(f"workspaces.{name}.match_env_steps: expected a workspace listed before it, got {ws.match_env_steps!r}")
        for i, row in enumerate(self.rows):
            ws = self.workspaces.get(row.workspace)
            if ws is None:
                raise ValueError(f"rows.{i}.workspace: unknown workspace {row.workspace!r}; expected one of {names}")
            stage, _, k = row.stage.partition("@")
            if stage not in ("evaluate", "rerank") or not k.isdigit() or int(k) > ws.iterations:
                raise ValueError(f"rows.{i}.stage: expected evaluate@k or rerank@k with k <= {ws.iterations}, got {row.stage!r}")
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
            lines.append(f"  {where}: {e['msg']} (got {e.get('input')!r})" if where else f"  {e['msg'].removeprefix('Value error, ')}")
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
    return spec.model_copy(update={"seeds": [s for s in spec.seeds if s in wanted], "workspaces": workspaces, "rows": rows})


def only_workspaces(spec: Spec, names: list[str]) -> Spec:
    """The spec cut to the workspaces `names` and their rows (a table's missing rows run on their own)."""
    unknown = [n for n in names if n not in spec.workspaces]
    if unknown:
        raise ConfigError(f"--workspace: {unknown} not among the spec's workspaces {list(spec.workspaces)}")
    rows = [r for r in spec.rows if r.workspace in names]
    return spec.model_copy(update={"workspaces": {n: ws for n, ws in spec.workspaces.items() if n in names}, "rows": rows})


def budget(spec: Spec, name: str, out: Path, given: int | None) -> int | None:
    """The env steps workspace `name` is to spend (`match_env_steps`): `given`, or what the matched
    workspace's first seed spent in `out`."""
    ws = spec.workspaces[name]
    if not ws.match_env_steps:
        return None
    if given is not None:
        return given
    other, iterations = out / f"{ws.match_env_steps}-s{spec.seeds[0]}", spec.workspaces[ws.match_env_steps].iterations
    if not (other / "metrics" / f"collect@{iterations}.json").exists():
        raise ConfigError(f"workspaces.{name}.match_env_steps: {ws.match_env_steps}'s first seed has not run in {out}; run it first, "
                          f"or pass --env-steps N (the `env_steps_budget` of the results.json of the run that did)")
    return spent_env_steps(other, iterations)


def merge(spec: Spec, files: list[Path], replace: bool = False) -> tuple[list[dict], list[dict]]:
    """The rows of several results.json files of `spec`'s table (each from `--seed` runs), every row's
    seeds joined; and per file its commit and wall time. A seed given twice for a row is kept once where its
    figures are the same (a stage re-run, as the run cache replays or a run reproduces it); where they differ
    it is refused, or with `replace` the later file's figures replace the earlier's, listed in that file's
    `replaced`."""
    rows = {r.name: {"row": r.name, "workspace": r.workspace, "stage": r.stage, "seeds": []} for r in spec.rows}
    sources = []
    for f in files:
        try:
            data = json.loads(Path(f).read_text())
            name, given = data["spec"]["name"], data["rows"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{f}: not a table's results.json ({type(err).__name__}: {err})") from None
        if name != spec.name:
            raise ConfigError(f"{f}: spec.name: results of table {name!r}, expected {spec.name!r}")
        replaced = []
        for r in given:
            if r["row"] not in rows:
                raise ConfigError(f"{f}: rows: row {r['row']!r} is not in {spec.name}'s spec")
            earlier = {s["seed"]: s for s in rows[r["row"]]["seeds"]}
            differ = sorted(s["seed"] for s in r["seeds"] if s["seed"] in earlier and s != earlier[s["seed"]])
            if differ and not replace:
                raise ConfigError(f"{f}: rows: row {r['row']!r} has seed(s) {differ} that an earlier file gave with other figures "
                                  "(--replace: keep this file's)")
            replaced += [{"row": r["row"], "seed": k} for k in differ]
            rows[r["row"]]["seeds"] = [s for s in rows[r["row"]]["seeds"] if s["seed"] not in differ]
            rows[r["row"]]["seeds"] += [s for s in r["seeds"] if s["seed"] not in earlier or s["seed"] in differ]
        # A joined table's own sources are kept under it, so joining it again loses none of its runs' commits.
        own = {"merged_from": data["merged_from"]} if "merged_from" in data else {
            "git_commit": data.get("git_commit"), "wall_s": data.get("wall_s"), "packages_sha256": data.get("packages_sha256")}
        sources.append({"file": str(f), **own, **({"replaced": replaced} if replaced else {})})
    for r in rows.values():
        r["seeds"].sort(key=lambda s: s["seed"])
    return [r for r in rows.values() if r["seeds"]], sources


def get_dotted(params: dict, key: str):
    for part in key.split("."):
        params = params[part]
    return params


def set_dotted(params: dict, key: str, value) -> None:
    *path, last = key.split(".")
    node = params
    for part in path:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = copy.deepcopy(value)  # the spec's own values are never changed by later keys


def workspace_params(spec: Spec, name: str, seed: int, env_steps: int | None) -> dict:
    """The base profile with the workspace's changes, the seed's offsets and the matched env steps;
    validated, so a bad key fails before anything runs."""
    params = yaml.safe_load((ROOT / spec.base).read_text())
    ws = spec.workspaces[name]
    for key, value in {**spec.set, **ws.set}.items():
        set_dotted(params, key, value)
    params.setdefault("evolve", {})["iterations"] = ws.iterations
    defaults = parse_params(params, f"{spec.name}/{name}").model_dump()
    for key, step in SEED_KEYS.items():
        section, *_ = key.split(".")
        if section in methods() and section != defaults["method"]:
            continue
        set_dotted(params, key, get_dotted(defaults, key) + seed * step)
    if env_steps is not None:
        set_dotted(params, spec.workspaces[name].env_steps_key, env_steps)
    parse_params(params, f"{spec.name}/{name}-s{seed}")
    return params


def prepare(root: Path, params: dict, cache: Path | None = None) -> None:
    """A workspace: the stages' code (identical everywhere, so the run cache matches across workspaces),
    params.yaml, and a DVC repository whose cache is `cache` (the table's; its own without one)."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root / "src", ignore_errors=True)  # a file deleted from the checkout goes from the copy too
    shutil.copytree(ROOT / "src", root / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    text = yaml.safe_dump(params, sort_keys=False)
    if not (root / "params.yaml").exists() or (root / "params.yaml").read_text() != text:
        with atomic_path(root / "params.yaml") as tmp:
            tmp.write_text(text)
    if not (root / ".dvc").exists():
        subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
        if cache is not None:
            subprocess.run([sys.executable, "-m", "dvc", "cache", "dir", str(cache)], cwd=root, check=True)


def read_metrics(root: Path, stage: str) -> dict:
    return json.loads((root / "metrics" / f"{stage}.json").read_text())


def demonstration_steps(root: Path) -> int:
    """Env steps the workspace's demonstrations took: the experts' (TerminalTraj's: its teacher's)."""
    from qevolve.recipe import load_recipe

    method = yaml.safe_load((root / "params.yaml").read_text()).get("method", "qevolve")
    return read_metrics(root, load_recipe(method).demonstrations)["cumulative_env_steps"]


def own_env_steps(root: Path, cumulative: int) -> int:
    """Env steps of the workspace's own rollouts in a cumulative count (the demonstrations' steps taken off)."""
    return cumulative - demonstration_steps(root)


def spent_env_steps(root: Path, iterations: int) -> int:
    """Env steps the workspace's own rollouts took in its first `iterations` iterations."""
    return own_env_steps(root, read_metrics(root, f"collect@{iterations}")["cumulative_env_steps"])


def mean_std(values: list[float]) -> tuple[float, float | None]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def gather(spec: Spec, out: Path) -> list[dict]:
    """Per row: per seed, the row stage's metrics per split, and the env steps and tokens behind it."""
    results = []
    for row in spec.rows:
        ws = spec.workspaces[row.workspace]
        seeds = []
        for seed in spec.seeds[: ws.seeds]:
            root = out / f"{row.workspace}-s{seed}"
            m = read_metrics(root, row.stage)
            experts = demonstration_steps(root)
            first = next(iter(m.values()))
            seeds.append({
                "seed": seed, "workspace": str(root.relative_to(out)),
                **{f"{split}/{key}": m[split][key] for split in spec.splits() if split in m for key in ("success_rate", "avg_reward", "episodes")},
                **{f"{split}/tokens_per_episode": m[split]["prompt_tokens_per_episode"] + m[split]["output_tokens_per_episode"]
                   for split in spec.splits() if split in m},
                **({f"{spec.by_type}/{key}": m[spec.by_type][key] for key in (*BY_TYPE_KEYS, "by_type") if key in m[spec.by_type]}
                   if spec.by_type in m else {}),
                "expert_env_steps": experts,
                "own_env_steps": first["cumulative_env_steps"] - experts,
                "generated_tokens": first.get("cumulative_generated_tokens", 0),
            })
        results.append({"row": row.name, "workspace": row.workspace, "stage": row.stage, "seeds": seeds})
    return results


def fmt(values: list[float], percent: bool = False, digits: int = 3) -> str:
    m, s = mean_std(values)
    if percent:
        return f"{100 * m:.1f}" + (f" ± {100 * s:.1f}" if s is not None else "")
    if digits == 0:
        return f"{m:,.0f}" + (f" ± {s:,.0f}" if s is not None else "")
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if s is not None else "")


def by_type_markdown(results: list[dict], split: str) -> str:
    """The per-task-type table of `split`: success % ± binomial standard error of every seed's episodes
    pooled, per type and over all, then the means over seeds of tokens per episode by role, System 1 calls
    per episode, invalid and repeated-action rates."""
    types = sorted({ty for r in results for s in r["seeds"] for ty in s.get(f"{split}/by_type", {})})
    head = (f"| # | row | seeds | {' | '.join(f'{ty} success %' for ty in types)} | all success % | tokens per episode (high / low) | "
            "System 1 calls per episode | invalid % | repeated % |")
    lines = [head, "|---:|---|---:|" + "---:|" * (len(types) + 5)]

    def pooled(counts: list[dict]) -> str:
        n, won = sum(c["episodes"] for c in counts), sum(c["won"] for c in counts)
        if not n:
            return ""
        p = won / n
        return f"{100 * p:.1f} ± {100 * (p * (1 - p) / n) ** 0.5:.1f} ({won}/{n})"

    for i, r in enumerate(results, 1):
        seeds = r["seeds"]
        col = lambda key: [s[key] for s in seeds if key in s]  # noqa: E731
        cells = [pooled([s[f"{split}/by_type"][ty] for s in seeds if ty in s.get(f"{split}/by_type", {})]) for ty in types]
        cells.append(pooled([c for s in seeds for c in s.get(f"{split}/by_type", {}).values()]))
        high, low = col(f"{split}/high_tokens_per_episode"), col(f"{split}/low_tokens_per_episode")
        tokens = f"{fmt(high, digits=0)} / {fmt(low, digits=0)}" if high else fmt(col(f"{split}/tokens_per_episode"), digits=0) + " (flat)"
        calls = col(f"{split}/subtasks_per_episode")
        lines.append(f"| {i} | {r['row']} | {len(seeds)} | {' | '.join(cells)} | {tokens} | {fmt(calls, digits=2) if calls else ''} | "
                     f"{fmt(col(f'{split}/invalid_rate'), True)} | {fmt(col(f'{split}/repeated_rate'), True)} |")
    return "\n".join(lines) + "\n"


def markdown(results: list[dict], by_type: str | None = None, pair: tuple[str, ...] = SPLITS) -> str:
    if by_type:
        return by_type_markdown(results, by_type)
    label = {"valid_seen": "seen", "valid_unseen": "unseen"}
    head = (f"| # | row | seeds | {' | '.join(f'{label.get(s, s)} success % | {label.get(s, s)} reward' for s in pair)} | own env steps | "
            f"generated tokens | tokens per {label.get(pair[0], pair[0])} episode |")
    lines = [head, "|---:|---|---:|" + "---:|---:|" * len(pair) + "---:|---:|---:|"]
    for i, r in enumerate(results, 1):
        col = lambda key: [s[key] for s in r["seeds"] if key in s]  # noqa: E731
        cells = " | ".join(f"{fmt(col(f'{s}/success_rate'), True)} | {fmt(col(f'{s}/avg_reward'))}" for s in pair)
        lines.append(f"| {i} | {r['row']} | {len(r['seeds'])} | {cells} | {fmt(col('own_env_steps'), digits=0)} | "
                     f"{fmt(col('generated_tokens'), digits=0)} | {fmt(col(f'{pair[0]}/tokens_per_episode'), digits=0)} |")
    return "\n".join(lines) + "\n"


def write_curves(spec: Spec, out: Path) -> None:
    """Per workspace, mean success per split against iteration and own env steps (one file per method,
    which is how DVC colours the lines), with the DVC plots that draw them."""
    folder = out / "curves"
    folder.mkdir(exist_ok=True)
    files = []
    for name, ws in spec.workspaces.items():
        if ws.set.get("rerank.best_of"):
            continue  # a test-time variant: its evaluate@k curve is Q-Evolve's own
        rows = []
        for k in range(ws.iterations + 1):
            points = []
            for seed in spec.seeds[: ws.seeds]:
                root = out / f"{name}-s{seed}"
                m = read_metrics(root, f"evaluate@{k}")
                points.append({**{s: m[s]["success_rate"] for s in spec.splits() if s in m},
                               "env_steps": own_env_steps(root, next(iter(m.values()))["cumulative_env_steps"])})
            rows.append({"iteration": k, **{key: statistics.mean(p[key] for p in points) for key in points[0]}})
        path = folder / f"{ws.label}.json"
        write_json(path, rows)
        files.append(path.relative_to(out).as_posix())
    plots = [
        {f"success_by_{x}": {"template": "simple", "x": x, "y": {f: list(spec.splits()) for f in files}, "y_label": "success rate",
                             "title": f"Success rate by {x.replace('_', ' ')}"}}
        for x in ("iteration", "env_steps")
    ]
    (out / "dvc.yaml").write_text(yaml.safe_dump({"plots": plots}, sort_keys=False))


def render_plots(out: Path) -> list[Path]:
    """`dvc plots show` of the table's curves, each Vega-Lite plot rendered to a PNG."""
    import vl_convert

    if not (out / ".dvc").exists():
        subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=out, check=True)
    shown = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "--json"], cwd=out, check=True, capture_output=True, text=True)
    images = []
    for name, renders in json.loads(shown.stdout)["data"].items():
        chart = renders[0]["content"]
        # DVC colours by revision (one here) and dashes by file::field; a still image reads better with
        # one colour per method (file) and one dash per split (field), and points on the lines.
        chart["transform"] = [
            {"calculate": "replace(split(datum['filename::field'], '::')[0], '.json', '')", "as": "method"},
            {"calculate": "split(datum['filename::field'], '::')[1]", "as": "split"},
        ]
        chart["mark"] = {"type": "line", "point": True}
        chart["encoding"]["color"] = {"field": "method", "type": "nominal"}
        chart["encoding"]["strokeDash"] = {"field": "split", "type": "nominal"}
        chart["encoding"]["y"]["scale"] = {"domain": [0, 1]}
        path = out / f"{name}.png"
        with atomic_path(path) as tmp:
            tmp.write_bytes(vl_convert.vegalite_to_png(json.dumps(chart), scale=1.5))
        images.append(path)
    return images


def git_commit() -> str:
    """The checkout's commit, marked `-dirty` when tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head + ("-dirty" if dirty else "") if head else "unknown"


def packages() -> list[str]:
    """The interpreter's version and every installed distribution as `name==version`, sorted: what a run
    was computed with besides the code (two checkouts of one commit can resolve other versions)."""
    from importlib.metadata import distributions

    found = {f"{d.metadata['Name']}=={d.version}" for d in distributions() if d.metadata["Name"]}
    return [f"python=={platform.python_version()}", *sorted(found, key=str.lower)]


def packages_sha256(listing: list[str]) -> str:
    return hashlib.sha256("\n".join(listing).encode()).hexdigest()


def log_table(spec: Spec, results: list[dict], wall_s: float, images: list[Path], commit: str, listing: list[str]) -> str:
    """One MLflow parent run for the table, one child per row and seed; returns the parent's id."""
    import mlflow

    from flows.tracking import use_experiment

    use_experiment(f"table-{spec.name}")
    with mlflow.start_run(run_name=f"table-{spec.name}", tags={"qevolve.git_commit": commit, "qevolve.packages_sha256": packages_sha256(listing)}) as parent:
        mlflow.log_metric("wall_s", wall_s)
        mlflow.log_text("\n".join(listing) + "\n", "environment/packages.txt")
        mlflow.log_text(markdown(results, spec.by_type, spec.splits()), "table.md")
        for image in images:
            mlflow.log_artifact(str(image))
        for i, r in enumerate(results, 1):
            for s in r["seeds"]:
                with mlflow.start_run(run_name=f"{i}. {r['row']} (seed {s['seed']})", nested=True,
                                      tags={"qevolve.row": r["row"], "qevolve.stage": r["stage"], "qevolve.workspace": s["workspace"]}):
                    mlflow.log_params({"row": i, "seed": s["seed"], "workspace": r["workspace"], "stage": r["stage"]})
                    mlflow.log_metrics({k.replace("/", "_"): float(v) for k, v in s.items() if isinstance(v, (int, float)) and k != "seed"})
        return parent.info.run_id


@flow(name="table")
def table(spec_path: str, out: str | None = None, seeds: int | None = None, only: list[int] | None = None,
          env_steps: int | None = None, workspaces: list[str] | None = None) -> dict:
    """Run every workspace and seed of the spec (each an evolution; only the first `seeds` seeds, or the
    seeds in `only`, and only `workspaces`, if given), then write and log the table. `env_steps`: the
    budget of the `match_env_steps` workspaces, where the workspace they match does not run here."""
    from flows.evolve import evolve

    start = time.perf_counter()
    commit = git_commit()
    full = spec = load_spec(Path(spec_path))
    if seeds is not None:
        spec = first_seeds(spec, seeds)
    if only:
        spec = only_seeds(spec, only)
    if workspaces:
        spec = only_workspaces(spec, workspaces)
    out_dir = Path(out or ROOT / "runs" / spec.name).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{out_dir / 'mlflow.db'}")
    # Seed-major: every workspace's first seed before any second seed, so a partial table has every row.
    plan = [(name, seed) for i, seed in enumerate(spec.seeds) for name, ws in spec.workspaces.items() if i < ws.seeds]
    for name, ws in spec.workspaces.items():  # validate every workspace's parameters before any compute
        for seed in spec.seeds[: ws.seeds]:
            workspace_params(spec, name, seed, 1 if ws.match_env_steps else None)
    budgets = {}
    for n, (name, seed) in enumerate(plan, 1):
        if spec.workspaces[name].match_env_steps:
            budgets[name] = budget(full, name, out_dir, env_steps)
        root = inside(out_dir, f"{name}-s{seed}", f"{spec_path}: workspace")
        prepare(root, workspace_params(spec, name, seed, budgets.get(name)), out_dir / "dvc-cache")
        print(f"[table] {n}/{len(plan)}: {name} seed {seed} in {root}", flush=True)
        try:
            evolve(root=str(root))
        finally:
            os.chdir(ROOT)
    results = gather(spec, out_dir)
    wall = time.perf_counter() - start
    write_curves(spec, out_dir)
    images = render_plots(out_dir)
    listing = packages()
    run_id = log_table(spec, results, wall, images, commit, listing)
    text = markdown(results, spec.by_type, spec.splits())
    write_json(out_dir / "results.json", {"spec": spec.model_dump(), "rows": results, "wall_s": wall, "git_commit": commit, "mlflow_parent_run_id": run_id,
                                          "env_steps_budget": budgets, "packages_sha256": packages_sha256(listing), "packages": listing})
    with atomic_path(out_dir / "table.md") as tmp:
        tmp.write_text(text)
    return {"out": str(out_dir), "mlflow_parent_run_id": run_id, "wall_s": wall, "table": text, "images": [str(p) for p in images], "git_commit": commit}


def write_merged(spec_path: str, files: list[str], out: str | None = None, replace: bool = False) -> dict:
    """`merge` of the results files into `<out>/table.md` and `<out>/results.json` (no runs, no plots:
    those stay with each run's own folder and MLflow database)."""
    spec = load_spec(Path(spec_path))
    results, sources = merge(spec, [Path(f) for f in files], replace)
    out_dir = Path(out or ROOT / "runs" / spec.name).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(results, spec.by_type, spec.splits())
    write_json(out_dir / "results.json", {"spec": spec.model_dump(), "rows": results, "merged_from": sources})
    with atomic_path(out_dir / "table.md") as tmp:
        tmp.write_text(text)
    return {"out": str(out_dir), "table": text, "sources": sources}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", help="table spec, e.g. benchmarks/table.yaml")
    parser.add_argument("--out", help="output folder (default runs/<spec name>)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--seeds", type=int, help="run only the spec's first N seeds")
    which.add_argument("--seed", type=int, action="append", help="run only this seed of the spec (repeatable); join the runs with --merge")
    which.add_argument("--merge", nargs="+", metavar="RESULTS", help="run nothing: join these results.json files of the spec's table into one table")
    parser.add_argument("--replace", action="store_true", help="with --merge: a later file's seed with other figures replaces the earlier file's")
    parser.add_argument("--workspace", action="append", help="run only this workspace of the spec (repeatable), with its rows")
    parser.add_argument("--env-steps", type=int, help="the budget of the match_env_steps workspaces when the workspace they match does not run here")
    args = parser.parse_args(argv)
    if args.replace and not args.merge:
        parser.error("--replace: only with --merge")
    try:
        if args.merge:
            result = write_merged(args.spec, args.merge, args.out, args.replace)
            print(result["table"])
            for s in result["sources"]:
                for r in s.get("replaced", []):
                    print(f"{s['file']}: replaced seed {r['seed']} of row {r['row']!r} that an earlier file gave with other figures")
            print("joined " + ", ".join(f"{s['file']} ({'a joined table' if 'merged_from' in s else 'commit ' + str(s['git_commit'])})"
                                        for s in result["sources"]) + f" into {result['out']}")
            return 0
        result = table(args.spec, args.out, args.seeds, args.seed, args.env_steps, args.workspace)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    print()
    print(result["table"])
    print(f"wall time {result['wall_s'] / 60:.1f} min at commit {result['git_commit']}; MLflow parent run {result['mlflow_parent_run_id']} "
          f"in {result['out']}/mlflow.db; plots {', '.join(result['images'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
