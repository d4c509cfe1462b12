"""`advantage@k`: per-step advantages of the hybrid dataset from the critic (Q-Evolve's process reward).

Default: GAE over the critic's V with the environment reward only (`advantage.use_aux: false`; the paper
found that adding the auxiliary rewards here hurts). `advantage.estimator: q_minus_v` uses Q(s,a) - V(s).
`advantage.constant` writes the control's advantages instead (weight 1 on every step); the critic's figures are
still computed and reported.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from qevolve.algos.rl import gae_advantages
from qevolve.algos.stats import auc
from qevolve.data.advantages import ADVANTAGES_FILE, MOVING, SCHEMA
from qevolve.data.atomic import atomic_dir, write_json
from qevolve.data.store import read_store
from qevolve.models.critic import critic_items, critic_values, load_critic
from qevolve.models.device import placement
from qevolve.models.prompt import make_builder
from qevolve.params import Params

CONSTANT = {"bppo": 1.0, "awr": 0.0}
"""`advantage.constant`: the advantage at which each update's weight on a step is 1
(`qevolve.algos.rl.update_weights`)."""


def histogram(values: list[float], bins: int = 20) -> list[dict]:
    """Equal-width histogram as DVC plot rows: [{"advantage": bin centre, "count": n}, ...]."""
    lo, hi = min(values), max(values)
    hi = hi if hi > lo else lo + 1.0
    counts = torch.histc(torch.tensor(values), bins=bins, min=lo, max=hi)
    width = (hi - lo) / bins
    return [{"advantage": lo + (i + 0.5) * width, "count": int(c)} for i, c in enumerate(counts)]


def advantage(
    params: Params, base_dir: Path, critic_dir: Path, data_dir: Path, out: Path, metrics_path: Path, curve_path: Path
) -> dict:
    cfg = params.advantage
    trajs = read_store(data_dir)
    model, tok = load_critic(base_dir, params.model, critic_dir)
    items = critic_items(make_builder(params, tok, critic_dir), trajs, weighted=False)
    values = critic_values(model, items, tok.pad_token_id, params.critic.micro_batch_size)
    rows = []
    for i, t in enumerate(trajs):
        if not t.steps:
            continue
        T = len(t.steps)
        v = torch.tensor([values[i][s][0] for s in range(T + 1)])
        q = torch.tensor([values[i][s][1] for s in range(T)])
        if t.steps[-1].done:
            v[T] = 0.0  # terminal: nothing after the last step
        if cfg.estimator == "gae":
            rewards = torch.tensor([s.reward + (s.aux_reward if cfg.use_aux else 0.0) for s in t.steps])
            adv = gae_advantages(rewards, v, cfg.gamma, cfg.lam)
        else:
            adv = q - v[:T]
        rows += [
            {
                "trajectory_id": t.trajectory_id,
                "step": s.step,
                "source": t.source,
                "value": float(v[j]),
                "q": float(q[j]),
                "raw_advantage": float(adv[j]),
            }
            for j, s in enumerate(t.steps)
        ]
    raw = torch.tensor([r["raw_advantage"] for r in rows])
    if torch.isnan(raw).any():
        raise ValueError(
            f"{critic_dir}: the critic gives NaN values on {data_dir}; retrain it (e.g. a lower critic.lr)"
        )
    mean, std = float(raw.mean()), float(raw.std()) if len(rows) > 1 else 1.0
    for r in rows:
        r["advantage"] = (r["raw_advantage"] - mean) / (std + 1e-8) if cfg.normalize else r["raw_advantage"]
        if cfg.constant:
            r["advantage"] = CONSTANT[params.policy.algo]
    with atomic_dir(out) as tmp:
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp / ADVANTAGES_FILE)
    by_source: dict[str, list[float]] = {}
    by_episode: dict[str, list[float]] = {}
    for r in rows:
        by_source.setdefault("expert" if r["source"] == "expert" else "self", []).append(r["raw_advantage"])
        by_episode.setdefault(r["trajectory_id"], []).append(r["raw_advantage"])
    won = {t.trajectory_id: t.won for t in trajs}
    ranked = auc(*([sum(a) / len(a) for tid, a in by_episode.items() if won[tid] == w] for w in (True, False)))
    metrics = {
        "steps": len(rows),
        "raw_mean": mean,
        "raw_std": std,
        "positive_share": float((raw > 0).float().mean()),
        "moving_share": float((raw.abs() >= MOVING).float().mean()),
        "auc_won_lost": ranked["auc"],
        "constant": cfg.constant,
        **{f"raw_mean_{k}": sum(v) / len(v) for k, v in by_source.items()},
        **placement(model),
    }
    write_json(metrics_path, metrics)
    write_json(curve_path, histogram([r["advantage"] for r in rows]))
    return metrics
