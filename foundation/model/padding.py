"""Static-shape batches: a token-budgeted batch padded to a fixed token count and one of a few row counts.

A CUDA graph replays the kernels it captured on the buffers it captured them with, so every batch it serves
must have the same shapes: ``L`` history tokens, ``B`` rows and the attention's ``max_len`` (which sizes its
grid). :func:`pad_batch` appends padding rows to a batch until it has exactly ``StaticShapes.tokens`` tokens
and the smallest of ``StaticShapes.rows`` that fits, and sets ``max_len`` to the cap every real row already
respects.

Why padding changes neither the loss nor a gradient (``tests/test_teacher_padding.py`` checks both):

- every padding row comes after the real rows and attends only to itself (attention, PMA, the K most recent
  tokens and every per-row block work within a row), so the real rows' outputs are those of the batch alone;
- the click/conversion losses mask a padding row's labels (``label_mask`` False), and the generative loss
  weighs its positions by ``row_is_real``: the padding rows' terms are multiplied by zero, so the gradient
  they send back is exactly zero (their values are finite: empty feature bags pool to zero);
- the shared negatives are drawn with a fixed shape (``num_negatives``), whatever the batch; in-batch
  negatives leave the padding rows' candidates out.

The attention's ``1/N`` is HSTU's fixed ``attention_norm``, not ``max_len``, so a larger ``max_len`` changes
the output only by rounding. Per-position negatives (``negatives="position"``) and dropout draw random
numbers per token, so a padded batch draws other numbers than the unpadded one (the same distribution).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import IterableDataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from foundation.data.batch import JaggedBatch, take_rows


@dataclass(frozen=True)
class StaticShapes:
    """The shapes of a bucketed batch.

    Attributes:
        tokens: history tokens of every padded batch (the token budget: no batch has more).
        rows: the row counts a padded batch may have, ascending ("buckets"); a batch takes the smallest that
            holds its rows and the padding rows its missing tokens need.
        max_len: the longest history a row may have (the data's truncation); every padded batch's ``max_len``.
    """

    tokens: int
    rows: tuple[int, ...]
    max_len: int

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.max_len < 1:
            raise ValueError(f"static shapes need positive tokens and max_len, got {self.tokens}, {self.max_len}")
        if not self.rows or list(self.rows) != sorted(set(self.rows)) or self.rows[0] < 1:
            raise ValueError(f"static shapes: rows must be ascending positive counts, got {self.rows}")

    def rows_needed(self, rows: int, tokens: int) -> int | None:
        """The rows a batch of ``rows`` rows and ``tokens`` tokens has once padded (its own and the padding rows
        its missing tokens need), or None when it has more tokens than ``tokens``."""
        if tokens > self.tokens:
            return None
        return rows + -(-(self.tokens - tokens) // self.max_len)

    def holds(self, rows: int, tokens: int, bucket: int) -> bool:
        """Whether a batch of ``rows`` rows and ``tokens`` tokens fits ``bucket`` rows once padded."""
        needed = self.rows_needed(rows, tokens)
        return needed is not None and needed <= bucket

    def rows_for(self, rows: int, tokens: int) -> int | None:
        """The bucket of a batch of ``rows`` rows and ``tokens`` tokens, or None when none holds it (or it
        has more tokens than ``tokens``)."""
        needed = self.rows_needed(rows, tokens)
        return None if needed is None else next((r for r in self.rows if r >= needed), None)


def static_shapes(tokens: int, max_len: int, rows: str | tuple[int, ...]) -> StaticShapes:
    """:class:`StaticShapes` from a ``"128,256,512"``-style list of row counts (or a tuple of them)."""
    if isinstance(rows, str):
        try:
            rows = tuple(int(r) for r in rows.split(",") if r.strip())
        except ValueError as err:
            raise ValueError(f"bucket rows must be comma-separated integers, got {rows!r}") from err
    return StaticShapes(tokens=tokens, rows=tuple(rows), max_len=max_len)


@dataclass
class PaddedBatch(JaggedBatch):
    """A :class:`JaggedBatch` padded to static shapes: rows ``real_rows:`` are padding (module doc).

    Attributes:
        row_is_real: ``[B]`` bool, False on the padding rows (a tensor, so a captured graph reads it).
        real_rows, real_tokens: the batch's own rows and history tokens (host ints, for accounting).
    """

    row_is_real: torch.Tensor | None = None
    real_rows: int = 0
    real_tokens: int = 0


def pad_batch(batch: JaggedBatch, shapes: StaticShapes, rows: int | None = None) -> PaddedBatch | None:
    """``batch`` padded to ``shapes`` (module doc), or None when no bucket holds it.

    The padding rows come after the real ones: first as many rows of ``shapes.max_len`` tokens (the last one
    shorter) as the missing tokens need, then empty rows up to the bucket. Their ids, times and features are
    zeros, their feature bags empty, their labels absent. Works on host (or device) tensors alike. ``rows``:
    pad to that bucket of ``shapes`` (None when it does not hold the batch) instead of the smallest that holds it.
    """
    if isinstance(batch, PaddedBatch):
        raise ValueError("pad_batch: the batch is padded already")
    b, num_tokens = batch.batch_size, batch.num_tokens
    if batch.max_len > shapes.max_len:
        raise ValueError(f"pad_batch: a row has {batch.max_len} history tokens, more than max_len={shapes.max_len}")
    if rows is None:
        rows = shapes.rows_for(b, num_tokens)
    elif rows not in shapes.rows:
        raise ValueError(f"pad_batch: {rows} rows is not a bucket of {shapes.rows}")
    elif not shapes.holds(b, num_tokens, rows):
        rows = None
    if rows is None:
        return None
    pad_rows, pad_tokens = rows - b, shapes.tokens - num_tokens
    full, rest = divmod(pad_tokens, shapes.max_len)
    pad_lengths = [shapes.max_len] * full + ([rest] if rest else [])
    pad_lengths += [0] * (pad_rows - len(pad_lengths))
    offsets = batch.offsets
    lengths = torch.tensor(pad_lengths, dtype=offsets.dtype, device=offsets.device)
    padded = {
        "history": {k: _pad(v, pad_tokens) for k, v in batch.history.items()},
        "offsets": torch.cat([offsets, offsets[-1:] + lengths.cumsum(0)]),
        "max_len": shapes.max_len,
        "sparse": _pad_bags(batch.sparse, pad_rows),
        "dense": _pad(batch.dense, pad_rows),
        "candidate": _pad(batch.candidate, pad_rows),
        "domain": _pad(batch.domain, pad_rows),
        "timestamp": _pad(batch.timestamp, pad_rows),
        "user_id": _pad(batch.user_id, pad_rows),
        "example_id": _pad(batch.example_id, pad_rows, fill=-1),
        "labels": {k: _pad(v, pad_rows) for k, v in batch.labels.items()},
        "label_mask": {k: _pad(v, pad_rows) for k, v in batch.label_mask.items()},
        "oracle": {k: _pad(v, pad_rows) for k, v in batch.oracle.items()},
    }
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(JaggedBatch)}
    return PaddedBatch(
        **{**fields, **padded},
        row_is_real=torch.arange(rows, device=offsets.device) < b,
        real_rows=b,
        real_tokens=num_tokens,
    )


def bucket_stand_in(batch: JaggedBatch, shapes: StaticShapes, rows: int) -> PaddedBatch | None:
    """A batch of bucket ``rows`` made from ``batch``'s real rows (a padded batch's are its first
    ``real_rows``): as many of its first rows as the bucket holds with the padding rows the token budget then
    needs, or None when not even its first row fits (a bucket too small for the budget's tokens).

    A stand-in has a bucket's shapes and real values, for whatever must see every bucket before training does
    (:meth:`gem.loop.StaticStep.prepare` warms up and captures each bucket's step on one). Reads offsets."""
    real = batch.real_rows if isinstance(batch, PaddedBatch) else batch.batch_size
    ends = batch.offsets.tolist()
    kept = next((k for k in range(real, 0, -1) if shapes.holds(k, ends[k] - ends[0], rows)), None)
    if kept is None:
        return None
    unpadded = JaggedBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(JaggedBatch)})
    return pad_batch(take_rows(unpadded, torch.arange(kept, device=batch.offsets.device)), shapes, rows=rows)


