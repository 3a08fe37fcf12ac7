"""Triton LayerNorm fused with a scale on its input, a gate on its output and the cast for the next GEMM, or with
the residual add before it.

``y = dropout(LN(scale * x) * gate).to(out_dtype)``, float32 inside; the dropout's keep mask is an input (drawn
by the caller from PyTorch's generator), read forward and backward in place of eager dropout's own passes (which
read and write ``y`` once more each way). What it saves over eager PyTorch under bf16 autocast, per ``[M, N]`` call: autocast runs LayerNorm in float32, so eager writes a float32
output, multiplies it by the gate into another float32 tensor and casts that to bf16 for the next
GEMM; here one pass reads ``x`` (and the gate) and writes ``y`` in bf16 once. The backward reads
``dy``, ``x`` and the gate once and writes ``dx`` (and ``dgate``). A :class:`~kernels.glue.SiluGate` (the HSTU
block's ``u``) is read as its pre-activation and activated here, ``silu(pre + bias)`` in float32, and its backward
writes the pre-activation's gradient (into the projection's, where the gate's ``GateGrad`` says) and sums the gate
bias's beside the weight's: the split SiLU neither writes the gate nor runs its backward. The weight and bias gradients are
per-program float32 partial sums over a block of rows, added by the last program of each group to finish
(:mod:`kernels.triton.group_sums`): no reduction over the programs in a kernel launch of its own after every call,
and with ``GEM_KERNELS_DETERMINISTIC=1`` gradients that do not depend on which group finished first.

``residual_layer_norm``: ``s = x + branch``, ``y = LN(s)``, both written by one pass that reads ``x`` and the
branch (a block's output added to the float32 residual stream, normalised for the next block). Eager writes
``s``, then reads it again for the norm; backward, it adds the norm's input gradient to the stream's in a pass of
its own and casts the sum for the branch in another. Here the norm's backward reads the stream's gradient and
writes both inputs' gradients. Without a branch the stream passes through and only that gradient add is saved.
Rows of the sum it also returns (``picks``) get their gradient added into the backward's fresh ``dx`` in place.
A bias of the branch passed here (``branch_bias``, its projection's, left out of the GEMM) is added in the same
pass, and its gradient, the column sums of the sum's gradient, comes out of the backward's partial sums beside the
norm's own: no reduction over the ``[M, N]`` branch gradient of its own.

Forward: one program per row, the whole row in one ``BLOCK_N`` tile (``N`` up to 16,384).
Works on triton 3.6 and 3.9, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.glue import SiluGate
from kernels.triton.group_sums import GroupSums, arrived_last, put_group_sum, sum_partials

MAX_N = 16384


@triton.jit
def _gate(pre, gate_bias, GATE_SILU: tl.constexpr, HAS_GATE_BIAS: tl.constexpr):
    """``(gate, d gate / d pre)`` from the gate as read (float32): itself, or ``silu(pre + gate_bias)``."""
    if HAS_GATE_BIAS:
        pre += gate_bias
    if GATE_SILU:
        sig = tl.sigmoid(pre)
        return pre * sig, sig * (1.0 + pre * (1.0 - sig))
    else:
        return pre, tl.full(pre.shape, 1.0, tl.float32)


@triton.jit
def _ln_fwd_kernel(
    x_ptr, r_ptr, rb_ptr, w_ptr, b_ptr, g_ptr, gb_ptr, m_ptr, s_ptr, y_ptr, mean_ptr, rstd_ptr,
    N, stride_x, stride_r, stride_g, stride_m, stride_s, stride_y, scale, eps, keep_scale,
    HAS_RESIDUAL: tl.constexpr, HAS_BRANCH_BIAS: tl.constexpr, HAS_GATE: tl.constexpr, GATE_SILU: tl.constexpr,
    HAS_GATE_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BRANCH_BIAS:
            x += tl.load(rb_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        stored = x.to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + cols, stored, mask=mask)
        x = stored.to(tl.float32)  # the norm of the sum as stored, which the backward reads (a bf16 stream rounds)
    x = x * scale
    mean = tl.sum(x, axis=0) / N
    centred = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = centred * rstd * w + b
    if HAS_GATE:
        pre = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        gate_bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if HAS_GATE_BIAS:
            gate_bias = tl.load(gb_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = y * _gate(pre, gate_bias, GATE_SILU, HAS_GATE_BIAS)[0]
    if HAS_DROPOUT:
        keep = tl.load(m_ptr + row * stride_m + cols, mask=mask, other=0) != 0
        y = tl.where(keep, y * keep_scale, 0.0)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


# The row count changes with every batch: specialising on its divisibility would compile twice.
@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _ln_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, b_ptr, g_ptr, gb_ptr, m_ptr, mean_ptr, rstd_ptr, ds_ptr, dx_ptr, dr_ptr, dg_ptr,
    partial_ptr, group_ptr, count_ptr, M, N, rows_per_program, stride_dy, stride_x, stride_g, stride_m, stride_ds,
    stride_dx, stride_dr, stride_dg, scale, keep_scale,
    HAS_GATE: tl.constexpr, GATE_SILU: tl.constexpr, HAS_GATE_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_STREAM_GRAD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BRANCH_BIAS: tl.constexpr, SUMS: tl.constexpr,
    ATOMIC_TOTALS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``partial_ptr``, ``group_ptr``, ``count_ptr``: a :class:`~kernels.triton.group_sums.GroupSums` of
    ``SUMS * N`` columns: each program's dw, db and, with a branch bias or a gate bias, that bias's gradient (the
    sum's, or the gate's pre-activation's) side by side. ``dg_ptr``: with ``GATE_SILU`` the pre-activation's
    gradient.

    Each program walks its ``rows_per_program`` rows ``ROWS`` at a time as one ``[ROWS, BLOCK_N]`` tile: a thread
    holds the same columns of every row of the tile, so the column sums it adds into ``dw``/``db`` stay in its
    registers. With ``STAGES > 1`` the loop is software-pipelined: the next ``STAGES - 1`` tiles' loads are copied
    into shared memory (``cp.async``) while this one is computed, so the loads in flight are not bounded by the
    registers that the accumulators and the row being computed hold."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    gate_bias = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    if HAS_GATE_BIAS:
        gate_bias = tl.load(gb_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dbb = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # int64 bounds make the rows int64 (ints in the interpreter): no row * stride overflow.
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for start in tl.range(first, last, ROWS, num_stages=STAGES):
        rows = start + tl.arange(0, ROWS)
        row_mask = rows < last
        mask = row_mask[:, None] & col_mask[None, :]
        r = rows[:, None]
        c = cols[None, :]
        x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32) * scale
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        x_hat = tl.where(mask, (x - tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]) * rstd, 0.0)
        dn = tl.load(dy_ptr + r * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            keep = tl.load(m_ptr + r * stride_m + c, mask=mask, other=0) != 0
            dn = tl.where(keep, dn * keep_scale, 0.0)
        if HAS_GATE:
            pre = tl.load(g_ptr + r * stride_g + c, mask=mask, other=0.0).to(tl.float32)
            gate, dgate_dpre = _gate(pre, gate_bias, GATE_SILU, HAS_GATE_BIAS)
            dgate = dn * (x_hat * w + b) * dgate_dpre
            tl.store(dg_ptr + r * stride_dg + c, dgate.to(dg_ptr.dtype.element_ty), mask=mask)
            if HAS_GATE_BIAS:
                dbb += tl.sum(dgate, axis=0)
            dn = dn * gate
        dw += tl.sum(dn * x_hat, axis=0)
        db += tl.sum(dn, axis=0)
        d_hat = dn * w
        mean_dot = tl.sum(d_hat * x_hat, axis=1)[:, None] / N
        mean_d = tl.sum(d_hat, axis=1)[:, None] / N
        dx = (d_hat - x_hat * mean_dot - mean_d) * rstd * scale
        if HAS_STREAM_GRAD:  # the sum's own gradient (the residual stream past this norm) joins the norm's
            dx += tl.load(ds_ptr + r * stride_ds + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + r * stride_dx + c, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_RESIDUAL:
            tl.store(dr_ptr + r * stride_dr + c, dx.to(dr_ptr.dtype.element_ty), mask=mask)
        if HAS_BRANCH_BIAS:
            dbb += tl.sum(dx, axis=0)
    stride = SUMS * N
    tl.store(partial_ptr + pid * stride + cols, dw, mask=col_mask)
    tl.store(partial_ptr + pid * stride + N + cols, db, mask=col_mask)
    if SUMS == 3:
        tl.store(partial_ptr + pid * stride + 2 * N + cols, dbb, mask=col_mask)
    group = pid // GROUP
    first_pid = group * GROUP
    size = tl.minimum(GROUP, tl.num_programs(0) - first_pid)
    if arrived_last(count_ptr + group, size):
        # The SUMS rows as one [4, BLOCK_N] block (rows past SUMS masked off).
        k = tl.arange(0, 4)
        offsets = k[:, None] * N + cols[None, :]
        mask = (k < SUMS)[:, None] & col_mask[None, :]
        total = sum_partials(partial_ptr, stride, first_pid, size, offsets, mask)
        put_group_sum(group_ptr, stride, group, total, offsets, mask, ATOMIC_TOTALS)


def _rows_2d(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[..., N]`` -> ``[M, N]`` with unit column stride (a view where possible)."""
    x2 = x.reshape(-1, n)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


