"""Bad data at the edges (issue 19): flipped bits in shards, broken schema.json, runs with nothing to
train on, enormous ids and lines in converter input. Each case does the bad thing and checks the exit
code, a one-line message naming the file/row/field (<= 500 characters) and that nothing valid was lost."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch  # noqa: F401  (imported here, its log handler binds to the real stderr, not a test's capture)
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from foundation.data.converters import convert
from foundation.data.io import (
    CorruptFileError,
    checksum_path,
    iter_valid_row_groups,
    list_shards,
    open_shard,
    shard_path,
    write_checksum,
    write_table,
)
from foundation.data.schema import EventSchema, SchemaError
from gem.cli import main
from tests.events import SCHEMA, make_events, write_dataset

REPO = Path(__file__).resolve().parents[1]
MAX_MESSAGE = 500


def gem_process(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m gem.cli ARGS`` as a user runs it: the real exit code and stderr."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "gem.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def error_line(stderr: str) -> str:
    """The one ``gem: error:`` line of a refused command (no traceback, nothing else on stderr that says error)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("gem: error: ")]
    assert len(lines) == 1, stderr[-3000:]
    assert len(lines[0]) <= MAX_MESSAGE + len("gem: error: "), len(lines[0])
    return lines[0]


def train_args(dataset: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--flavor",
        "debug",
        f"data.path={dataset}",
        "data.batch_size=32",
        "data.max_len=8",
        "train.max_steps=2",
        f"train.out_dir={out}",
        f"train.tracking_uri=sqlite:///{out}/mlflow.db",
        "train.progress_bar=false",
        *extra,
    ]


