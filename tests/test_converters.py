import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from foundation.data.converters import FORMATS, convert
from foundation.data.io import list_shards, open_shard
from foundation.data.schema import EventSchema
from foundation.data.validate import DataValidationError, find_bad_rows

# (user, item, rating, timestamp) in file order. User 1 is out of time order with a tie at 200
# (30 before 40 in the file); user 2 has two interactions and is dropped; user 3 is interleaved.
EVENTS = [
    (1, 10, 5, 300),
    (1, 20, 4, 100),
    (3, 7, 3, 50),
    (1, 30, 3, 200),
    (2, 11, 2, 10),
    (1, 40, 3, 200),
    (3, 8, 1, 60),
    (2, 12, 4, 20),
    (1, 50, 1, 400),
    (3, 9, 5, 70),
]
# Time order per user (stable on the timestamp) for the formats without timestamps.
ORDERED = {1: [20, 30, 40, 10, 50], 2: [11, 12], 3: [7, 8, 9]}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def ml_dat(path: Path, events=EVENTS) -> Path:
    return write(path, "".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in events))


def ml_csv(path: Path, events=EVENTS) -> Path:
    return write(path, "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r}.0,{t}\n" for u, i, r, t in events))


def sasrec(path: Path, seqs=ORDERED) -> Path:
    return write(path, "".join(f"{u} {i}\n" for u, items in seqs.items() for i in items))


def seq_tsv(path: Path, seqs=ORDERED) -> Path:
    return write(path, "".join(f"{u}\t{' '.join(map(str, items))}\n" for u, items in seqs.items()))


def read_split(out: Path, split: str) -> dict[int, dict]:
    schema = EventSchema.load(out)
    table = pa.concat_tables([open_shard(p, schema).read() for p in list_shards(out, split)])
    rows, _ = find_bad_rows(table, schema)
    assert len(rows) == 0
    return {r["user_id"]: r for r in table.to_pylist()}


def check_user1(out: Path, timestamps: bool, protocol: str = "hstu") -> None:
    test, valid, train = (read_split(out, s) for s in ("test", "valid", "train"))
    assert set(test) == set(valid) == set(train) == {1, 3}
    ts = [100, 200, 200, 300, 400] if timestamps else [0, 1, 2, 3, 4]
    t = test[1]
    assert t["history_item_ids"] == [20, 30, 40, 10] and t["item_id"] == 50
    assert t["history_timestamps"] == ts[:4] and t["timestamp"] == ts[4]
    assert t["history_actions"] == [1] * 4 and t["history_domains"] == [0] * 4
    assert t["domain"] == 0 and t["click"] == 1 and t["conversion"] is None
    v = valid[1]
    assert v["history_item_ids"] == [20, 30, 40] and v["item_id"] == 10 and v["timestamp"] == ts[3]
    tr = train[1]
    if protocol == "hstu":
        assert tr["history_item_ids"] == [20, 30, 40] and tr["item_id"] == 10
    else:
        assert tr["history_item_ids"] == [20, 30] and tr["item_id"] == 40 and tr["timestamp"] == ts[2]
    assert test[3]["history_item_ids"] == [7, 8] and test[3]["item_id"] == 9
    assert valid[3]["history_item_ids"] == [7] and valid[3]["item_id"] == 8
    ids = [r["example_id"] for split in (train, valid, test) for r in split.values()]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(
    ("fmt", "make", "timestamps"),
    [("movielens-dat", ml_dat, True), ("movielens-csv", ml_csv, True), ("sasrec", sasrec, False), ("seq-tsv", seq_tsv, False)],
)
def test_formats_split_exactly(tmp_path, fmt, make, timestamps):
    src = make(tmp_path / "input.txt")
    stats = convert(fmt, src, tmp_path / "ds", ids="keep")
    assert stats["users"] == 2 and stats["dropped_users"] == 1 and stats["dropped_interactions"] == 2
    assert stats["interactions"] == 8 and stats["items"] == 8 and stats["bad_lines"] == 0
    assert stats["rows"] == {"train": 2, "valid": 2, "test": 2}
    check_user1(tmp_path / "ds", timestamps)
    schema = EventSchema.load(tmp_path / "ds")
    assert schema.task == "next_item" and schema.num_items == 51 and schema.num_users == 4
    assert json.loads((tmp_path / "ds" / "conversion.json").read_text()) == stats


