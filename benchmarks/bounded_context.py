"""Bounded context (STEP-HRL's Figure 3): the prompt tokens each agent design reads at each step of the
same expert trajectories, counted with a real tokenizer. No model runs; the result is deterministic.

- flat: qevolve's flat policy, the whole history as one chat (`PromptBuilder`, no context limit);
- hrl: a GLIDER-style hierarchy: the high level reads every past observation and action and the subtasks
  so far, once per subtask; the low level reads its subtask's own history as a chat;
- step-hrl: STEP-HRL's three single-turn prompts (`qevolve.hierarchy.roles`): one high call per subtask,
  one low and one progress call per step, with rule-annotated subtasks and progress.

    python -m benchmarks.bounded_context [--env alfworld] [--split valid_seen] [--games 0] [--tokenizer smollm2]

It prints a table (tokens per episode, mean and p90; the slope of prompt tokens per step against the step
index; the coefficient of variation of the per-step prompt) and writes benchmarks/results/bounded_context.json
and bounded_context.png (mean prompt tokens per step against the step index).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
QUICKSTART_TYPES = {"alfworld": ["pick_and_place_simple", "look_at_obj_in_light"], "textcraft": []}
EXPERT = {"alfworld": "handcoded", "textcraft": "planner"}


def expert_trajectories(env_name: str, split: str, games: int, max_steps: int = 60) -> list:
    from qevolve.config import EnvConfig
    from qevolve.envs import make_env, select_tasks
    from qevolve.stages.experts import demonstrate

    cfg = EnvConfig(name=env_name, task_types=QUICKSTART_TYPES[env_name], processes=False)
    env = make_env(cfg, expert=EXPERT[env_name])
    try:
        return [
            t for t in (demonstrate(env, task, max_steps) for task in select_tasks(env, split, cfg, games, 0)) if t.won
        ]
    finally:
        env.close()


def per_step_tokens(trajs: list, env_name: str, tok) -> dict[str, list[list[tuple[int, int]]]]:
    """design -> per trajectory -> per step (prompt tokens, output tokens), every call at that step summed."""
    from qevolve.environments import ENVIRONMENTS
    from qevolve.hierarchy.annotators import rule_labels
    from qevolve.hierarchy.roles import RolePrompts, low_output, transitions
    from qevolve.models.prompt import PromptBuilder, format_action

    flat = PromptBuilder(tok, 10**9, repeat_task=True, intro=ENVIRONMENTS[env_name].intro)
    chat = PromptBuilder(tok, 10**9, intro=ENVIRONMENTS[env_name].intro)

    def n(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    def single(text: str) -> int:
        return len(chat.head_ids) + len(chat.user_turn(text))

    out: dict[str, list] = {"flat": [], "hrl": [], "step-hrl": []}
    for t in trajs:
        obs = [s.observation for s in t.steps]
        acts = [format_action(s.action) for s in t.steps]
        out["flat"].append(
            [
                (len(flat.prompt(t.instruction, obs[: i + 1], acts[:i])), len(flat.action_ids(acts[i])))
                for i in range(len(obs))
            ]
        )
        labels = rule_labels(env_name, t)
        sets = transitions(t, labels, RolePrompts(env_name))
        high = {h.step: h for h in sets["high"]}
        steps, glider = [], []
        for i, (low, progress) in enumerate(zip(sets["low"], sets["progress"])):
            p = single(low.state_text) + single(progress.state_text)
            o = n(low.output_text) + n(progress.output_text)
            if i in high:
                p, o = p + single(high[i].state_text), o + n(high[i].output_text)
            steps.append((p, o))
            # GLIDER-style: the high level reads the whole history; the low level its subtask's turns
            start = max(k for k in high if k <= i)
            history = "\n".join(f"{obs[j]}\n{acts[j]}" for j in range(i)) + f"\n{obs[i]}"
            hp = (
                single(
                    f"Task: {t.instruction}\nSubtasks so far: {[labels[k].subtask for k in high if k <= i]}\n{history}"
                )
                if i in high
                else 0
            )
            lp = len(chat.prompt(f"{t.instruction} Subtask: {labels[i].subtask}", obs[start : i + 1], acts[start:i]))
            glider.append(
                (
                    hp + lp,
                    (n(high[i].output_text) if i in high else 0)
                    + len(chat.action_ids(low_output(t.steps[i].action, labels[i].ends))),
                )
            )
        out["step-hrl"].append(steps)
        out["hrl"].append(glider)
    return out


def summarise(steps: list[list[tuple[int, int]]]) -> dict:
    totals = sorted(sum(p + o for p, o in s) for s in steps)
    points = [(i, p) for s in steps for i, (p, _) in enumerate(s)]
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x in xs), 1e-9)
    by_step: dict[int, list[int]] = {}
    for i, p in points:
        by_step.setdefault(i, []).append(p)
    return {
        "episodes": len(steps),
        "tokens_per_episode_mean": statistics.fmean(totals),
        "tokens_per_episode_p90": totals[min(len(totals) - 1, int(0.9 * len(totals)))],
        "prompt_slope_per_step": slope,
        "prompt_cv": statistics.pstdev(ys) / my,
        "mean_prompt_by_step": {i: statistics.fmean(v) for i, v in sorted(by_step.items())},
    }


def load_tokenizer_of(base: str):
    """The tokenizer of a `model.base` value (`smollm2`: SmolLM2's, converted from the GGUF once and cached)."""
    from qevolve.models.base import load_tokenizer, write_pointer

    if Path(base).is_dir():
        return load_tokenizer(base)
    with tempfile.TemporaryDirectory() as folder:
        write_pointer(base, Path(folder))
        return load_tokenizer(folder)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", choices=sorted(EXPERT), default="alfworld")
    ap.add_argument("--split", default="valid_seen")
    ap.add_argument(
        "--games",
        type=int,
        default=0,
        help="games drawn from the split (0 = all; ALFWorld: the quickstart's two types)",
    )
    ap.add_argument(
        "--tokenizer", default="smollm2", help="a `model.base` value, or a base folder written by the `base` stage"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "bounded_context.json")
    args = ap.parse_args(argv)
    tok = load_tokenizer_of(args.tokenizer)
    trajs = expert_trajectories(args.env, args.split, args.games)
    results = {design: summarise(s) for design, s in per_step_tokens(trajs, args.env, tok).items()}
    steps = [len(t.steps) for t in trajs]
    print(
        f"{args.env} {args.split}: {len(trajs)} expert episodes, {statistics.fmean(steps):.1f} steps on average "
        f"(max {max(steps)}), "
        f"tokenizer {args.tokenizer}"
    )
    print("| design | tokens/episode (mean) | p90 | prompt slope (tokens/step) | prompt CV |\n|---|---|---|---|---|")
    for design, r in results.items():
        print(
            f"| {design} | {r['tokens_per_episode_mean']:,.0f} | {r['tokens_per_episode_p90']:,} | "
            f"{r['prompt_slope_per_step']:.1f} | "
            f"{r['prompt_cv']:.2f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "env": args.env,
                "split": args.split,
                "tokenizer": args.tokenizer,
                "episodes": len(trajs),
                "designs": results,
            },
            indent=1,
        )
        + "\n"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for design, r in results.items():
        curve = r["mean_prompt_by_step"]
        ax.plot(list(curve), list(curve.values()), label=design)
    ax.set_xlabel("step index")
    ax.set_ylabel("prompt tokens per step (mean)")
    ax.set_title(f"{args.env} {args.split}, {len(trajs)} expert episodes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
