"""Validation at the edge: every bad-record case under both policies, schema checks, corrupt files."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from foundation.data.io import (
    CorruptFileError,
    QuarantineLog,
    atomic_write_text,
    iter_valid_row_groups,
    write_checksum,
    write_table,
)
from foundation.data.schema import SchemaError
from foundation.data.validate import DataValidationError
from tests.events import SCHEMA, make_events

BAD_ROW = 3


def _replace(table: pa.Table, name: str, row: int, value) -> pa.Table:
    values = table.column(name).to_pylist()
    values[row] = value
    idx = table.schema.get_field_index(name)
    field = table.schema.field(name).with_nullable(True)  # other writers need not declare nullability
    return table.set_column(idx, field, pa.array(values, field.type))


def _nonempty_history(table: pa.Table, row: int) -> pa.Table:
    for name, value in (
        ("history_item_ids", [1, 2, 3]),
        ("history_actions", [0, 1, 2]),
        ("history_timestamps", [10, 20, 30]),
        ("history_domains", [0, 1, 2]),
    ):
        table = _replace(table, name, row, value)
    return table


CASES = {
    "negative user id": (lambda t: _replace(t, "user_id", BAD_ROW, -1), "user_id"),
    "item id over cardinality": (lambda t: _replace(t, "item_id", BAD_ROW, SCHEMA.num_items), "item_id"),
    "domain over cardinality": (lambda t: _replace(t, "domain", BAD_ROW, 7), "domain"),
    "sparse id out of range": (lambda t: _replace(t, "user_age", BAD_ROW, [0, 99]), "user_age"),
    "history item out of range": (
        lambda t: _replace(_nonempty_history(t, BAD_ROW), "history_item_ids", BAD_ROW, [1, -5, 2]),
        "history_item_ids",
    ),
    "nan dense": (lambda t: _replace(t, "dense", BAD_ROW, [0.0, math.nan]), "dense"),
    "inf dense": (lambda t: _replace(t, "dense", BAD_ROW, [math.inf, 0.0]), "dense"),
    "dense wrong width": (lambda t: _replace(t, "dense", BAD_ROW, [0.0]), "dense"),
    "history lengths differ": (
        lambda t: _replace(_nonempty_history(t, BAD_ROW), "history_actions", BAD_ROW, [0, 1]),
        "history_actions",
    ),
    "history timestamps decrease": (
        lambda t: _replace(_nonempty_history(t, BAD_ROW), "history_timestamps", BAD_ROW, [10, 30, 20]),
        "history_timestamps",
    ),
    "history event after impression": (
        lambda t: _replace(_nonempty_history(t, BAD_ROW), "history_timestamps", BAD_ROW, [10, 20, 10**9]),
        "history_timestamps",
    ),
    "click label not binary": (lambda t: _replace(t, "click", BAD_ROW, 2), "click"),
    "conversion label negative": (lambda t: _replace(t, "conversion", BAD_ROW, -1), "conversion"),
    "oracle probability out of range": (lambda t: _replace(t, "p_click", BAD_ROW, 1.5), "p_click"),
    "null in a required column": (lambda t: _replace(t, "item_id", BAD_ROW, None), "item_id"),
}


@pytest.fixture
def good_table() -> pa.Table:
    return make_events(20, seed=1)


def _write(table: pa.Table, tmp_path, row_group_size: int = 8):
    path = tmp_path / "train" / "part-00000.parquet"
    write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_record_error_policy_names_file_row_and_field(case, good_table, tmp_path):
    corrupt, field = CASES[case]
    path = _write(corrupt(good_table), tmp_path)
    with pytest.raises(DataValidationError) as err:
        list(iter_valid_row_groups(path, SCHEMA, policy="error"))
    message = str(err.value)
    assert str(path) in message and f"row {BAD_ROW}:" in message and f"field {field}" in message


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_record_quarantine_policy_counts_and_keeps_the_rest(case, good_table, tmp_path):
    corrupt, field = CASES[case]
    path = _write(corrupt(good_table), tmp_path)
    log = QuarantineLog(tmp_path)
    kept = pa.concat_tables(t for _, t in iter_valid_row_groups(path, SCHEMA, policy="quarantine", quarantine=log))
    assert log.count == 1
    assert kept.num_rows == good_table.num_rows - 1
    assert BAD_ROW not in kept.column("example_id").to_pylist()
    quarantined = pa.concat_tables(pq.read_table(p) for p in sorted((tmp_path / "quarantine").glob("*.parquet")))
    assert quarantined.column("source_row").to_pylist() == [BAD_ROW]
    assert f"field {field}" in quarantined.column("reason")[0].as_py()


def test_good_table_passes_untouched(good_table, tmp_path):
    path = _write(good_table, tmp_path)
    kept = pa.concat_tables(t for _, t in iter_valid_row_groups(path, SCHEMA, policy="error"))
    assert kept.equals(good_table)


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda t: t.drop_columns(["history_domains"]), "missing ['history_domains']"),
        (lambda t: t.append_column("surprise", pa.array([0] * t.num_rows)), "unexpected ['surprise']"),
        (lambda t: t.set_column(1, "user_id", t.column("user_id").cast(pa.int32())), "column 'user_id' has type int32"),
    ],
)
def test_schema_checked_on_open(mutate, expected, good_table, tmp_path):
    path = tmp_path / "part.parquet"
    pq.write_table(mutate(good_table), path)  # another tool's file, adopted
    write_checksum(path)
    for policy in ("error", "quarantine"):
        with pytest.raises(DataValidationError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            list(iter_valid_row_groups(path, SCHEMA, policy=policy, quarantine=QuarantineLog(tmp_path)))


def test_truncated_file_gives_clear_error(good_table, tmp_path):
    path = _write(good_table, tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptFileError, match=r"checksum mismatch .*: the file is corrupt, truncated or was modified"):
        list(iter_valid_row_groups(path, SCHEMA))
    write_checksum(path)  # truncated before its checksum was taken: the Parquet reader still refuses it
    with pytest.raises(CorruptFileError, match="truncated or corrupt"):
        list(iter_valid_row_groups(path, SCHEMA))


def test_garbage_in_row_group_gives_clear_error(good_table, tmp_path):
    path = _write(good_table, tmp_path)
    data = bytearray(path.read_bytes())
    data[8:400] = b"\x00" * 392
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match=str(path.name)):
        list(iter_valid_row_groups(path, SCHEMA))


def test_unknown_policy_is_rejected(good_table, tmp_path):
    with pytest.raises(ValueError, match="unknown bad-record policy"):
        list(iter_valid_row_groups(_write(good_table, tmp_path), SCHEMA, policy="ignore"))


def test_atomic_write_leaves_no_temp_files(tmp_path):
    target = tmp_path / "x.json"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_schema_roundtrip(tmp_path):
    SCHEMA.save(tmp_path)
    assert type(SCHEMA).load(tmp_path) == SCHEMA
    (tmp_path / "schema.json").write_text("{not json")
    with pytest.raises(SchemaError, match=r"schema\.json: not valid JSON"):
        type(SCHEMA).load(tmp_path)