def flip_bit(path: Path, offset: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def page_offsets(path: Path, column: str) -> range:
    """Byte range of ``column``'s pages in row group 0 (page headers included)."""
    meta = pq.ParquetFile(path).metadata.row_group(0)
    chunk = meta.column(pq.ParquetFile(path).schema_arrow.get_field_index(column))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    return range(start, start + chunk.total_compressed_size)


def silent_flip(path: Path, column: str = "history_item_ids") -> tuple[int, int]:
    """A bit of ``column``'s pages whose flip a reader without checksums reads as different data, no error:
    the corruption issue 19 found. Returns ``(offset, bit)``; the file is left unchanged."""
    original, table = path.read_bytes(), pq.read_table(path)
    pages = page_offsets(path, column)
    for offset in range(pages.start + len(pages) // 2, pages.stop):
        for bit in range(8):
            flip_bit(path, offset, bit)
            try:
                changed = not pq.read_table(path).equals(table)
            except (OSError, pa.ArrowException):
                changed = False
            path.write_bytes(original)
            if changed:
                return offset, bit
    raise AssertionError(f"{path}: no silent flip in {column}'s pages")


@pytest.fixture
def dataset(tmp_path) -> Path:
    return write_dataset(tmp_path / "data", rows={"train": 256, "valid": 64, "test": 64}, row_group_size=64)


def test_a_flipped_bit_in_a_shard_stops_training_naming_the_shard(dataset, tmp_path):
    shard = shard_path(dataset, "train", 1)
    offset, bit = silent_flip(shard)
    others = {p: p.read_bytes() for p in dataset.rglob("*") if p.is_file() and p != shard}
    flip_bit(shard, offset, bit)
    run = gem_process(*train_args(dataset, tmp_path / "runs"), cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    line = error_line(run.stderr)
    assert str(shard) in line and "checksum mismatch" in line
    assert not (tmp_path / "runs" / "debug" / "checkpoints" / "last.ckpt").exists()
    # Nothing valid was lost: every other file is byte-identical and still opens verified.
    assert all(p.read_bytes() == data for p, data in others.items())
    for split in ("train", "valid", "test"):
        for other in list_shards(dataset, split):
            if other != shard:
                open_shard(other, SCHEMA)


def test_every_flipped_bit_is_refused_and_page_crcs_catch_flips_the_sidecar_cannot(tmp_path):
    """Random flips anywhere are refused by the sha256 sidecar. A flip that happened before the sidecar was
    written (then adopted), and that a reader without checksums reads as silently different data, is still
    caught by the page CRCs when its page is read."""
    table = make_events(200, seed=3, max_hist=30)
    path = tmp_path / "train" / "part-00000.parquet"
    write_table(table, path, row_group_size=50)
    original = path.read_bytes()
    rng = np.random.default_rng(0)
    for offset, bit in zip(rng.integers(4, len(original) - 8, 40), rng.integers(0, 8, 40), strict=True):
        flip_bit(path, int(offset), int(bit))
        with pytest.raises(CorruptFileError, match="checksum mismatch"):
            list(iter_valid_row_groups(path, SCHEMA))
        path.write_bytes(original)
    silent = 0
    for column in ("history_item_ids", "dense", "user_id"):
        for offset in page_offsets(path, column)[::7]:
            flip_bit(path, offset, 3)
            try:
                misread = not pq.read_table(path).equals(table)
            except (OSError, pa.ArrowException):
                misread = False  # a reader without checksums fails too: not the silent case
            if misread:
                silent += 1
                write_checksum(path)  # the corruption predates the checksum
                with pytest.raises(CorruptFileError, match="row group 0 is unreadable"):
                    list(iter_valid_row_groups(path, SCHEMA))
            path.write_bytes(original)
    write_checksum(path)
    assert silent >= 50
    assert pa.concat_tables(t for _, t in iter_valid_row_groups(path, SCHEMA)).equals(table)


def test_a_flip_after_verification_with_the_mtime_restored_is_caught_by_page_crcs(tmp_path):
    path = tmp_path / "train" / "part-00000.parquet"
    write_table(make_events(100, seed=4, max_hist=30), path, row_group_size=100)
    open_shard(path, SCHEMA)  # hashed once; later opens in this process trust size + mtime + inode
    stat = path.stat()
    offset, bit = silent_flip(path)
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.seek(offset)
        byte = f.read(1)[0] ^ (1 << bit)
        f.seek(offset)
        f.write(bytes([byte]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(CorruptFileError, match=f"{path}: row group 0 is unreadable"):
        list(iter_valid_row_groups(path, SCHEMA))


def test_a_split_directory_still_reads_as_one_parquet_dataset(dataset):
    """Sidecars are dot-files, which pyarrow (and pandas, Spark) skip when reading a directory."""
    assert checksum_path(shard_path(dataset, "train", 0)).is_file()
    assert pq.read_table(dataset / "train").num_rows == 256


def test_shards_without_checksums_are_refused_until_adopted(dataset, tmp_path, capsys):
    shard = shard_path(dataset, "train", 0)
    checksum_path(shard).unlink()
    assert main(train_args(dataset, tmp_path / "runs")) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{shard}: no checksum" in line and "gem data checksum" in line
    assert main(["data", "checksum", str(dataset)]) == 0
    assert json.loads(capsys.readouterr().out) == {"adopted": 1, "verified": 5}
    assert main(train_args(dataset, tmp_path / "runs")) == 0


def test_adopting_a_corrupt_shard_is_refused(dataset, capsys):
    shard = shard_path(dataset, "train", 0)
    checksum_path(shard).unlink()
    pages = page_offsets(shard, "history_item_ids")
    flip_bit(shard, pages.start + len(pages) // 2, 5)
    assert main(["data", "checksum", str(dataset)]) == 2
    assert f"{shard}: row group 0 is unreadable" in error_line(capsys.readouterr().err)
    assert not checksum_path(shard).exists()


SCHEMA_CASES = {
    "garbled": (lambda text: text[: len(text) // 2] + "\x00{{", "not valid JSON"),
    "unknown key": (lambda text: json.dumps({**json.loads(text), "colour": "red"}), "unknown field 'colour'"),
    "wrong type": (lambda text: json.dumps({**json.loads(text), "num_items": "lots"}), "field num_items: expected a positive integer, got 'lots'"),
    "bad feature": (
        lambda text: json.dumps({**json.loads(text), "sparse": [{"name": "age", "cardinality": -3}]}),
        "sparse[0]: field cardinality",
    ),
    "huge number": (lambda text: text.replace('"num_items": 40', '"num_items": ' + "9" * 5000), "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_a_broken_schema_json_is_one_line_naming_the_file_and_field(case, dataset, tmp_path, capsys):
    corrupt, expected = SCHEMA_CASES[case]
    path = dataset / "schema.json"
    path.write_text(corrupt(path.read_text()))
    with pytest.raises(SchemaError, match=re.escape(expected)):
        EventSchema.load(dataset)
    assert main(train_args(dataset, tmp_path / "runs")) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"gem: error: {path}: ") and expected in line


def test_no_usable_training_rows_is_an_error_not_an_untrained_success(dataset, tmp_path, capsys):
    schema = json.loads((dataset / "schema.json").read_text())
    # Cardinalities smaller than the data: no row of this dataset fits them all.
    (dataset / "schema.json").write_text(json.dumps({**schema, "num_users": 1, "num_items": 1, "num_domains": 1}))
    out = tmp_path / "runs"
    assert main(train_args(dataset, out, "data.policy=error")) == 2
    line = error_line(capsys.readouterr().err)
    assert re.search(r"/train/part-0000[01]\.parquet: row \d+: field user_id: id out of range", line), line
    assert main(train_args(dataset, out, "data.policy=quarantine")) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{dataset / 'train'}: training ran 0 steps: the split has 256 rows" in line and "no checkpoint" in line
    assert not (out / "debug" / "checkpoints" / "last.ckpt").exists()
    quarantined = pa.concat_tables(pq.read_table(p) for p in sorted((dataset / "quarantine").glob("train-*.parquet")))
    assert quarantined.num_rows == 256 and quarantined.column("reason").null_count == 0  # every row kept, with its reason


def test_an_empty_train_split_is_an_error(tmp_path, capsys):
    data = tmp_path / "data"
    SCHEMA.save(data)
    write_table(SCHEMA.arrow_schema().empty_table(), shard_path(data, "train", 0))
    write_table(make_events(64, seed=1), shard_path(data, "valid", 0))
    assert main(train_args(data, tmp_path / "runs")) == 2
    assert "training ran 0 steps: the split has 0 rows" in error_line(capsys.readouterr().err)


def sasrec_lines(bad: str) -> str:
    good = "".join(f"{u} {i}\n" for u in (1, 2) for i in (3, 4, 5, 6))
    return good[: good.index("2 ")] + bad + "\n" + good[good.index("2 ") :]


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ("9" * 10_000_000 + " 5", "line 5: field user: 9999"),
        ("x" * 10_000_000, "line 5: field count: expected 2 fields"),
        ("1 " + "7" * 5_000, "line 5: field item: 7777"),
    ],
    ids=["ten-million-digit id", "ten-megabyte line", "five-thousand-digit item"],
)
def test_converter_refuses_enormous_ids_and_lines_in_one_short_line(bad, expected, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text(sasrec_lines(bad))
    run = gem_process("data", "convert", "--format", "sasrec", "--input", str(src), "--out", str(tmp_path / "ds"), cwd=tmp_path)
    assert run.returncode == 2
    line = error_line(run.stderr)
    assert f"{src}: {expected}" in line and "characters)" in line
    assert not (tmp_path / "ds").exists()

    stats = convert("sasrec", src, tmp_path / "ds", policy="quarantine")
    assert stats["bad_lines"] == 1 and stats["users"] == 2 and stats["interactions"] == 8
    (kept,) = pq.read_table(tmp_path / "ds" / "quarantine" / "in.parquet").to_pylist()
    assert kept["line"] == 5 and kept["text"] == bad  # quarantined whole: nothing lost

