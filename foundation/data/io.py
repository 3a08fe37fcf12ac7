"""Parquet I/O for event datasets: atomic writes, checked opens, and record validation at the edge.

Layout of a dataset directory::

    schema.json
    train/part-00000.parquet ...
    train/.part-00000.parquet.sha256 ... (the shard's sha256, ``sha256sum`` format; hidden, so that
                                          pyarrow, pandas and Spark read a split directory as before)
    valid/...
    test/...
    quarantine/<split>-<shard>.parquet   (bad rows with a reason, under the quarantine policy)

Checksums: every Parquet file written here carries CRC32 page checksums and a ``.sha256`` sidecar.
A shard is opened only after its bytes match the sidecar (hashed once per process while its size and
mtime are unchanged), and its pages are CRC-checked at every read, so a flipped bit is refused with
the file named instead of read as different data. Shards written by another tool get sidecars from
:func:`adopt_shards` (``gem data checksum``), which first reads every page.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from foundation.data.schema import EventSchema
from foundation.data.validate import DataValidationError, find_bad_rows
from foundation.messages import clip

POLICIES = ("error", "quarantine")
CHECKSUM_SUFFIX = ".sha256"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside ``path`` to write; on a clean exit, fsync it and rename it over ``path``.

    Readers see the old file or the whole new one, never a part; on an error the temp file is removed
    and ``path`` is untouched. Every file this project writes goes through here.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def checksum_path(path: str | Path) -> Path:
    """The sidecar of a Parquet file, ``.<name>.sha256``: dataset readers skip names that start with a dot."""
    path = Path(path)
    return path.with_name(f".{path.name}{CHECKSUM_SUFFIX}")


def write_checksum(path: str | Path) -> str:
    """Hash ``path`` and write its sidecar atomically, in ``sha256sum`` format; returns the hex digest."""
    digest = sha256_file(path)
    atomic_write_text(checksum_path(path), f"{digest}  {Path(path).name}\n")
    return digest


def write_table(table: pa.Table, path: str | Path, *, row_group_size: int = 8192) -> Path:
    """Atomically write one Parquet shard with page CRCs (see :func:`atomic_path`), then its sidecar."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, row_group_size=row_group_size, compression="zstd", write_page_checksum=True)
    write_checksum(path)
    return Path(path)


def shard_path(dataset_dir: str | Path, split: str, shard: int) -> Path:
    return Path(dataset_dir) / split / f"part-{shard:05d}.parquet"


def list_shards(dataset_dir: str | Path, split: str) -> list[Path]:
    split_dir = Path(dataset_dir) / split
    if not split_dir.is_dir():
        raise FileNotFoundError(f"{split_dir}: split {split!r} not found in dataset {dataset_dir}")
    shards = sorted(split_dir.glob("*.parquet"))
    if not shards:
        raise FileNotFoundError(f"{split_dir}: no Parquet shards")
    return shards


class CorruptFileError(ValueError):
    """A file that cannot be read: truncated, not Parquet, damaged, or not matching its checksum."""


_verified: dict[Path, tuple[int, int, int]] = {}
_verified_lock = threading.Lock()


