"""The versioned embedding store's writer: teacher user/item vectors for serving and retrieval.

The store's layout and its reader (open, latest version, verify) are in :mod:`transfer.store`; this
module writes versions.

Serving features: a value model scored at serving time (:mod:`value_models.serving`) needs the raw inputs
of the row each vector came from, so every version also stores them, in the same row order as the ids:
each side's multi-hot features as jagged ``(offsets[n+1] int64, values[N] int64)``, the user's
``feature_history_len`` most recent history item ids (jagged the same way) and the user's dense features
``[U, D]`` float32. Features are cheap (no model), so they are always taken from the latest rows, also in
an incremental refresh; the manifest's ``features`` entry lists them with the kept history length.

Publishing: everything is written into a hidden temp dir under the store, fsynced, renamed to
``v{N:06d}`` (one atomic step; readers never see a partial version) and only then is ``LATEST``
replaced. A killed export leaves at most a hidden temp dir (removed by the next export) or a complete
version that ``LATEST`` does not point to yet. Versions are immutable, so a reader holding version v
keeps reading it while v+1 is published.

Incremental refresh (``since=N``): a user's vector is copied from version N when the fingerprint of its
latest row (history, user features, dense features, domain and timestamp: every input a user tower can
see) is unchanged, and recomputed otherwise; items likewise with their item-side inputs. The model
cost thus scales with the changed entities; finding them still scans the id columns of the data.

Retention (``retention=K``): after a publish, the newest K versions are kept and older ones deleted;
``LATEST`` is never deleted. Parents are *not* protected: every version is self-contained (copied
vectors are stored, not linked), so deleting a parent never breaks a child; lineage stays in the
manifests and MLflow. A deleted version is first renamed to a hidden name, so it vanishes atomically;
readers that already memory-mapped it keep their (POSIX) mapping.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from foundation.checkpoint import TrainedModel, checkpoint_run_id
from foundation.data.io import (
    atomic_write_text,
    fsync_dir,
    iter_valid_row_groups,
    list_shards,
    open_shard,
    sha256_file,
)
from foundation.data.pipeline import RowBlock, build_batch, gather_jagged, table_to_block
from foundation.data.schema import HISTORY_FIELDS, SCHEMA_FILE, EventSchema
from transfer.index import INDEX_FILE, INDEX_META_FILE, build_index, save_index
from transfer.lineage import log_lineage_run
from transfer.store import (
    ARRAY_NAMES,
    FORMAT_VERSION,
    LATEST_FILE,
    MANIFEST_FILE,
    SIDES,
    EmbeddingStore,
    StoreError,
    latest_version,
    list_versions,
    open_store,
    version_name,
)

KEY_COLUMN = {"user": "user_id", "item": "item_id"}
REPR = {"user": "user_repr", "item": "item_repr"}
# History items kept per user for serving-time features; a student's history_len must not exceed it.
FEATURE_HISTORY_LEN = 64
# splitmix64 finaliser constants: cheap, well-mixed 64-bit hashing in vectorised numpy.
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


# -- selecting each entity's latest row -----------------------------------------------------------


@dataclass
class Latest:
    """Each user's and item's latest row across the splits, as blocks in ascending id order."""

    blocks: dict[str, RowBlock]

    def ids(self, side: str) -> np.ndarray:
        return self.blocks[side].scalars[KEY_COLUMN[side]]


def _scan_keys(units: list[tuple[Path, int]], schema: EventSchema) -> dict[str, np.ndarray]:
    """Id columns of every row: ``user_id, item_id, timestamp, example_id`` plus ``unit``/``row`` positions."""
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("user_id", "item_id", "timestamp", "example_id", "unit", "row")}
    files = {}
    for u, (path, rg) in enumerate(units):
        pf = files.setdefault(path, open_shard(path, schema))
        table = pf.read_row_group(rg, columns=["user_id", "item_id", "timestamp", "example_id"])
        for name in ("user_id", "item_id", "timestamp", "example_id"):
            cols[name].append(table.column(name).to_numpy().astype(np.int64))
        cols["unit"].append(np.full(table.num_rows, u, np.int64))
        cols["row"].append(np.arange(table.num_rows, dtype=np.int64))
    return {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in cols.items()}


def _latest_rows(keys: np.ndarray, timestamp: np.ndarray, example_id: np.ndarray) -> np.ndarray:
    """Index of each key's row with the max ``(timestamp, example_id)``, in ascending key order."""
    order = np.lexsort((example_id, timestamp, keys))
    sorted_keys = keys[order]
    last = np.append(sorted_keys[1:] != sorted_keys[:-1], True) if len(order) else np.zeros(0, bool)
    return order[last]


