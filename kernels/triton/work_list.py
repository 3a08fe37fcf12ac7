"""A compact launch grid for jagged batches: one program per row block that holds rows.

The attention kernels' full grid is ``B * H * cdiv(max_rows, BLOCK)`` programs, sized for every sequence
being the longest; a program past the end of its sequence returns at once. A batch of a few long sequences
and many short ones (heavy-tailed histories, or rows padded to a static bucket) launches mostly such
programs, and each still takes a slot of an SM, loads its sequence's offsets and exits. Only
``sum_b cdiv(len_b, BLOCK) <= cdiv(L, BLOCK) + B`` blocks hold rows, a bound known on the host from the
tensors' shapes (no device sync, the same for every batch of a static shape, so CUDA graphs keep it).

:func:`build_work_list` lists, per program of that compact grid, which (sequence, head, block) it owns, in
the full grid's order (sequences in the launch order, a (sequence, head)'s blocks consecutive, descending or
ascending); programs past the list's end get a block past every sequence and return as before.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton.per_batch import per_batch

# The block a program past the list's end gets: its first row, ``block * BLOCK``, is past every sequence
# (2**30 rows) and still fits the kernels' int32 row arithmetic.
_PAST_ROWS = 1 << 30


def compact_programs(total_rows: int, batch: int, max_rows: int, block: int) -> int | None:
    """Programs per head of the compact grid, ``cdiv(total_rows, block) + batch``, or None where that is not
    fewer than the full grid's ``batch * cdiv(max_rows, block)``.

    Args:
        total_rows: the rows of all sequences together (the tensor's first dimension).
        batch: sequences ``B``.
        max_rows: the most rows of any sequence (the full grid's row count).
        block: rows per program.
    """
    compact = triton.cdiv(total_rows, block) + batch
    return compact if compact < batch * triton.cdiv(max_rows, block) else None


def build_work_list(
    offsets: torch.Tensor, order: torch.Tensor, heads: int, block: int, programs: int, descending: bool, name: str
) -> torch.Tensor:
    """``[heads * programs, 2]`` int32 ``(sequence * heads + head, block)`` per program of the compact grid.

    Args:
        offsets: ``[B+1]`` row offsets of the sequences the blocks split (queries or keys).
        order: ``[B]`` int32 sequence indices in launch order.
        heads: ``H``.
        block: rows per program.
        programs: programs per head (:func:`compact_programs`).
        descending: a sequence's blocks last first (causal query blocks), else first first.
        name: the :func:`kernels.triton.per_batch.per_batch` slot: the list is built once per batch and pass.
    """

    def build() -> torch.Tensor:
        lengths = (offsets[1:] - offsets[:-1])[order.long()]
        blocks = (lengths + block - 1) // block
        per_sequence = blocks * heads
        ends = per_sequence.cumsum(0)
        pid = torch.arange(heads * programs, device=offsets.device, dtype=ends.dtype)
        rank = torch.searchsorted(ends, pid, right=True)
        past = rank >= order.numel()
        rank = rank.clamp_(max=max(order.numel() - 1, 0))
        local = pid - (ends[rank] - per_sequence[rank])
        count = blocks[rank].clamp(min=1)
        head = local // count
        index = local % count
        if descending:
            index = count - 1 - index
        sequence_head = order.long()[rank] * heads + head
        index = torch.where(past, _PAST_ROWS // block, index)
        sequence_head = torch.where(past, 0, sequence_head)
        return torch.stack([sequence_head, index], dim=1).to(torch.int32)

    return per_batch(name, (offsets, order), build, extra=(heads, block, programs, descending))