def _stat_key(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def verify_checksum(path: str | Path) -> None:
    """Check ``path`` against its ``.sha256`` sidecar; raise :class:`CorruptFileError` naming it.

    A file is hashed once per process while its size, mtime and inode stay the same (page CRCs guard
    each later read).
    """
    path = Path(path).resolve()
    key = _stat_key(path)
    with _verified_lock:
        if _verified.get(path) == key:
            return
    sidecar = checksum_path(path)
    if not sidecar.is_file():
        raise CorruptFileError(
            f"{path}: no checksum ({sidecar.name} missing); write the dataset with `gem data`, or run "
            f"`gem data checksum {path.parent.parent}` to adopt shards written by another tool"
        )
    recorded = sidecar.read_text().split(maxsplit=1)[0] if sidecar.stat().st_size else ""
    actual = sha256_file(path)
    if actual != recorded:
        raise CorruptFileError(
            f"{path}: checksum mismatch (sha256 {actual[:12]}…, {sidecar.name} says {recorded[:12]}…): "
            "the file is corrupt, truncated or was modified"
        )
    with _verified_lock:
        _verified[path] = key


def open_parquet(path: str | Path) -> pq.ParquetFile:
    """Open a Parquet file whose page CRCs are checked at every read; raise naming it if it is unreadable."""
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
        pf.schema_arrow  # noqa: B018  (decodes the footer's names: a damaged one raises here, not later)
        return pf
    except (pa.ArrowException, OSError, ValueError) as exc:  # ValueError: a name that is not UTF-8
        raise CorruptFileError(f"{path}: not a readable Parquet file (truncated or corrupt?): {clip(str(exc))}") from None


def open_shard(path: str | Path, schema: EventSchema, *, verify_sha256: bool = True) -> pq.ParquetFile:
    """Open a shard after checking its sha256, and check its columns and types against ``schema``.

    ``verify_sha256=False`` skips the sidecar (page CRCs are still checked at every read), for datasets too
    large to hash at every start. Raises :class:`CorruptFileError` or :class:`DataValidationError` naming the
    file and what is wrong.
    """
    path = Path(path)
    if verify_sha256:
        verify_checksum(path)
    pf = open_parquet(path)
    check_columns(pf.schema_arrow, schema, where=str(path))
    return pf


def adopt_shards(dataset_dir: str | Path) -> dict[str, int]:
    """Give every shard of ``dataset_dir`` without a sidecar one, after reading all its pages (and CRCs).

    For datasets written by another tool (or before shards had checksums). A shard that already has a
    sidecar is verified against it, never rewritten. Returns ``{"adopted", "verified"}`` counts.
    """
    dataset_dir = Path(dataset_dir)
    schema = EventSchema.load(dataset_dir)
    counts = {"adopted": 0, "verified": 0}
    for split_dir in sorted(p for p in dataset_dir.iterdir() if p.is_dir() and p.name != "quarantine"):
        for shard in sorted(split_dir.glob("*.parquet")):
            if checksum_path(shard).is_file():
                verify_checksum(shard)
                counts["verified"] += 1
                continue
            pf = open_parquet(shard)
            check_columns(pf.schema_arrow, schema, where=str(shard))
            for rg in range(pf.num_row_groups):
                read_row_group(pf, rg, where=str(shard))
            write_checksum(shard)
            counts["adopted"] += 1
    return counts


def check_columns(actual: pa.Schema, schema: EventSchema, *, where: str) -> None:
    expected = schema.arrow_schema()
    missing = [n for n in expected.names if n not in actual.names]
    extra = [n for n in actual.names if n not in expected.names]
    if missing or extra:
        raise DataValidationError(f"{where}: columns do not match the schema: missing {missing}, unexpected {extra}")
    for f in expected:
        got = actual.field(f.name).type
        if got != f.type:
            raise DataValidationError(f"{where}: column {f.name!r} has type {got}, expected {f.type}")


def read_row_group(pf: pq.ParquetFile, index: int, *, where: str) -> pa.Table:
    try:
        return pf.read_row_group(index)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CorruptFileError(f"{where}: row group {index} is unreadable (truncated or corrupt?): {clip(str(exc))}") from None


@dataclass
class QuarantineLog:
    """Counts bad rows and writes them, with their reason, under ``<dataset>/quarantine/``."""

    dataset_dir: Path
    count: int = 0

    def add(self, bad: pa.Table, source: Path, row_group: int) -> None:
        self.count += bad.num_rows
        out = self.dataset_dir / "quarantine" / f"{source.parent.name}-{source.stem}-rg{row_group:05d}.parquet"
        write_table(bad, out)


def iter_valid_row_groups(
    shard: Path,
    schema: EventSchema,
    *,
    policy: str = "error",
    quarantine: QuarantineLog | None = None,
    row_groups: list[int] | None = None,
    verify_sha256: bool = True,
) -> Iterator[tuple[int, pa.Table]]:
    """Yield ``(row_group_index, table)`` for the shard's row groups with bad rows handled by ``policy``.

    ``error`` raises :class:`DataValidationError` naming the file, the row and the field;
    ``quarantine`` drops bad rows from the yielded table and records them in ``quarantine``.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown bad-record policy {policy!r}; choose one of {POLICIES}")
    pf = open_shard(shard, schema, verify_sha256=verify_sha256)
    first_row = [0]
    for i in range(pf.num_row_groups):
        first_row.append(first_row[-1] + pf.metadata.row_group(i).num_rows)
    for rg in row_groups if row_groups is not None else range(pf.num_row_groups):
        table = read_row_group(pf, rg, where=str(shard))
        bad_rows, reasons = find_bad_rows(table, schema)
        if len(bad_rows):
            if policy == "error":
                row, reason = int(bad_rows[0]), reasons[0]
                raise DataValidationError(f"{shard}: row {first_row[rg] + row}: {reason}")
            bad = table.take(pa.array(bad_rows)).append_column("reason", pa.array(reasons, pa.string()))
            bad = bad.append_column("source_row", pa.array(bad_rows + first_row[rg], pa.int64()))
            if quarantine is None:
                raise ValueError("policy 'quarantine' needs a QuarantineLog")
            quarantine.add(bad, shard, rg)
            keep = pa.array(sorted(set(range(table.num_rows)) - set(bad_rows.tolist())), pa.int64())
            table = table.take(keep)
        yield rg, table