def select_latest(dataset_dir: Path, splits: tuple[str, ...], schema: EventSchema) -> Latest:
    """Find each user's and item's latest row (one id-column pass), then read only the row groups holding them."""
    units = [(p, rg) for s in splits for p in list_shards(dataset_dir, s) for rg in range(open_shard(p, schema).num_row_groups)]
    keys = _scan_keys(units, schema)
    picked = {side: _latest_rows(keys[KEY_COLUMN[side]], keys["timestamp"], keys["example_id"]) for side in SIDES}
    needed = np.unique(np.concatenate(list(picked.values())))
    tables = []
    # Global row indices follow unit order, so the sorted ``needed`` splits into one run per unit.
    for chunk in np.split(needed, np.flatnonzero(np.diff(keys["unit"][needed])) + 1):
        if not len(chunk):
            continue
        path, rg = units[keys["unit"][chunk[0]]]
        # policy "error": a quarantined latest row would silently serve an older history.
        ((_, table),) = iter_valid_row_groups(path, schema, policy="error", row_groups=[rg])
        tables.append(table.take(pa.array(keys["row"][chunk])))
    rows = pa.concat_tables(tables) if tables else schema.arrow_schema().empty_table()
    # ``needed`` is sorted and the tables follow it, so a global row index maps to its rank in ``needed``.
    return Latest({side: table_to_block(rows.take(pa.array(np.searchsorted(needed, picked[side]))), schema) for side in SIDES})


# -- fingerprints ---------------------------------------------------------------------------------


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _jagged_hash(offsets: np.ndarray, values: np.ndarray, salt: int) -> np.ndarray:
    """``[n]`` uint64 hash of each row of a jagged column: position-aware, order-sensitive, length-aware."""
    lengths = np.diff(offsets)
    row = np.repeat(np.arange(len(lengths)), lengths)
    pos = (np.arange(len(values)) - offsets[row]).astype(np.uint64)
    bits = values.view(np.uint32) if values.dtype == np.float32 else values.astype(np.int64)
    h = _mix(bits.astype(np.uint64) ^ _mix(pos + np.uint64(salt)))
    # Segment sums through a wrapping cumsum: differences stay exact modulo 2**64.
    csum = np.concatenate(([np.uint64(0)], np.cumsum(h, dtype=np.uint64)))
    return _mix(csum[offsets[1:]] - csum[offsets[:-1]] + _mix(lengths.astype(np.uint64) + np.uint64(salt)))


def fingerprints(block: RowBlock, schema: EventSchema, side: str) -> np.ndarray:
    """``[n]`` uint64 hash of the inputs a ``side`` tower may read in each row (module doc); collisions ~2**-64."""
    if side == "user":
        jagged = [*HISTORY_FIELDS, *(f.name for f in schema.user_features)]
        scalars = ["user_id", "domain", "timestamp"]
    else:
        jagged = [f.name for f in schema.item_features]
        scalars = ["item_id", "domain"]
    n = block.num_rows
    parts = [_jagged_hash(*block.jagged[name], salt=i) for i, name in enumerate(jagged)]
    parts += [_mix(block.scalars[c].astype(np.uint64) + np.uint64(100 + i)) for i, c in enumerate(scalars)]
    if side == "user" and block.dense.shape[1]:
        width = block.dense.shape[1]
        parts.append(_jagged_hash(np.arange(n + 1) * width, np.ascontiguousarray(block.dense).reshape(-1), salt=200))
    h = np.zeros(n, np.uint64)
    for p in parts:
        h = _mix(h ^ p)
    return h


# -- serving features -----------------------------------------------------------------------------


