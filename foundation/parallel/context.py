"""Context parallel token layout: which of a jagged batch's tokens each cp rank holds (zigzag).

Causal attention work grows along a sequence (token ``i`` attends to ``i + 1`` keys), so cutting
each sequence into ``cp`` contiguous pieces would give the last rank most of the work. Zigzag
cuts every sequence into ``2 * cp`` near-equal chunks and gives rank ``r`` chunks ``r`` and
``2 * cp - 1 - r``: one cheap early chunk and one expensive late one, so every rank does about the
same work. Each rank then computes attention for its own query tokens against the whole
sequence's keys and values (all-gathered across the cp group), keeping the tokens' global
positions for the causal mask, the relative bias and ``num_targets`` (a token is a target when
its position is at least its sequence's length minus ``num_targets``, whichever rank holds it).

This module only computes the layout; the K/V gather through the kernels dispatcher is not wired
into the HSTU blocks yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ContextShard:
    """One cp rank's share of a jagged batch.

    Attributes:
        token_index: ``[L_r]`` int64 indices into the batch's ``[L]`` tokens, ordered by row then
            position (so ``values[token_index]`` is this rank's jagged tensor).
        offsets: ``[B+1]`` row boundaries into ``token_index``.
        positions: ``[L_r]`` each token's position inside its own sequence (for causal masks and
            relative position bias).
    """

    token_index: torch.Tensor
    offsets: torch.Tensor
    positions: torch.Tensor


def chunk_bounds(length: int, num_chunks: int) -> list[int]:
    """``num_chunks + 1`` boundaries cutting ``length`` tokens into near-equal chunks (earlier chunks longer)."""
    base, extra = divmod(length, num_chunks)
    bounds = [0]
    for c in range(num_chunks):
        bounds.append(bounds[-1] + base + int(c < extra))
    return bounds


def zigzag_shard(offsets: torch.Tensor, cp_size: int, cp_rank: int) -> ContextShard:
    """The tokens of ``offsets[B+1]`` that cp rank ``cp_rank`` of ``cp_size`` holds, zigzag-balanced."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank} (cp_size={cp_size})")
    chunks = (cp_rank, 2 * cp_size - 1 - cp_rank)
    index, positions, lengths = [], [], []
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        bounds = chunk_bounds(end - start, 2 * cp_size)
        mine = [torch.arange(bounds[c], bounds[c + 1]) for c in chunks]
        row = torch.cat(mine)
        positions.append(row)
        index.append(row + start)
        lengths.append(row.numel())
    empty = torch.zeros(0, dtype=torch.int64)
    return ContextShard(
        token_index=torch.cat([empty, *index]),
        offsets=torch.cat(
            [torch.zeros(1, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64).cumsum(0)]
        ),
        positions=torch.cat([empty, *positions]),
    )


def causal_work(shard: ContextShard) -> int:
    """Query-key pairs this rank's tokens attend to under a causal mask (``position + 1`` each)."""
    return int((shard.positions + 1).sum())