def test_holdout_protocol(tmp_path):
    stats = convert("movielens-dat", ml_dat(tmp_path / "ratings.dat"), tmp_path / "ds", protocol="holdout", ids="keep")
    assert stats["protocol"] == "holdout"
    check_user1(tmp_path / "ds", True, protocol="holdout")


def test_dense_ids_and_id_maps(tmp_path):
    seqs = {900: [10**12, 5, 10**12, 77], 4: [77, 5, 3]}
    stats = convert("seq-tsv", seq_tsv(tmp_path / "s.tsv", seqs), tmp_path / "ds")
    assert stats["item_ids"] == "dense" and stats["user_ids"] == "dense"
    items = pq.read_table(tmp_path / "ds" / "item_ids.parquet").to_pydict()
    assert items == {"raw_id": [3, 5, 77, 10**12], "id": [1, 2, 3, 4], "interactions": [1, 2, 2, 2]}
    users = pq.read_table(tmp_path / "ds" / "user_ids.parquet").to_pydict()
    assert users["raw_id"] == [4, 900] and users["id"] == [1, 2]
    test = read_split(tmp_path / "ds", "test")
    assert test[2]["history_item_ids"] == [4, 2, 4] and test[2]["item_id"] == 3
    assert test[1]["history_item_ids"] == [3, 2] and test[1]["item_id"] == 1
    assert EventSchema.load(tmp_path / "ds").num_items == 5

    stats = convert("seq-tsv", tmp_path / "s.tsv", tmp_path / "kept", ids="keep")
    assert stats["item_ids"] == "keep" and stats["num_items"] == 10**12 + 1


def test_shards(tmp_path):
    seqs = {u: [u, u + 1, u + 2, u + 3] for u in range(1, 8)}
    stats = convert("sasrec", sasrec(tmp_path / "x.txt", seqs), tmp_path / "ds", rows_per_shard=3)
    assert stats["shards"] == {"train": 3, "valid": 3, "test": 3}
    assert [p.name for p in list_shards(tmp_path / "ds", "test")] == [f"part-0000{i}.parquet" for i in range(3)]
    test = read_split(tmp_path / "ds", "test")
    assert {u: r["history_item_ids"] + [r["item_id"]] for u, r in test.items()} == seqs


BAD_LINES = [
    ("movielens-dat", "1::2::3\n", "line 2", "count"),
    ("movielens-dat", "1::x::3::4\n", "line 2", "MovieID"),
    ("movielens-dat", "-1::2::3::4\n", "line 2", "UserID"),
    ("movielens-dat", "1::2::good::4\n", "line 2", "Rating"),
    ("movielens-dat", "1::2::3::-4\n", "line 2", "Timestamp"),
    ("movielens-dat", "1::2::nan::4\n", "line 2", "Rating"),
    ("movielens-csv", "1,2.5,3,4\n", "line 3", "movieId"),
    ("sasrec", "1 2 3\n", "line 2", "count"),
    ("sasrec", "1 -2\n", "line 2", "item"),
    ("seq-tsv", "7\t1 2 x 4\n", "line 2", "item 3"),
    ("seq-tsv", "7 1 2 3\n", "line 2", "count"),
    ("seq-tsv", "1\t4 5 6\n", "line 2", "already has a sequence on line 1"),
    ("seq-tsv", "8\t1 99999999999999999999\n", "line 2", "int64"),
]
GOOD_FIRST = {
    "movielens-dat": "1::10::5::1\n",
    "movielens-csv": "userId,movieId,rating,timestamp\n1,10,5,1\n",
    "sasrec": "1 10\n",
    "seq-tsv": "1\t10 20 30\n",
}
GOOD_REST = {
    "movielens-dat": "1::20::5::2\n1::30::5::3\n",
    "movielens-csv": "1,20,5,2\n1,30,5,3\n",
    "sasrec": "1 20\n1 30\n",
    "seq-tsv": "2\t5 6 7\n",
}


