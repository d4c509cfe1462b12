"""Critic encoding: one forward pass per trajectory window against one forward pass per step.

The one-pass critic (`qevolve.models.critic.critic_values`) reads V(s_t) and Q(s_t, a_t) for every step
of a window at the turn boundaries of a single pass. The baseline, as the published repositories do it,
encodes each step's own prefix (history up to action t) separately. The trajectories are 20-step
episodes sampled from the workspace's trained policy on train games; the benchmark fails if any value
differs by more than 1e-4.

    python -m benchmarks.critic [--workspace runs/quickstart] [--episodes 8] [--max-steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import workspace_params
from qevolve.models.critic import CriticItem, read_positions
from qevolve.models.device import pad_ids


@torch.no_grad()
def per_step_values(
    critic, items: list[CriticItem], pad_id: int, batch_size: int
) -> dict[int, dict[int, tuple[float, float]]]:
    """The baseline: each step's prefix (up to its action, or its observation for a final state) in its
    own sequence; same output layout as `critic_values`."""
    critic.eval()
    jobs = []  # (trajectory, step, prefix length, V position, Q position)
    for it in items:
        for step, (vp, qp) in read_positions(it).items():
            jobs.append((it, step, (qp if qp >= 0 else vp) + 1, vp, qp))
    out: dict[int, dict[int, tuple[float, float]]] = {}
    for i in range(0, len(jobs), batch_size):
        mb = jobs[i : i + batch_size]
        ids, attn = pad_ids([it.window.ids[:n] for it, _, n, _, _ in mb], pad_id)
        v, q, _ = critic(ids, attn)
        for b, (it, step, _, vp, qp) in enumerate(mb):
            values = out.setdefault(it.traj, {})
            if qp >= 0 or step not in values:
                values[step] = (float(v[b, vp]), float(q[b, qp]) if qp >= 0 else float("nan"))
    return out


def max_difference(a: dict, b: dict) -> float:
    if a.keys() != b.keys() or any(a[t].keys() != b[t].keys() for t in a):
        raise ValueError("the two value tables cover different trajectories or steps")
    return max(abs(x - y) for t in a for s in a[t] for x, y in zip(a[t][s], b[t][s]) if x == x)  # x == x skips NaN


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--workspace", type=Path, default=Path("runs/quickstart"), help="holds params.yaml, models/base and models/bc"
    )
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="timings are the median of this many runs")
    args = ap.parse_args(argv)

    from qevolve.envs import make_env, select_tasks
    from qevolve.models.critic import critic_items, critic_values, load_critic
    from qevolve.models.policy import Actor
    from qevolve.models.prompt import make_builder
    from qevolve.rollout import play

    ws = args.workspace
    params = workspace_params(ws)
    critic, tok = load_critic(ws / "models/base", params.model, ws / "models/bc")
    torch.manual_seed(0)
    for head in (critic.v, critic.q):  # random heads, so that equal values mean something
        torch.nn.init.normal_(head.weight, std=0.1)
    builder = make_builder(params, tok, ws / "models/bc")
    actor = Actor(
        critic.lm, tok, builder, params.policy.action_mode, params.policy.temperature, params.policy.max_new_tokens
    )
    tasks = select_tasks(make_env(params.env), "train", params.env, args.episodes, 0)
    trajs = play(
        lambda: make_env(params.env),
        tasks,
        actor,
        max_steps=args.max_steps,
        greedy=False,
        source="bench",
        batch_size=args.episodes,
    )
    items = critic_items(builder, trajs, weighted=True)
    batch = params.critic.micro_batch_size

    times = {"one pass per window": [], "one pass per step": []}
    for _ in range(args.repeats):
        for name, fn in (("one pass per window", critic_values), ("one pass per step", per_step_values)):
            start = time.perf_counter()
            values = fn(critic, items, tok.pad_token_id, batch)
            times[name].append(time.perf_counter() - start)
            if name == "one pass per window":
                fast = values
            else:
                diff = max_difference(fast, values)
    steps = sum(len(t.steps) for t in trajs)
    print(
        f"\n{len(trajs)} sampled train episodes, {steps} steps ({steps / len(trajs):.1f} per episode), "
        f"{len(items)} windows of <= {params.model.context_tokens} tokens, micro-batch {batch}; median of "
        f"{args.repeats}\n"
    )
    print(f"{'encoding':<22}{'seconds':>9}{'traj/s':>9}{'speed-up':>10}")
    slow = statistics.median(times["one pass per step"])
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:<22}{t:>9.2f}{len(trajs) / t:>9.2f}{slow / t:>9.1f}x")
    print(f"\nlargest |difference| of V and Q between the two: {diff:.2e}")
    return 0 if diff <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
