"""Parquet shards -> ``JaggedBatch``: sharded by rank and worker, deterministic, token-budgeted, resumable.

The unit of work is a Parquet row group. Per epoch, the row groups of a split are shuffled with
``(seed, epoch)`` and dealt round-robin to the ``world_size * num_workers`` streams; stream
``s = rank * num_workers + worker``. Each stream takes its row groups ``shuffle_window`` at a time,
shuffles the rows of each window as one (0, every row group: one permutation of the whole split, as
a small dataset's epoch wants; 1: rows mix only within a row group), packs them
into batches of at most ``batch_size`` rows and ``token_budget`` history tokens (after most-recent
truncation to ``max_len``), and numbers its batches. A trainer that records the last consumed
batch index of every stream can resume exactly: the streams are rebuilt identically and skip what
was consumed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from foundation.data.batch import BatchPosition, JaggedBatch
from foundation.data.io import QuarantineLog, iter_valid_row_groups, list_shards, open_shard
from foundation.data.schema import HISTORY_FIELDS, ORACLE_FIELDS, TASKS, EventSchema

SCALAR_FIELDS = ("example_id", "user_id", "item_id", "domain", "timestamp")


@dataclass
class DataConfig:
    """Where a dataset lives and how it is batched.

    ``token_budget`` bounds the history tokens of a batch (0: only ``batch_size`` bounds it); it
    must be at least ``max_len`` so that any single row fits. ``shuffle_window`` row groups of a stream
    are shuffled together (0: all of them; memory: that many row groups at once). ``verify_sha256`` checks each shard against
    its ``.sha256`` once per process before reading it (:func:`foundation.data.io.open_shard`); page CRCs
    are checked at every read either way. ``cache_bytes``: a split read in the trainer's process
    (``num_workers=0``) keeps its decoded row groups in memory across epochs when its decoded size
    (:func:`decoded_bytes`) is at most this (0: never), so that an epoch after the first only shuffles
    and packs (:func:`caches_split`).
    """

    path: str = "data/synth-debug"
    train_split: str = "train"
    eval_split: str = "valid"
    test_split: str = "test"
    max_len: int = 256
    batch_size: int = 256
    token_budget: int = 0
    num_workers: int = 0
    shuffle: bool = True
    seed: int = 0
    policy: str = "error"
    pin_memory: bool = False
    verify_sha256: bool = True
    shuffle_window: int = 1
    cache_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        if self.max_len < 1 or self.batch_size < 1:
            raise ValueError("data.max_len and data.batch_size must be positive")
        if self.shuffle_window < 0:
            raise ValueError(f"data.shuffle_window={self.shuffle_window} must be 0 (all) or positive")
        if self.cache_bytes < 0:
            raise ValueError(f"data.cache_bytes={self.cache_bytes} must be 0 (never cache) or positive")
        if self.token_budget and self.token_budget < self.max_len:
            raise ValueError(f"data.token_budget={self.token_budget} must be 0 or >= data.max_len={self.max_len}")


@dataclass
class RowBlock:
    """One row group as numpy arrays. Jagged columns are ``(offsets[n+1], values[N])``."""

    scalars: dict[str, np.ndarray]
    jagged: dict[str, tuple[np.ndarray, np.ndarray]]
    dense: np.ndarray
    labels: dict[str, np.ndarray]
    label_mask: dict[str, np.ndarray]
    oracle: dict[str, np.ndarray]

    @property
    def num_rows(self) -> int:
        return len(self.scalars["example_id"])

    def history_lengths(self) -> np.ndarray:
        offsets = self.jagged["history_item_ids"][0]
        return offsets[1:] - offsets[:-1]


def concat_blocks(blocks: list[RowBlock]) -> RowBlock:
    """The rows of ``blocks`` in order as one block (jagged offsets shifted past the earlier blocks)."""
    if len(blocks) == 1:
        return blocks[0]

    def jagged(name: str) -> tuple[np.ndarray, np.ndarray]:
        starts = np.cumsum([0] + [b.jagged[name][0][-1] for b in blocks[:-1]])
        offsets = [b.jagged[name][0][:-1] + s for b, s in zip(blocks, starts, strict=True)]
        total = starts[-1] + blocks[-1].jagged[name][0][-1]
        return np.concatenate([*offsets, [total]]), np.concatenate([b.jagged[name][1] for b in blocks])

    def cat(get) -> dict[str, np.ndarray]:
        return {k: np.concatenate([get(b)[k] for b in blocks]) for k in get(blocks[0])}

    return RowBlock(
        scalars=cat(lambda b: b.scalars),
        jagged={name: jagged(name) for name in blocks[0].jagged},
        dense=np.concatenate([b.dense for b in blocks]),
        labels=cat(lambda b: b.labels),
        label_mask=cat(lambda b: b.label_mask),
        oracle=cat(lambda b: b.oracle),
    )


def _jagged_parts(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    arr = col.combine_chunks()
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values[offsets[0] : offsets[-1]]


def table_to_block(table: pa.Table, schema: EventSchema) -> RowBlock:
    jagged_names = [*HISTORY_FIELDS, *(f.name for f in schema.sparse)]
    n = table.num_rows
    dense = np.zeros((n, 0), np.float32)
    if schema.dense_dim:
        _, flat = _jagged_parts(table.column("dense"))
        dense = flat.astype(np.float32).reshape(n, schema.dense_dim)
    labels, masks = {}, {}
    for task in TASKS:
        col = table.column(task)
        masks[task] = ~col.is_null().to_numpy(zero_copy_only=False)
        labels[task] = col.fill_null(0).to_numpy().astype(np.float32)
    oracle = {}
    if schema.has_oracle:
        oracle = {t: table.column(c).to_numpy().astype(np.float32) for t, c in ORACLE_FIELDS.items()}
    return RowBlock(
        scalars={c: table.column(c).to_numpy().astype(np.int64) for c in SCALAR_FIELDS},
        jagged={c: _jagged_parts(table.column(c)) for c in jagged_names},
        dense=dense,
        labels=labels,
        label_mask=masks,
        oracle=oracle,
    )


def gather_jagged(
    offsets: np.ndarray, values: np.ndarray, rows: np.ndarray, keep_last: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Take ``rows`` of a jagged column ``(offsets[n+1], values[N])``, keeping at most the ``keep_last`` most
    recent values of each (all with ``None``).

    Returns ``(lengths[len(rows)], values[sum(lengths)])``.
    """
    ends = offsets[rows + 1]
    starts = offsets[rows]
    if keep_last is not None:
        starts = np.maximum(starts, ends - keep_last)
    lengths = ends - starts
    total = int(lengths.sum())
    if total == 0:
        return lengths, values[:0]
    row_start = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return lengths, values[row_start + np.arange(total)]


