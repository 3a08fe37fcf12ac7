"""The embedding store's reader: open a published version, find the latest one, verify its files.

Serving reads the store through this module alone; writing versions is :mod:`transfer.export`'s.

Layout of a store::

    LATEST                 the name of the newest published version, e.g. ``v000003`` (replaced atomically)
    .lock                  held (flock) by the one exporter writing at a time
    v000001/
        manifest.json      version, parent, mode, teacher run id, checkpoint sha256, created_at, dims,
                           row counts, refresh counts, sha256 and size of every other file
        users.npy          float32 [U, d]  user_repr from each user's latest row (max timestamp)
        user_ids.npy       int64 [U], sorted ascending (lookups use searchsorted)
        user_timestamps.npy    int64 [U]   timestamp of the row each vector was computed from
        user_fingerprints.npy  uint64 [U]  hash of that row's user-side model inputs
        user_updated_version.npy int64 [U] the version that computed the vector (freshness)
        items.npy, item_ids.npy, item_timestamps.npy, item_fingerprints.npy, item_updated_version.npy
                           the same for every candidate item (item-side inputs of its latest row)
        items.faiss, index.json    the retrieval index over ``items.npy`` (:mod:`transfer.index`)
        user_feat_{name}_offsets.npy / _values.npy   serving features of the same latest row
        user_history_offsets.npy / _values.npy, user_dense.npy, item_feat_{name}_offsets.npy / _values.npy

Versions are immutable once published, so a reader holding version v keeps reading it while v+1 is
published; :func:`open_store` checks every file of a version against its manifest before use.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from foundation.data.io import sha256_file

if TYPE_CHECKING:
    from transfer.index import ItemIndex

MANIFEST_FILE = "manifest.json"
LATEST_FILE = "LATEST"
FORMAT_VERSION = 1
VERSION_RE = re.compile(r"^v(\d{6})$")
SIDES = ("user", "item")
ARRAY_NAMES = {side: {"vectors": f"{side}s", "ids": f"{side}_ids", "timestamps": f"{side}_timestamps",
                      "fingerprints": f"{side}_fingerprints", "updated_version": f"{side}_updated_version"}
               for side in SIDES}


class StoreError(ValueError):
    """An embedding store or version that cannot be used: missing, corrupt, or incompatible."""


def version_name(version: int) -> str:
    return f"v{version:06d}"


def list_versions(store_root: str | Path) -> list[int]:
    """Published versions, ascending (hidden temp and trash dirs are not versions)."""
    root = Path(store_root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := VERSION_RE.match(p.name)) and p.is_dir())


def latest_version(store_root: str | Path) -> int | None:
    path = Path(store_root) / LATEST_FILE
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if not (m := VERSION_RE.match(text)):
        raise StoreError(f"{path}: not a version name: {text!r}")
    return int(m.group(1))


@dataclass
class EmbeddingStore:
    """One verified store version; arrays are read-only memory maps.

    ``users``/``items`` are ``[U, d]``/``[I, d]`` float32 with ids ``user_ids[U]``/``item_ids[I]``
    (sorted); freshness arrays as in the module doc.
    """

    path: Path
    manifest: dict
    arrays: dict[str, np.ndarray]

    @property
    def version(self) -> int:
        return self.manifest["version"]

    def side(self, side: str, key: str) -> np.ndarray:
        return self.arrays[ARRAY_NAMES[side][key]]

    def rows(self, side: str, ids) -> tuple[np.ndarray, np.ndarray]:
        """``ids[B]`` -> ``(rows[B] int64, found[B] bool)``: each id's row in this version's arrays (0 if unknown)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        known = self.side(side, "ids")
        rows = np.minimum(np.searchsorted(known, ids), max(len(known) - 1, 0))
        found = known[rows] == ids if len(known) else np.zeros(len(ids), bool)
        return rows, found

    def _lookup(self, side: str, ids) -> tuple[np.ndarray, np.ndarray]:
        rows, found = self.rows(side, ids)
        vectors = self.side(side, "vectors")
        out = np.zeros((len(rows), vectors.shape[1]), np.float32)
        out[found] = vectors[rows[found]]
        return out, found

    def lookup_users(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """``ids[B]`` -> ``(vectors[B, d] float32, found[B] bool)``; unknown users get zero vectors."""
        return self._lookup("user", ids)

    def lookup_items(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """``ids[B]`` -> ``(vectors[B, d] float32, found[B] bool)``; unknown items get zero vectors."""
        return self._lookup("item", ids)

    def index(self) -> ItemIndex:
        """The version's retrieval index (verified with the version at open)."""
        if self.manifest.get("index") is None:
            raise StoreError(f"{self.path}: this version was exported without a retrieval index")
        # FAISS is loaded only by readers that retrieve; scoring never needs it.
        from transfer.index import load_index

        return load_index(self.path)


def open_store(store_root: str | Path, version: int | None = None, *, verify: bool = True) -> EmbeddingStore:
    """Open ``version`` (default: ``LATEST``), check every file against the manifest, memory-map the arrays.

    A missing, resized or modified file raises :class:`StoreError` naming it. ``verify=False`` skips the
    sha256 pass (sizes are still checked) for stores too large to hash at every open.
    """
    root = Path(store_root)
    version = latest_version(root) if version is None else version
    if version is None:
        raise StoreError(f"{root}: no {LATEST_FILE}; no version has been published")
    path = root / version_name(version)
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise StoreError(f"{path}: version {version} not found (deleted by retention, or never published)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION or manifest.get("version") != version:
        raise StoreError(f"{manifest_path}: not a format-{FORMAT_VERSION} manifest of version {version}")
    for name, entry in manifest["files"].items():
        _verify_file(path / name, entry, verify)
    arrays = {
        name.removesuffix(".npy"): np.load(path / name, mmap_mode="r", allow_pickle=False)
        for name in manifest["files"]
        if name.endswith(".npy")
    }
    return EmbeddingStore(path, manifest, arrays)


def _verify_file(path: Path, entry: dict, check_sha: bool) -> None:
    """Check ``path`` against its manifest ``entry`` (``bytes``, ``sha256`` when ``check_sha``); raise :class:`StoreError`."""
    if not path.is_file():
        raise StoreError(f"{path}: listed in the manifest but missing")
    if path.stat().st_size != entry["bytes"]:
        raise StoreError(f"{path}: {path.stat().st_size} bytes, manifest says {entry['bytes']}: truncated or modified")
    if check_sha and (actual := sha256_file(path)) != entry["sha256"]:
        raise StoreError(
            f"{path}: checksum mismatch (manifest {entry['sha256'][:12]}…, file {actual[:12]}…): corrupt or modified"
        )
