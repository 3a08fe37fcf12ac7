"""The event schema: one row is one impression of a candidate item to a user on a surface (domain).

A dataset is a directory holding ``schema.json`` (an :class:`EventSchema`) and one folder per split
(``train/``, ``valid/``, ``test/``) of Parquet shards. Every producer (the synthetic world, the
converters) writes this layout, and every consumer reads it through :mod:`foundation.data.io`.

Columns (``S`` = number of rows):

- ids: ``example_id`` int64, ``user_id`` int64, ``item_id`` int64 (the candidate),
  ``domain`` int32, ``timestamp`` int64;
- one ``list<int64>`` column per categorical feature (multi-hot), named by the feature;
- ``dense``: ``list<float32>`` of exactly ``dense_dim`` values (absent when ``dense_dim == 0``);
- history before the impression, oldest first, all of equal length per row:
  ``history_item_ids`` list<int64>, ``history_actions`` list<int32>,
  ``history_timestamps`` list<int64>, ``history_domains`` list<int32>;
- labels: ``click`` and ``conversion`` int8, null when absent (masked in the loss, never zero-filled);
- optional oracle columns (synthetic data only): ``p_click`` and ``p_conversion`` float32, the true
  probabilities, so that the NE/AUC ceiling can be reported.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa

from foundation.messages import clip, shown

TASKS = ("click", "conversion")
HISTORY_FIELDS = ("history_item_ids", "history_actions", "history_timestamps", "history_domains")
ID_FIELDS = ("example_id", "user_id", "item_id", "domain", "timestamp")
ORACLE_FIELDS = {"click": "p_click", "conversion": "p_conversion"}
SCHEMA_FILE = "schema.json"


class SchemaError(ValueError):
    """A ``schema.json`` that is not valid JSON or not a schema; the message names the file and the field."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# field -> (what it must be, check); counts must be positive, dense_dim may be 0.
_SCHEMA_FIELDS = {
    "num_users": ("a positive integer", lambda v: _is_int(v) and v > 0),
    "num_items": ("a positive integer", lambda v: _is_int(v) and v > 0),
    "num_domains": ("a positive integer", lambda v: _is_int(v) and v > 0),
    "num_actions": ("a positive integer", lambda v: _is_int(v) and v > 0),
    "dense_dim": ("a non-negative integer", lambda v: _is_int(v) and v >= 0),
    "sparse": ("a list of features", lambda v: isinstance(v, list)),
    "task": ("'ctr' or 'next_item'", lambda v: v in ("ctr", "next_item")),
    "has_oracle": ("true or false", lambda v: isinstance(v, bool)),
    "domain_names": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v)),
    "description": ("a string", lambda v: isinstance(v, str)),
}
_FEATURE_FIELDS = {
    "name": ("a non-empty string", lambda v: isinstance(v, str) and bool(v)),
    "cardinality": ("a positive integer", lambda v: _is_int(v) and v > 0),
    "side": ("'user' or 'item'", lambda v: v in ("user", "item")),
}


def _check_fields(d, spec: dict, required: tuple[str, ...], where: str) -> None:
    """Raise :class:`SchemaError` for the first unknown, missing or ill-typed field of the object ``d``."""
    if not isinstance(d, dict):
        raise SchemaError(f"{where}: expected an object, got {shown(d)}")
    if unknown := sorted(set(d) - set(spec)):
        raise SchemaError(f"{where}: unknown field {shown(unknown[0])}; known: {sorted(spec)}")
    if missing := [k for k in required if k not in d]:
        raise SchemaError(f"{where}: missing field {missing[0]!r}")
    for name, value in d.items():
        what, ok = spec[name]
        if not ok(value):
            raise SchemaError(f"{where}: field {name}: expected {what}, got {shown(value)}")


@dataclass(frozen=True)
class SparseFeature:
    """A named categorical feature. ``side`` says whose it is: ``user`` or ``item``."""

    name: str
    cardinality: int
    side: str = "user"

    def __post_init__(self) -> None:
        if self.side not in ("user", "item"):
            raise ValueError(f"sparse feature {self.name!r}: side must be 'user' or 'item', got {self.side!r}")
        if self.cardinality <= 0:
            raise ValueError(f"sparse feature {self.name!r}: cardinality must be positive")


