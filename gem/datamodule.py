"""``EventDataModule``: the Lightning data module over one dataset directory, resumable to the batch."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from foundation.data.batch import BatchPosition, JaggedBatch
from foundation.data.io import list_shards, open_shard
from foundation.data.pipeline import DataConfig, EventStream, build_dataloader, caches_split, count_rows
from foundation.data.schema import EventSchema
from foundation.model.padding import PaddedBatches, StaticShapes


def estimate_batches(cfg: DataConfig, split: str, world_size: int) -> int:
    """Batches of one epoch of ``split`` per rank: rows over ``batch_size``, or tokens over ``token_budget``
    when that binds first (tokens = rows x the mean capped history length of the split's first row group),
    plus one partial batch per stream."""
    rows = count_rows(cfg.path, split) / max(world_size, 1)
    batches = rows / cfg.batch_size
    if cfg.token_budget:
        first = pq.ParquetFile(list_shards(cfg.path, split)[0])
        if first.metadata.num_row_groups:
            lengths = pc.list_value_length(first.read_row_group(0, columns=["history_item_ids"]).column(0))
            capped = pc.min_element_wise(lengths.fill_null(0), cfg.max_len)
            mean = pc.mean(capped).as_py() or 0.0
            batches = max(batches, rows * mean / cfg.token_budget)
    return math.ceil(batches) + max(cfg.num_workers, 1) - 1


class EventDataModule(L.LightningDataModule):
    """Train/val/test streams over one dataset directory; its state is the data position.

    The training module reports every consumed batch (:meth:`record`); the position is saved in the
    checkpoint, and on resume the streams skip what was consumed, so the run continues exactly.

    Lightning asks for each split's loader once per fit and iterates it every epoch, so a split that
    :func:`~foundation.data.pipeline.caches_split` allows (read in this process, small enough) is read from
    disk in the first epoch only; its batches are the same either way.
    """

    def __init__(self, cfg: DataConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.schema = EventSchema.load(cfg.path)
        self.epoch = 0
        self.consumed: dict[int, int] = {}
        self.next_worker_stream = 0
        self.train_stream: EventStream | None = None
        self._estimates: dict[str, int] = {}

    def verify_shards(self) -> None:
        """Open every shard of the train and eval splits (checksum, columns), so that a corrupt or foreign
        file is refused before a run starts rather than at its first batch."""
        for split in dict.fromkeys((self.cfg.train_split, self.cfg.eval_split)):
            for shard in list_shards(self.cfg.path, split):
                open_shard(shard, self.schema, verify_sha256=self.cfg.verify_sha256)

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        # GemParallelStrategy says how data-parallel ranks read (tp/cp peers read the same rows).
        return getattr(trainer.strategy, "data_rank_world", (trainer.global_rank, trainer.world_size))

    def _stream(self, split: str, training: bool) -> EventStream:
        rank, world = self._rank_world()
        return EventStream(
            self.cfg.path, split, self.cfg, training=training, rank=rank, world_size=world,
            cache_blocks=caches_split(self.cfg.path, split, self.cfg),
        )

    def train_dataloader(self):
        self.train_stream = self._stream(self.cfg.train_split, training=True)
        # Lightning starts iterating before the epoch's hooks run, and the first epoch it trains after a
        # restore does not iterate again: point the stream at that epoch, the count of epochs whose batches
        # all ran (one past ``self.epoch`` for a checkpoint written at an epoch's end).
        trainer = self.trainer
        self.start_epoch(trainer.fit_loop.epoch_progress.current.processed if trainer is not None else self.epoch)
        shapes = self.train_shapes()
        return build_dataloader(PaddedBatches(self.train_stream, shapes) if shapes else self.train_stream, self.cfg)

    def train_shapes(self) -> StaticShapes | None:
        """The static shapes the training module's step wants its batches padded to (``train_shapes``), if any:
        they are padded in the DataLoader's workers."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        return getattr(module, "train_shapes", None)

    def val_dataloader(self):
        return build_dataloader(self._stream(self.cfg.eval_split, training=False), self.cfg)

    def test_dataloader(self):
        return build_dataloader(self._stream(self.cfg.test_split, training=False), self.cfg)

    def start_epoch(self, epoch: int) -> None:
        """Point the train stream at ``epoch``; a restarted epoch keeps its consumed counts as skips."""
        if epoch != self.epoch:
            self.epoch, self.consumed, self.next_worker_stream = epoch, {}, 0
        if self.train_stream is not None:
            self.train_stream.set_epoch(epoch)
            self.train_stream.set_skip(self.consumed, self.next_worker_stream)

    def on_before_batch_transfer(self, batch: JaggedBatch, dataloader_idx: int) -> JaggedBatch:
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is not None and module.training and hasattr(module, "count_batch"):
            module.count_batch(batch)
        return batch

    def transfer_batch_to_device(self, batch: JaggedBatch, device: torch.device, dataloader_idx: int) -> JaggedBatch:
        return batch.to(device, non_blocking=True)

    def estimated_batches(self, kind: str) -> int:
        """Expected batches of one epoch on this rank, ``kind`` ``train`` or ``eval`` (a progress bar's total)."""
        split = self.cfg.train_split if kind == "train" else self.cfg.eval_split
        if split not in self._estimates:
            self._estimates[split] = estimate_batches(self.cfg, split, self._rank_world()[1])
        return self._estimates[split]

    def record(self, position: BatchPosition) -> None:
        if position.epoch == self.epoch:
            self.consumed[position.stream] = position.index + 1
            self.next_worker_stream = (position.stream + 1) % max(self.cfg.num_workers, 1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": dict(self.consumed),
            "next_worker_stream": self.next_worker_stream,
            "num_workers": self.cfg.num_workers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_workers"] != self.cfg.num_workers:
            raise ValueError(
                f"cannot resume exactly: the checkpoint was written with data.num_workers={state['num_workers']}, "
                f"this run has {self.cfg.num_workers}"
            )
        self.epoch, self.consumed = state["epoch"], dict(state["consumed"])
        self.next_worker_stream = state["next_worker_stream"]
