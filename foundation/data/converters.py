"""Converters from public sequence datasets to the event schema, as a next-item task.

Formats (``fmt`` of :func:`convert`):

- ``movielens-dat``: ``UserID::MovieID::Rating::Timestamp`` (ML-1M / ML-10M ``ratings.dat``);
- ``movielens-csv``: ``ratings.csv`` with the header ``userId,movieId,rating,timestamp`` (ML-20M, ML-25M);
- ``sasrec``: ``user item`` per line, whitespace separated, one interaction per line, lines of one
  user already in time order (SASRec's ``data/*.txt``);
- ``seq-tsv``: ``user<TAB>item item ...`` per line, one line per user, oldest item first.

Input may be gzip-compressed, whatever its name: a file that starts with the gzip magic bytes is
read through ``gzip`` (e.g. ``ratings.dat.gz``); a corrupt or truncated gzip stream raises
:class:`~foundation.data.validate.DataValidationError` naming the file.

Every interaction is a positive (ratings are not thresholded, as in the HSTU/SASRec protocol), so
every row has ``click = 1`` and ``conversion`` null. A user's items ``i_1 .. i_n`` are put in time
order by a sort on the timestamp; formats without timestamps use the position index ``0 .. n-1`` as
the timestamp. Events of one user that share a timestamp are ordered by ``ties`` (:data:`TIE_RULES`):

- ``"file"`` (default): file order (a stable sort);
- ``"sequence"``: the order of a reference sequence file ``ties_reference`` in ``seq-tsv`` format,
  e.g. ML-1M's ``sequences.tsv``, so that a timestamped file reproduces that file's order and
  leave-one-out targets. The ``k``-th event of a (user, item) pair takes the place of the pair's
  ``k``-th occurrence in the reference; events the reference lacks follow the referenced ones of
  their tie, in file order, and are counted (``ties_unreferenced``);
- ``"item"``: ascending item id, a rule that no file order can change.

Only the order inside a tie changes; the statistics count the events that share their user's
timestamp with another (``tied_events``).

Splits (leave-one-out, one row per user and split; ``history`` = ``history_*`` columns, oldest first,
never truncated — the pipeline caps lengths):

========  =====================  ==================  ======================================
split     history                candidate           under ``protocol="holdout"``
========  =====================  ==================  ======================================
test      ``i_1 .. i_{n-1}``     ``i_n``             same
valid     ``i_1 .. i_{n-2}``     ``i_{n-1}``         same
train     ``i_1 .. i_{n-2}``     ``i_{n-1}``         history ``i_1 .. i_{n-3}``, cand ``i_{n-2}``
========  =====================  ==================  ======================================

The train row is the user's whole training sequence (``history + [candidate]``); the generative
objective trains on every position of it, so one row per user is all it needs.

- ``protocol="hstu"`` (default) is the HSTU paper's protocol (arXiv 2402.17152): train on every
  item but the last, evaluate on the last. Its valid row is the last position of the train
  sequence, so valid metrics are in-sample: a sanity check, not an unbiased model-selection score.
- ``protocol="holdout"`` (SASRec's protocol) also holds ``i_{n-1}`` out of training, so valid is a
  clean model-selection split. Select hyper-parameters with ``holdout``, then train the reported
  model with ``hstu`` to compare with published numbers.

Users with fewer than :data:`MIN_INTERACTIONS` (3) interactions are dropped and counted (they cannot
give a train, a valid and a test target).

Ids. Every id must be a non-negative integer. ``ids="auto"`` keeps the original ids when they are
compact (``max_id + 1 <= 2 * distinct + 1``; ML-1M items: ids up to 3952 for 3706 movies, so
``num_items = 3953`` and unused ids, such as 0, simply never occur); otherwise it maps them densely
to ``1 .. distinct`` in increasing raw-id order, so id 0 is never assigned and can mean padding.
``"keep"`` and ``"dense"`` force either choice, separately for users and items. Both maps are always
written, ``user_ids.parquet`` and ``item_ids.parquet`` (``raw_id``, the id used in the dataset, and
``interactions``), so a consumer can tell which item ids exist (e.g. to build a ``valid_items`` mask
for full ranking) in either mode.

Malformed lines (wrong field count, a non-integer or negative id, a non-numeric rating, a user line
repeated in ``seq-tsv``) raise :class:`~foundation.data.validate.DataValidationError` naming the
file, the line number (1-based, header included) and the field under ``policy="error"``; under
``policy="quarantine"`` they are skipped, counted, and written with their reason to
``out_dir/quarantine/<source stem>.parquet``. Blank lines are ignored.

Output (written to a temporary sibling directory and renamed into place, so a reader sees the whole
dataset or none of it; ``schema.json`` is written last)::

    out_dir/schema.json                  EventSchema(task="next_item")
    out_dir/{train,valid,test}/part-NNNNN.parquet
    out_dir/user_ids.parquet, out_dir/item_ids.parquet
    out_dir/conversion.json              the statistics returned by convert()
    out_dir/quarantine/<stem>.parquet    only under policy="quarantine" with bad lines
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import tempfile
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from foundation.data.io import POLICIES, atomic_write_text, fsync_dir, shard_path, write_table
from foundation.data.schema import EventSchema
from foundation.data.validate import DataValidationError
from foundation.messages import clip, shown

FORMATS = ("movielens-dat", "movielens-csv", "sasrec", "seq-tsv")
TIMESTAMPED_FORMATS = ("movielens-dat", "movielens-csv")
PROTOCOLS = ("hstu", "holdout")
ID_MODES = ("auto", "keep", "dense")
TIE_RULES = ("file", "sequence", "item")
GZIP_MAGIC = b"\x1f\x8b"
MIN_INTERACTIONS = 3
MOVIELENS_CSV_HEADER = ("userId", "movieId", "rating", "timestamp")
STATS_FILE = "conversion.json"
_INT64_MAX = 2**63 - 1


class _BadField(Exception):
    """One malformed line; carries the field name and the reason for the error message."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"field {field}: {reason}")
        self.field = field
        self.reason = reason


