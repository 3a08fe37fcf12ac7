"""Triton per-row SiLU modulation: ``y = dropout(silu(h) * scale[row] + shift[row])`` over a jagged batch's tokens.

InterFormer's personalised FFN conditions every token of row ``b`` on that row's ``(scale_b, shift_b)``.
Eager PyTorch broadcasts both to ``[L, N]`` tensors, runs SiLU, a multiply and an add as separate
passes, and its backward scatter-adds every token's gradient into its row (``index_put_`` sorts the
indices first; ``index_add_`` serialises on atomics, every token of a row hitting the same ``N``
addresses). Here one pass reads ``h`` (and the dropout's keep mask, an input) and writes ``y``; the backward reads ``dy`` and ``h`` once, writes
``dh``, and sums ``dy * silu(h)`` and ``dy`` over each row's tokens in registers. A ``bias`` (the projection's, left
out of its GEMM) is added to ``h`` here, and its gradient summed per row beside the others: one ``[B, N]`` reduction
instead of the GEMM backward's over ``[L, N]``; a constant ``scale_offset`` (the PFFN's ``1 + g``) costs no pass.

Rows are cut into chunks of ``CHUNK_TILES * BLOCK_L`` contiguous tokens, and one program per (chunk, column block)
walks its chunk in ``BLOCK_L`` tiles with its row's ``scale``/``shift`` loaded once. A program per whole row made
the longest row of a batch the kernel's time (a 4,096-event history walked by 32 programs while the rest of the
GPU had finished); chunks bound every program's walk. Backward, a row of one chunk stores its sums directly; in a
longer row each chunk stores its partial sums and the last of the row's chunks to finish (an atomic count) adds
them in chunk order: deterministic, no float atomics. Row boundaries come from ``searchsorted`` on the sorted rows,
the chunk table from their lengths (no host sync; once per batch, :mod:`.per_batch`); the grid is the bound
``L / chunk + B`` on the chunks, and the programs past the last chunk return at once.

Works on triton 3.6 and 3.9, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.group_sums import arrived_last
from kernels.triton.per_batch import per_batch

# Token tile x column block: rows cut into chunks of 128 tokens give a batch of a few long rows (4,096-event
# histories, B of 4) 512 programs per row; fixed sizes compile once, whatever the batch (module constants, so that
# `experiments/bench_glue.py --launches` can time others through the real op; docs/benchmarks.md, session 54).
BLOCK_L = 32
BLOCK_N = 64
NUM_WARPS = 4
# Token tiles per chunk: a program walks at most this many (module doc).
CHUNK_TILES = 4
# Tiles whose loads are in flight at once: above 1 the walk is software-pipelined, the next tiles' loads copied into
# shared memory while this one is computed (docs/benchmarks.md, session 54).
STAGES = 3


@triton.jit
def _chunk_block(chunk_row_ptr, chunk_first_ptr, offsets_ptr, scale_ptr, b_ptr, stride_s, N, scale_offset,
                 HAS_BIAS: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_TILES: tl.constexpr):
    """This program's chunk, its row (``B`` past the last chunk), the row's first chunk and chunk count, the column
    block (and mask), the chunk's token range, the row's ``scale_offset + scale`` columns and the bias's (zeros
    without one)."""
    chunk = tl.program_id(0)
    row = tl.load(chunk_row_ptr + chunk).to(tl.int64)
    first_chunk = tl.load(chunk_first_ptr + row)
    chunks = tl.load(chunk_first_ptr + row + 1) - first_chunk
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    start = tl.load(offsets_ptr + row) + (chunk - first_chunk) * (CHUNK_TILES * BLOCK_L)
    end = tl.minimum(tl.load(offsets_ptr + row + 1), start + CHUNK_TILES * BLOCK_L)
    a = scale_offset + tl.load(scale_ptr + row * stride_s + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    return chunk, row, first_chunk, chunks, cols, col_ok, start, end, a, bias


# The row count changes with the batch: specialising on its divisibility would compile again for each.
@triton.jit(do_not_specialize=["B"])
def _modulate_fwd_kernel(
    h_ptr, scale_ptr, shift_ptr, b_ptr, offsets_ptr, chunk_row_ptr, chunk_first_ptr, m_ptr, y_ptr, B, N, stride_h,
    stride_s, stride_t, stride_m, stride_y, keep_scale, scale_offset, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_TILES: tl.constexpr,
    STAGES: tl.constexpr,
):
    if tl.load(chunk_row_ptr + tl.program_id(0)) >= B:  # past the last chunk
        return
    _, row, _, _, cols, col_ok, start, end, a, bias = _chunk_block(
        chunk_row_ptr, chunk_first_ptr, offsets_ptr, scale_ptr, b_ptr, stride_s, N, scale_offset, HAS_BIAS, BLOCK_L,
        BLOCK_N, CHUNK_TILES,
    )
    c = tl.load(shift_ptr + row * stride_t + cols, mask=col_ok, other=0.0).to(tl.float32)
    for first in tl.range(start, end, BLOCK_L, num_stages=STAGES):
        tokens = (first + tl.arange(0, BLOCK_L)).to(tl.int64)
        mask = (tokens < end)[:, None] & col_ok[None, :]
        h = tl.load(h_ptr + tokens[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h += bias[None, :]
        y = h * tl.sigmoid(h) * a[None, :] + c[None, :]
        if HAS_DROPOUT:
            keep = tl.load(m_ptr + tokens[:, None] * stride_m + cols[None, :], mask=mask, other=0) != 0
            y = tl.where(keep, y * keep_scale, 0.0)
        tl.store(y_ptr + tokens[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["B"])
def _modulate_bwd_kernel(
    dy_ptr, h_ptr, scale_ptr, b_ptr, offsets_ptr, chunk_row_ptr, chunk_first_ptr, m_ptr, dh_ptr, dscale_ptr,
    dshift_ptr, db_ptr, partial_ptr, count_ptr, B, N, stride_dy, stride_h, stride_s, stride_m, stride_dh, keep_scale,
    scale_offset, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK_TILES: tl.constexpr, STAGES: tl.constexpr,
):
    """``partial_ptr``: ``[chunks, 3, N]`` float32, each chunk's sums (rows of several chunks); ``count_ptr``:
    ``[B, column blocks]`` int32 zeros."""
    if tl.load(chunk_row_ptr + tl.program_id(0)) >= B:  # past the last chunk
        return
    chunk, row, first_chunk, chunks, cols, col_ok, start, end, a, bias = _chunk_block(
        chunk_row_ptr, chunk_first_ptr, offsets_ptr, scale_ptr, b_ptr, stride_s, N, scale_offset, HAS_BIAS, BLOCK_L,
        BLOCK_N, CHUNK_TILES,
    )
    acc_scale = tl.zeros((BLOCK_L, BLOCK_N), dtype=tl.float32)
    acc_shift = tl.zeros((BLOCK_L, BLOCK_N), dtype=tl.float32)
    acc_bias = tl.zeros((BLOCK_L, BLOCK_N), dtype=tl.float32)
    for first in tl.range(start, end, BLOCK_L, num_stages=STAGES):
        tokens = (first + tl.arange(0, BLOCK_L)).to(tl.int64)
        mask = (tokens < end)[:, None] & col_ok[None, :]
        dy = tl.load(dy_ptr + tokens[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            keep = tl.load(m_ptr + tokens[:, None] * stride_m + cols[None, :], mask=mask, other=0) != 0
            dy = tl.where(keep, dy * keep_scale, 0.0)
        h = tl.load(h_ptr + tokens[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h += bias[None, :]
        sig = tl.sigmoid(h)
        silu = h * sig
        acc_scale += dy * silu
        acc_shift += dy
        dh = dy * a[None, :] * (sig + silu * (1.0 - sig))
        if HAS_BIAS:
            acc_bias += dh  # masked tokens have dy = 0, so dh = 0
        tl.store(dh_ptr + tokens[:, None] * stride_dh + cols[None, :], dh.to(dh_ptr.dtype.element_ty), mask=mask)
    sum_scale, sum_shift, sum_bias = tl.sum(acc_scale, axis=0), tl.sum(acc_shift, axis=0), tl.sum(acc_bias, axis=0)
    last = chunks == 1
    if chunks > 1:
        tl.store(partial_ptr + chunk * 3 * N + cols, sum_scale, mask=col_ok)
        tl.store(partial_ptr + (chunk * 3 + 1) * N + cols, sum_shift, mask=col_ok)
        tl.store(partial_ptr + (chunk * 3 + 2) * N + cols, sum_bias, mask=col_ok)
        last = arrived_last(count_ptr + row * tl.num_programs(1) + tl.program_id(1), chunks)
        if last:
            sum_scale = tl.zeros((BLOCK_N,), dtype=tl.float32)
            sum_shift = tl.zeros((BLOCK_N,), dtype=tl.float32)
            sum_bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for c in range(first_chunk, first_chunk + chunks):  # chunk order, whichever finished last
                sum_scale += tl.load(partial_ptr + c * 3 * N + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
                sum_shift += tl.load(partial_ptr + (c * 3 + 1) * N + cols, mask=col_ok, other=0.0,
                                     cache_modifier=".cg")
                sum_bias += tl.load(partial_ptr + (c * 3 + 2) * N + cols, mask=col_ok, other=0.0,
                                    cache_modifier=".cg")
    if last:
        tl.store(dscale_ptr + row * N + cols, sum_scale.to(dscale_ptr.dtype.element_ty), mask=col_ok)
        tl.store(dshift_ptr + row * N + cols, sum_shift.to(dshift_ptr.dtype.element_ty), mask=col_ok)
        if HAS_BIAS:
            tl.store(db_ptr + row * N + cols, sum_bias, mask=col_ok)


def _unit_columns(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch_shape(tokens: int, batch: int, n: int) -> tuple[tuple[int, int], dict]:
    """``((chunks at most, column blocks), {BLOCK_L, BLOCK_N, CHUNK_TILES, STAGES, num_warps})``."""
    block_n = min(BLOCK_N, triton.next_power_of_2(max(n, 1)))
    blocks = {"BLOCK_L": BLOCK_L, "BLOCK_N": block_n, "CHUNK_TILES": CHUNK_TILES, "STAGES": STAGES,
              "num_warps": NUM_WARPS}
    return (max_chunks(tokens, batch), triton.cdiv(n, block_n)), blocks


def max_chunks(tokens: int, batch: int) -> int:
    """A bound on the chunks of ``batch`` rows holding ``tokens`` in all: each row's last chunk may be short."""
    return triton.cdiv(tokens, CHUNK_TILES * BLOCK_L) + batch


