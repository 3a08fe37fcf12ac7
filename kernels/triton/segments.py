"""Triton backward for :func:`kernels.jagged_broadcast`: a per-row (segment) sum of token gradients.

The forward is a plain gather (``index_select``). Its autograd backward would be ``index_add_``,
which on the GPU either serialises on atomics (every token of a row adds into the same ``N``
addresses) or, as advanced indexing's ``index_put_(accumulate=True)``, sorts the indices first. Rows
are contiguous runs of tokens, so the backward is a segment sum: one program per (row, column block)
walks its row's tokens in ``BLOCK_L x BLOCK_N`` tiles and accumulates in float32. Deterministic (no
atomics); the row boundaries come from ``searchsorted`` on the sorted rows, without a host sync.

Works on triton 3.6 and 3.9, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_L = 32


@triton.jit
def _segment_sum_kernel(
    x_ptr, offsets_ptr, out_ptr, N, stride_x, stride_out, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    start = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    acc = tl.zeros((BLOCK_L, BLOCK_N), dtype=tl.float32)
    for first in range(start, end, BLOCK_L):
        tokens = first + tl.arange(0, BLOCK_L)
        mask = (tokens < end)[:, None] & col_ok[None, :]
        tile = tl.load(x_ptr + tokens[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0)
        acc += tile.to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, tl.sum(acc, axis=0), mask=col_ok)


def _block_n(n: int) -> int:
    # Narrow column blocks give a few long rows (4,096-token histories, B of 4) enough programs.
    return min(64, triton.next_power_of_2(max(n, 1)))


def segment_sum(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x[L, N]`` (rows contiguous), ``offsets[B+1]`` -> ``[B, N]`` float32 sums of each row's tokens."""
    batch, n = offsets.numel() - 1, x.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(batch, n, device=x.device, dtype=torch.float32)
    if batch and n:
        block_n = _block_n(n)
        grid = (batch, triton.cdiv(n, block_n))
        _segment_sum_kernel[grid](x, offsets, out, n, x.stride(0), out.stride(0), BLOCK_L=BLOCK_L, BLOCK_N=block_n)
    return out


class _JaggedBroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.batch, ctx.dtype = values.shape[0], values.dtype
        return values.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (rows,) = ctx.saved_tensors
        boundaries = torch.arange(ctx.batch + 1, device=rows.device, dtype=rows.dtype)
        offsets = torch.searchsorted(rows, boundaries)
        return segment_sum(grad, offsets).to(ctx.dtype), None


def jagged_broadcast(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``values[rows]`` with a segment-sum backward; ``rows[L]`` sorted (see module docstring)."""
    return _JaggedBroadcastFn.apply(values, rows)