def is_gzip(path: Path) -> bool:
    """Whether ``path`` starts with the gzip magic bytes (its name does not matter)."""
    with open(path, "rb") as f:
        return f.read(len(GZIP_MAGIC)) == GZIP_MAGIC


def open_input(path: Path):
    """``path`` opened for binary reading, through ``gzip`` when its content is gzip-compressed."""
    return gzip.open(path, "rb") if is_gzip(path) else open(path, "rb")


def _read_lines(path: Path, f: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """``(line_number, raw_line)``; a corrupt or truncated gzip stream becomes a one-line error."""
    number = 0
    try:
        for number, raw in enumerate(f, start=1):
            yield number, raw
    except (OSError, EOFError, zlib.error) as exc:
        raise DataValidationError(
            f"{path}: corrupt gzip input after line {number}: {type(exc).__name__}: {exc}"
        ) from None


def _non_negative_int(token: bytes, name: str) -> int:
    token = token.strip()
    if token.isdigit():
        # Digits are counted before int(): Python refuses to convert more than 4300 of them.
        if len(token.lstrip(b"0")) > len(str(_INT64_MAX)) or int(token) > _INT64_MAX:
            raise _BadField(name, f"{clip(token.decode())} does not fit in int64")
        return int(token)
    if token[:1] == b"-" and token[1:].isdigit():
        raise _BadField(name, f"negative value {clip(token.decode())}")
    text = token.decode(errors="backslashreplace")
    raise _BadField(name, f"not a non-negative integer: {shown(text)}" if token else "empty value")


def _check_number(token: bytes, name: str) -> None:
    try:
        finite = math.isfinite(float(token))
    except ValueError:
        finite = False
    if not finite:
        raise _BadField(name, f"not a finite number: {shown(token.decode(errors='backslashreplace'))}")


@dataclass
class _Parsed:
    """Interactions in file order: ``users[N]``, ``items[N]``, ``timestamps[N]`` (None: use positions)."""

    users: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray | None
    bad: list[tuple[int, str, str, str]] = field(default_factory=list)  # (line, field, reason, text)


class _LineReader:
    """Iterates ``(line_number, stripped_line)`` over non-blank lines and applies the bad-line policy."""

    def __init__(self, path: Path, policy: str) -> None:
        self.path = path
        self.policy = policy
        self.bad: list[tuple[int, str, str, str]] = []

    def lines(self) -> Iterator[tuple[int, bytes]]:
        # Binary mode: a stray non-UTF-8 byte then becomes a bad id on a numbered line, not a decode
        # error with no line number.
        with open_input(self.path) as f:
            for number, raw in _read_lines(self.path, f):
                line = raw.rstrip(b"\r\n")
                if line.strip():
                    yield number, line

    def reject(self, number: int, line: bytes, bad: _BadField) -> None:
        text = line.decode(errors="backslashreplace")
        if self.policy == "error":
            raise DataValidationError(
                f"{self.path}: line {number}: field {bad.field}: {bad.reason} (line: {shown(text)})"
            )
        self.bad.append((number, bad.field, bad.reason, text))


def _parse_per_interaction(
    path: Path, policy: str, split_line: Callable[[bytes], list[bytes]], names: tuple[str, ...], header: bool
) -> _Parsed:
    """Formats with one interaction per line; ``names``: user, item[, rating, timestamp]."""
    reader = _LineReader(path, policy)
    # Growable int64 buffers: no Python object per interaction survives the line it came from.
    cap, n = 1 << 16, 0
    users, items = np.empty(cap, np.int64), np.empty(cap, np.int64)
    has_time = len(names) == 4
    stamps = np.empty(cap if has_time else 0, np.int64)
    lines = reader.lines()
    if header:
        first = next(lines, None)
        got = tuple(t.strip().decode(errors="replace").lstrip("\ufeff") for t in first[1].split(b",")) if first else ()
        if got != MOVIELENS_CSV_HEADER:
            where = f"line {first[0]}" if first else "empty file"
            raise DataValidationError(
                f"{path}: {where}: expected the header {','.join(MOVIELENS_CSV_HEADER)!r}, got {shown(','.join(got))}"
            )
    for number, line in lines:
        fields = split_line(line)
        try:
            if len(fields) != len(names):
                raise _BadField("count", f"expected {len(names)} fields ({', '.join(names)}), got {len(fields)}")
            user = _non_negative_int(fields[0], names[0])
            item = _non_negative_int(fields[1], names[1])
            if has_time:
                _check_number(fields[2], names[2])
                stamp = _non_negative_int(fields[3], names[3])
        except _BadField as bad:
            reader.reject(number, line, bad)
            continue
        if n == cap:
            cap *= 2
            users, items = np.resize(users, cap), np.resize(items, cap)
            if has_time:
                stamps = np.resize(stamps, cap)
        users[n], items[n] = user, item
        if has_time:
            stamps[n] = stamp
        n += 1
    return _Parsed(users[:n].copy(), items[:n].copy(), stamps[:n].copy() if has_time else None, reader.bad)


def _parse_movielens_dat(path: Path, policy: str) -> _Parsed:
    names = ("UserID", "MovieID", "Rating", "Timestamp")
    return _parse_per_interaction(path, policy, lambda line: line.split(b"::"), names, header=False)


def _parse_movielens_csv(path: Path, policy: str) -> _Parsed:
    names = ("userId", "movieId", "rating", "timestamp")
    return _parse_per_interaction(path, policy, lambda line: line.split(b","), names, header=True)


def _parse_sasrec(path: Path, policy: str) -> _Parsed:
    return _parse_per_interaction(path, policy, bytes.split, ("user", "item"), header=False)


def _parse_seq_tsv(path: Path, policy: str) -> _Parsed:
    reader = _LineReader(path, policy)
    users: list[np.ndarray] = []
    items: list[np.ndarray] = []
    seen: dict[int, int] = {}
    for number, line in reader.lines():
        fields = line.split(b"\t")
        try:
            if len(fields) != 2:
                raise _BadField("count", f"expected 2 tab-separated fields (user, items), got {len(fields)}")
            user = _non_negative_int(fields[0], "user")
            if user in seen:
                raise _BadField("user", f"user {user} already has a sequence on line {seen[user]}")
            tokens = fields[1].split()
            # Fast path for the common case; the slow one finds and names the offending item.
            if not all(t.isdigit() and len(t) < 19 for t in tokens):
                for position, token in enumerate(tokens, start=1):
                    _non_negative_int(token, f"items (item {position})")
            seq = np.array([int(t) for t in tokens], dtype=np.int64)
        except _BadField as bad:
            reader.reject(number, line, bad)
            continue
        seen[user] = number
        users.append(np.full(len(seq), user, np.int64))
        items.append(seq)
    if not users:
        return _Parsed(np.empty(0, np.int64), np.empty(0, np.int64), None, reader.bad)
    return _Parsed(np.concatenate(users), np.concatenate(items), None, reader.bad)


_PARSERS: dict[str, Callable[[Path, str], _Parsed]] = {
    "movielens-dat": _parse_movielens_dat,
    "movielens-csv": _parse_movielens_csv,
    "sasrec": _parse_sasrec,
    "seq-tsv": _parse_seq_tsv,
}


def _id_map(raw: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """``(distinct_raw[K], counts[K], new_ids[N], mode_used)`` for ``raw[N]``; see the module docstring."""
    distinct, inverse, counts = np.unique(raw, return_inverse=True, return_counts=True)
    if mode == "auto":
        mode = "keep" if int(distinct[-1]) + 1 <= 2 * len(distinct) + 1 else "dense"
    new = raw if mode == "keep" else inverse.astype(np.int64) + 1
    return distinct, counts, new, mode


def _map_table(distinct: np.ndarray, counts: np.ndarray, mode: str) -> pa.Table:
    new = distinct if mode == "keep" else np.arange(1, len(distinct) + 1, dtype=np.int64)
    return pa.table({"raw_id": distinct, "id": new, "interactions": counts.astype(np.int64)})


def _split_rows(
    items: np.ndarray,
    stamps: np.ndarray,
    user_ids: np.ndarray,
    ends: np.ndarray,
    held_out: int,
    first_example: int,
    schema: pa.Schema,
) -> pa.Table:
    """One row per user whose candidate is the ``held_out``-th item from the end of its sequence.

    ``items[N]``/``stamps[N]`` are grouped by user in time order, ``ends[U]`` the exclusive end of each
    user's run, ``user_ids[U]`` the dataset user id of each run; rows follow ``schema``.
    """
    starts = np.concatenate([[0], ends[:-1]])
    cand = ends - held_out
    hist_len = cand - starts
    owner = np.repeat(np.arange(len(ends)), ends - starts)
    keep = np.arange(len(items)) < cand[owner]
    offsets = pa.array(np.concatenate([[0], np.cumsum(hist_len)]).astype(np.int32))
    h_items, h_stamps = items[keep], stamps[keep]
    n_hist, n_rows = len(h_items), len(ends)
    columns = {
        "example_id": pa.array(np.arange(first_example, first_example + n_rows, dtype=np.int64)),
        "user_id": pa.array(user_ids),
        "item_id": pa.array(items[cand]),
        "domain": pa.array(np.zeros(n_rows, np.int32)),
        "timestamp": pa.array(stamps[cand]),
        "history_item_ids": pa.ListArray.from_arrays(offsets, pa.array(h_items)),
        "history_actions": pa.ListArray.from_arrays(offsets, pa.array(np.ones(n_hist, np.int32))),
        "history_timestamps": pa.ListArray.from_arrays(offsets, pa.array(h_stamps)),
        "history_domains": pa.ListArray.from_arrays(offsets, pa.array(np.zeros(n_hist, np.int32))),
        "click": pa.array(np.ones(n_rows, np.int8)),
        "conversion": pa.nulls(n_rows, pa.int8()),
    }
    return pa.Table.from_arrays([columns[name] for name in schema.names], schema=schema)


def _occurrence(keys: np.ndarray) -> np.ndarray:
    """``[N]`` how many earlier elements of ``keys[N]`` (in array order) equal each element."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    group_start = np.repeat(starts, np.diff(np.concatenate([starts, [len(keys)]])))
    occurrence = np.empty(len(keys), np.int64)
    occurrence[order] = np.arange(len(keys)) - group_start
    return occurrence


def _reference_rank(users: np.ndarray, items: np.ndarray, reference: Path) -> np.ndarray:
    """``[N]`` position in the ``seq-tsv`` file ``reference`` of each (user, item) event (raw ids, file
    order; the ``k``-th occurrence of a pair maps to the pair's ``k``-th occurrence there), or
    ``int64`` max for events the reference lacks."""
    ref = _parse_seq_tsv(reference, "error")
    rank = np.full(len(users), _INT64_MAX, np.int64)
    if not len(ref.users) or not len(users):
        return rank
    span = int(max(items.max(), ref.items.max())) + 1
    if (int(max(users.max(), ref.users.max())) + 1) * span > _INT64_MAX:
        raise ValueError(f"{reference}: user and item ids too large to match events for ties='sequence'")
    ref_keys = ref.users * span + ref.items
    ref_order = np.argsort(ref_keys, kind="stable")
    ref_sorted = ref_keys[ref_order]
    keys = users * span + items
    index = np.searchsorted(ref_sorted, keys, "left") + _occurrence(keys)
    found = index < len(ref_sorted)
    found[found] = ref_sorted[index[found]] == keys[found]
    rank[found] = ref_order[index[found]]
    return rank


def _tie_rank(ties: str, users: np.ndarray, items: np.ndarray, reference: Path | None) -> np.ndarray | None:
    """The secondary sort key of events that share a user and a timestamp (None: file order)."""
    if ties == "item":
        return items
    if ties == "sequence":
        return _reference_rank(users, items, reference)
    return None


def _count_tied(users: np.ndarray, stamps: np.ndarray) -> int:
    """Events whose user has another event at the same timestamp (``users``/``stamps`` sorted by both)."""
    same = (users[1:] == users[:-1]) & (stamps[1:] == stamps[:-1])
    tied = np.zeros(len(users), bool)
    tied[1:] |= same
    tied[:-1] |= same
    return int(tied.sum())


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` directory to ``out_dir``; an old dataset is replaced only if asked."""
    if out_dir.exists():
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        elif not overwrite:
            raise FileExistsError(f"{out_dir}: already exists and is not empty; pass overwrite=True to replace it")
    if out_dir.exists():
        # A directory cannot be replaced by rename in one step: move the old one aside first, so a
        # failure leaves either the old or the new dataset at out_dir, never a mix.
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / "dataset")
        try:
            os.replace(tmp, out_dir)
        except OSError:
            os.replace(old / "dataset", out_dir)
            old.rmdir()
            raise
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)
    fsync_dir(out_dir.parent)


def convert(
    fmt: str,
    src: str | Path,
    out_dir: str | Path,
    *,
    policy: str = "error",
    rows_per_shard: int = 4096,
    protocol: str = "hstu",
    ids: str = "auto",
    ties: str = "file",
    ties_reference: str | Path | None = None,
    overwrite: bool = False,
) -> dict:
    """Convert the sequence file ``src`` in format ``fmt`` into a next-item dataset at ``out_dir``.

    Args:
        fmt: one of :data:`FORMATS`.
        src: the input file.
        out_dir: the dataset directory to create (must be absent or empty unless ``overwrite``).
        policy: ``"error"`` or ``"quarantine"`` for malformed lines.
        rows_per_shard: rows (users) per Parquet shard.
        protocol: ``"hstu"`` or ``"holdout"``; what the train split holds (module docstring).
        ids: ``"auto"``, ``"keep"`` or ``"dense"``; how user and item ids are mapped.
        ties: one of :data:`TIE_RULES`; the order of a user's events that share a timestamp (module
            docstring). Only formats with timestamps have ties.
        ties_reference: the ``seq-tsv`` file whose order ``ties="sequence"`` follows.
        overwrite: replace an existing non-empty ``out_dir``.

    Returns:
        Statistics (also written to ``out_dir/conversion.json``): ``users``, ``items`` (distinct, after
        dropping), ``interactions`` (kept), ``dropped_users``, ``dropped_interactions``, ``bad_lines``,
        ``num_users``/``num_items`` (schema cardinalities), ``user_ids``/``item_ids`` (``keep`` or
        ``dense``), ``rows`` and ``shards`` per split, ``tied_events`` (events sharing their user's
        timestamp) and, under ``ties="sequence"``, ``ties_unreferenced``, plus the arguments that
        shaped the output.

    Raises:
        FileNotFoundError: ``src`` (or ``ties_reference``) does not exist.
        DataValidationError: a malformed line under ``policy="error"`` (in ``ties_reference``: any), a
            bad CSV header, a corrupt gzip stream, or no user left with at least
            :data:`MIN_INTERACTIONS` interactions.
    """
    for name, value, allowed in (
        ("fmt", fmt, FORMATS),
        ("policy", policy, POLICIES),
        ("protocol", protocol, PROTOCOLS),
        ("ids", ids, ID_MODES),
        ("ties", ties, TIE_RULES),
    ):
        if value not in allowed:
            raise ValueError(f"unknown {name} {value!r}; choose one of {allowed}")
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be positive, got {rows_per_shard}")
    src, out_dir = Path(src), Path(out_dir)
    if not src.is_file():
        raise FileNotFoundError(f"{src}: input file for the {fmt} converter not found")
    if ties != "file" and fmt not in TIMESTAMPED_FORMATS:
        raise ValueError(f"ties={ties!r}: the {fmt} format has no timestamps, so no ties to order")
    if (ties == "sequence") != (ties_reference is not None):
        raise ValueError("ties_reference (a seq-tsv file) is required with ties='sequence' and only with it")
    if ties_reference is not None and not Path(ties_reference).is_file():
        raise FileNotFoundError(f"{ties_reference}: reference sequence file for ties='sequence' not found")

    parsed = _PARSERS[fmt](src, policy)

    _, user_inverse, user_counts = np.unique(parsed.users, return_inverse=True, return_counts=True)
    kept = user_counts[user_inverse] >= MIN_INTERACTIONS
    dropped_users = int((user_counts < MIN_INTERACTIONS).sum())
    if not kept.any():
        raise DataValidationError(
            f"{src}: no user has at least {MIN_INTERACTIONS} interactions "
            f"({len(user_counts)} users, {len(parsed.users)} valid interactions, {len(parsed.bad)} bad lines)"
        )
    raw_users, raw_items = parsed.users[kept], parsed.items[kept]
    user_distinct, user_n, users, user_mode = _id_map(raw_users, ids)
    item_distinct, item_n, items, item_mode = _id_map(raw_items, ids)

    tie_rank = None
    if parsed.timestamps is None:
        order = np.argsort(users, kind="stable")
    else:
        stamps = parsed.timestamps[kept]
        tie_rank = _tie_rank(ties, raw_users, raw_items, Path(ties_reference) if ties_reference else None)
        # lexsort is stable: what the keys leave tied keeps file order.
        order = np.lexsort((stamps, users) if tie_rank is None else (tie_rank, stamps, users))
        stamps = stamps[order]
    users, items = users[order], items[order]
    run_start = np.flatnonzero(np.concatenate([[True], users[1:] != users[:-1]]))
    ends = np.concatenate([run_start[1:], [len(users)]])
    if parsed.timestamps is None:
        stamps = np.arange(len(users), dtype=np.int64) - np.repeat(run_start, ends - run_start)
    row_users = users[run_start]

    n_users = len(row_users)
    held_out = {"train": 2 if protocol == "hstu" else 3, "valid": 2, "test": 1}
    schema = EventSchema(
        num_users=int(users.max()) + 1,
        num_items=int(items.max()) + 1,
        task="next_item",
        description=f"{fmt} {src.name}: leave-one-out next-item ({protocol} protocol)",
    )
    stats: dict = {
        "format": fmt,
        "source": str(src),
        "protocol": protocol,
        "policy": policy,
        "users": n_users,
        "items": len(item_distinct),
        "interactions": len(items),
        "dropped_users": dropped_users,
        "dropped_interactions": int((~kept).sum()),
        "bad_lines": len(parsed.bad),
        "num_users": schema.num_users,
        "num_items": schema.num_items,
        "user_ids": user_mode,
        "item_ids": item_mode,
        "ties": ties,
        "tied_events": _count_tied(users, stamps) if parsed.timestamps is not None else 0,
        "rows": {},
        "shards": {},
    }
    if ties == "sequence":
        stats["ties_reference"] = str(ties_reference)
        stats["ties_unreferenced"] = int((tie_rank == _INT64_MAX).sum())

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its 0700 mode would survive the rename; mkdir honours the umask like any dataset.
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        for index, split in enumerate(("train", "valid", "test")):
            table = _split_rows(
                items, stamps, row_users, ends, held_out[split], index * n_users, schema.arrow_schema()
            )
            n_shards = -(-n_users // rows_per_shard)
            for shard in range(n_shards):
                write_table(table.slice(shard * rows_per_shard, rows_per_shard), shard_path(tmp, split, shard))
            stats["rows"][split] = table.num_rows
            stats["shards"][split] = n_shards
        write_table(_map_table(user_distinct, user_n, user_mode), tmp / "user_ids.parquet")
        write_table(_map_table(item_distinct, item_n, item_mode), tmp / "item_ids.parquet")
        if parsed.bad:
            lines, fields, reasons, texts = zip(*parsed.bad, strict=True)
            bad = pa.table(
                {
                    "line": pa.array(lines, pa.int64()),
                    "field": pa.array(fields, pa.string()),
                    "reason": pa.array(reasons, pa.string()),
                    "text": pa.array(texts, pa.string()),
                }
            )
            write_table(bad, tmp / "quarantine" / f"{src.stem}.parquet")
        atomic_write_text(tmp / STATS_FILE, json.dumps(stats, indent=2, sort_keys=True))
        schema.save(tmp)
        for sub in [tmp, *(p for p in tmp.iterdir() if p.is_dir())]:
            fsync_dir(sub)
        _publish(tmp, out_dir, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return stats
