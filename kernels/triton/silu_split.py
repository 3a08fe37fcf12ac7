"""Triton SiLU of a projection split into its parts, whose backward writes the input gradient once.

The HSTU block applies SiLU to its ``[L, 4·H·D]`` ``uvqk`` projection and splits it into ``u, v, q, k``. Forward,
eager PyTorch already does this in one pass (the parts are views). Backward, autograd first concatenates the four
parts' gradients into a new ``[L, N]`` tensor (a read and a write of it), then SiLU's backward reads that and
``h`` and writes ``dh``. Here each part's gradient is read where its consumer wrote it, with the matching columns
of ``h``, and its columns of ``dh`` are written once: the concatenation's read and write are gone. A part with no
gradient (unused) has its columns of ``dh`` zero-filled.

With a ``bias`` (the projection's, left out of its GEMM) the kernels add it in float32 before the SiLU, and the
backward sums the bias gradient as the LayerNorm's backward sums its weight's (:mod:`kernels.triton.group_sums`):
each program stores its row tile's column sums of ``dh``, and the last of each group of ``GROUP`` row tiles to finish
(an arrival count per group and column tile) adds the group's in row order. No reduction over the whole ``[L, N]``
gradient, and none of the partial sums in a launch of its own.

``gate_first`` (the HSTU block's ``u``, which only gates the attention's norm): the gate's columns are neither
activated nor written here; the gated norm (:mod:`kernels.triton.layer_norm`) activates them as it reads them and
writes their pre-activation gradient into the columns of ``dh`` it is handed (:class:`~kernels.glue.GateGrad`), so
the gate costs no pass of its own either way.

Works on triton 3.6 and 3.9, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.glue import GateGrad, SiluGate
from kernels.triton.group_sums import GroupSums, arrived_last, put_group_sum, sum_partials

# A 32 x 128 tile per program, rows in contiguous 256-byte (bf16) runs: at the `large` teacher's shapes its
# backward beat 16 x 256 tiles (docs/benchmarks.md, session 28); fixed, so it compiles once. Module constants, so
# that `experiments/bench_glue.py --launches` can time other launch shapes through the real op.
BLOCK_M = 32
BLOCK_N = 128
NUM_WARPS = 4
# Row tiles whose bias-gradient partial sums the last of them to finish adds up.
GROUP = 16


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows (int64), columns and mask."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, (rows < M)[:, None] & (cols < N)[None, :]


# The token count changes with every batch: specialising on its divisibility would compile twice.
@triton.jit(do_not_specialize=["M"])
def _silu_fwd_kernel(
    h_ptr, b_ptr, y_ptr, M, N, stride_h, stride_y, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    h = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], (h * tl.sigmoid(h)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _silu_bwd_kernel(
    dy_ptr, h_ptr, b_ptr, dh_ptr, partial_ptr, sums_ptr, count_ptr, M, N, stride_dy, stride_h, stride_dh,
    stride_partial, stride_sums, stride_count,
    HAS_BIAS: tl.constexpr, ATOMIC_TOTALS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """With ``HAS_BIAS``: ``partial_ptr`` ``[row tiles, N]`` float32, each program's column sums of ``dh``;
    ``count_ptr`` ``[groups, column tiles]`` int32 zeros; ``sums_ptr``: ``ATOMIC_TOTALS``: ``[N]`` float32 zeros, the
    bias gradient; else ``[groups, N]``, each group's sums."""
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    sig = tl.sigmoid(h)
    dh = dy * sig * (1.0 + h * (1.0 - sig))
    tl.store(dh_ptr + rows[:, None] * stride_dh + cols[None, :], dh.to(dh_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:  # this row tile's share of the bias gradient (rows past M have dy = 0)
        tile = tl.program_id(0)
        cols_ok = cols < N
        tl.store(partial_ptr + tile * stride_partial + cols, tl.sum(dh, axis=0), mask=cols_ok)
        group = tile // GROUP
        first = group * GROUP
        size = tl.minimum(GROUP, tl.num_programs(0) - first)
        if arrived_last(count_ptr + group * stride_count + tl.program_id(1), size):
            total = sum_partials(partial_ptr, stride_partial, first, size, cols, cols_ok)
            put_group_sum(sums_ptr, stride_sums, group, total, cols, cols_ok, ATOMIC_TOTALS)


def _grid(m: int, n: int) -> tuple[int, int]:
    return triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)


class _SiluSplitFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias, widths, gate):
        """``gate``: a :class:`~kernels.glue.GateGrad` when the first part is a gate left un-activated (its columns of
        ``h`` returned as they are, a view), else None."""
        h = h if h.stride(-1) == 1 else h.contiguous()
        m, n = h.shape
        start = gate.width if gate is not None else 0
        y = torch.empty(m, n - start, device=h.device, dtype=h.dtype)
        if m and n - start:
            _silu_fwd_kernel[_grid(m, n - start)](
                h[:, start:], h if bias is None else bias[start:], y, m, n - start, h.stride(0), y.stride(0),
                HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
            )
        ctx.save_for_backward(h, bias)
        ctx.widths, ctx.gate = widths, gate
        ctx.set_materialize_grads(False)
        parts = y.split(widths[1:] if gate is not None else widths, -1)
        return (h[:, :start], *parts) if gate is not None else tuple(parts)

    @staticmethod
    def backward(ctx, *grads):
        h, bias = ctx.saved_tensors
        m = h.shape[0]
        gate = ctx.gate
        # The gate's gradient already lies in the gate's columns of the buffer its norm was handed (GateGrad).
        in_place = gate is not None and gate.holds(grads[0])
        dh = gate.take() if gate is not None else None
        if dh is None:
            dh = torch.empty_like(h, memory_format=torch.contiguous_format)
        sums = None if bias is None else _BiasSums(m, ctx.widths, h.device)
        start = 0
        for i, (width, dy) in enumerate(zip(ctx.widths, grads, strict=True)):
            cols = slice(start, start + width)
            if gate is not None and i == 0:  # un-activated here: its gradient is the pre-activation's
                # (and its bias's comes from the gate's consumer: its columns of the totals stay zero)
                if dy is None:
                    dh[:, cols].zero_()
                elif not in_place:
                    dh[:, cols].copy_(dy)
            elif dy is None:
                dh[:, cols].zero_()
            elif m and width:
                dy = dy if dy.stride(-1) == 1 else dy.contiguous()
                partial, totals, counts = sums.part(i, cols) if sums is not None else (dh, dh, dh)
                _silu_bwd_kernel[_grid(m, width)](
                    dy, h[:, cols], h if bias is None else bias[cols], dh[:, cols], partial, totals, counts, m, width,
                    dy.stride(0), h.stride(0), dh.stride(0), partial.stride(0), totals.stride(0),
                    counts.stride(0), HAS_BIAS=bias is not None, ATOMIC_TOTALS=sums is None or sums.atomic,
                    GROUP=GROUP, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
                )
            start += width
        return dh, None if sums is None else sums.total().to(bias.dtype), None, None