def _jagged_arrays(offsets: np.ndarray, values: np.ndarray, keep_last: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Every row of a jagged column, each cut to its ``keep_last`` most recent values: ``(offsets, values)`` int64."""
    lengths, kept = gather_jagged(offsets, values, np.arange(len(offsets) - 1), keep_last)
    return np.concatenate(([0], np.cumsum(lengths))).astype(np.int64), kept.astype(np.int64)


def feature_arrays(block: RowBlock, schema: EventSchema, side: str, history_len: int) -> dict[str, np.ndarray]:
    """The serving features of ``block``'s rows (module doc), keyed by file stem, e.g. ``user_feat_age_offsets``."""
    out: dict[str, np.ndarray] = {}
    for f in schema.sparse:
        if f.side == side:
            offsets, values = _jagged_arrays(*block.jagged[f.name], None)
            out[f"{side}_feat_{f.name}_offsets"], out[f"{side}_feat_{f.name}_values"] = offsets, values
    if side == "user":
        history = _jagged_arrays(*block.jagged["history_item_ids"], history_len)
        out["user_history_offsets"], out["user_history_values"] = history
        out["user_dense"] = np.ascontiguousarray(block.dense, dtype=np.float32)
    return out


# -- computing ------------------------------------------------------------------------------------


@torch.inference_mode()
def embed_rows(
    teacher: TrainedModel, block: RowBlock, rows: np.ndarray, side: str, batch_size: int, device: str,
    progress: bool = False,
) -> np.ndarray:
    """``[len(rows), d]`` float32 ``user_repr`` or ``item_repr`` of ``block``'s ``rows``, ``batch_size`` rows per forward."""
    out = []
    starts = range(0, len(rows), batch_size)
    for lo in tqdm(starts, desc=f"export {side}s", unit="batch", disable=not progress, leave=False):
        batch = build_batch([(block, rows[lo : lo + batch_size])], teacher.schema, teacher.max_len, None)
        vectors = getattr(teacher.model(batch.to(device)), REPR[side])
        if vectors is None:
            raise StoreError(f"model {teacher.arch!r} has no {REPR[side]} to export")
        out.append(vectors.float().cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def refresh_side(
    teacher: TrainedModel, latest: Latest, side: str, parent: EmbeddingStore | None, version: int, batch_size: int, device: str,
    progress: bool = False,
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Arrays of one side for ``version``: rows whose fingerprint matches ``parent`` are copied, others computed.

    Returns ``(arrays by key, {"recomputed", "copied"}, seconds spent in the model)``; with no parent every
    row is computed.
    """
    block, ids = latest.blocks[side], latest.ids(side)
    prints = fingerprints(block, teacher.schema, side)
    same, pos = _unchanged(parent, side, ids, prints)
    t0 = time.perf_counter()
    computed = embed_rows(teacher, block, np.flatnonzero(~same), side, batch_size, device, progress)
    model_seconds = time.perf_counter() - t0
    dims = computed.shape[1] if len(computed) else (parent.side(side, "vectors").shape[1] if parent else 0)
    if parent is not None and parent.side(side, "vectors").shape[1] != dims:
        raise StoreError(f"{parent.path}: {side} vectors have d={parent.side(side, 'vectors').shape[1]}, the model gives d={dims}")
    vectors = np.zeros((len(ids), dims), np.float32)
    if len(computed):
        vectors[~same] = computed
    updated = np.full(len(ids), version, np.int64)
    if same.any():
        vectors[same] = parent.side(side, "vectors")[pos[same]]
        updated[same] = parent.side(side, "updated_version")[pos[same]]
    arrays = {"vectors": vectors, "ids": ids, "timestamps": block.scalars["timestamp"], "fingerprints": prints,
              "updated_version": updated}
    return arrays, {"recomputed": int((~same).sum()), "copied": int(same.sum())}, model_seconds


def _unchanged(parent: EmbeddingStore | None, side: str, ids: np.ndarray, prints: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(same[n], pos[n])``: whether each id has the same fingerprint in ``parent``, and its row there."""
    old_ids = parent.side(side, "ids") if parent is not None else np.zeros(0, np.int64)
    if not len(old_ids):
        return np.zeros(len(ids), bool), np.zeros(len(ids), np.int64)
    pos = np.minimum(np.searchsorted(old_ids, ids), len(old_ids) - 1)
    return (old_ids[pos] == ids) & (parent.side(side, "fingerprints")[pos] == prints), pos


# -- writing --------------------------------------------------------------------------------------


@contextmanager
def _writer_lock(root: Path):
    """One exporter per store; the kernel drops the lock if its holder is killed."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(root: Path) -> None:
    # Under the writer lock, any hidden temp or trash dir (or LATEST temp file) belongs to a killed exporter.
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_file() and p.name.startswith(f".{LATEST_FILE}.") and p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)


def _save_array(directory: Path, name: str, array: np.ndarray) -> None:
    with open(directory / f"{name}.npy", "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def _file_entries(directory: Path) -> dict[str, dict]:
    return {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in sorted(directory.iterdir())}


def _publish(root: Path, tmp: Path, version: int) -> Path:
    """Rename the finished temp dir to its version name, then point ``LATEST`` at it."""
    fsync_dir(tmp)
    final = root / version_name(version)
    os.rename(tmp, final)
    fsync_dir(root)
    atomic_write_text(root / LATEST_FILE, version_name(version) + "\n")
    return final


def _write_version(
    root: Path,
    sides: dict[str, dict[str, np.ndarray]],
    features: dict[str, np.ndarray],
    manifest: dict,
    *,
    with_index: bool,
    index_factory: str | None,
) -> Path:
    """Write a version's arrays, its item index (``with_index``) and manifest into a temp dir, then publish it.

    ``manifest`` gains ``index`` and ``files``. On an error the temp dir is removed; on a kill it stays
    hidden until the next export removes it. A failed write (``OSError``: full disk, quota, permissions)
    raises :class:`StoreError` naming the store, the version and the file; ``LATEST`` is left as it was.
    """
    version = manifest["version"]
    try:
        return _write_and_publish(root, sides, features, manifest, with_index=with_index, index_factory=index_factory)
    except OSError as exc:  # a full disk, a quota, a read-only store: nothing half-written is published
        where = f" ({Path(exc.filename).name})" if exc.filename else ""
        reason = exc.strerror or str(exc)
        latest = latest_version(root)
        raise StoreError(
            f"{root}: could not write version {version_name(version)}{where}: {reason}; "
            + (f"{LATEST_FILE} still names {version_name(latest)}" if latest is not None else "nothing was published")
        ) from exc


def _write_and_publish(
    root: Path,
    sides: dict[str, dict[str, np.ndarray]],
    features: dict[str, np.ndarray],
    manifest: dict,
    *,
    with_index: bool,
    index_factory: str | None,
) -> Path:
    version = manifest["version"]
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{version_name(version)}-", dir=root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; a published version is for every reader
        for side, arrays in sides.items():
            for key, array in arrays.items():
                _save_array(tmp, ARRAY_NAMES[side][key], array)
        for name, array in features.items():
            _save_array(tmp, name, array)
        manifest["index"] = None
        if with_index and len(sides["item"]["ids"]):
            item_index = build_index(sides["item"]["vectors"], sides["item"]["ids"], factory=index_factory)
            save_index(item_index, tmp)
            manifest["index"] = {"file": INDEX_FILE, "meta": INDEX_META_FILE, **vars(item_index.meta)}
        manifest["files"] = _file_entries(tmp)
        atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True))
        return _publish(root, tmp, version)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def apply_retention(store_root: str | Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` versions, never ``LATEST``; returns the deleted versions."""
    if keep < 1:
        raise ValueError(f"retention must keep at least 1 version, got {keep}")
    root = Path(store_root)
    latest = latest_version(root)
    doomed = [v for v in list_versions(root)[:-keep] if v != latest]
    for v in doomed:
        trash = root / f".trash-{version_name(v)}"
        os.rename(root / version_name(v), trash)
        shutil.rmtree(trash)
    if doomed:
        fsync_dir(root)
    return doomed


def _base_manifest(teacher: TrainedModel, dataset_dir: Path, splits: tuple[str, ...]) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "teacher": {
            "checkpoint": str(teacher.path.resolve()),
            "checkpoint_sha256": sha256_file(teacher.path),
            "mlflow_run_id": checkpoint_run_id(teacher.path),
            "arch": teacher.arch,
            "flavor": teacher.flavor,
        },
        "source": {"dataset": str(dataset_dir), "splits": list(splits), "schema_sha256": sha256_file(dataset_dir / SCHEMA_FILE)},
        "max_len": teacher.max_len,
    }


def _check_parent(parent: EmbeddingStore, manifest: dict) -> None:
    """An incremental refresh may only reuse vectors computed by the same model on the same inputs."""
    for key, now, then in (
        ("checkpoint sha256", manifest["teacher"]["checkpoint_sha256"], parent.manifest["teacher"]["checkpoint_sha256"]),
        ("max_len", manifest["max_len"], parent.manifest["max_len"]),
    ):
        if now != then:
            raise StoreError(f"{parent.path}: {key} {then!r} differs from this export's {now!r}; run a full export")


def export_embeddings(
    teacher: TrainedModel,
    dataset_dir: str | Path,
    store_root: str | Path,
    *,
    splits: tuple[str, ...] = ("train", "valid", "test"),
    since: int | None = None,
    retention: int | None = None,
    tracking_uri: str | None = None,
    index_factory: str | None = None,
    build_retrieval_index: bool = True,
    batch_size: int | None = None,
    device: str | None = None,
    feature_history_len: int = FEATURE_HISTORY_LEN,
    progress: bool = False,
) -> dict:
    """Compute and publish a new store version of ``teacher``'s vectors (module doc); ``since`` makes it an
    incremental refresh. The model runs on ``device`` (default: CUDA when available), ``batch_size`` rows at a
    time (default: its training batch size); ``progress`` shows a bar per side.

    Returns ``{"version", "path", "parent", "mode", "users", "items", "users_recomputed",
    "users_copied", "items_recomputed", "items_copied", "deleted", "seconds" (per phase), "manifest"}``
    (+ ``"run_id"`` with
    ``tracking_uri``).
    """
    dataset_dir, root = Path(dataset_dir).resolve(), Path(store_root)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    teacher.model.to(device)
    batch_size = batch_size or teacher.batch_size
    manifest = _base_manifest(teacher, dataset_dir, tuple(splits))
    with _writer_lock(root):
        _remove_leftovers(root)
        parent = open_store(root, since) if since is not None else None
        if parent is not None:
            _check_parent(parent, manifest)
        version = max(list_versions(root), default=0) + 1
        t0 = time.perf_counter()
        latest = select_latest(dataset_dir, tuple(splits), teacher.schema)
        t1 = time.perf_counter()
        sides = {side: refresh_side(teacher, latest, side, parent, version, batch_size, device, progress) for side in SIDES}
        t2 = time.perf_counter()
        manifest.update(
            version=version,
            parent=since,
            mode="incremental" if since is not None else "full",
            created_at=datetime.now(timezone.utc).isoformat(),
            dims={side: int(sides[side][0]["vectors"].shape[1]) for side in SIDES},
            rows={side: len(latest.ids(side)) for side in SIDES},
            refresh={f"{side}s_{k}": v for side in SIDES for k, v in sides[side][1].items()},
        )
        features = {k: v for side in SIDES for k, v in feature_arrays(latest.blocks[side], teacher.schema, side,
                                                                       feature_history_len).items()}
        manifest["features"] = {"history_len": feature_history_len, "dense_dim": teacher.schema.dense_dim,
                                **{side: [f.name for f in teacher.schema.sparse if f.side == side] for side in SIDES}}
        arrays = {side: side_arrays for side, (side_arrays, _, _) in sides.items()}
        path = _write_version(
            root, arrays, features, manifest, with_index=build_retrieval_index, index_factory=index_factory
        )
        deleted = apply_retention(root, retention) if retention is not None else []
    # Wall seconds per phase; "model" (the forward passes over changed rows) is the one that scales with the
    # changes, "select" (id scan, reading latest rows) and "fingerprint" (hashing every entity's inputs) do not.
    model = sum(seconds for _, _, seconds in sides.values())
    seconds = {"select": t1 - t0, "fingerprint": t2 - t1 - model, "model": model, "write": time.perf_counter() - t2}
    report = {"version": version, "path": str(path), "parent": since, "mode": manifest["mode"],
              "users": manifest["rows"]["user"], "items": manifest["rows"]["item"], **manifest["refresh"],
              "deleted": deleted, "seconds": seconds, "manifest": manifest}
    if tracking_uri:
        report["run_id"] = log_to_mlflow(report, tracking_uri)
    return report


def log_to_mlflow(report: dict, tracking_uri: str, experiment: str = "gem") -> str:
    """Record a published version as an MLflow run; tags carry lineage (teacher run, checkpoint, version)."""
    manifest = report["manifest"]
    return log_lineage_run(
        stage="export",
        run_name=f"export-{version_name(report['version'])}",
        teacher=manifest["teacher"],
        tracking_uri=tracking_uri,
        experiment=experiment,
        tags={"export_version": report["version"],
              "export_parent": "" if report["parent"] is None else report["parent"]},
        params={"version": report["version"], "parent": report["parent"], "mode": report["mode"],
                "store": str(Path(report["path"]).parent), "splits": ",".join(manifest["source"]["splits"])},
        metrics={k: report[k] for k in ("users", "items", "users_recomputed", "users_copied", "items_recomputed",
                                        "items_copied")},
        documents={MANIFEST_FILE: manifest},
    )