def build_batch(
    pieces: list[tuple[RowBlock, np.ndarray]], schema: EventSchema, max_len: int, position: BatchPosition | None
) -> JaggedBatch:
    """Collate rows taken from one or more blocks into a ``JaggedBatch`` (histories cut to ``max_len``)."""

    def cat(get) -> np.ndarray:
        return np.concatenate([get(block, rows) for block, rows in pieces])

    history, hist_lengths = {}, None
    for name in HISTORY_FIELDS:
        parts = [gather_jagged(*block.jagged[name], rows, max_len) for block, rows in pieces]
        hist_lengths = np.concatenate([p[0] for p in parts])
        history[name.removeprefix("history_")] = torch.from_numpy(
            np.concatenate([p[1] for p in parts]).astype(np.int64)
        )
    offsets = torch.from_numpy(np.concatenate(([0], np.cumsum(hist_lengths))).astype(np.int64))

    keys, kjt_lengths, kjt_values = [], [], []
    for f in schema.sparse:
        parts = [gather_jagged(*block.jagged[f.name], rows, None) for block, rows in pieces]
        keys.append(f.name)
        kjt_lengths.append(np.concatenate([p[0] for p in parts]))
        kjt_values.append(np.concatenate([p[1] for p in parts]))
    batch_size = sum(len(rows) for _, rows in pieces)
    sparse = KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(np.concatenate(kjt_values).astype(np.int64)) if keys else torch.zeros(0, dtype=torch.int64),
        lengths=torch.from_numpy(np.concatenate(kjt_lengths).astype(np.int32)) if keys else torch.zeros(0, dtype=torch.int32),
        stride=batch_size,
        # Known here on the host; torchrec would otherwise sum the lengths on the device and sync to read them.
        length_per_key=[int(lengths.sum()) for lengths in kjt_lengths],
    )
    scalars = {c: torch.from_numpy(cat(lambda b, r, c=c: b.scalars[c][r])) for c in SCALAR_FIELDS}
    return JaggedBatch(
        history=history,
        offsets=offsets,
        max_len=int(hist_lengths.max()) if len(hist_lengths) else 0,
        sparse=sparse,
        dense=torch.from_numpy(cat(lambda b, r: b.dense[r])),
        candidate=scalars["item_id"],
        domain=scalars["domain"],
        timestamp=scalars["timestamp"],
        user_id=scalars["user_id"],
        example_id=scalars["example_id"],
        labels={t: torch.from_numpy(cat(lambda b, r, t=t: b.labels[t][r])) for t in TASKS},
        label_mask={t: torch.from_numpy(cat(lambda b, r, t=t: b.label_mask[t][r])) for t in TASKS},
        oracle={t: torch.from_numpy(cat(lambda b, r, t=t: b.oracle[t][r])) for t in schema_oracle_tasks(schema)},
        position=position,
    )


