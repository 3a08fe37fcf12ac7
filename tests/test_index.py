"""The FAISS item index: exact search equals numpy, HNSW and IVF recall, default factories, write/read round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from transfer.index import (
    INDEX_META_FILE,
    build_index,
    default_factory,
    load_index,
    measure_qps,
    recall_at_k,
    save_index,
)


def clustered(n: int, d: int, *, clusters: int = 32, seed: int = 0) -> np.ndarray:
    """``[n, d]`` float32 points around ``clusters`` random centres (a retrieval-like corpus)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, d))
    return (centres[rng.integers(0, clusters, n)] + 0.3 * rng.normal(size=(n, d))).astype(np.float32)


def numpy_top_k(items: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force cosine top-``k``: ``(positions[Q, k], scores[Q, k])``."""
    unit = items / np.linalg.norm(items, axis=1, keepdims=True)
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    scores = q @ unit.T
    top = np.argsort(-scores, axis=1)[:, :k]
    return top, np.take_along_axis(scores, top, axis=1)


def test_exact_flat_equals_numpy_top_k_with_caller_ids():
    items, queries = clustered(2_000, 16), clustered(50, 16, seed=1)
    ids = np.arange(2_000, dtype=np.int64) * 7 + 100_000
    index = build_index(items, ids)
    assert index.meta.factory == "Flat" and index.meta.normalized
    got_ids, got_scores = index.search(queries, 10)
    want_pos, want_scores = numpy_top_k(items, queries, 10)
    np.testing.assert_array_equal(got_ids, ids[want_pos])
    np.testing.assert_allclose(got_scores, want_scores, rtol=1e-4, atol=1e-5)
    assert items.dtype == np.float32 and not np.allclose(np.linalg.norm(items, axis=1), 1)  # caller's data untouched


def test_hnsw_recall_at_10_on_clustered_data():
    # Queries drawn around the same centres as the items: HNSW's graph is built for in-distribution queries.
    points = clustered(20_200, 32)
    items, queries = points[:20_000], points[20_000:]
    ids = np.arange(len(items), dtype=np.int64)
    exact = build_index(items, ids, factory="Flat")
    hnsw = build_index(items, ids, factory="HNSW32", search_params="efSearch=128")
    assert recall_at_k(hnsw, exact, queries, 10) > 0.9
    assert recall_at_k(exact, exact, queries, 10) == 1.0
    qps = measure_qps(hnsw, queries, 10, repeats=1)
    assert qps["queries"] == 200 and qps["qps"] > 0


def test_ivf_keeps_ids_natively_and_defaults_follow_corpus_size():
    items = clustered(5_000, 16)
    ids = np.arange(len(items), dtype=np.int64) + 10**9
    # nprobe = nlist probes every list, so this IVF search is exact.
    index = build_index(items, ids, factory="IVF16,Flat", metric="l2", normalize=False, search_params="nprobe=16")
    assert type(index.index).__name__ != "IndexIDMap"
    found, distances = index.search(items[:20], 1)
    np.testing.assert_array_equal(found[:, 0], ids[:20])
    np.testing.assert_allclose(distances[:, 0], 0, atol=1e-4)
    assert default_factory(99_999, 64) == ("Flat", "")
    assert default_factory(500_000, 64) == ("IVF2048,Flat", "nprobe=32")
    assert default_factory(4_000_000, 96) == ("IVF4096,PQ48", "nprobe=32")


def test_mid_size_default_keeps_recall_for_queries_away_from_the_items():
    # Queries around other centres than the items, as user vectors are against item vectors: HNSW's graph walk
    # loses most true neighbours there, which is why the default for 100k..2M items is IVF-Flat.
    items, queries = clustered(20_000, 32), clustered(200, 32, seed=5)
    ids = np.arange(len(items), dtype=np.int64)
    exact = build_index(items, ids, factory="Flat")
    factory, params = default_factory(150_000, 32)
    assert factory.startswith("IVF") and factory.endswith(",Flat")
    default = recall_at_k(build_index(items, ids, factory=factory, search_params=params), exact, queries, 10)
    hnsw = recall_at_k(build_index(items, ids, factory="HNSW32", search_params="efSearch=128"), exact, queries, 10)
    assert default > 0.88 and hnsw < 0.8, (default, hnsw)


def test_write_read_round_trip(tmp_path):
    items, queries = clustered(3_000, 8), clustered(30, 8, seed=2)
    ids = np.arange(len(items), dtype=np.int64)[::-1].copy()
    index = build_index(items, ids, factory="HNSW16", search_params="efSearch=64")
    save_index(index, tmp_path)
    loaded = load_index(tmp_path)
    assert loaded.meta == index.meta
    assert json.loads((tmp_path / INDEX_META_FILE).read_text())["count"] == 3_000
    for a, b in zip(index.search(queries, 5), loaded.search(queries, 5), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"shape \[N, 8\]"):
        loaded.search(np.zeros((2, 9), np.float32), 5)
    (tmp_path / "items.faiss").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="unreadable FAISS index"):
        load_index(tmp_path)
