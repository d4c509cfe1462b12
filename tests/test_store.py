import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qevolve.data.store import SchemaError, StepRecord, Trajectory, read_store, write_store


def _traj(tid="t1", reward=1.0):
    steps = [
        StepRecord(0, "obs0", "Action: go to desk 1", "go to desk 1", "obs1", 0.0, False, False, True),
        StepRecord(1, "obs1", "Action: take book 1", "take book 1", "obs2", reward, True, True, True, logp=-0.5),
    ]
    return Trajectory(
        tid, "task/a", "pick_and_place_simple", "train", "expert", "put a book on the desk", won=True, steps=steps
    )


def test_round_trip(tmp_path):
    write_store(tmp_path / "s", [_traj("a"), _traj("b")])
    back = read_store(tmp_path / "s")
    assert [t.trajectory_id for t in back] == ["a", "b"]
    assert back[0].steps[1] == _traj().steps[1]
    assert back[0].steps[0].observation == "obs0" and back[0].steps[0].action == "go to desk 1"
    assert back[0].reward == 1.0 and back[0].won
    assert math.isnan(back[0].steps[0].logp)
    assert sorted(p.name for p in (tmp_path).iterdir()) == ["s"]  # no temporary folder left behind


def _rewrite(path, transform):
    table = pq.read_table(path)
    pq.write_table(transform(table), path)


def test_missing_column_names_file_and_column(tmp_path):
    write_store(tmp_path / "s", [_traj()])
    steps = tmp_path / "s" / "steps.parquet"
    _rewrite(steps, lambda t: t.drop_columns(["aux_reason"]))
    with pytest.raises(SchemaError, match=r"steps\.parquet: .*'aux_reason'"):
        read_store(tmp_path / "s")


def test_wrong_version_is_rejected(tmp_path):
    write_store(tmp_path / "s", [_traj()])
    path = tmp_path / "s" / "trajectories.parquet"
    _rewrite(path, lambda t: t.replace_schema_metadata({b"qevolve.schema_version": b"0"}))
    with pytest.raises(SchemaError, match=r"trajectories\.parquet: schema version '0'"):
        read_store(tmp_path / "s")


def test_wrong_type_is_rejected(tmp_path):
    write_store(tmp_path / "s", [_traj()])
    path = tmp_path / "s" / "steps.parquet"
    _rewrite(
        path,
        lambda t: t.set_column(t.schema.get_field_index("step"), "step", pa.array(["0", "1"])).replace_schema_metadata(
            t.schema.metadata
        ),
    )
    with pytest.raises(SchemaError, match="column 'step' has type string, expected int32"):
        read_store(tmp_path / "s")


def test_nan_reward_is_rejected(tmp_path):
    write_store(tmp_path / "s", [_traj(reward=float("nan"))])
    with pytest.raises(SchemaError, match=r"trajectories\.parquet: column 'reward' holds NaN or null at row 0"):
        read_store(tmp_path / "s")


def test_failed_write_keeps_previous_store(tmp_path, monkeypatch):
    write_store(tmp_path / "s", [_traj("old")])

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", broken)
    with pytest.raises(OSError, match=f"disk full while writing {tmp_path / 's'}; the previous version"):
        write_store(tmp_path / "s", [_traj("new")])
    monkeypatch.undo()
    assert [t.trajectory_id for t in read_store(tmp_path / "s")] == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
