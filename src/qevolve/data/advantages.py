"""Per-step advantages, as the `advantage` stage writes them and the `policy` stage reads them."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from qevolve.data.store import SchemaError

ADVANTAGES_FILE = "advantages.parquet"
MOVING = 0.05
"""A raw advantage (in reward units: a won episode's reward is 1) this far from 0 moves its step's probability;
the `moving_share` metrics count the steps or transitions that reach it."""


SCHEMA = pa.schema(
    [
        ("trajectory_id", pa.string()),
        ("step", pa.int32()),
        ("source", pa.string()),
        ("value", pa.float64()),
        ("q", pa.float64()),
        ("advantage", pa.float64()),
        ("raw_advantage", pa.float64()),
    ]
)


def read_advantages(folder: Path) -> dict[tuple[str, int], float]:
    """(trajectory id, step) -> advantage, as the policy stage reads it."""
    path = Path(folder) / ADVANTAGES_FILE
    if not path.exists():
        raise SchemaError(f"{path}: missing (expected the advantage stage's output)")
    names = pq.read_schema(path).names
    for col in ("trajectory_id", "step", "advantage"):
        if col not in names:
            raise SchemaError(f"{path}: missing column {col!r}")
    table = pq.read_table(path, columns=["trajectory_id", "step", "advantage"]).to_pylist()
    return {(r["trajectory_id"], r["step"]): r["advantage"] for r in table}