# Backward programs per SM, their warps (at most width / 256: `_num_warps`), the rows of their tiles and the tiles in
# flight: the loads in flight per SM are what the pass waits on (docs/benchmarks.md, sessions 28, 33 and 54).
BWD_PROGRAMS_PER_SM = 2
BWD_WARPS = 4
BWD_ROWS = 2
BWD_STAGES = 3
# Programs whose partial sums the last of them to finish adds up.
BWD_GROUP = 16


def _num_programs(m: int, device: torch.device) -> int:
    """Programs of the backward: enough to fill the GPU, few enough that the partial sums stay small."""
    if device.type == "cuda":
        return max(1, min(m, BWD_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(m, 4))


def _forward(x, weight, bias, gate, residual, scale, eps, out_dtype, dropout=(None, 1.0), residual_bias=None,
             gate_bias=None, gate_silu=False):
    """``(sum or x, gate, y, mean, rstd)`` as 2-D ``[M, N]`` tensors; ``sum`` is ``x + residual (+ residual_bias)``
    when there is a residual. ``dropout``: ``(mask [M, N] uint8 or None, 1 / (1 - p))``. ``gate_silu``: the gate is
    ``silu(gate + gate_bias)``."""
    n = x.shape[-1]
    x2 = _rows_2d(x, n)
    g2 = _rows_2d(gate, n) if gate is not None else None
    r2 = _rows_2d(residual, n) if residual is not None else None
    m2, keep_scale = dropout
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=out_dtype)
    s2 = torch.empty(m, n, device=x.device, dtype=torch.promote_types(x.dtype, r2.dtype)) if r2 is not None else None
    mean = torch.empty(m, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    block_n = triton.next_power_of_2(max(n, 1))
    if m:
        _ln_fwd_kernel[(m,)](
            x2, _or(r2, x2), _or(residual_bias, weight), weight, bias, _or(g2, x2), _or(gate_bias, weight),
            _or(m2, x2), _or(s2, y), y, mean, rstd, n, x2.stride(0), _stride(r2), _stride(g2), _stride(m2),
            _stride(s2), y.stride(0), scale, eps, keep_scale, HAS_RESIDUAL=r2 is not None,
            HAS_BRANCH_BIAS=r2 is not None and residual_bias is not None, HAS_GATE=g2 is not None,
            GATE_SILU=gate_silu, HAS_GATE_BIAS=gate_bias is not None, HAS_DROPOUT=m2 is not None, BLOCK_N=block_n,
            num_warps=_num_warps(block_n),
        )
    return (s2 if s2 is not None else x2), g2, y, mean, rstd


def _backward(
    dy, x2, weight, bias, g2, mean, rstd, scale, *, gate_dtype, dropout=(None, 1.0), ds=None, residual_dtype=None,
    residual_bias_dtype=None, gate_bias=None, gate_silu=False, dg_out=None,
):
    """``(dx, dresidual, dweight, dbias, dgate, dbias_of_branch_or_gate)`` of ``[M, N]`` inputs (``dresidual``: with
    ``residual_dtype``; the last: the column sums of the sum's gradient with ``residual_bias_dtype``, or of the gate
    pre-activation's with a ``gate_bias``). ``dg_out``: ``[M, N]`` where to write the gate's gradient (else a new
    tensor)."""
    m, n = x2.shape
    dy2 = _rows_2d(dy, n)
    ds2 = _rows_2d(ds, n) if ds is not None else None
    m2, keep_scale = dropout
    dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
    dr = torch.empty(m, n, device=x2.device, dtype=residual_dtype) if residual_dtype is not None else None
    dg = None
    if g2 is not None:
        dg = dg_out if dg_out is not None else torch.empty(m, n, device=x2.device, dtype=gate_dtype)
    rows_per_program = max(1, triton.cdiv(triton.cdiv(m, _num_programs(m, x2.device)), BWD_ROWS)) * BWD_ROWS
    programs = max(1, triton.cdiv(m, rows_per_program))
    # Each program's partial sums of dw, db (and the residual bias's or the gate bias's gradient) lie side by side.
    third_dtype = residual_bias_dtype if gate_bias is None else gate_bias.dtype
    sums = 2 if third_dtype is None else 3
    group_sums = GroupSums(programs, BWD_GROUP, sums * n, x2.device)
    block_n = triton.next_power_of_2(max(n, 1))
    if m:
        _ln_bwd_kernel[(programs,)](
            dy2, x2, weight, bias, _or(g2, x2), _or(gate_bias, weight), _or(m2, x2), mean, rstd, _or(ds2, dy2), dx,
            _or(dr, dx), _or(dg, dx), group_sums.partial, group_sums.sums, group_sums.counts, m, n,
            rows_per_program, dy2.stride(0), x2.stride(0), _stride(g2), _stride(m2), _stride(ds2),
            dx.stride(0), _stride(dr), _stride(dg), scale, keep_scale,
            HAS_GATE=g2 is not None, GATE_SILU=gate_silu, HAS_GATE_BIAS=gate_bias is not None,
            HAS_DROPOUT=m2 is not None, HAS_STREAM_GRAD=ds2 is not None, HAS_RESIDUAL=dr is not None,
            HAS_BRANCH_BIAS=residual_bias_dtype is not None, SUMS=sums, ATOMIC_TOTALS=group_sums.atomic,
            GROUP=BWD_GROUP, ROWS=BWD_ROWS, STAGES=BWD_STAGES, BLOCK_N=block_n,
            num_warps=min(BWD_WARPS, _num_warps(block_n)),
        )
    totals = group_sums.total().view(sums, n)
    dthird = totals[2].to(third_dtype) if sums == 3 else None
    return dx, dr, totals[0].to(weight.dtype), totals[1].to(bias.dtype), dg, dthird


def _or(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """``t``, or a tensor the kernel never reads (its flag is off) in its place."""
    return t if t is not None else placeholder


def _stride(t: torch.Tensor | None) -> int:
    return t.stride(0) if t is not None else 0


def _dropout_rows(mask: torch.Tensor | None, p: float, n: int) -> tuple[torch.Tensor | None, float]:
    """The kernels' dropout arguments: the keep mask as ``[M, N]`` bytes, and ``1 / (1 - p)``."""
    if mask is None:
        return None, 1.0
    return _rows_2d(mask, n).view(torch.uint8), 1.0 / (1.0 - p)


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, gate, gate_bias, gate_grad, gate_silu, scale, eps, out_dtype, dropout_mask,
                dropout_p):
        """``gate_silu``: ``gate`` is a :class:`~kernels.glue.SiluGate`'s pre-activation and ``gate_bias`` its bias
        (or None); ``gate_grad``: its :class:`~kernels.glue.GateGrad` or None."""
        dropout = _dropout_rows(dropout_mask, dropout_p, x.shape[-1])
        x2, g2, y, mean, rstd = _forward(x, weight, bias, gate, None, scale, eps, out_dtype, dropout,
                                         gate_bias=gate_bias, gate_silu=gate_silu)
        ctx.save_for_backward(x2, weight, bias, g2, gate_bias, mean, rstd, dropout[0])
        ctx.scale, ctx.keep_scale, ctx.shape = scale, dropout[1], x.shape
        ctx.gate_dtype = gate.dtype if gate is not None else None
        ctx.gate_grad, ctx.gate_silu = gate_grad, gate_silu
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, bias, g2, gate_bias, mean, rstd, m2 = ctx.saved_tensors
        dg_out = ctx.gate_grad.gate_columns() if ctx.gate_grad is not None else None
        if dg_out is not None and dg_out.shape != x2.shape:  # a gate of more dimensions: a gradient of its own
            dg_out = None
        dx, _, grad_w, grad_b, dg, grad_gb = _backward(
            dy, x2, weight, bias, g2, mean, rstd, ctx.scale, gate_dtype=ctx.gate_dtype, dropout=(m2, ctx.keep_scale),
            gate_bias=gate_bias, gate_silu=ctx.gate_silu, dg_out=dg_out,
        )
        grad_g = dg if dg is None or dg.shape == ctx.shape else dg.view(ctx.shape)
        return dx.view(ctx.shape), grad_w, grad_b, grad_g, grad_gb, None, None, None, None, None, None, None


class _ResidualLayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, branch, branch_bias, weight, bias, eps, out_dtype, picks):
        s2, _, y, mean, rstd = _forward(x, weight, bias, None, branch, 1.0, eps, out_dtype, residual_bias=branch_bias)
        ctx.save_for_backward(s2, weight, bias, mean, rstd, picks)
        ctx.shape, ctx.dtypes = x.shape, (x.dtype, branch.dtype if branch is not None else None)
        ctx.bias_dtype = branch_bias.dtype if branch_bias is not None else None
        ctx.set_materialize_grads(False)
        # Without a branch the stream passes through (a view of x): its gradient still arrives here.
        stream = x.view_as(x) if branch is None else s2.view(x.shape)
        if picks is None:
            return stream, y.view(x.shape)
        return stream, y.view(x.shape), s2.index_select(0, picks)

    @staticmethod
    def backward(ctx, ds, dy, dpicked=None):
        s2, weight, bias, mean, rstd, picks = ctx.saved_tensors
        x_dtype, branch_dtype = ctx.dtypes
        bias_dtype = ctx.bias_dtype
        if dy is None and dpicked is None:  # the norm's output unused: the sum's gradient is every input's
            dbb = ds.reshape(-1, ds.shape[-1]).sum(0, dtype=torch.float32).to(bias_dtype) if bias_dtype else None
            dr = ds.to(branch_dtype) if branch_dtype else None
            return ds.to(x_dtype), dr, dbb, None, None, None, None, None
        dbb = None
        # Stream, branch and sum of one dtype (a bf16 stream): the two gradients are equal, and one tensor is
        # written and handed to both (autograd accumulates into a gradient in place only when no one else holds
        # its storage).
        shared = branch_dtype == x_dtype == s2.dtype
        if dy is None:
            dx = (ds.to(x_dtype, copy=True, memory_format=torch.contiguous_format) if ds is not None
                  else s2.new_zeros(ctx.shape, dtype=x_dtype))
            dr = dx if shared else dx.to(branch_dtype, copy=True) if branch_dtype else None
            grad_w = grad_b = None
        else:
            dx, dr, grad_w, grad_b, _, dbb = _backward(
                dy, s2, weight, bias, None, mean, rstd, 1.0, gate_dtype=None, ds=ds,
                residual_dtype=None if shared else branch_dtype, residual_bias_dtype=bias_dtype,
            )
            dr = dx if shared else dr
        rows = dx.view(-1, dx.shape[-1])
        if dpicked is not None:
            rows.index_add_(0, picks, dpicked.to(dx.dtype))
            if dr is not None and dr is not dx:  # the picked rows' sums, rounded once into the branch's dtype
                dr.view(-1, dr.shape[-1]).index_copy_(0, picks, rows.index_select(0, picks).to(dr.dtype))
            if dbb is not None:
                dbb = (dbb.float() + dpicked.sum(0, dtype=torch.float32)).to(bias_dtype)
        if bias_dtype and dbb is None:
            dbb = rows.sum(0, dtype=torch.float32).to(bias_dtype)
        dx = dx.to(x_dtype).view(ctx.shape)
        dr = dx if shared else dr.view(ctx.shape) if dr is not None else None
        return dx, dr, dbb, grad_w, grad_b, None, None, None


