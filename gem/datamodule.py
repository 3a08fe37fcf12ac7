"""``EventDataModule``: the Lightning data module over one dataset directory, resumable to the batch."""

from __future__ import annotations

from typing import Any

import lightning as L

from foundation.data.batch import BatchPosition
from foundation.data.io import list_shards, open_shard
from foundation.data.pipeline import DataConfig, EventStream, build_dataloader
from foundation.data.schema import EventSchema


class EventDataModule(L.LightningDataModule):
    """Train/val/test streams over one dataset directory; its state is the data position.

    The training module reports every consumed batch (:meth:`record`); the position is saved in the
    checkpoint, and on resume the streams skip what was consumed, so the run continues exactly.
    """

    def __init__(self, cfg: DataConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.schema = EventSchema.load(cfg.path)
        self.epoch = 0
        self.consumed: dict[int, int] = {}
        self.next_worker_stream = 0
        self.train_stream: EventStream | None = None

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
        return EventStream(self.cfg.path, split, self.cfg, training=training, rank=rank, world_size=world)

    def train_dataloader(self):
        self.train_stream = self._stream(self.cfg.train_split, training=True)
        self.start_epoch(self.epoch)
        return build_dataloader(self.train_stream, self.cfg)

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