@pytest.mark.parametrize(("fmt", "bad", "where", "field"), BAD_LINES)
def test_malformed_line_error(tmp_path, fmt, bad, where, field):
    src = write(tmp_path / "in.txt", GOOD_FIRST[fmt] + bad + GOOD_REST[fmt])
    with pytest.raises(DataValidationError) as info:
        convert(fmt, src, tmp_path / "ds")
    message = str(info.value)
    assert str(src) in message and where in message and field in message
    assert not (tmp_path / "ds").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in.txt"]  # no temporary directory left behind


@pytest.mark.parametrize(("fmt", "bad", "where", "field"), BAD_LINES)
def test_malformed_line_quarantine(tmp_path, fmt, bad, where, field):
    src = write(tmp_path / "in.txt", GOOD_FIRST[fmt] + bad + GOOD_REST[fmt])
    stats = convert(fmt, src, tmp_path / "ds", policy="quarantine", ids="keep")
    assert stats["bad_lines"] == 1
    assert stats["users"] == (2 if fmt == "seq-tsv" else 1)
    q = pq.read_table(tmp_path / "ds" / "quarantine" / "in.parquet").to_pylist()
    assert len(q) == 1 and f"line {q[0]['line']}" == where
    assert field in q[0]["field"] + ": " + q[0]["reason"]
    assert q[0]["text"] == bad.rstrip("\n")
    assert read_split(tmp_path / "ds", "test")[1]["history_item_ids"] == [10, 20]


def test_file_level_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.dat"):
        convert("movielens-dat", tmp_path / "nope.dat", tmp_path / "ds")
    with pytest.raises(DataValidationError, match="header"):
        convert("movielens-csv", write(tmp_path / "r.csv", "1,2,3,4\n"), tmp_path / "ds")
    with pytest.raises(DataValidationError, match="at least 3"):
        convert("sasrec", write(tmp_path / "s.txt", "1 2\n1 3\n"), tmp_path / "ds")
    with pytest.raises(ValueError, match="fmt"):
        convert("parquet", tmp_path / "s.txt", tmp_path / "ds")
    with pytest.raises(ValueError, match="policy"):
        convert("sasrec", tmp_path / "s.txt", tmp_path / "ds", policy="ignore")


def test_blank_lines_and_crlf(tmp_path):
    src = write(tmp_path / "r.dat", "\n1::10::5::1\r\n\n1::20::5::2\r\n1::30::5::3\r\n")
    stats = convert("movielens-dat", src, tmp_path / "ds")
    assert stats["interactions"] == 3 and stats["bad_lines"] == 0


def test_existing_output(tmp_path):
    src = seq_tsv(tmp_path / "s.tsv")
    (tmp_path / "ds").mkdir()  # an empty directory is fine
    convert("seq-tsv", src, tmp_path / "ds")
    with pytest.raises(FileExistsError):
        convert("seq-tsv", src, tmp_path / "ds")
    seq_tsv(src, {5: [1, 2, 3, 4]})
    convert("seq-tsv", src, tmp_path / "ds", overwrite=True, ids="keep")
    assert set(read_split(tmp_path / "ds", "test")) == {5}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "s.tsv"]


@pytest.mark.parametrize("name", ["ratings.dat.gz", "ratings.dat"])
def test_gzip_input_by_content(tmp_path, name):
    """Gzip is recognised by its magic bytes, whatever the file is called; the result is the plain file's."""
    plain = ml_dat(tmp_path / "plain.dat")
    src = tmp_path / name
    src.write_bytes(gzip.compress(plain.read_bytes()))
    stats = convert("movielens-dat", src, tmp_path / "ds", ids="keep")
    assert stats["interactions"] == 8 and stats["bad_lines"] == 0
    check_user1(tmp_path / "ds", True)


