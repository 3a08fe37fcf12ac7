"""Record checks for event tables, vectorised over a whole Arrow table.

Every check yields ``(row_indices, reason)`` where the reason names the field; the first failing
check wins for a row, so each bad row carries exactly one reason.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from foundation.data.schema import HISTORY_FIELDS, ORACLE_FIELDS, TASKS, EventSchema


class DataValidationError(ValueError):
    """A record or file that breaks the event schema; the message names the file, row and field."""


def _np(arr: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return arr.to_numpy(zero_copy_only=False)


def _list_parts(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(lengths[S], flat_values[N], parent_row[N])`` of a list column with nulls treated as empty."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    lengths = _np(pc.fill_null(pc.list_value_length(col), 0)).astype(np.int64)
    flat = _np(pc.list_flatten(col))
    parents = _np(pc.list_parent_indices(col)).astype(np.int64)
    return lengths, flat, parents


def _check_nulls(table: pa.Table, schema: EventSchema) -> Iterator[tuple[np.ndarray, str]]:
    for name in schema.arrow_schema().names:
        if name in TASKS:
            continue
        col = table.column(name)
        if col.null_count:
            yield np.flatnonzero(_np(col.is_null())), f"field {name}: null value in a required column"


def _check_range(values: np.ndarray, rows: np.ndarray, name: str, upper: int | None):
    bad = values < 0
    if upper is not None:
        bad |= values >= upper
    if bad.any():
        where = f"[0, {upper})" if upper is not None else ">= 0"
        yield np.unique(rows[bad]), f"field {name}: id out of range, must be in {where}"


def _check_ids(table: pa.Table, schema: EventSchema) -> Iterator[tuple[np.ndarray, str]]:
    for name in ("example_id", "user_id", "item_id", "domain", "timestamp"):
        values = _np(pc.fill_null(table.column(name), 0)).astype(np.int64)
        yield from _check_range(values, np.arange(len(values)), name, schema.cardinality_of(name))
    for f in schema.sparse:
        _, flat, parents = _list_parts(table.column(f.name))
        yield from _check_range(flat.astype(np.int64), parents, f.name, f.cardinality)


def _check_dense(table: pa.Table, schema: EventSchema) -> Iterator[tuple[np.ndarray, str]]:
    if not schema.dense_dim:
        return
    lengths, flat, parents = _list_parts(table.column("dense"))
    wrong = np.flatnonzero(lengths != schema.dense_dim)
    if len(wrong):
        yield wrong, f"field dense: expected {schema.dense_dim} values"
    nonfinite = ~np.isfinite(flat.astype(np.float64))
    if nonfinite.any():
        yield np.unique(parents[nonfinite]), "field dense: NaN or inf"


def _check_history(table: pa.Table, schema: EventSchema) -> Iterator[tuple[np.ndarray, str]]:
    parts = {name: _list_parts(table.column(name)) for name in HISTORY_FIELDS}
    lengths = parts["history_item_ids"][0]
    for name in HISTORY_FIELDS[1:]:
        unequal = np.flatnonzero(parts[name][0] != lengths)
        if len(unequal):
            yield unequal, f"field {name}: length differs from history_item_ids"
    for name in ("history_item_ids", "history_actions", "history_domains"):
        _, flat, parents = parts[name]
        yield from _check_range(flat.astype(np.int64), parents, name, schema.cardinality_of(name))
    _, ts, parents = parts["history_timestamps"]
    if len(ts):
        ts = ts.astype(np.int64)
        step_back = (np.diff(ts) < 0) & (parents[1:] == parents[:-1])
        if step_back.any():
            yield np.unique(parents[1:][step_back]), "field history_timestamps: timestamps decrease"
        impression = _np(pc.fill_null(table.column("timestamp"), 0)).astype(np.int64)
        future = ts > impression[parents]
        if future.any():
            yield np.unique(parents[future]), "field history_timestamps: event after the impression"


def _check_labels(table: pa.Table, schema: EventSchema) -> Iterator[tuple[np.ndarray, str]]:
    for task in TASKS:
        col = table.column(task)
        values = _np(pc.fill_null(col, 0)).astype(np.int64)
        bad = np.flatnonzero((values != 0) & (values != 1))
        if len(bad):
            yield bad, f"field {task}: label must be 0, 1 or null"
    if schema.has_oracle:
        for column in ORACLE_FIELDS.values():
            p = _np(table.column(column)).astype(np.float64)
            bad = np.flatnonzero(~((p >= 0) & (p <= 1)))
            if len(bad):
                yield bad, f"field {column}: probability must be in [0, 1]"


CHECKS = (_check_nulls, _check_ids, _check_dense, _check_history, _check_labels)


def find_bad_rows(table: pa.Table, schema: EventSchema) -> tuple[np.ndarray, list[str]]:
    """Return ``(bad_rows, reasons)``: sorted row indices and one reason per bad row."""
    reason_of: dict[int, str] = {}
    for check in CHECKS:
        for rows, reason in check(table, schema):
            for r in rows.tolist():
                reason_of.setdefault(int(r), reason)
    rows = np.array(sorted(reason_of), dtype=np.int64)
    return rows, [reason_of[r] for r in rows.tolist()]