def schema_oracle_tasks(schema: EventSchema) -> tuple[str, ...]:
    return tuple(ORACLE_FIELDS) if schema.has_oracle else ()


@dataclass
class _Packer:
    """Greedy token-budget packing of rows into batches, carrying a partial batch across blocks."""

    batch_size: int
    token_budget: int
    max_len: int
    pieces: list[tuple[RowBlock, np.ndarray]] = field(default_factory=list)
    rows: int = 0
    tokens: int = 0

    def add(self, block: RowBlock, order: np.ndarray) -> Iterator[list[tuple[RowBlock, np.ndarray]]]:
        cost = np.minimum(block.history_lengths()[order], self.max_len)
        start = 0
        for i in range(len(order)):
            full_rows = self.rows + (i - start) >= self.batch_size
            full_tokens = self.token_budget and self.tokens + int(cost[i]) > self.token_budget
            if full_rows or full_tokens:
                if i > start:
                    self.pieces.append((block, order[start:i]))
                yield self.flush()
                start = i
            self.tokens += int(cost[i])
        if len(order) > start:
            self.pieces.append((block, order[start:]))
            self.rows += len(order) - start

    def flush(self) -> list[tuple[RowBlock, np.ndarray]]:
        out, self.pieces, self.rows, self.tokens = self.pieces, [], 0, 0
        return out


class EventStream(IterableDataset):
    """Streams ``JaggedBatch`` es of one split for one rank; see the module docstring for the order.

    ``set_epoch`` picks the epoch's shuffle; ``set_skip`` says how many batches of each stream were
    already consumed (exact resume). Bad rows are handled by ``cfg.policy``. ``cache_blocks`` keeps the
    validated row groups in memory after their first read (small datasets read in the main process:
    each epoch then only shuffles and packs).
    """

    def __init__(
        self,
        dataset_dir: str | Path,
        split: str,
        cfg: DataConfig,
        *,
        training: bool,
        rank: int = 0,
        world_size: int = 1,
        cache_blocks: bool = False,
    ) -> None:
        self.dataset_dir = Path(dataset_dir)
        self.schema = EventSchema.load(self.dataset_dir)
        self.shards = list_shards(self.dataset_dir, split)
        self.units = [
            (s, rg)
            for s in self.shards
            for rg in range(open_shard(s, self.schema, verify_sha256=cfg.verify_sha256).num_row_groups)
        ]
        self.cfg = cfg
        self.shuffle = training and cfg.shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.skip: dict[int, int] = {}
        self.first_worker_stream = 0
        self.quarantine = QuarantineLog(self.dataset_dir)
        # Validated row groups kept across epochs (in this process: DataLoader workers have their own copy).
        self.blocks: dict[tuple[Path, int], RowBlock] | None = {} if cache_blocks else None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_skip(self, consumed: dict[int, int], first_worker_stream: int = 0) -> None:
        """Resume after ``consumed[stream]`` batches of each stream.

        A ``DataLoader`` always polls worker 0 first, so worker ``w`` serves this rank's logical
        stream ``(w + first_worker_stream) % num_workers``: passing the stream that was due next
        reproduces the uninterrupted interleaving.
        """
        self.skip = dict(consumed)
        self.first_worker_stream = first_worker_stream

    def stream_units(self, stream: int, num_streams: int) -> list[tuple[Path, int]]:
        units = list(self.units)
        if self.shuffle:
            order = np.random.default_rng([self.cfg.seed, self.epoch]).permutation(len(units))
            units = [units[i] for i in order]
        return units[stream::num_streams]

    def load_block(self, shard: Path, row_group: int) -> RowBlock:
        """One row group, validated under ``cfg.policy``; read once when the stream caches blocks."""
        if self.blocks is not None and (shard, row_group) in self.blocks:
            return self.blocks[shard, row_group]
        ((_, table),) = iter_valid_row_groups(
            shard,
            self.schema,
            policy=self.cfg.policy,
            quarantine=self.quarantine,
            row_groups=[row_group],
            verify_sha256=self.cfg.verify_sha256,
        )
        block = table_to_block(table, self.schema)
        if self.blocks is not None:
            self.blocks[shard, row_group] = block
        return block

    def __iter__(self) -> Iterator[JaggedBatch]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        stream = self.rank * workers + (worker + self.first_worker_stream) % workers
        skip = self.skip.get(stream, 0)
        packer = _Packer(self.cfg.batch_size, self.cfg.token_budget, self.cfg.max_len)
        index = 0
        units = self.stream_units(stream, self.world_size * workers)
        window = self.cfg.shuffle_window or max(len(units), 1)
        for first in range(0, len(units), window):
            group = units[first : first + window]
            block = concat_blocks([self.load_block(shard, rg) for shard, rg in group])
            order = np.arange(block.num_rows)
            if self.shuffle:
                key = [k for shard, rg in group for k in (rg, *shard.stem.encode())]
                order = np.random.default_rng([self.cfg.seed, self.epoch, *key]).permutation(order)
            for pieces in packer.add(block, order):
                if index >= skip:
                    yield build_batch(pieces, self.schema, self.cfg.max_len, BatchPosition(self.epoch, stream, index))
                index += 1
        if packer.pieces and index >= skip:
                yield build_batch(packer.flush(), self.schema, self.cfg.max_len, BatchPosition(self.epoch, stream, index))


