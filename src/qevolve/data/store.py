"""Trajectory store: Parquet, one row per step, with a per-trajectory table beside it.

A store is a folder holding `steps.parquet` and `trajectories.parquet`. Both carry the schema version in
their metadata; a file whose version or columns do not match fails loudly, naming the file and column.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from qevolve.data.atomic import atomic_dir
from qevolve.errors import UserError

SCHEMA_VERSION = "1"
VERSION_KEY = b"qevolve.schema_version"


class SchemaError(UserError, ValueError):
    """A trajectory file that does not match the store's schema."""

    hint = (
        "a stage's data is missing, damaged or from another qevolve version: `dvc checkout <stage>` restores the "
        "version "
        "dvc.lock records, or rerun the stage that wrote it (`dvc repro <stage>`)"
    )


@dataclass
class StepRecord:
    step: int
    observation: str
    """What the agent saw before acting (step 0: the first observation)."""
    output: str
    """The model's raw output (for experts and admissible mode: `Action: <action>`)."""
    action: str | None
    """The parsed action; None on a format error."""
    next_observation: str
    reward: float
    done: bool
    won: bool
    valid: bool
    """False when the environment rejected the action or it did not parse."""
    aux_reward: float = 0.0
    aux_reason: str = ""
    logp: float = math.nan
    """Behaviour log-prob of the output (NaN for experts)."""
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass
class Trajectory:
    trajectory_id: str
    task_id: str
    task_type: str
    split: str
    source: str
    """`expert`, or `policy@k` for iteration k's policy."""
    instruction: str
    won: bool = False
    failure: str = ""
    """Why the episode ended without success: `max_steps`, `env_error: ...`; empty otherwise."""
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def reward(self) -> float:
        return float(sum(s.reward for s in self.steps))


_STEP_SCHEMA = pa.schema(
    [
        ("trajectory_id", pa.string()),
        ("task_id", pa.string()),
        ("split", pa.string()),
        ("source", pa.string()),
        ("step", pa.int32()),
        ("observation", pa.string()),
        ("output", pa.string()),
        ("action", pa.string()),
        ("next_observation", pa.string()),
        ("reward", pa.float64()),
        ("done", pa.bool_()),
        ("won", pa.bool_()),
        ("valid", pa.bool_()),
        ("aux_reward", pa.float64()),
        ("aux_reason", pa.string()),
        ("logp", pa.float64()),
        ("prompt_tokens", pa.int32()),
        ("output_tokens", pa.int32()),
    ],
    metadata={VERSION_KEY: SCHEMA_VERSION.encode()},
)

_TRAJ_SCHEMA = pa.schema(
    [
        ("trajectory_id", pa.string()),
        ("task_id", pa.string()),
        ("task_type", pa.string()),
        ("split", pa.string()),
        ("source", pa.string()),
        ("instruction", pa.string()),
        ("num_steps", pa.int32()),
        ("reward", pa.float64()),
        ("won", pa.bool_()),
        ("failure", pa.string()),
    ],
    metadata={VERSION_KEY: SCHEMA_VERSION.encode()},
)

_STEP_FIELDS = [f.name for f in fields(StepRecord)]
_TRAJ_FIELDS = ["trajectory_id", "task_id", "task_type", "split", "source", "instruction", "won", "failure"]


def write_store(path: Path | str, trajectories: list[Trajectory]) -> None:
    """Write `trajectories` as a store folder at `path`, atomically."""
    step_rows, traj_rows = [], []
    for t in trajectories:
        traj_rows.append({**{k: getattr(t, k) for k in _TRAJ_FIELDS}, "num_steps": len(t.steps), "reward": t.reward})
        for s in t.steps:
            step_rows.append(
                {
                    "trajectory_id": t.trajectory_id,
                    "task_id": t.task_id,
                    "split": t.split,
                    "source": t.source,
                    **asdict(s),
                }
            )
    with atomic_dir(path) as tmp:
        pq.write_table(pa.Table.from_pylist(step_rows, schema=_STEP_SCHEMA), tmp / "steps.parquet")
        pq.write_table(pa.Table.from_pylist(traj_rows, schema=_TRAJ_SCHEMA), tmp / "trajectories.parquet")


def read_checked(path: Path, schema: pa.Schema, schema_version: str = SCHEMA_VERSION) -> pa.Table:
    """The Parquet file at `path`, refused (`SchemaError`, naming the file and column) unless it carries
    `schema_version` and every column of `schema` with its type."""
    if not path.exists():
        raise SchemaError(f"{path}: missing (expected a Parquet file of a qevolve store)")
    try:
        file_schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise SchemaError(f"{path}: not a readable Parquet file: {err}") from None
    version = (file_schema.metadata or {}).get(VERSION_KEY, b"<none>").decode()
    if version != schema_version:
        raise SchemaError(f"{path}: schema version {version!r}, expected {schema_version!r}")
    for want in schema:
        if want.name not in file_schema.names:
            raise SchemaError(f"{path}: missing column {want.name!r} ({want.type})")
        got = file_schema.field(want.name).type
        if got != want.type:
            raise SchemaError(f"{path}: column {want.name!r} has type {got}, expected {want.type}")
    table = pq.read_table(path, columns=schema.names)
    for col in ("reward", "aux_reward"):
        if col in schema.names and table.num_rows:
            values = table.column(col).to_pylist()
            bad = next((i for i, v in enumerate(values) if v is None or math.isnan(v)), None)
            if bad is not None:
                raise SchemaError(f"{path}: column {col!r} holds NaN or null at row {bad}")
    return table


def read_episodes(path: Path | str) -> list[dict]:
    """Each episode of a store without its steps: `task_id`, `task_type`, `split`, `won`, ... (the columns of
    trajectories.parquet), checked as `read_store` checks them."""
    return read_checked(Path(path) / "trajectories.parquet", _TRAJ_SCHEMA).to_pylist()


def read_store(path: Path | str) -> list[Trajectory]:
    """Read a store folder back into trajectories, validating both files."""
    path = Path(path)
    trajs = read_episodes(path)
    by_id = {r["trajectory_id"]: Trajectory(**{k: r[k] for k in _TRAJ_FIELDS}) for r in trajs}
    for r in read_checked(path / "steps.parquet", _STEP_SCHEMA).to_pylist():
        t = by_id.get(r["trajectory_id"])
        if t is None:
            raise SchemaError(
                f"{path / 'steps.parquet'}: trajectory_id {r['trajectory_id']!r} not in trajectories.parquet"
            )
        t.steps.append(StepRecord(**{k: r[k] for k in _STEP_FIELDS}))
    for t in by_id.values():
        t.steps.sort(key=lambda s: s.step)
    return list(by_id.values())