class PaddedBatches(IterableDataset):
    """A stream's batches padded to ``shapes`` (:func:`pad_batch`), for a ``DataLoader`` to pad in its workers
    (and pin as usual); a batch no bucket holds passes unpadded. The stream keeps its other roles (epoch,
    resume position): a padded batch carries its batch's ``position``."""

    def __init__(self, stream: Iterable[JaggedBatch], shapes: StaticShapes) -> None:
        self.stream, self.shapes = stream, shapes

    def __iter__(self) -> Iterator[JaggedBatch]:
        for batch in self.stream:
            yield pad_batch(batch, self.shapes) or batch


def _pad(t: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """``t[N, ...]`` followed by ``n`` rows of ``fill``."""
    return torch.cat([t, t.new_full((n, *t.shape[1:]), fill)])


def _pad_bags(sparse: KeyedJaggedTensor, n: int) -> KeyedJaggedTensor:
    """The KJT with ``n`` empty bags appended to every key (the values do not change)."""
    keys = sparse.keys()
    if not keys:
        return KeyedJaggedTensor(keys=[], values=sparse.values(), lengths=sparse.lengths(), stride=sparse.stride() + n)
    lengths = sparse.lengths().view(len(keys), -1)
    lengths = torch.cat([lengths, lengths.new_zeros(len(keys), n)], dim=1).flatten()
    return KeyedJaggedTensor(
        keys=keys,
        values=sparse.values(),
        weights=sparse.weights_or_none(),
        lengths=lengths,
        stride=sparse.stride() + n,
        length_per_key=sparse.length_per_key(),
    )


def real_tokens_and_rows(batch: JaggedBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(token_is_real[L], row_is_real[B])`` bool of a :class:`PaddedBatch` (computed on its device from
    tensors, so a captured graph recomputes them), or None for a batch without padding."""
    if not isinstance(batch, PaddedBatch):
        return None
    tokens = torch.repeat_interleave(batch.row_is_real, batch.lengths, output_size=batch.num_tokens)
    return tokens, batch.row_is_real
