"""A FAISS retrieval index over item vectors, built from a factory string and stored beside ``index.json``.

Default index by corpus size ``n`` (vectors of width ``d``), for a brute-force-quality first stage:

- ``n < 100_000``: ``Flat`` — exact; a full scan of 100k x 128 floats takes a few ms per query batch.
- ``100_000 <= n < 2_000_000``: ``IVF{nlist},Flat`` (``nlist`` as below) searched with ``nprobe=32`` —
  uncompressed vectors, a scan of ~32/nlist of the corpus per query. Not HNSW: retrieval queries are
  *user* vectors, which need not lie where the item vectors do, and HNSW's graph walk misses their
  neighbours. Measured on a trained DLRM's real user vectors against 100k item vectors (real ones,
  jittered), recall@10 was 0.51 for ``HNSW32`` at ``efSearch=128`` (0.68 even at 1024; 0.997 for
  in-distribution queries) but 0.986 for ``IVF1024,Flat`` at ``nprobe=32`` (``docs/benchmarks.md``).
- ``n >= 2_000_000``: ``IVF{nlist},PQ{m}`` with ``nlist ~ 4 sqrt(n)`` (a power of two) and ``m`` the
  largest divisor of ``d`` not above ``min(64, d // 2)``, searched with ``nprobe=32`` — compressed
  codes, so a corpus of many millions fits in memory; trained on at most 256 vectors per list.

Ids: FAISS positions are replaced by the caller's int64 ids. IVF indexes store ids natively; the others
are wrapped in ``IndexIDMap``. With ``normalize`` the item vectors and the queries are L2-normalised, so
an inner-product index scores cosine similarity.

Files::

    items.faiss   faiss.write_index
    index.json    {"factory", "metric", "normalized", "dims", "count", "search_params"}
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import faiss
import numpy as np

from foundation.data.io import atomic_path, atomic_write_text

INDEX_FILE = "items.faiss"
INDEX_META_FILE = "index.json"
METRICS = {"ip": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2}
FLAT_MAX = 100_000
IVF_FLAT_MAX = 2_000_000


@dataclass(frozen=True)
class IndexMeta:
    """What ``index.json`` records; ``search_params`` is a ``faiss.ParameterSpace`` string ("" for none)."""

    factory: str
    metric: str
    normalized: bool
    dims: int
    count: int
    search_params: str


@dataclass
class ItemIndex:
    """A FAISS index whose results are item ids, with the settings it was built with."""

    index: faiss.Index
    meta: IndexMeta

    def search(self, user_vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` items for ``user_vectors[B, d]``: ``(ids[B, k] int64, scores[B, k] float32)``.

        Scores are inner products (cosines when normalised) or squared L2 distances; a row with fewer
        than ``k`` results is padded with id -1 (FAISS's convention).
        """
        queries = _prepare(user_vectors, self.meta.dims, self.meta.normalized)
        scores, ids = self.index.search(queries, k)
        return ids, scores