def test_gzip_bad_line_is_numbered(tmp_path):
    src = tmp_path / "in.txt.gz"
    src.write_bytes(gzip.compress(b"1::10::5::1\n1::x::5::2\n"))
    with pytest.raises(DataValidationError, match=r"in\.txt\.gz: line 2: field MovieID"):
        convert("movielens-dat", src, tmp_path / "ds")


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_gzip_is_one_line_error(tmp_path, damage):
    data = bytearray(gzip.compress(ml_dat(tmp_path / "plain.dat").read_bytes() * 50))
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    src = tmp_path / "ratings.dat.gz"
    src.write_bytes(bytes(data))
    with pytest.raises(DataValidationError) as info:
        convert("movielens-dat", src, tmp_path / "ds")
    message = str(info.value)
    assert message.startswith(f"{src}: corrupt gzip input after line ") and "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert not (tmp_path / "ds").exists()


def test_ties_rules(tmp_path):
    """User 1 has items 30 and 40 tied at timestamp 200, 30 first in the file."""
    src = ml_dat(tmp_path / "ratings.dat")
    by_file = convert("movielens-dat", src, tmp_path / "file", ids="keep")
    assert by_file["ties"] == "file" and by_file["tied_events"] == 2
    assert read_split(tmp_path / "file", "test")[1]["history_item_ids"] == [20, 30, 40, 10]

    reference = seq_tsv(tmp_path / "ref.tsv", {1: [20, 40, 30, 10, 50], 3: [7, 8, 9], 9: [1, 2, 3]})
    stats = convert("movielens-dat", src, tmp_path / "seq", ids="keep", ties="sequence", ties_reference=reference)
    assert stats["ties_unreferenced"] == 0 and stats["ties_reference"] == str(reference)
    test = read_split(tmp_path / "seq", "test")
    assert test[1]["history_item_ids"] == [20, 40, 30, 10] and test[1]["history_timestamps"] == [100, 200, 200, 300]
    assert test[3]["history_item_ids"] == [7, 8]

    # Ids are descending in the file at the tie, and the reference orders only items it knows.
    events = [(1, 9, 5, 1), (1, 8, 5, 5), (1, 7, 5, 5), (1, 6, 5, 5), (1, 5, 5, 9)]
    src = ml_dat(tmp_path / "tie.dat", events)
    convert("movielens-dat", src, tmp_path / "item", ids="keep", ties="item")
    assert read_split(tmp_path / "item", "test")[1]["history_item_ids"] == [9, 6, 7, 8]
    reference = seq_tsv(tmp_path / "ref2.tsv", {1: [9, 6, 8, 5]})
    stats = convert("movielens-dat", src, tmp_path / "part", ids="keep", ties="sequence", ties_reference=reference)
    assert stats["ties_unreferenced"] == 1
    assert read_split(tmp_path / "part", "test")[1]["history_item_ids"] == [9, 6, 8, 7]


def test_ties_repeated_pairs_follow_occurrences(tmp_path):
    """The k-th event of a repeated (user, item) pair takes the place of its k-th occurrence in the reference."""
    events = [(1, 5, 5, 1), (1, 6, 5, 2), (1, 5, 5, 2), (1, 7, 5, 3)]
    src = ml_dat(tmp_path / "r.dat", events)
    reference = seq_tsv(tmp_path / "ref.tsv", {1: [5, 5, 6, 7]})
    convert("movielens-dat", src, tmp_path / "ds", ids="keep", ties="sequence", ties_reference=reference)
    test = read_split(tmp_path / "ds", "test")[1]
    assert test["history_item_ids"] == [5, 5, 6] and test["item_id"] == 7


