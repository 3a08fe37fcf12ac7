"""Embedding-store export throughput (full and incremental refresh) and retrieval-index recall/QPS.

Export: for each dataset, a full export (version 1), then a copy of the dataset where a fraction of the
users each get one newer row, exported incrementally from version 1; users/s counts every user in the
version over the export's wall time (model, hashing, writing, index), and the incremental row also gives
the users actually recomputed.

Index: the store's real ``item_repr`` as the corpus and real ``user_repr`` as queries (a trained
teacher's; user vectors need not lie where the item vectors do), recall@K of each index against exact
search, and single-thread QPS; then the same at ``--scaled-corpus`` items (jittered copies of the real item
vectors), the size range where the default index is approximate.

    python -m experiments.bench_export --ckpt runs/default/checkpoints/last.ckpt \\
        --data data/synth-debug --data data/synth-default --out /tmp/bench-export --json export.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from foundation.data.io import atomic_write_text, list_shards, shard_path, write_table
from gem.module import load_trained
from transfer.export import export_embeddings
from transfer.index import build_index, measure_qps, recall_at_k
from transfer.store import open_store

# factory -> search params tried on one build of it
INDEXES = {
    "Flat": ("",),
    "HNSW32": ("efSearch=64", "efSearch=128", "efSearch=512"),
    "IVF64,Flat": ("nprobe=8", "nprobe=16"),
}
SCALED_INDEXES = {
    "HNSW32": ("efSearch=128", "efSearch=512", "efSearch=1024"),
    "IVF1024,Flat": ("nprobe=16", "nprobe=32", "nprobe=64"),
}


def each_setting(corpus: np.ndarray, ids: np.ndarray, indexes: dict[str, tuple[str, ...]]):
    """Yield ``(factory, params, index)`` for every setting, building each factory once."""
    for factory, settings in indexes.items():
        index = build_index(corpus, ids, factory=factory)
        for params in settings:
            if params:
                faiss.ParameterSpace().set_index_parameters(index.index, params)
            yield factory, params, index


def with_changed_users(dataset: Path, out: Path, fraction: float, seed: int = 0) -> tuple[Path, int]:
    """A copy of ``dataset`` where ``fraction`` of its users get one newer row (their latest, re-timed past every
    split's last event, so it is their latest row); returns ``(copy, users changed)``."""
    shutil.rmtree(out, ignore_errors=True)  # left by an interrupted run
    shutil.copytree(dataset, out)
    table = pa.concat_tables(
        pq.read_table(p) for split in ("train", "valid", "test") for p in list_shards(dataset, split)
    )
    users = np.unique(table["user_id"].to_numpy())
    chosen = np.random.default_rng(seed).choice(users, max(1, int(fraction * len(users))), replace=False)
    frame = table.select(["user_id", "timestamp"]).to_pandas().reset_index()
    frame = frame[frame["user_id"].isin(chosen)].sort_values("timestamp").groupby("user_id").tail(1)
    rows = table.take(pa.array(frame["index"].to_numpy()))
    last_ts = int(pc.max(table["timestamp"]).as_py())
    start_id = int(pc.max(table["example_id"]).as_py()) + 10**9
    for name, values in (
        ("timestamp", np.full(len(rows), last_ts + 1)),
        ("example_id", start_id + np.arange(len(rows))),
    ):
        i = rows.schema.get_field_index(name)
        rows = rows.set_column(i, rows.schema.field(i), pa.array(values, pa.int64()))
    write_table(rows, shard_path(out, "train", 9_999))
    return out, len(chosen)


def bench_export(ckpt: Path, dataset: Path, work: Path, fraction: float) -> list[dict]:
    """Full export of ``dataset`` then an incremental one after ``fraction`` of users changed."""
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    rows = []
    t0, c0 = time.perf_counter(), time.process_time()
    full = export_embeddings(load_trained(ckpt), dataset, store, device="cpu")
    rows.append(_row(dataset, "full", full, time.perf_counter() - t0, time.process_time() - c0))
    changed, _ = with_changed_users(dataset, work / "changed", fraction)
    t0, c0 = time.perf_counter(), time.process_time()
    inc = export_embeddings(load_trained(ckpt), changed, store, since=full["version"], device="cpu")
    rows.append(
        _row(
            dataset,
            f"incremental ({fraction:.0%} of users changed)",
            inc,
            time.perf_counter() - t0,
            time.process_time() - c0,
        )
    )
    shutil.rmtree(work / "changed")
    return rows


def _row(dataset: Path, mode: str, report: dict, seconds: float, cpu_seconds: float) -> dict:
    # CPU seconds (all of the process's threads) show the work done, which a shared machine's wall time blurs.
    row = {
        "dataset": str(dataset),
        "mode": mode,
        "users": report["users"],
        "items": report["items"],
        "users_recomputed": report["users_recomputed"],
        "items_recomputed": report["items_recomputed"],
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "users_per_s": report["users"] / seconds,
        "phase_seconds": report["seconds"],
        "store": str(Path(report["path"]).parent),
    }
    print(json.dumps(row), flush=True)
    return row


def bench_index(store_root: Path, k: int, num_queries: int, seed: int = 0) -> list[dict]:
    """Recall@``k`` against exact search and 1-thread QPS of :data:`INDEXES` on the store's real vectors."""
    store = open_store(store_root)
    items, item_ids = np.asarray(store.arrays["items"]), np.asarray(store.arrays["item_ids"])
    users = np.asarray(store.arrays["users"])
    queries = users[
        np.random.default_rng(seed).choice(len(users), min(num_queries, len(users)), replace=False)
    ]
    faiss.omp_set_num_threads(1)
    exact = build_index(items, item_ids, factory="Flat")
    rows = []
    for factory, params, index in each_setting(items, item_ids, INDEXES):
        row = {
            "factory": factory,
            "search_params": params,
            "items": len(items),
            "queries": len(queries),
            "k": k,
            "recall": recall_at_k(index, exact, queries, k),
            "qps": measure_qps(index, queries, k)["qps"],
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def bench_index_scaled(
    store_root: Path, corpus_size: int, k: int, num_queries: int, jitter: float = 0.1, seed: int = 0
) -> list[dict]:
    """Recall@``k``/QPS at a corpus size where the default is not Flat: ``corpus_size`` real item vectors with
    Gaussian jitter (``jitter`` x each dimension's std), queried by real user vectors and, for contrast, by
    in-distribution queries (corpus points, jittered again)."""
    store = open_store(store_root)
    items, users = np.asarray(store.arrays["items"]), np.asarray(store.arrays["users"])
    rng = np.random.default_rng(seed)
    scale = jitter * items.std(0)
    corpus = items[rng.integers(0, len(items), corpus_size)] + scale * rng.normal(
        size=(corpus_size, items.shape[1])
    )
    corpus = corpus.astype(np.float32)
    ids = np.arange(corpus_size, dtype=np.int64)
    user_queries = users[rng.choice(len(users), min(num_queries, len(users)), replace=False)]
    near = corpus[rng.choice(corpus_size, num_queries, replace=False)] + scale * rng.normal(
        size=(num_queries, items.shape[1])
    )
    faiss.omp_set_num_threads(1)
    exact = build_index(corpus, ids, factory="Flat")
    rows = []
    for factory, params, index in each_setting(corpus, ids, SCALED_INDEXES):
        row = {
            "factory": factory,
            "search_params": params,
            "items": corpus_size,
            "k": k,
            "recall_user_queries": recall_at_k(index, exact, user_queries, k),
            "recall_in_distribution": recall_at_k(index, exact, near.astype(np.float32), k),
            "qps": measure_qps(index, user_queries, k, repeats=1)["qps"],
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a checkpoint whose model gives user_repr/item_repr")
    parser.add_argument(
        "--data", action="append", required=True, help="dataset directory (repeat for several sizes)"
    )
    parser.add_argument("--out", required=True, help="scratch directory for stores")
    parser.add_argument(
        "--fraction", type=float, default=0.05, help="fraction of users changed for the refresh"
    )
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--queries", type=int, default=2_000)
    parser.add_argument(
        "--scaled-corpus", type=int, default=100_000, help="corpus size of the jittered-corpus index run"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    out = Path(args.out)
    export_rows, index_rows = [], []
    for i, dataset in enumerate(args.data):
        work = out / f"d{i}"
        work.mkdir(parents=True, exist_ok=True)
        export_rows += bench_export(Path(args.ckpt), Path(dataset), work, args.fraction)
    index_rows = bench_index(Path(export_rows[-1]["store"]), args.k, args.queries)
    scaled_rows = bench_index_scaled(
        Path(export_rows[-1]["store"]), args.scaled_corpus, args.k, args.queries // 2
    )
    if args.json:
        payload = {"export": export_rows, "index": index_rows, "index_scaled": scaled_rows}
        atomic_write_text(Path(args.json), json.dumps(payload, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
