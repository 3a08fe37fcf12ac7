"""Triton self-gate ``x * sigmoid(g)`` (the InterFormer summary's gate), forward and backward in one pass each.

Eager PyTorch runs the sigmoid and the product as two kernels forward and three backward (the product's two
gradients and the sigmoid's), each reading and writing its tensors again; on the summary's small ``[B, T, d]``
tokens every launch costs more than its bytes. Here the forward reads ``x`` and ``g`` once and writes ``y``; the
backward reads ``dy``, ``x`` and ``g`` once and writes ``dx`` and ``dg``. The sigmoid is computed in float32.

Works on triton 3.6 and 3.9, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
NUM_WARPS = 4


# The element count changes with the batch: specialising on its divisibility would compile twice.
@triton.jit(do_not_specialize=["n"])
def _gate_fwd_kernel(x_ptr, g_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (x * tl.sigmoid(g)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n"])
def _gate_bwd_kernel(dy_ptr, x_ptr, g_ptr, dx_ptr, dg_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    tl.store(dx_ptr + offs, (dy * sig).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + offs, (dy * x * sig * (1.0 - sig)).to(dg_ptr.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


class _SigmoidGateFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        x, g = x.contiguous(), g.contiguous()
        y = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(x.dtype, g.dtype))
        if x.numel():
            _gate_fwd_kernel[_grid(x.numel())](x, g, y, x.numel(), BLOCK=BLOCK, num_warps=NUM_WARPS)
        ctx.save_for_backward(x, g)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, g = ctx.saved_tensors
        dy = dy.contiguous()
        dx, dg = torch.empty_like(x), torch.empty_like(g)
        if x.numel():
            _gate_bwd_kernel[_grid(x.numel())](dy, x, g, dx, dg, x.numel(), BLOCK=BLOCK, num_warps=NUM_WARPS)
        return dx, dg


def sigmoid_gate(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`kernels.pytorch.silu_split.sigmoid_gate`."""
    return _SigmoidGateFn.apply(x, g)
