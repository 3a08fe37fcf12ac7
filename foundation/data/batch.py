"""``JaggedBatch``: the one batch type every model consumes.

Histories are jagged: each field is a flat ``values[L]`` tensor with shared ``offsets[B+1]``
(``L = offsets[-1]``), oldest event first within each row, never padded. Categorical features are
a torchrec ``KeyedJaggedTensor``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class BatchPosition:
    """Where a batch came from in the data stream; enough to resume exactly after it.

    ``stream`` identifies one (rank, worker) stream, ``index`` is the batch's ordinal in it.
    """

    epoch: int
    stream: int
    index: int


@dataclass
class JaggedBatch:
    """A batch of ``B`` impressions with jagged histories.

    Attributes:
        history: ``{"item_ids", "actions", "timestamps", "domains"}`` -> ``values[L]`` (int64).
        offsets: ``[B+1]`` int64 row boundaries into every history field.
        max_len: longest history in this batch (``<=`` the configured cap).
        sparse: KJT with one key per categorical feature, ``B`` bags each.
        dense: ``[B, D]`` float32 (``D`` may be 0).
        candidate: ``[B]`` item id being scored.
        domain: ``[B]`` surface id.
        timestamp: ``[B]`` impression time.
        user_id: ``[B]``.
        example_id: ``[B]``.
        labels: task -> ``[B]`` float32 in {0, 1} (0 where absent).
        label_mask: task -> ``[B]`` bool, True where the label is present.
        oracle: task -> ``[B]`` true probability (synthetic data only; empty otherwise).
        position: stream position of this batch, for exact resume (None outside training).
    """

    history: dict[str, torch.Tensor]
    offsets: torch.Tensor
    max_len: int
    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    candidate: torch.Tensor
    domain: torch.Tensor
    timestamp: torch.Tensor
    user_id: torch.Tensor
    example_id: torch.Tensor
    labels: dict[str, torch.Tensor]
    label_mask: dict[str, torch.Tensor]
    oracle: dict[str, torch.Tensor] = field(default_factory=dict)
    position: BatchPosition | None = None

    @property
    def batch_size(self) -> int:
        return int(self.candidate.numel())

    @property
    def num_tokens(self) -> int:
        """``L``, from a shape: reading ``offsets[-1]`` would sync a GPU batch with the host."""
        return self.history["item_ids"].shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` history length per row."""
        return self.offsets[1:] - self.offsets[:-1]

    def _map(self, fn) -> JaggedBatch:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = fn(v)
            elif isinstance(v, dict):
                out[f.name] = {k: fn(t) for k, t in v.items()}
        return replace(self, **out)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedBatch:
        moved = self._map(lambda t: t.to(device, non_blocking=non_blocking))
        moved.sparse = self.sparse.to(torch.device(device), non_blocking=non_blocking)
        return moved

    def pin_memory(self) -> JaggedBatch:
        pinned = self._map(lambda t: t.pin_memory())
        pinned.sparse = self.sparse.pin_memory()
        return pinned


def take_rows(batch: JaggedBatch, rows: torch.Tensor) -> JaggedBatch:
    """The batch restricted to ``rows[R]`` (int64 row indices, in that order): histories, features, labels.

    The KJT keeps every key, each with ``R`` bags; ``position`` is kept, since the global batch it
    came from is what the data position counts.
    """
    lengths = batch.lengths[rows]
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    tokens = jagged_index(batch.offsets, rows, lengths)
    keys, per_key = batch.sparse.keys(), batch.sparse.to_dict()
    bags = [per_key[k] for k in keys]
    bag_lengths = [jt.lengths()[rows] for jt in bags]
    bag_values = [jt.values()[jagged_index(jt.offsets(), rows, n)] for jt, n in zip(bags, bag_lengths, strict=True)]
    sparse = KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(bag_values) if bags else batch.sparse.values()[:0],
        lengths=torch.cat(bag_lengths).to(torch.int32) if bags else batch.sparse.lengths()[:0],
        stride=len(rows),
    )
    return replace(
        batch,
        history={k: v[tokens] for k, v in batch.history.items()},
        offsets=offsets,
        max_len=int(lengths.max()) if len(rows) else 0,
        sparse=sparse,
        dense=batch.dense[rows],
        candidate=batch.candidate[rows],
        domain=batch.domain[rows],
        timestamp=batch.timestamp[rows],
        user_id=batch.user_id[rows],
        example_id=batch.example_id[rows],
        labels={k: v[rows] for k, v in batch.labels.items()},
        label_mask={k: v[rows] for k, v in batch.label_mask.items()},
        oracle={k: v[rows] for k, v in batch.oracle.items()},
    )


def jagged_index(offsets: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Flat value indices ``[sum(lengths)]`` of ``rows`` in a jagged tensor with ``offsets[B+1]``."""
    starts = offsets[rows].to(torch.int64)
    lengths = lengths.to(torch.int64)
    row_of_value = torch.repeat_interleave(torch.arange(len(rows), device=lengths.device), lengths)
    first_of_row = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
    return starts[row_of_value] + torch.arange(int(lengths.sum()), device=lengths.device) - first_of_row[row_of_value]