def build_dataloader(stream: Iterable[JaggedBatch], cfg: DataConfig) -> DataLoader:
    """A ``DataLoader`` over an :class:`EventStream` (batches are already collated by the stream).

    Its workers' base seed comes from a generator of its own (the stream shuffles with its own seeds): drawn
    from torch's global one, each new iterator would shift the random numbers a training step draws, and a
    run resumed from a checkpoint (which restores that generator) would make its iterator after the restore.
    """
    return DataLoader(
        stream,
        batch_size=None,
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory and torch.cuda.is_available(),
        persistent_workers=False,
        generator=torch.Generator().manual_seed(cfg.seed),
    )


def decoded_bytes(dataset_dir: str | Path, split: str) -> int:
    """Bytes a split takes decoded into :class:`RowBlock` s, estimated from the Parquet footers: 8 per value
    and per list offset (the blocks hold int64 ids and offsets; float32 columns take less)."""
    total = 0
    for shard in list_shards(dataset_dir, split):
        meta = pq.ParquetFile(shard).metadata
        for index in range(meta.num_row_groups):
            group = meta.row_group(index)
            values = sum(group.column(c).num_values for c in range(group.num_columns))
            total += 8 * (values + group.num_rows * group.num_columns)
    return total


def caches_split(dataset_dir: str | Path, split: str, cfg: DataConfig) -> bool:
    """Whether an :class:`EventStream` of ``split`` should cache its row groups: read in the trainer's
    process (DataLoader workers start afresh every epoch, so a cache there would be lost) and no larger
    decoded than ``cfg.cache_bytes``."""
    return cfg.num_workers == 0 and cfg.cache_bytes > 0 and decoded_bytes(dataset_dir, split) <= cfg.cache_bytes


def count_rows(dataset_dir: str | Path, split: str) -> int:
    return sum(pq.ParquetFile(s).metadata.num_rows for s in list_shards(dataset_dir, split))


def valid_item_mask(dataset_dir: str | Path, num_items: int) -> torch.Tensor | None:
    """``[num_items]`` bool of ids that are real items, from a converter's ``item_ids.parquet``.

    Full ranking must not count never-used ids (e.g. gaps in MovieLens ids) as candidates.
    """
    path = Path(dataset_dir) / "item_ids.parquet"
    if not path.is_file():
        return None
    ids = pq.read_table(path, columns=["id"]).column("id").to_numpy()
    mask = torch.zeros(num_items, dtype=torch.bool)
    mask[torch.as_tensor(ids.astype("int64", copy=True))] = True
    return mask
