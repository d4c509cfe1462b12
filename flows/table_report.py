"""A benchmark table's results: gathered from its workspaces' metrics (or joined from several runs'
results.json), as markdown, success curves with their DVC plots, and one MLflow parent run."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from flows.provenance import machine, machine_line, packages_sha256
from flows.table_spec import SPLITS, Spec
from flows.workspace import demonstration_steps, own_env_steps, read_metrics
from qevolve import paths
from qevolve.algos.stats import clustered, difference_text, paired_bootstrap, percent_interval
from qevolve.config import ConfigError
from qevolve.data.atomic import atomic_path, write_json
from qevolve.data.store import read_episodes

BY_TYPE_KEYS = (
    "high_tokens_per_episode",
    "low_tokens_per_episode",
    "subtasks_per_episode",
    "invalid_rate",
    "repeated_rate",
)
"""What a per-type table reads of an evaluation beside its successes per type (the role keys only a
hierarchical method's evaluation has)."""


def mean_std(values: list[float]) -> tuple[float, float | None]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def task_outcomes(root: Path, stage: str) -> dict[str, dict]:
    """Per split, per task: its type, and the episodes and wins the row's stage played on it (read from the
    stage's episodes, `data/evaluate@k` or `data/rerank@k`; what pairs two rows by task)."""
    name, _, k = stage.partition("@")
    out: dict[str, dict] = {}
    for e in read_episodes(root / {"evaluate": paths.evaluation, "rerank": paths.reranked}[name](int(k))):
        task = out.setdefault(e["split"], {}).setdefault(
            e["task_id"], {"type": e["task_type"], "won": 0, "episodes": 0}
        )
        task["won"] += e["won"]
        task["episodes"] += 1
    return out


def critic_auc(root: Path, stage: str) -> dict:
    """{"critic_auc": the held-out AUC of the critic behind a row} (`diagnose@k`, k the row's iteration: flat
    `critic_auc`, a hierarchy's low level, System 2 for Multi²; None where no held-out episode was won, or none
    lost), or {} where no critic was diagnosed at that iteration."""
    k = int(stage.partition("@")[2])
    path = root / "metrics" / f"diagnose@{k}.json"
    if not k or not path.is_file():
        return {}
    d = json.loads(path.read_text())
    return {"critic_auc": d.get("critic_auc", d.get("low_critic_auc"))}


def update_weights(root: Path, stage: str) -> dict:
    """{"weight_off_one": the share of action tokens whose weight in the update behind a row was more than 0.1
    from behaviour cloning's 1} (`policy@k`'s `weight_off_one_share`), or {} where the row's iteration had no
    such update."""
    k = int(stage.partition("@")[2])
    path = root / "metrics" / f"policy@{k}.json"
    share = json.loads(path.read_text()).get("weight_off_one_share") if k and path.is_file() else None
    return {} if share is None else {"weight_off_one": share}


def gather(spec: Spec, out: Path) -> list[dict]:
    """Per row: per seed, the row stage's metrics per split, its outcome on each task, and the env steps and
    tokens behind it."""
    results = []
    for row in spec.rows:
        ws = spec.workspaces[row.workspace]
        seeds = []
        for seed in spec.seeds[: ws.seeds]:
            root = out / f"{row.workspace}-s{seed}"
            m = read_metrics(root, row.stage)
            tasks = task_outcomes(root, row.stage)
            experts = demonstration_steps(root)
            first = next(iter(m.values()))
            seeds.append(
                {
                    "seed": seed,
                    "workspace": str(root.relative_to(out)),
                    **{
                        f"{split}/{key}": m[split][key]
                        for split in spec.splits()
                        if split in m
                        for key in ("success_rate", "avg_reward", "episodes")
                    },
                    **{
                        f"{split}/env_failures": m[split].get("env_failures", 0)
                        for split in spec.splits()
                        if split in m
                    },
                    **{
                        f"{split}/invalid_rate": m[split]["invalid_rate"]
                        for split in spec.splits()
                        if "invalid_rate" in m.get(split, {})
                    },
                    **{f"{split}/tasks": tasks.get(split, {}) for split in spec.splits() if split in m},
                    **{
                        f"{split}/tokens_per_episode": m[split]["prompt_tokens_per_episode"]
                        + m[split]["output_tokens_per_episode"]
                        for split in spec.splits()
                        if split in m
                    },
                    **(
                        {
                            f"{spec.by_type}/{key}": m[spec.by_type][key]
                            for key in (*BY_TYPE_KEYS, "by_type")
                            if key in m[spec.by_type]
                        }
                        if spec.by_type in m
                        else {}
                    ),
                    "expert_env_steps": experts,
                    "own_env_steps": first["cumulative_env_steps"] - experts,
                    "generated_tokens": first.get("cumulative_generated_tokens", 0),
                    **critic_auc(root, row.stage),
                    **update_weights(root, row.stage),
                }
            )
        results.append(
            {
                "row": row.name,
                "workspace": row.workspace,
                "stage": row.stage,
                "against": spec.against(row),
                "seeds": seeds,
            }
        )
    return results


def outcomes(seeds: list[dict], split: str, task_type: str | None = None) -> dict[str, list[float]]:
    """Task -> its episodes' outcomes (0 or 1) over every seed, of one type or all (`clustered`'s input). A seed
    from before per-task outcomes were kept counts each of its episodes as a task of its own (no clustering)."""
    out: dict[str, list[float]] = {}
    for j, s in enumerate(seeds):
        tasks = s.get(f"{split}/tasks")
        if tasks is None:
            types = s.get(f"{split}/by_type")
            counts = (
                [c for ty, c in types.items() if task_type in (None, ty)]
                if types is not None
                else [
                    {
                        "episodes": s[f"{split}/episodes"],
                        "won": round(s[f"{split}/success_rate"] * s[f"{split}/episodes"]),
                    }
                ]
            )
            won = sum(c["won"] for c in counts)
            for i in range(sum(c["episodes"] for c in counts)):
                out[f"seed #{j} episode {i}"] = [float(i < won)]
            continue
        for name, t in tasks.items():
            if task_type is None or t["type"] == task_type:
                out.setdefault(name, []).extend([1.0] * t["won"] + [0.0] * (t["episodes"] - t["won"]))
    return out


def rate_cell(seeds: list[dict], split: str, task_type: str | None = None) -> str:
    """`28.0 [21.9, 35.1] (52/186)`: the pooled success %, its 95 % interval clustered by task, won of episodes."""
    found = outcomes(seeds, split, task_type)
    if not found:
        return ""
    c = clustered(found)
    return f"{percent_interval(c['rate'], c['low'], c['high'])} ({c['won']:.0f}/{c['episodes']})"


def difference_cell(results: list[dict], r: dict, split: str) -> str:
    """`+4.3 [-2.1, +10.8], better on 2 of 3 seeds vs #1`: this row's success minus its `against` row's on the tasks
    and seeds both played, with the crossed paired bootstrap's 95 % interval and how many seeds' own differences
    are above 0 (`difference_text`; where no pair differs, the exact bound); empty where a row lacks per-task
    outcomes."""
    index = {x["row"]: i for i, x in enumerate(results, 1)}
    if r.get("against") not in index:
        return ""
    other = results[index[r["against"]] - 1]

    def by_task(row: dict) -> dict[str, dict[int, float]] | None:
        if any(f"{split}/tasks" not in s for s in row["seeds"]):
            return None
        table: dict[str, dict[int, float]] = {}
        for s in row["seeds"]:
            for name, t in s[f"{split}/tasks"].items():
                table.setdefault(name, {})[s["seed"]] = t["won"] / t["episodes"]
        return table

    a, b = by_task(r), by_task(other)
    if not a or not b:
        return ""
    try:
        d = paired_bootstrap(a, b)
    except ValueError:
        return ""
    return f"{difference_text(d)} vs #{index[other['row']]}"


def fmt(values: list[float], percent: bool = False, digits: int = 3) -> str:
    """Mean ± std over seeds; empty where no seed has the figure (a results file older than it)."""
    if not values:
        return ""
    m, s = mean_std(values)
    if percent:
        return f"{100 * m:.1f}" + (f" ± {100 * s:.1f}" if s is not None else "")
    if digits == 0:
        return f"{m:,.0f}" + (f" ± {s:,.0f}" if s is not None else "")
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if s is not None else "")


