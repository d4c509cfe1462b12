"""Transition store: a hierarchical agent's three transition sets, one Parquet file per role.

A store is a folder holding `high.parquet`, `low.parquet` and `progress.parquet` (`qevolve.hierarchy.roles`),
each row one transition (state text, output text, reward, done, next state text) with its trajectory and
the tokens of its prompt and output. Like the step store (`qevolve.data.store`) every file carries its
schema version, and a file whose version or columns do not match fails loudly, naming the file and column.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from qevolve.data.atomic import atomic_dir
from qevolve.data.store import VERSION_KEY, SchemaError, read_checked
from qevolve.hierarchy.roles import ROLES, Transition

SCHEMA_VERSION = "1"
SCHEMA = pa.schema(
    [
        ("trajectory_id", pa.string()),
        ("task_id", pa.string()),
        ("split", pa.string()),
        ("source", pa.string()),
        ("level", pa.string()),
        ("subtask_index", pa.int32()),
        ("step", pa.int32()),
        ("state_text", pa.string()),
        ("output_text", pa.string()),
        ("reward", pa.float64()),
        ("done", pa.bool_()),
        ("next_state_text", pa.string()),
        ("won", pa.bool_()),
        ("prompt_tokens", pa.int32()),
        ("output_tokens", pa.int32()),
    ],
    metadata={VERSION_KEY: SCHEMA_VERSION.encode()},
)
_FIELDS = [f.name for f in fields(Transition)]


def write_transitions(path: Path | str, sets: dict[str, list[Transition]], count: Callable[[str], int]) -> None:
    """Write the three sets as a store folder at `path`, atomically; `count` gives a text's token count."""
    with atomic_dir(path) as tmp:
        for role in ROLES:
            rows = [
                {
                    **asdict(t),
                    "level": role,
                    "prompt_tokens": count(t.state_text),
                    "output_tokens": count(t.output_text),
                }
                for t in sets.get(role, [])
            ]
            pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp / f"{role}.parquet")


def read_transitions(path: Path | str) -> dict[str, list[dict]]:
    """role -> its transitions (dicts with every column), validating each file's version, columns and level."""
    path = Path(path)
    out = {}
    for role in ROLES:
        file = path / f"{role}.parquet"
        rows = read_checked(file, SCHEMA, SCHEMA_VERSION).to_pylist()
        wrong = next((i for i, r in enumerate(rows) if r["level"] != role), None)
        if wrong is not None:
            raise SchemaError(f"{file}: column 'level' is {rows[wrong]['level']!r} at row {wrong}, expected {role!r}")
        out[role] = rows
    return out


def as_transitions(rows: list[dict]) -> list[Transition]:
    return [Transition(**{k: r[k] for k in _FIELDS}) for r in rows]
