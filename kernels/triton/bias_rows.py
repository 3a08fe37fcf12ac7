"""Deterministic bias-table gradients on the host side: the dQ programs' rows, and their sum in a fixed order.

With ``GEM_KERNELS_DETERMINISTIC=1`` every dQ program writes its part of the table gradients into a row of its
own, with plain stores (:mod:`kernels.triton.bias`); here the rows are allocated and summed: over the batch's
sequences and a sequence's row blocks by ``torch.sum`` (a fixed reduction order), then the position row's signed
distances folded into table entries by slices. Nothing depends on the order the programs ran in.

Memory: ``B * H * cdiv(N, BLOCK_M)`` rows of ``2 * (N + 3 * BLOCK_M)`` floats for a causal position table
(``N`` more per half without the causal mask), and of ``T`` for a time table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BiasGradRows:
    """Per-program table-gradient rows of one dQ launch.

    Attributes:
        position: ``[programs, 2, LD]`` float32 or None; half 0 holds history scores by ``e = offset + m - n``,
            half 1 the target rows' scores by ``e = offset + n_hist - n``.
        time: ``[programs, T]`` float32 or None.
        offset: ``OFF``, the ``e`` of distance 0.
        blocks: row blocks per (sequence, head): the grid is ``B * H * blocks`` programs.
    """

    position: torch.Tensor | None
    time: torch.Tensor | None
    offset: int
    blocks: int


def build_bias_grad_rows(
    pos_bias: torch.Tensor | None,
    time_bias: torch.Tensor | None,
    batch_heads: int,
    max_q_len: int,
    max_kv_len: int,
    causal: bool,
    block_m: int,
) -> BiasGradRows:
    """Zeroed rows for a dQ grid of ``batch_heads * cdiv(max_q_len, block_m)`` programs.

    A program's tiles reach ``e`` from ``offset + m_start - n_start - block_m`` (its last key tile, at most
    ``block_m`` keys past its queries when causal, the whole row otherwise) to ``offset + m_start + block_m``.
    """
    blocks = -(-max_q_len // block_m)
    offset = 2 * block_m + (0 if causal else max_kv_len)
    width = offset + max_q_len + block_m
    device = (pos_bias if pos_bias is not None else time_bias).device
    programs = batch_heads * blocks
    return BiasGradRows(
        position=None if pos_bias is None else torch.zeros(programs, 2, width, device=device),
        time=None if time_bias is None else torch.zeros(programs, time_bias.shape[1], device=device),
        offset=offset,
        blocks=blocks,
    )


def _per_table_row(rows: torch.Tensor, heads: int, blocks: int, table_rows: int) -> torch.Tensor:
    """``[B * H * blocks, ...]`` program rows -> ``[table_rows, ...]`` sums: per head, or over every head of a
    shared ``[1, ...]`` table. Program ``((b * H) + h) * blocks + i`` ran (sequence rank b, head h)."""
    per_head = rows.view(-1, heads, blocks, *rows.shape[1:]).sum(dim=(0, 2))
    return per_head.sum(0, keepdim=True) if table_rows == 1 else per_head


def _fold_nonnegative(rows: torch.Tensor, offset: int, size: int) -> torch.Tensor:
    """``[..., W]`` sums by ``e = offset + d`` for ``d >= 0`` -> ``[..., size]`` by entry ``min(d, size - 1)``."""
    padded = F.pad(rows, (0, size))
    far = padded[..., offset + size - 1 :].sum(-1, keepdim=True)
    return torch.cat([padded[..., offset : offset + size - 1], far], -1)


def sum_position_rows(grad_rows: BiasGradRows, heads: int, table_rows: int, size: int) -> torch.Tensor:
    """The ``[table_rows, size]`` position-table gradient: entry ``min(|d|, size - 1)`` of distance ``d``."""
    by_e = _per_table_row(grad_rows.position, heads, grad_rows.blocks, table_rows).sum(1)
    offset = grad_rows.offset
    # Negative distances, mirrored: index k holds d = -k (k = 0 is counted with the non-negative ones).
    mirrored = F.pad(by_e[..., :offset].flip(-1), (1, 0))
    return _fold_nonnegative(by_e, offset, size) + _fold_nonnegative(mirrored, 0, size)


def sum_time_rows(grad_rows: BiasGradRows, heads: int, table_rows: int) -> torch.Tensor:
    """The ``[table_rows, T]`` time-table gradient."""
    return _per_table_row(grad_rows.time, heads, grad_rows.blocks, table_rows)