LEGEND = (
    "success %: pooled over seeds, with its 95 % Wilson interval at the sample size left once episodes of one "
    "task are counted as the correlated draws they are (Kish's design effect; a rate of 0 or 100 % at its number of "
    "tasks), and won/episodes. Δ: the row's success minus the row named, on the tasks and seeds both played, with "
    "a 95 % "
    "paired bootstrap interval (tasks and seeds drawn independently: a seed is one trained model that plays every "
    "task) and on how many seeds the row's own difference is above 0; an interval holding 0 does not tell the rows "
    'apart; "no discordant pair": the rows agree on every task, and Δ lies within the exact 95 % bound given. env '
    "fail: episodes the environment failed, left out of the rates. critic AUC: how well the critic of the row's "
    "iteration ranks won above lost episodes it never trained on (`diagnose@k`, on the previous policy's evaluation "
    "episodes; a hierarchy's low level), per seed; 0.5 is chance; n/a: no held-out episode was won, or none lost. "
    "invalid %: actions the environment rejected or that did not parse, in the first split's episodes. weight ≠ 1: the "
    "share of action tokens whose weight in the row's update was more than 0.1 from behaviour cloning's 1 (near 0, "
    "the update is more behaviour cloning).\n"
)


def auc_cell(seeds: list[dict]) -> str:
    """Each seed's held-out critic AUC (a mean would hide a seed at chance), n/a for a seed whose held-out episodes
    did not have both outcomes; '' where the row had no critic."""
    if not any("critic_auc" in s for s in seeds):
        return ""
    return " / ".join("n/a" if s.get("critic_auc") is None else f"{s['critic_auc']:.2f}" for s in seeds)