class _BiasSums(GroupSums):
    """The backward's bias-gradient sums over its row tiles (``N`` the parts' widths in all), an arrival count per
    group and column tile of every part."""

    def __init__(self, m: int, widths: tuple[int, ...], device: torch.device) -> None:
        tiles = [triton.cdiv(w, BLOCK_N) for w in widths]
        super().__init__(triton.cdiv(m, BLOCK_M), GROUP, sum(widths), device, count_columns=sum(tiles))
        self.tile_starts = [sum(tiles[:i]) for i in range(len(widths))]

    def part(self, index: int, cols: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(partial, sums, counts)`` of part ``index`` (its columns ``cols``), as its launch indexes them."""
        return self.partial[:, cols], self.sums[..., cols], self.counts[:, self.tile_starts[index]:]


def silu_split(h, widths, bias=None, *, gate_first=False):
    """Same contract as :func:`kernels.pytorch.silu_split.silu_split`. With ``gate_first`` the gate's
    :class:`~kernels.glue.GateGrad` takes the gradient the Triton norm writes for it, in place in ``dh``."""
    widths = tuple(widths)
    if not gate_first:
        return _SiluSplitFn.apply(h, bias, widths, None)
    grad = GateGrad(h, widths[0])
    pre, *rest = _SiluSplitFn.apply(h, bias, widths, grad)
    return (SiluGate(pre, None if bias is None else bias[: widths[0]], grad), *rest)