def test_ties_bad_arguments(tmp_path):
    src = ml_dat(tmp_path / "ratings.dat")
    with pytest.raises(ValueError, match="ties"):
        convert("movielens-dat", src, tmp_path / "ds", ties="random")
    with pytest.raises(ValueError, match="ties_reference"):
        convert("movielens-dat", src, tmp_path / "ds", ties="sequence")
    with pytest.raises(ValueError, match="ties_reference"):
        convert("movielens-dat", src, tmp_path / "ds", ties_reference=src)
    with pytest.raises(FileNotFoundError, match=r"missing\.tsv"):
        convert("movielens-dat", src, tmp_path / "ds", ties="sequence", ties_reference=tmp_path / "missing.tsv")
    with pytest.raises(ValueError, match="no timestamps"):
        convert("seq-tsv", seq_tsv(tmp_path / "s.tsv"), tmp_path / "ds", ties="item")
    bad_reference = write(tmp_path / "bad.tsv", "1\t20 x\n")
    with pytest.raises(DataValidationError, match=r"bad\.tsv: line 1"):
        convert("movielens-dat", src, tmp_path / "ds", ties="sequence", ties_reference=bad_reference)
    assert not (tmp_path / "ds").exists()


def test_every_format_is_tested():
    assert {fmt for fmt, *_ in BAD_LINES} == set(FORMATS)


def shared_ml1m() -> Path:
    root = os.environ.get("GEM_SHARED_DATA")
    base = Path(root) if root else Path(__file__).resolve().parents[2] / "shared" / "data"
    return base / "ml-1m" / "sequences.tsv"


@pytest.mark.data
@pytest.mark.skipif(not shared_ml1m().is_file(), reason="ML-1M sequences.tsv not present (../shared/data)")
def test_ml1m_sequences(tmp_path):
    stats = convert("seq-tsv", shared_ml1m(), tmp_path / "ml1m")
    assert stats["users"] == 6040 and stats["items"] == 3706 and stats["interactions"] == 1_000_209
    assert stats["dropped_users"] == 0 and stats["bad_lines"] == 0
    assert stats["item_ids"] == "keep" and stats["num_items"] == 3953
    schema = EventSchema.load(tmp_path / "ml1m")
    test = pa.concat_tables([open_shard(p, schema).read() for p in list_shards(tmp_path / "ml1m", "test")])
    assert test.num_rows == 6040
    assert len(find_bad_rows(test, schema)[0]) == 0
    # Every interaction appears exactly once across a test row (history + target).
    assert sum(len(h) for h in test.column("history_item_ids").to_pylist()) + test.num_rows == 1_000_209
    first = test.slice(0, 1).to_pylist()[0]
    line = shared_ml1m().open().readline().split("\t")
    assert first["user_id"] == int(line[0])
    assert first["history_item_ids"] + [first["item_id"]] == [int(x) for x in line[1].split()]


def shared_ratings_subset() -> Path:
    return shared_ml1m().parent / "ratings-users-0001-2999.dat.gz"


@pytest.mark.data
@pytest.mark.skipif(
    not (shared_ml1m().is_file() and shared_ratings_subset().is_file()),
    reason="ML-1M sequences.tsv and ratings-users-0001-2999.dat.gz not present (../shared/data)",
)
def test_ml1m_ratings_subset_follows_sequences(tmp_path):
    """With ties='sequence' the timestamped subset reproduces sequences.tsv's order for its 2,999 users."""
    stats = convert(
        "movielens-dat", shared_ratings_subset(), tmp_path / "ts", ties="sequence", ties_reference=shared_ml1m()
    )
    assert stats["users"] == 2999 and stats["interactions"] == 487_650 and stats["ties_unreferenced"] == 0
    assert stats["tied_events"] > 0
    schema = EventSchema.load(tmp_path / "ts")
    test = pa.concat_tables([open_shard(p, schema).read() for p in list_shards(tmp_path / "ts", "test")])
    expected = {}
    with shared_ml1m().open() as f:
        for line in f:
            user, items = line.split("\t")
            if int(user) <= 2999:
                expected[int(user)] = [int(x) for x in items.split()]
    for row in test.to_pylist():
        assert row["history_item_ids"] + [row["item_id"]] == expected[row["user_id"]]
        assert row["history_timestamps"] == sorted(row["history_timestamps"]) and row["timestamp"] >= row["history_timestamps"][-1]
