"""Flipped bits in a real Parquet shard: what a reader without checksums, the page CRCs and the sha256
sidecar each make of them (issue 19; the table in ``docs/reliability.md``).

A synthetic-world shard is written by :func:`foundation.data.io.write_table` (zstd, CRC32 page checksums,
``.sha256`` sidecar). Then one bit at a time is flipped, every ``--stride``-th byte of the file (bit
``offset % 8``), and the file is read three ways:

- ``plain``: ``pyarrow.parquet.read_table`` with no checksum verification, as the project read shards before;
- ``page_crc``: ``ParquetFile(page_checksum_verification=True)``, the page CRCs alone;
- ``sha256``: :func:`foundation.data.io.verify_checksum`, the sidecar.

Each read is counted as ``error`` (refused), ``same`` (the flip changed nothing read, e.g. a statistics
byte) or ``silent`` (different data, no error: the failure issue 19 found).

    python -m experiments.fault_bitflips --examples 500 --max-history 16 --stride 1 --json bitflips.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from foundation.data.io import atomic_write_text, shard_path, verify_checksum
from foundation.data.synthetic import generate_world
from gem.flavors import synth_preset

READERS = ("plain", "page_crc", "sha256")


def read_outcome(path: Path, reader: str, table: pa.Table) -> str:
    """``error``, ``same`` or ``silent`` for one read of ``path`` by ``reader``."""
    try:
        if reader == "sha256":
            verify_checksum(path)
            return "same"  # the bytes match their sidecar
        got = pq.ParquetFile(path, page_checksum_verification=reader == "page_crc").read()
    except (OSError, pa.ArrowException, ValueError):  # ValueError: CorruptFileError, a name that is not UTF-8
        return "error"
    return "same" if got.equals(table) else "silent"


def flip_every(path: Path, stride: int) -> dict[str, dict[str, int]]:
    """Counts per reader and outcome over flips of every ``stride``-th byte of ``path`` (restored after each)."""
    original = path.read_bytes()
    table = pq.read_table(path)
    counts = {reader: dict.fromkeys(("error", "same", "silent"), 0) for reader in READERS}
    for offset in range(0, len(original), stride):
        data = bytearray(original)
        data[offset] ^= 1 << (offset % 8)
        path.write_bytes(bytes(data))
        for reader in READERS:
            counts[reader][read_outcome(path, reader, table)] += 1
    path.write_bytes(original)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="rows of the synthetic world (debug preset)")
    parser.add_argument("--max-history", type=int, default=16, help="history events kept per row")
    parser.add_argument("--stride", type=int, default=3, help="flip one bit of every N-th byte")
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = synth_preset(
            "debug", num_examples=args.examples, rows_per_shard=args.examples, max_history=args.max_history
        )
        generate_world(cfg, tmp, progress=False)
        shard = shard_path(tmp, "train", 0)
        result = {"bytes": shard.stat().st_size, "flips": -(-shard.stat().st_size // args.stride),
                  "stride": args.stride, "examples": args.examples, "max_history": args.max_history,
                  "counts": flip_every(shard, args.stride)}
    print(json.dumps(result, indent=2))
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