def env_failures(seeds: list[dict], splits: tuple[str, ...]) -> int:
    return sum(s.get(f"{split}/env_failures", 0) for s in seeds for split in splits)


def by_type_markdown(results: list[dict], split: str) -> str:
    """The per-task-type table of `split`: success per type and over all (`rate_cell`), the difference with the
    row compared with (`difference_cell`), then the means over seeds of tokens per episode by role, System 1
    calls per episode, invalid and repeated-action rates."""
    types = sorted({ty for r in results for s in r["seeds"] for ty in s.get(f"{split}/by_type", {})})
    head = (
        f"| # | row | seeds | {' | '.join(f'{ty} success %' for ty in types)} | all success % | Δ all | env fail | "
        "tokens per episode (high / low) | System 1 calls per episode | invalid % | repeated % | critic AUC |"
    )
    lines = [head, "|---:|---|---:|" + "---:|" * (len(types) + 8)]
    for i, r in enumerate(results, 1):
        seeds = r["seeds"]
        col = lambda key: [s[key] for s in seeds if key in s]  # noqa: E731
        cells = [rate_cell(seeds, split, ty) for ty in types] + [
            rate_cell(seeds, split),
            difference_cell(results, r, split),
            str(env_failures(seeds, (split,))),
        ]
        high, low = col(f"{split}/high_tokens_per_episode"), col(f"{split}/low_tokens_per_episode")
        tokens = (
            f"{fmt(high, digits=0)} / {fmt(low, digits=0)}"
            if high
            else fmt(col(f"{split}/tokens_per_episode"), digits=0) + " (flat)"
        )
        calls = col(f"{split}/subtasks_per_episode")
        lines.append(
            f"| {i} | {r['row']} | {len(seeds)} | {' | '.join(cells)} | {tokens} | "
            f"{fmt(calls, digits=2) if calls else ''} | "
            f"{fmt(col(f'{split}/invalid_rate'), True)} | {fmt(col(f'{split}/repeated_rate'), True)} | "
            f"{auc_cell(seeds)} |"
        )
    return "\n".join(lines) + "\n\n" + LEGEND


