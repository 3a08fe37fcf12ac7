"""Triton SiLU of a projection split into its parts, whose backward writes the input gradient once.

The HSTU block applies SiLU to its ``[L, 4·H·D]`` ``uvqk`` projection and splits it into ``u, v, q, k``. Forward,
eager PyTorch already does this in one pass (the parts are views). Backward, autograd first concatenates the four
parts' gradients into a new ``[L, N]`` tensor (a read and a write of it), then SiLU's backward reads that and
``h`` and writes ``dh``. Here each part's gradient is read where its consumer wrote it, with the matching columns
of ``h``, and its columns of ``dh`` are written once: the concatenation's read and write are gone. A part with no
gradient (unused) has its columns of ``dh`` zero-filled.

With a ``bias`` (the projection's, left out of its GEMM) the kernels add it in float32 before the SiLU, and the
backward writes each row tile's column sums of ``dh`` beside ``dh``: the bias gradient is then a reduction of
``[L / BLOCK_M, N]`` float32 partial sums instead of the GEMM backward's reduction of the whole ``[L, N]`` gradient.

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

# A 32 x 128 tile per program, rows in contiguous 256-byte (bf16) runs: at the `large` teacher's shapes its
# backward beat 16 x 256 tiles (docs/benchmarks.md, session 28); fixed, so it compiles once. Module constants, so
# that `experiments/bench_glue.py --launches` can time other launch shapes through the real op.
BLOCK_M = 32
BLOCK_N = 128
NUM_WARPS = 4


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
    dy_ptr, h_ptr, b_ptr, dh_ptr, db_ptr, M, N, stride_dy, stride_h, stride_dh, stride_db,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    sig = tl.sigmoid(h)
    dh = dy * sig * (1.0 + h * (1.0 - sig))
    tl.store(dh_ptr + rows[:, None] * stride_dh + cols[None, :], dh.to(dh_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:  # this row tile's share of the bias gradient (rows past M have dy = 0)
        tl.store(db_ptr + tl.program_id(0) * stride_db + cols, tl.sum(dh, axis=0), mask=cols < N)


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
        # Per row tile and column, float32: the bias gradient is one small reduction of these, not one of dh.
        partial = None if bias is None else torch.empty(
            triton.cdiv(m, BLOCK_M), h.shape[1], device=h.device, dtype=torch.float32
        )
        start = 0
        for i, (width, dy) in enumerate(zip(ctx.widths, grads, strict=True)):
            cols = slice(start, start + width)
            if gate is not None and i == 0:  # un-activated here: its gradient is the pre-activation's
                if partial is not None:  # the gate's bias gradient comes from the gate's consumer
                    partial[:, cols].zero_()
                if dy is None:
                    dh[:, cols].zero_()
                elif not in_place:
                    dh[:, cols].copy_(dy)
            elif dy is None:
                dh[:, cols].zero_()
                if partial is not None:
                    partial[:, cols].zero_()
            elif m and width:
                dy = dy if dy.stride(-1) == 1 else dy.contiguous()
                _silu_bwd_kernel[_grid(m, width)](
                    dy, h[:, cols], h if bias is None else bias[cols], dh[:, cols],
                    dh if partial is None else partial[:, cols], m, width, dy.stride(0), h.stride(0), dh.stride(0),
                    0 if partial is None else partial.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M,
                    BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
                )
            start += width
        return dh, None if partial is None else partial.sum(0).to(bias.dtype), None, None


def silu_split(h, widths, bias=None, *, gate_first=False):
    """Same contract as :func:`kernels.pytorch.silu_split.silu_split`. With ``gate_first`` the gate's
    :class:`~kernels.glue.GateGrad` takes the gradient the Triton norm writes for it, in place in ``dh``."""
    widths = tuple(widths)
    if not gate_first:
        return _SiluSplitFn.apply(h, bias, widths, None)
    grad = GateGrad(h, widths[0])
    pre, *rest = _SiluSplitFn.apply(h, bias, widths, grad)
    return (SiluGate(pre, None if bias is None else bias[: widths[0]], grad), *rest)