def _chunk_table(offsets: torch.Tensor, tokens: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chunk_row[max_chunks], chunk_first[B+1])``: each chunk's row (``B`` past the last chunk) and each row's
    first chunk (an empty row has one chunk, which writes its zero sums). Once per batch (:mod:`.per_batch`).

    Both are views of one table, ``chunk_first`` after an even number of ``chunk_row`` entries: Triton specialises
    the kernels on whether a pointer is 16-byte aligned, and an offset that followed ``max_chunks``' parity would
    compile them again for a batch of another bucket (a few more rows) in the middle of training."""
    bound = max_chunks(tokens, batch)
    front = bound + bound % 2

    def compute() -> torch.Tensor:
        chunk = CHUNK_TILES * BLOCK_L
        per_row = ((offsets[1:] - offsets[:-1] + chunk - 1) // chunk).clamp(min=1)
        first = torch.cat([offsets.new_zeros(1), per_row.cumsum(0)])
        index = torch.arange(front, device=offsets.device, dtype=offsets.dtype)
        return torch.cat([torch.searchsorted(first[1:], index, right=True), first])

    table = per_batch("chunk_table", (offsets,), compute, extra=(tokens, batch, CHUNK_TILES, BLOCK_L))
    return table[:bound], table[front:]


def _row_offsets(rows: torch.Tensor, batch: int) -> torch.Tensor:
    """``[B+1]`` boundaries of each row's tokens in the sorted ``rows[L]`` (once per batch: :mod:`.per_batch`)."""
    return per_batch(
        "row_offsets",
        (rows,),
        lambda: torch.searchsorted(rows, torch.arange(batch + 1, device=rows.device, dtype=rows.dtype)),
        extra=(batch,),
    )