def markdown(results: list[dict], by_type: str | None = None, pair: tuple[str, ...] = SPLITS) -> str:
    if by_type:
        return by_type_markdown(results, by_type)
    label = {"valid_seen": "seen", "valid_unseen": "unseen"}
    head = (
        "| # | row | seeds | "
        + " | ".join(f"{label.get(s, s)} success % | Δ {label.get(s, s)} | {label.get(s, s)} reward" for s in pair)
        + " | "
        f"env fail | own env steps | generated tokens | tokens per {label.get(pair[0], pair[0])} episode | "
        "critic AUC | invalid % | weight ≠ 1 % |"
    )
    lines = [head, "|---:|---|---:|" + "---:|---:|---:|" * len(pair) + "---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(results, 1):
        col = lambda key: [s[key] for s in r["seeds"] if key in s]  # noqa: E731
        cells = " | ".join(
            f"{rate_cell(r['seeds'], s)} | {difference_cell(results, r, s)} | {fmt(col(f'{s}/avg_reward'))}"
            for s in pair
        )
        lines.append(
            f"| {i} | {r['row']} | {len(r['seeds'])} | {cells} | {env_failures(r['seeds'], pair)} | "
            f"{fmt(col('own_env_steps'), digits=0)} | "
            f"{fmt(col('generated_tokens'), digits=0)} | {fmt(col(f'{pair[0]}/tokens_per_episode'), digits=0)} | "
            f"{auc_cell(r['seeds'])} | "
            f"{fmt(col(f'{pair[0]}/invalid_rate'), True) if col(f'{pair[0]}/invalid_rate') else ''} | "
            f"{fmt(col('weight_off_one'), True) if col('weight_off_one') else ''} |"
        )
    return "\n".join(lines) + "\n\n" + LEGEND


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
                points.append(
                    {
                        **{s: m[s]["success_rate"] for s in spec.splits() if s in m},
                        "env_steps": own_env_steps(root, next(iter(m.values()))["cumulative_env_steps"]),
                    }
                )
            rows.append({"iteration": k, **{key: statistics.mean(p[key] for p in points) for key in points[0]}})
        path = folder / f"{ws.label}.json"
        write_json(path, rows)
        files.append(path.relative_to(out).as_posix())
    plots = [
        {
            f"success_by_{x}": {
                "template": "simple",
                "x": x,
                "y": {f: list(spec.splits()) for f in files},
                "y_label": "success rate",
                "title": f"Success rate by {x.replace('_', ' ')}",
            }
        }
        for x in ("iteration", "env_steps")
    ]
    (out / "dvc.yaml").write_text(yaml.safe_dump({"plots": plots}, sort_keys=False))


def render_plots(out: Path) -> list[Path]:
    """`dvc plots show` of the table's curves, each Vega-Lite plot rendered to a PNG."""
    import vl_convert

    if not (out / ".dvc").exists():
        subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=out, check=True)
    shown = subprocess.run(
        [sys.executable, "-m", "dvc", "plots", "show", "--json"], cwd=out, check=True, capture_output=True, text=True
    )
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