@dataclass
class EventSchema:
    """Cardinalities and feature names of a dataset; stored as ``schema.json`` beside its splits.

    ``task`` is ``ctr`` (impressions with click/conversion labels) or ``next_item`` (sequence
    data: the candidate is the next item and every row is a positive).
    """

    num_users: int
    num_items: int
    num_domains: int = 1
    num_actions: int = 2
    sparse: list[SparseFeature] = field(default_factory=list)
    dense_dim: int = 0
    task: str = "ctr"
    has_oracle: bool = False
    domain_names: list[str] = field(default_factory=list)
    description: str = ""

    def __post_init__(self) -> None:
        self.sparse = [f if isinstance(f, SparseFeature) else SparseFeature(**f) for f in self.sparse]
        if self.task not in ("ctr", "next_item"):
            raise ValueError(f"schema task must be 'ctr' or 'next_item', got {self.task!r}")
        names = [f.name for f in self.sparse]
        clash = set(names) & (set(self.base_columns()) - set(names))
        if len(set(names)) != len(names) or clash:
            raise ValueError(f"sparse feature names must be unique and not shadow base columns: {names}")

    @property
    def user_features(self) -> list[SparseFeature]:
        return [f for f in self.sparse if f.side == "user"]

    @property
    def item_features(self) -> list[SparseFeature]:
        return [f for f in self.sparse if f.side == "item"]

    def base_columns(self) -> list[str]:
        cols = [*ID_FIELDS, *HISTORY_FIELDS, *TASKS]
        if self.dense_dim:
            cols.append("dense")
        if self.has_oracle:
            cols.extend(ORACLE_FIELDS.values())
        return cols

    def arrow_schema(self) -> pa.Schema:
        """The exact Arrow schema every Parquet shard of this dataset must have."""
        fields = [
            pa.field("example_id", pa.int64(), nullable=False),
            pa.field("user_id", pa.int64(), nullable=False),
            pa.field("item_id", pa.int64(), nullable=False),
            pa.field("domain", pa.int32(), nullable=False),
            pa.field("timestamp", pa.int64(), nullable=False),
        ]
        fields += [pa.field(f.name, pa.list_(pa.int64()), nullable=False) for f in self.sparse]
        if self.dense_dim:
            fields.append(pa.field("dense", pa.list_(pa.float32()), nullable=False))
        fields += [
            pa.field("history_item_ids", pa.list_(pa.int64()), nullable=False),
            pa.field("history_actions", pa.list_(pa.int32()), nullable=False),
            pa.field("history_timestamps", pa.list_(pa.int64()), nullable=False),
            pa.field("history_domains", pa.list_(pa.int32()), nullable=False),
            pa.field("click", pa.int8(), nullable=True),
            pa.field("conversion", pa.int8(), nullable=True),
        ]
        if self.has_oracle:
            fields += [pa.field(c, pa.float32(), nullable=False) for c in ORACLE_FIELDS.values()]
        return pa.schema(fields)

    def cardinality_of(self, column: str) -> int | None:
        """Upper bound (exclusive) for an id column, or None when unbounded."""
        bounds = {
            "user_id": self.num_users,
            "item_id": self.num_items,
            "history_item_ids": self.num_items,
            "domain": self.num_domains,
            "history_domains": self.num_domains,
            "history_actions": self.num_actions,
        }
        bounds.update({f.name: f.cardinality for f in self.sparse})
        return bounds.get(column)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, where: str = SCHEMA_FILE) -> EventSchema:
        """Parse and check a schema; raise :class:`SchemaError` naming ``where`` and the bad field."""
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as exc:  # ValueError: also an integer past Python's digit limit
            raise SchemaError(f"{where}: not valid JSON: {clip(str(exc))}") from None
        _check_fields(d, _SCHEMA_FIELDS, ("num_users", "num_items"), where)
        for i, feature in enumerate(d.get("sparse", [])):
            _check_fields(feature, _FEATURE_FIELDS, ("name", "cardinality"), f"{where}: sparse[{i}]")
        try:
            return cls(**d)
        except ValueError as exc:
            raise SchemaError(f"{where}: {exc}") from None

    def save(self, dataset_dir: str | Path) -> Path:
        from foundation.data.io import atomic_write_text

        return atomic_write_text(Path(dataset_dir) / SCHEMA_FILE, self.to_json())

    @classmethod
    def load(cls, dataset_dir: str | Path) -> EventSchema:
        path = Path(dataset_dir) / SCHEMA_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no schema.json; is {dataset_dir} a dataset written by `gem data`?")
        try:
            text = path.read_text()
        except UnicodeDecodeError as exc:
            raise SchemaError(f"{path}: not valid JSON: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        return cls.from_json(text, where=str(path))
