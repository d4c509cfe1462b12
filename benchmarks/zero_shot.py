"""Zero-shot success of a workspace's base model: the `evaluate` stage's games, prompt and greedy
admissible choice, with no training at all (a fresh LoRA adapter, whose B matrices are zero, leaves the
base unchanged). The row a pretrained base (`model.base: smollm2`) is compared against after BC.

    python -m benchmarks.zero_shot [--workspace runs/quickstart] [--out metrics/zero_shot.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks import workspace_params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, default=Path("runs/quickstart"), help="holds params.yaml and models/base")
    ap.add_argument(
        "--out", type=Path, default=None, help="metrics file to write (default: <workspace>/metrics/zero_shot.json)"
    )
    args = ap.parse_args(argv)
    from qevolve.environments import ENVIRONMENTS
    from qevolve.models.policy import Actor, load_policy
    from qevolve.models.prompt import PromptBuilder
    from qevolve.rollout import play_splits

    ws = args.workspace.resolve()
    params = workspace_params(ws, needs=("models/base", "metrics/experts.json"))
    model, tok = load_policy(ws / "models/base", params.model)
    builder = PromptBuilder(
        tok,
        params.model.context_tokens,
        "",
        params.prompt.repeat_task,
        params.prompt.max_observation_tokens,
        ENVIRONMENTS[params.env.name].intro,
    )
    actor = Actor(
        model.eval(), tok, builder, params.policy.action_mode, params.policy.temperature, params.policy.max_new_tokens
    )
    out = args.out or ws / "metrics" / "zero_shot.json"
    with tempfile.TemporaryDirectory() as episodes:
        metrics = play_splits(params, actor, Path(episodes), out, "zero-shot", ws / "metrics" / "experts.json")
    for split, m in metrics.items():
        print(
            f"zero-shot {split:<13} success {m['success_rate']:.1%} of {m['episodes']} games, invalid "
            f"{m['invalid_rate']:.1%}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
