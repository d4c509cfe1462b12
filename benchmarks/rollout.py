"""Rollout throughput: KV-cache reuse + batching across episodes against a naive loop.

The naive loop plays one episode at a time and re-encodes the whole history every turn. The fast path (`reuse`, the
rollout engine `SlotEngine`) keeps every episode's keys and values resident across turns and batches 1, 4 or 16
concurrent episodes with the environments in this process; `hf reuse` does the same with `HFBackend`'s per-slot caches,
the engine before `SlotEngine`; then 16 with each environment in its own worker process (`workers`), stepping in
parallel; 16 with the LoRA adapter left unmerged (`unmerged`); and in `admissible` mode 16 with every episode's
candidates scored in one padded pass (`one pass`; a CPU scores one episode per pass by default, see `HFBackend`). All
runs play the same valid_seen games greedily with the trained policy of a workspace (run `make quickstart` first), its
adapter merged into the weights as every inference stage loads it, and read ALFWorld's kept game translations from a
disk cache filled before timing, as every stage after the first does. The benchmark fails if any run takes a different
action than the naive loop.

    python -m benchmarks.rollout [--workspace runs/quickstart] [--episodes 16] [--max-steps 10] [--mode admissible free]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import workspace_params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--workspace", type=Path, default=Path("runs/quickstart"), help="holds params.yaml, models/base and models/bc"
    )
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--max-steps", type=int, default=10)
    ap.add_argument("--mode", nargs="+", default=["admissible", "free"], choices=["admissible", "free"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args(argv)
    from qevolve.envs import make_env, select_tasks
    from qevolve.models.backend import HFBackend
    from qevolve.models.policy import Actor, load_policy
    from qevolve.models.prompt import make_builder
    from qevolve.rollout import play

    ws = args.workspace
    params = workspace_params(ws)
    model, tok = load_policy(ws / "models/base", params.model, adapter=ws / "models/bc")
    unmerged, _ = load_policy(ws / "models/base", params.model, adapter=ws / "models/bc", trainable=True)
    builder = make_builder(params, tok, ws / "models/bc")
    env = make_env(params.env)
    tasks = select_tasks(env, "valid_seen", params.env, args.episodes, 0)
    # Every run reads the games' PDDL translations from a disk cache filled here, untimed, as every stage
    # after the first does (`QEVOLVE_SAS_CACHE`; the worker processes inherit it).
    cache = tempfile.TemporaryDirectory()
    os.environ["QEVOLVE_SAS_CACHE"] = cache.name
    for task in tasks:
        env.reset(task)
    env.close()

    rows = []
    for mode in args.mode:
        most = max(args.concurrency)
        runs = [("naive", False, 1), ("hf reuse", True, most)] + [("reuse", True, c) for c in args.concurrency]
        runs += [("workers", True, most), ("unmerged", True, most)]
        if mode == "admissible":
            runs.append(("one pass", True, most))
        reference = None
        for name, reuse, concurrency in runs:
            workers = name == "workers"  # environments in worker processes, stepping in parallel
            import fast_downward

            getattr(fast_downward.pddl2sas, "cache", {}).clear()  # no run starts with another's games in memory
            torch.manual_seed(0)
            policy = unmerged if name == "unmerged" else model
            actor = Actor(
                policy,
                tok,
                builder,
                mode,
                1.0,
                params.policy.max_new_tokens,
                reuse_cache=reuse,
                backend=HFBackend(policy.eval(), tok.pad_token_id) if name == "hf reuse" else None,
            )
            if name == "one pass":  # all episodes' candidates scored in one padded pass, not one episode per pass
                actor.backend.score_rows = concurrency
            model_s = 0.0
            act = actor.act

            def timed(*a, **k):
                nonlocal model_s
                t = time.perf_counter()
                out = act(*a, **k)
                model_s += time.perf_counter() - t
                return out

            actor.act = timed
            start = time.perf_counter()
            trajs = play(
                lambda: make_env(params.env, worker=workers),
                tasks,
                actor,
                max_steps=args.max_steps,
                greedy=True,
                source="bench",
                batch_size=concurrency,
                desc=f"{mode} {name} x{concurrency}",
                parallel=workers,
            )
            wall = time.perf_counter() - start
            actions = [[s.output for s in t.steps] for t in trajs]
            reference = reference or actions
            steps = sum(len(t.steps) for t in trajs)
            generated = sum(s.output_tokens for t in trajs for s in t.steps)
            rows.append(
                {
                    "mode": mode,
                    "run": name,
                    "episodes": concurrency,
                    "steps": steps,
                    "wall_s": wall,
                    "model_s": model_s,
                    "steps_per_s": steps / wall,
                    "model_ms": 1000 * model_s / steps,
                    "tok_per_s": generated / model_s,
                    "encoded": actor.backend.encoded_tokens,
                    "same": actions == reference,
                }
            )

    print(f"\n{args.episodes} valid_seen games, {args.max_steps} steps max, greedy, model {ws / 'models/bc'}\n")
    print(
        f"{'mode':<11}{'run':<10}{'concurrent':>10}{'env steps/s':>13}{'speed-up':>10}"
        f"{'model ms/step':>15}{'speed-up':>10}"
        f"{'gen tok/s':>11}{'encoded tok':>13}{'same actions':>14}"
    )
    base = {}
    for r in rows:
        if r["run"] == "naive":
            base[r["mode"]] = r
        b = base[r["mode"]]
        gen = f"{r['tok_per_s']:.1f}" if r["mode"] == "free" else "-"
        print(
            f"{r['mode']:<11}{r['run']:<10}{r['episodes']:>10}{r['steps_per_s']:>13.2f}"
            f"{r['steps_per_s'] / b['steps_per_s']:>9.1f}x"
            f"{r['model_ms']:>15.0f}{b['model_ms'] / r['model_ms']:>9.1f}x"
            f"{gen:>11}{r['encoded']:>13}{str(r['same']):>14}"
        )
    print(
        "\nenv steps/s: steps over the wall time of the whole rollout (ALFWorld resets and steps included); model "
        "ms/step:"
        " policy time per env step; gen tok/s: generated tokens per second of policy time (free mode); encoded tok:"
        " tokens run through the model."
    )
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