def _num_warps(block_n: int) -> int:
    return min(16, max(1, block_n // 256))


def layer_norm(x, weight, bias, eps, *, scale=1.0, gate=None, out_dtype=None, dropout_mask=None, dropout_p=0.0):
    """Same contract as :func:`kernels.pytorch.layer_norm.layer_norm` (``N <= MAX_N``). A
    :class:`~kernels.glue.SiluGate` is activated as it is read, and its pre-activation's gradient written where its
    ``grad`` says."""
    silu_gate = isinstance(gate, SiluGate)
    pre = gate.pre if silu_gate else gate
    dtype = out_dtype or (torch.promote_types(x.dtype, pre.dtype) if pre is not None else x.dtype)
    return _LayerNormFn.apply(
        x, weight, bias, pre, gate.bias if silu_gate else None, gate.grad if silu_gate else None, silu_gate,
        float(scale), float(eps), dtype, dropout_mask, float(dropout_p),
    )


def residual_layer_norm(x, branch, weight, bias, eps, *, branch_bias=None, out_dtype=None, picks=None):
    """Same contract as :func:`kernels.pytorch.layer_norm.residual_layer_norm` (``N <= MAX_N``)."""
    total = torch.promote_types(x.dtype, branch.dtype) if branch is not None else x.dtype
    return _ResidualLayerNormFn.apply(x, branch, branch_bias, weight, bias, float(eps), out_dtype or total, picks)