def _keep_bytes(mask: torch.Tensor | None, h: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The keep mask as bytes with unit column stride, or ``h`` in its place (never read) and stride 0."""
    if mask is None:
        return h, 0
    mask = _unit_columns(mask).view(torch.uint8)
    return mask, mask.stride(0)


class _SiluModulateFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, scale, shift, rows, bias, scale_offset, dropout_mask, dropout_p):
        h, scale, shift = _unit_columns(h), _unit_columns(scale), _unit_columns(shift)
        keep, stride_m = _keep_bytes(dropout_mask, h)
        keep_scale = 1.0 / (1.0 - dropout_p)
        batch, n = scale.shape
        offsets = _row_offsets(rows, batch)
        dtype = torch.promote_types(torch.promote_types(h.dtype, scale.dtype), shift.dtype)
        y = torch.empty(h.shape, device=h.device, dtype=dtype)
        chunk_row, chunk_first = _chunk_table(offsets, h.shape[0], batch)
        if batch and n and h.shape[0]:
            grid, blocks = _launch_shape(h.shape[0], batch, n)
            _modulate_fwd_kernel[grid](
                h, scale, shift, _or(bias, h), offsets, chunk_row, chunk_first, keep, y, batch, n, h.stride(0),
                scale.stride(0), shift.stride(0), stride_m, y.stride(0), keep_scale, scale_offset,
                HAS_BIAS=bias is not None, HAS_DROPOUT=dropout_mask is not None, **blocks,
            )
        ctx.save_for_backward(h, scale, offsets, chunk_row, chunk_first, keep if dropout_mask is not None else None, bias)
        ctx.shift_dtype, ctx.stride_m, ctx.keep_scale, ctx.scale_offset = shift.dtype, stride_m, keep_scale, scale_offset
        return y

    @staticmethod
    def backward(ctx, dy):
        h, scale, offsets, chunk_row, chunk_first, keep, bias = ctx.saved_tensors
        dy = _unit_columns(dy)
        batch, n = scale.shape
        dh = torch.empty_like(h, memory_format=torch.contiguous_format)
        launched = bool(batch and n and h.shape[0])
        # The kernel sums in float32 and writes each row's sums, rounded once, in the parameters' dtypes.
        alloc = torch.empty if launched else torch.zeros
        dscale = alloc(batch, n, device=h.device, dtype=scale.dtype)
        dshift = alloc(batch, n, device=h.device, dtype=ctx.shift_dtype)
        # Per row, float32: the bias gradient is then one small reduction instead of one over every token.
        partial_db = alloc(batch, n, device=h.device, dtype=torch.float32) if bias is not None else None
        if launched:
            grid, blocks = _launch_shape(h.shape[0], batch, n)
            # Rows of several chunks: each chunk's float32 sums, added by the row's last chunk (arrivals counted).
            partial = torch.empty(grid[0], 3, n, device=h.device, dtype=torch.float32)
            counts = torch.zeros(batch, grid[1], device=h.device, dtype=torch.int32)
            _modulate_bwd_kernel[grid](
                dy, h, scale, _or(bias, h), offsets, chunk_row, chunk_first, _or(keep, h), dh, dscale, dshift,
                _or(partial_db, dh), partial, counts, batch, n, dy.stride(0), h.stride(0), scale.stride(0),
                ctx.stride_m, dh.stride(0), ctx.keep_scale, ctx.scale_offset, HAS_BIAS=bias is not None,
                HAS_DROPOUT=keep is not None, **blocks,
            )
        db = partial_db.sum(0).to(bias.dtype) if bias is not None else None
        return dh, dscale, dshift, None, db, None, None, None


def _or(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """``t``, or a tensor the kernel never reads (its flag is off) in its place."""
    return t if t is not None else placeholder


def jagged_silu_modulate(h, scale, shift, rows, *, bias=None, scale_offset=0.0, dropout_mask=None, dropout_p=0.0):
    """Same contract as :func:`kernels.pytorch.row_modulate.jagged_silu_modulate`."""
    return _SiluModulateFn.apply(h, scale, shift, rows, bias, float(scale_offset), dropout_mask, float(dropout_p))
