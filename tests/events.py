"""Small hand-made event tables for tests that must not depend on the synthetic world."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from foundation.data.io import shard_path, write_table
from foundation.data.schema import EventSchema, SparseFeature

SCHEMA = EventSchema(
    num_users=50,
    num_items=40,
    num_domains=3,
    num_actions=3,
    sparse=[SparseFeature("user_age", 5, "user"), SparseFeature("item_category", 6, "item")],
    dense_dim=2,
    has_oracle=True,
)


def make_events(n: int, *, seed: int = 0, start_id: int = 0, max_hist: int = 12, schema: EventSchema = SCHEMA) -> pa.Table:
    """``n`` valid rows with ragged histories (lengths 0..max_hist) and some absent conversion labels."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_hist + 1, n)
    ts = rng.integers(1_000, 2_000, n)
    hist_ts = [np.sort(rng.integers(0, t, k)).tolist() for t, k in zip(ts, lengths, strict=True)]
    p_click = rng.uniform(0.05, 0.6, n).astype(np.float32)
    click = (rng.uniform(size=n) < p_click).astype(np.int8)
    conv = [None if rng.uniform() < 0.3 else int(c and rng.uniform() < 0.3) for c in click]
    cols = {
        "example_id": pa.array(np.arange(start_id, start_id + n), pa.int64()),
        "user_id": pa.array(rng.integers(0, schema.num_users, n), pa.int64()),
        "item_id": pa.array(rng.integers(0, schema.num_items, n), pa.int64()),
        "domain": pa.array(rng.integers(0, schema.num_domains, n), pa.int32()),
        "timestamp": pa.array(ts, pa.int64()),
    }
    for f in schema.sparse:
        cols[f.name] = pa.array([rng.integers(0, f.cardinality, rng.integers(1, 3)).tolist() for _ in range(n)], pa.list_(pa.int64()))
    if schema.dense_dim:
        cols["dense"] = pa.array(rng.normal(size=(n, schema.dense_dim)).astype(np.float32).tolist(), pa.list_(pa.float32()))
    cols["history_item_ids"] = pa.array([rng.integers(0, schema.num_items, k).tolist() for k in lengths], pa.list_(pa.int64()))
    cols["history_actions"] = pa.array([rng.integers(0, schema.num_actions, k).tolist() for k in lengths], pa.list_(pa.int32()))
    cols["history_timestamps"] = pa.array(hist_ts, pa.list_(pa.int64()))
    cols["history_domains"] = pa.array([rng.integers(0, schema.num_domains, k).tolist() for k in lengths], pa.list_(pa.int32()))
    cols["click"] = pa.array(click, pa.int8())
    cols["conversion"] = pa.array(conv, pa.int8())
    if schema.has_oracle:
        cols["p_click"] = pa.array(p_click, pa.float32())
        cols["p_conversion"] = pa.array(p_click * 0.1, pa.float32())
    return pa.Table.from_pydict(cols, schema=schema.arrow_schema())


def write_dataset(root: Path, *, rows: dict[str, int], shards: int = 2, row_group_size: int = 16, seed: int = 0) -> Path:
    """A dataset directory with ``rows[split]`` rows per split spread over ``shards`` shards."""
    SCHEMA.save(root)
    next_id = 0
    for s, (split, n) in enumerate(rows.items()):
        per = -(-n // shards)
        for k in range(shards):
            m = min(per, n - k * per)
            if m <= 0:
                continue
            write_table(
                make_events(m, seed=seed * 1000 + s * 100 + k, start_id=next_id),
                shard_path(root, split, k),
                row_group_size=row_group_size,
            )
            next_id += m
    return root
