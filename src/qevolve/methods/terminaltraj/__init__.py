"""TerminalTraj (arXiv 2602.01244): executable terminal environments, tasks with end-state validators,
a teacher's rollouts, and only the verified ones kept for training. Its code is unreleased; this follows
the specification reconstructed from the paper (../shared/research/terminaltraj.md) in miniature:

    generate -> teacher -> verify -> filter -> base -> bc -> evaluate@0

`generate` makes the tasks from template families (or a chat model writes them from source
repositories) through the sanity gate (`data/instances`, which is `env.data_dir`), `teacher` rolls the
noisy scripted teacher out on the train tasks, `verify` sets the validators' verdict beside a judge's,
`filter` keeps the validator-passed (or judge-accepted) rollouts as the demonstrations `bc` clones.
The paper stops at SFT; each iteration k >= 1 here is Q-Evolve's (collect, relabel, critic, advantage,
policy) on the same terminal tasks: `RECIPE` is Q-Evolve's with this setup, its demonstrations being the teacher's
(`build_on("qevolve")`, the declared dependency of one method on another)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from qevolve import paths

# SECTIONS: its sections, whose defaults are a dep of every stage of the method
from qevolve.methods.terminaltraj.config import INSTANCES, SECTIONS
from qevolve.recipe import SETUP, Stage, build_on

HERE = __name__
ROLLOUTS, VERIFIED = Path("data/teacher"), Path("data/verify")
_base, _bc = (s for s in SETUP if s.name in ("base", "bc"))

QEVOLVE = build_on("qevolve")
RECIPE = replace(
    QEVOLVE,
    name="terminaltraj",
    demonstrations="teacher",
    seed_keys={**QEVOLVE.seed_keys, "terminaltraj.filter.seed": 1},
    smoke={
        "env": {"name": "terminal", "data_dir": "data/instances"},
        "experts": {"demos": {"oracle": 1}},
        "policy": {"action_mode": "free"},
        "evaluate": {"splits": {"test": 0}},
    },
    setup=(
        Stage(
            "generate",
            f"{HERE}.generate",
            lambda k: {},
            lambda k: {"out": Path(INSTANCES)},
            ("env.max_steps", "env.terminal", "terminaltraj.generate"),
            once=True,
            details=True,
            path_params=("terminaltraj.generate.sources",),
        ),
        Stage(
            "teacher",
            f"{HERE}.teacher",
            lambda k: {"instances_dir": Path(INSTANCES)},
            lambda k: {"out": ROLLOUTS},
            ("env.max_steps", "env.terminal", "terminaltraj.teacher"),
            once=True,
        ),
        Stage(
            "verify",
            f"{HERE}.verify",
            lambda k: {"rollouts_dir": ROLLOUTS},
            lambda k: {"out": VERIFIED},
            ("terminaltraj.judge",),
            once=True,
        ),
        Stage(
            "filter",
            f"{HERE}.filter",
            lambda k: {"rollouts_dir": ROLLOUTS, "verify_dir": VERIFIED, "generate_metrics": paths.metrics("generate")},
            lambda k: {"out": paths.EXPERTS},
            ("terminaltraj.filter",),
            once=True,
            curve=("count", "row", "bar_horizontal"),
        ),
        _base,
        _bc,
    ),
)
__all__ = ["RECIPE", "SECTIONS"]
