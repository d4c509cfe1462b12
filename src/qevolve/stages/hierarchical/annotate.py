"""`annotate`: the expert trajectories cut into subtasks with each step's local progress, as the three
transition sets the hierarchical policy learns from (high, low, progress; `qevolve.hierarchy.transitions`);
with the running hierarchical method's section (`step_hrl`, `multi2`)."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from qevolve.data.atomic import write_json
from qevolve.data.store import read_store
from qevolve.envs import check_tasks, make_env
from qevolve.hierarchy.annotators import check_subtasks, llm_labels, rule_labels
from qevolve.hierarchy.config import section, section_name
from qevolve.hierarchy.roles import ROLES, encode, transitions
from qevolve.hierarchy.shared import role_builder, role_prompts
from qevolve.hierarchy.transitions import write_transitions
from qevolve.models.base import load_tokenizer
from qevolve.params import Params


def annotate(params: Params, experts_dir: Path, base_dir: Path, out: Path, metrics_path: Path) -> dict:
    """Label every expert trajectory (`<method>.annotator`) and write its transitions; every trajectory is
    labelled before anything is written, so a failing annotator leaves no partial store."""
    cfg = section(params)
    trajs = [t for t in read_store(experts_dir) if t.steps]
    if not trajs:
        raise ValueError(f"{experts_dir}: no expert trajectories to annotate")
    check_tasks(make_env(params.env), trajs, str(experts_dir))
    tok = load_tokenizer(base_dir)
    builder = role_builder(params, tok)
    prompts = role_prompts(params, builder)
    sets: dict[str, list] = {role: [] for role in ROLES}
    subtasks = 0
    for t in tqdm(trajs, desc="annotate", unit="traj"):
        key = f"{section_name(params)}.llm_url"
        labels = (
            llm_labels(cfg.llm_url, cfg.llm_model, t, key=key)
            if cfg.annotator == "llm"
            else rule_labels(params.env.name, t)
        )
        check_subtasks(
            params.env.name, t, labels, f"{key} = {cfg.llm_url!r}" if cfg.annotator == "llm" else "the rule annotator"
        )
        subtasks += labels[-1].subtask_index + 1
        for role, rows in transitions(t, labels, prompts, cfg.compat_converters, cfg.rejected_penalty).items():
            sets[role] += rows
    write_transitions(out, sets, lambda text: len(tok.encode(text, add_special_tokens=False)))
    high, low = sets["high"], sets["low"]
    metrics = {
        "trajectories": len(trajs),
        "subtasks_per_trajectory": subtasks / len(trajs),
        "steps_per_subtask": len(low) / max(subtasks, 1),
        "distinct_subtasks": len({h.output_text for h in high}),
        **{f"{role}_transitions": len(rows) for role, rows in sets.items()},
        **{
            f"{role}_prompt_tokens_mean": sum(len(encode(builder, r.state_text, "")[0]) for r in rows) / len(rows)
            for role, rows in sets.items()
            if rows
        },
    }
    write_json(metrics_path, metrics)
    return metrics