def log_table(
    spec: Spec, results: list[dict], wall_s: float, images: list[Path], commit: str, listing: list[str]
) -> str:
    """One MLflow parent run for the table, one child per row and seed; returns the parent's id."""
    import mlflow

    from flows.tracking import use_experiment

    use_experiment(f"table-{spec.name}")
    here = machine()
    with mlflow.start_run(
        run_name=f"table-{spec.name}",
        tags={
            "qevolve.git_commit": commit,
            "qevolve.packages_sha256": packages_sha256(listing),
            "qevolve.machine": machine_line(here),
        },
    ) as parent:
        mlflow.log_metric("wall_s", wall_s)
        mlflow.log_text("\n".join(listing) + "\n", "environment/packages.txt")
        mlflow.log_dict(here, "environment/machine.json")
        mlflow.log_text(markdown(results, spec.by_type, spec.splits()), "table.md")
        for image in images:
            mlflow.log_artifact(str(image))
        for i, r in enumerate(results, 1):
            for s in r["seeds"]:
                with mlflow.start_run(
                    run_name=f"{i}. {r['row']} (seed {s['seed']})",
                    nested=True,
                    tags={"qevolve.row": r["row"], "qevolve.stage": r["stage"], "qevolve.workspace": s["workspace"]},
                ):
                    mlflow.log_params({"row": i, "seed": s["seed"], "workspace": r["workspace"], "stage": r["stage"]})
                    mlflow.log_metrics(
                        {
                            k.replace("/", "_"): float(v)
                            for k, v in s.items()
                            if isinstance(v, (int, float)) and k != "seed"
                        }
                    )
        return parent.info.run_id


def code_of(source: dict) -> list[tuple[str | None, str | None]]:
    """The (commit, packages' hash) pairs a merge source's runs were computed with (a joined table's, each)."""
    if "merged_from" in source:
        return [c for s in source["merged_from"] for c in code_of(s)]
    return [(source.get("git_commit"), source.get("packages_sha256"))]


def merge(spec: Spec, files: list[Path], replace: bool = False, mixed: bool = False) -> tuple[list[dict], list[dict]]:
    """The rows of several results.json files of `spec`'s table (each from `--seed` runs), every row's
    seeds joined; and per file its commit and wall time. A seed given twice for a row is kept once where its
    figures are the same (a stage re-run, as the run cache replays or a run reproduces it); where they differ
    it is refused, or with `replace` the later file's figures replace the earlier's, listed in that file's
    `replaced`. Files computed with other code (another commit, a dirty tree, other packages) are refused
    unless `mixed`."""
    rows = {
        r.name: {"row": r.name, "workspace": r.workspace, "stage": r.stage, "against": spec.against(r), "seeds": []}
        for r in spec.rows
    }
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
                raise ConfigError(
                    f"{f}: rows: row {r['row']!r} has seed(s) {differ} that an earlier file gave with other figures "
                    "(--replace: keep this file's)"
                )
            replaced += [{"row": r["row"], "seed": k} for k in differ]
            rows[r["row"]]["seeds"] = [s for s in rows[r["row"]]["seeds"] if s["seed"] not in differ]
            rows[r["row"]]["seeds"] += [s for s in r["seeds"] if s["seed"] not in earlier or s["seed"] in differ]
        # A joined table's own sources are kept under it, so joining it again loses none of its runs' commits.
        own = (
            {"merged_from": data["merged_from"]}
            if "merged_from" in data
            else {
                "git_commit": data.get("git_commit"),
                "wall_s": data.get("wall_s"),
                "packages_sha256": data.get("packages_sha256"),
            }
        )
        sources.append({"file": str(f), **own, **({"replaced": replaced} if replaced else {})})
        codes = {c for src in sources for c in code_of(src)}
        if len(codes) > 1 and not mixed:
            raise ConfigError(
                f"{f}: git_commit/packages_sha256: its runs' code differs from an earlier file's "
                f"(commits {sorted({str(c) for c, _ in codes})}, {len({p for _, p in codes})} package listings); "
                "--mixed-code joins them anyway, and the table says so"
            )
    for r in rows.values():
        r["seeds"].sort(key=lambda s: s["seed"])
    return [r for r in rows.values() if r["seeds"]], sources
