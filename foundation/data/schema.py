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

TASKS = ("click", "conversion")
HISTORY_FIELDS = ("history_item_ids", "history_actions", "history_timestamps", "history_domains")
ID_FIELDS = ("example_id", "user_id", "item_id", "domain", "timestamp")
ORACLE_FIELDS = {"click": "p_click", "conversion": "p_conversion"}
SCHEMA_FILE = "schema.json"


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
    def from_json(cls, text: str) -> EventSchema:
        return cls(**json.loads(text))

    def save(self, dataset_dir: str | Path) -> Path:
        from foundation.data.io import atomic_write_text

        return atomic_write_text(Path(dataset_dir) / SCHEMA_FILE, self.to_json())

    @classmethod
    def load(cls, dataset_dir: str | Path) -> EventSchema:
        path = Path(dataset_dir) / SCHEMA_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no schema.json; is {dataset_dir} a dataset written by `gem data`?")
        try:
            return cls.from_json(path.read_text())
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: invalid schema: {exc}") from exc
