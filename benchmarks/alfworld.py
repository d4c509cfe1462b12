"""ALFWorld's own speed: resets and steps without and with qevolve's kept translations and shallow copies.

The same games are played three times in one process, each time by the same mix of expert and random actions (the
handcoded expert, seeded per game): `translate` translates every game's PDDL once per reset (in memory only) and
deep-copies text-generation contexts, as TextWorld does; `kept translations` reads each game's translation from the disk
cache (`QEVOLVE_SAS_CACHE`, filled by a first pass that is not timed), as every stage after the first does; `+ shallow
copies` adds the shallow context copies. Every run must see the same observations and admissible commands; exit 1 if
not.

    python -m benchmarks.alfworld [--games 24] [--split valid_unseen] [--steps 10]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import tempfile
import time


def play(env, games, steps: int) -> tuple[list[float], list[float], str]:
    """Reset and step times (s) and a digest of everything the games showed."""
    resets, step_times, digest = [], [], hashlib.sha256()
    for i, task in enumerate(games):
        random.seed(i)  # the handcoded expert breaks ties with the global random
        rng = random.Random(i)
        t = time.perf_counter()
        obs = env.reset(task)
        resets.append(time.perf_counter() - t)
        digest.update(repr(obs).encode())
        admissible = obs.admissible
        for k in range(steps):
            expert = env.expert_action()
            t = time.perf_counter()
            step = env.step(expert if expert and k % 3 else rng.choice(admissible))
            step_times.append(time.perf_counter() - t)
            digest.update(repr(step).encode())
            admissible = step.admissible
            if step.done:
                break
    return resets, step_times, digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", type=int, default=24)
    ap.add_argument("--split", default="valid_unseen")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)

    import fast_downward
    from textworld.envs.pddl import textgen

    from qevolve.envs.alfworld import AlfworldEnv

    env = AlfworldEnv()
    games = random.Random(0).sample(env.tasks(args.split), args.games)
    env.reset(games[0])  # installs qevolve's changes; the runs below switch them
    shallow, deep = textgen.copy_context, textgen.copy_context.deep
    runs = [("translate", "off", deep), ("kept translations", "disk", deep), ("+ shallow copies", "disk", shallow)]
    with tempfile.TemporaryDirectory() as cache:
        os.environ["QEVOLVE_SAS_CACHE"] = cache
        play(env, games, 0)  # fills the disk cache
        rows = []
        for name, translations, copy_context in runs:
            os.environ["QEVOLVE_SAS_CACHE"] = cache if translations == "disk" else "off"
            fast_downward.pddl2sas.cache.clear()
            textgen.copy_context = copy_context
            start = time.perf_counter()
            resets, steps, digest = play(env, games, args.steps)
            rows.append((name, time.perf_counter() - start, resets, steps, digest))
    textgen.copy_context = shallow

    print(f"{args.games} {args.split} games, up to {args.steps} steps of expert and random actions\n")
    print(f"{'run':<18} {'seconds':>8} {'speed-up':>9} {'reset ms':>9} {'step ms':>8} {'steps':>6}  same")
    base = rows[0][1]
    for name, seconds, resets, steps, digest in rows:
        print(
            f"{name:<18} {seconds:8.1f} {base / seconds:8.2f}x {statistics.median(resets) * 1000:9.0f} "
            f"{statistics.median(steps) * 1000:8.1f} {len(steps):6d}  {digest == rows[0][4]}"
        )
    print("\n(median reset and step times)")
    return 0 if all(r[4] == rows[0][4] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