def default_factory(count: int, dims: int) -> tuple[str, str]:
    """``(factory, search_params)`` for a corpus of ``count`` vectors of width ``dims`` (module doc)."""
    if count < FLAT_MAX:
        return "Flat", ""
    nlist = 1 << int(np.log2(4 * np.sqrt(count)))
    if count < IVF_FLAT_MAX:
        return f"IVF{nlist},Flat", "nprobe=32"
    m = max(k for k in range(1, min(64, max(dims // 2, 1)) + 1) if dims % k == 0)
    return f"IVF{nlist},PQ{m}", "nprobe=32"


def _prepare(vectors: np.ndarray, dims: int, normalize: bool) -> np.ndarray:
    """A C-contiguous float32 ``[N, dims]`` copy (FAISS normalises in place, so never the caller's array)."""
    out = np.array(vectors, dtype=np.float32, order="C", copy=True)
    if out.ndim != 2 or out.shape[1] != dims:
        raise ValueError(f"expected vectors of shape [N, {dims}], got {list(out.shape)}")
    if normalize:
        faiss.normalize_L2(out)
    return out


def build_index(
    vectors: np.ndarray,
    ids: np.ndarray,
    factory: str | None = None,
    metric: str = "ip",
    normalize: bool = True,
    *,
    search_params: str | None = None,
    seed: int = 0,
) -> ItemIndex:
    """Index ``vectors[N, d]`` under ``ids[N]`` (int64); ``factory=None`` picks by size (module doc).

    ``search_params`` (e.g. ``"efSearch=128"``) default to the size-based choice for default factories
    and to none for explicit ones. Trainable indexes are trained on a seeded sample.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {sorted(METRICS)}")
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if vectors.ndim != 2 or len(vectors) != len(ids):
        raise ValueError(f"vectors {list(vectors.shape)} and ids [{len(ids)}] do not match")
    dims = int(vectors.shape[1])
    chosen, default_params = default_factory(len(ids), dims)
    params = search_params if search_params is not None else (default_params if factory is None else "")
    factory = factory or chosen
    data = _prepare(vectors, dims, normalize)
    index = faiss.index_factory(dims, factory, METRICS[metric])
    # IVF indexes keep their own ids; the others only know positions and need the map.
    if faiss.try_extract_index_ivf(index) is None:
        index = faiss.IndexIDMap(index)
    if not index.is_trained:
        index.train(_training_sample(data, index, seed))
    index.add_with_ids(data, ids)
    meta = IndexMeta(factory, metric, normalize, dims, len(ids), params)
    _apply_params(index, params)
    return ItemIndex(index, meta)


def _training_sample(data: np.ndarray, index: faiss.Index, seed: int) -> np.ndarray:
    # 256 points per IVF list is plenty for k-means and bounds training time on huge corpora.
    ivf = faiss.try_extract_index_ivf(index)
    cap = 256 * ivf.nlist if ivf is not None else len(data)
    if len(data) <= cap:
        return data
    return data[np.sort(np.random.default_rng(seed).choice(len(data), cap, replace=False))]


def _apply_params(index: faiss.Index, params: str) -> None:
    if params:
        faiss.ParameterSpace().set_index_parameters(index, params)


def save_index(item_index: ItemIndex, directory: str | Path) -> list[Path]:
    """Write ``items.faiss`` and ``index.json`` into ``directory``, each atomically; returns both paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / INDEX_FILE
    with atomic_path(path) as tmp:
        # Serialised in memory and written by Python: faiss.write_index can leave a short file behind an
        # unchecked fclose on a full disk, which the manifest would then checksum as if it were whole.
        tmp.write_bytes(faiss.serialize_index(item_index.index).tobytes())
    meta = atomic_write_text(directory / INDEX_META_FILE, json.dumps(asdict(item_index.meta), indent=2, sort_keys=True))
    return [path, meta]


def load_index(directory: str | Path) -> ItemIndex:
    """Read an index written by :func:`save_index`, check it against ``index.json`` and set its search params."""
    directory = Path(directory)
    meta_path, path = directory / INDEX_META_FILE, directory / INDEX_FILE
    for p in (meta_path, path):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no retrieval index here")
    meta = IndexMeta(**json.loads(meta_path.read_text()))
    try:
        index = faiss.read_index(str(path))
    except RuntimeError as exc:
        raise ValueError(f"{path}: unreadable FAISS index (truncated or corrupt?): {exc}") from exc
    if index.d != meta.dims or index.ntotal != meta.count:
        raise ValueError(
            f"{path}: index has d={index.d}, {index.ntotal} vectors; {meta_path} says d={meta.dims}, {meta.count}"
        )
    _apply_params(index, meta.search_params)
    return ItemIndex(index, meta)


def recall_at_k(index: ItemIndex, exact: ItemIndex, queries: np.ndarray, k: int) -> float:
    """Mean fraction of ``exact``'s top-``k`` ids per query that ``index`` also returns in its top ``k``."""
    got, _ = index.search(queries, k)
    want, _ = exact.search(queries, k)
    hits = [len(np.intersect1d(g[g >= 0], w[w >= 0])) / max((w >= 0).sum(), 1) for g, w in zip(got, want, strict=True)]
    return float(np.mean(hits))


def measure_qps(index: ItemIndex, queries: np.ndarray, k: int, *, batch_size: int = 256, repeats: int = 3) -> dict:
    """Best-of-``repeats`` queries per second searching ``queries[Q, d]`` in batches of ``batch_size``.

    For benchmarks (``docs/benchmarks.md``), not pass/fail tests. Returns ``{"qps", "seconds", "queries",
    "batch_size", "k", "threads"}``.
    """
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for lo in range(0, len(queries), batch_size):
            index.search(queries[lo : lo + batch_size], k)
        best = min(best, time.perf_counter() - t0)
    return {
        "qps": len(queries) / best if best > 0 else float("inf"),
        "seconds": best,
        "queries": len(queries),
        "batch_size": batch_size,
        "k": k,
        "threads": faiss.omp_get_max_threads(),
    }
