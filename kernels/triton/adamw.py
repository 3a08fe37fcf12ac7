"""Triton multi-tensor AdamW: a model's whole optimizer step in one launch per gradient dtype, reading
low-precision gradients as they are and writing the low-precision copies the next forward reads.

With bf16 copies of the float32 weights (:class:`foundation.model.precision.CastOnce`) a step made three passes
over them: the copies' bf16 gradients converted to float32, torch's fused AdamW over those, and the next step's
copy of the updated weights into bf16. Here one pass reads the parameter, its gradient (bf16 or float32; a 2-D
gradient in any layout, e.g. one that reached its weight through a transpose) and both moments, and writes the
parameter, the moments and the copy: per element 12 bytes of memory traffic fewer than the three passes.

The tables are :mod:`kernels.triton.multi_copy`'s: per program its tensor and first element (the third column,
multi_copy's whole-block flag, is not read); per tensor the addresses of the parameter, gradient, moments and copy,
the element count and the gradient's layout. Gradients laid out otherwise than their parameters go in a launch of
their own, so the common launch has no index arithmetic for them. They are cached per set of addresses; the step's
scalars (learning rate, bias corrections) are arguments, so a new step reuses them. Works on triton 3.6 and 3.9,
and on CPU tensors under ``TRITON_INTERPRET=1``.

The embedding tables' sparse gradients (entries naming rows, repeats allowed) take a second path: their entries
sorted by row and summed per run of equal rows (:func:`sum_rows`, also the gradient clip's per-row sums), then the
same per-element update on each named row only (:func:`row_adamw`).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from kernels.pytorch.adamw import multi_adamw as reference_multi_adamw
from kernels.triton.multi_copy import bf16_nearest_even, block_programs, cached_tables, read_layout

BLOCK = 1024
NUM_WARPS = 4
SUM_CHUNK = 32  # sorted entries per program of the row AdamW's gradient sums
_TABLES: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = OrderedDict()
# Per tensor: param, grad, exp_avg, exp_avg_sq, copy (0: none), numel, grad cols, grad stride 0, grad stride 1.


@triton.jit
def _update(p, g, m, v, decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bias_sqrt, eps):
    """torch.optim.AdamW's per-element update in float32: decay, then the moments, then the step."""
    g = g.to(tl.float32)
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    return p, m, v


@triton.jit
def _store_copy(c_ptr, offs, p, C0, mask=None):
    if C0.dtype.element_ty == tl.bfloat16:
        tl.store(c_ptr + offs, bf16_nearest_even(p), mask=mask)
    else:
        tl.store(c_ptr + offs, p.to(C0.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_kernel(TENSORS, PROGRAMS, P0, G0, C0, decay, one_minus_beta1, beta2, one_minus_beta2, step_size,
                  bias_sqrt, eps, HAS_COPY: tl.constexpr, STRIDED: tl.constexpr, BLOCK: tl.constexpr):
    # One masked path for every block, in small programs: a second (unmasked) path and larger blocks hold more
    # registers, so fewer programs per SM are in flight to cover the memory's latency (docs/benchmarks.md, session 32).
    pid = tl.program_id(0)
    t = tl.load(PROGRAMS + 3 * pid)
    start = tl.load(PROGRAMS + 3 * pid + 1)
    row = TENSORS + 9 * t
    p_ptr = tl.load(row).to(P0.dtype)
    g_ptr = tl.load(row + 1).to(G0.dtype)
    m_ptr = tl.load(row + 2).to(P0.dtype)
    v_ptr = tl.load(row + 3).to(P0.dtype)
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < tl.load(row + 5)
    if STRIDED:  # a 2-D gradient laid out otherwise than its parameter: element i at (i // cols, i % cols)
        cols = tl.load(row + 6)
        g = tl.load(g_ptr + (offs // cols) * tl.load(row + 7) + (offs % cols) * tl.load(row + 8), mask=mask)
    else:
        g = tl.load(g_ptr + offs, mask=mask)
    p, m, v = _update(tl.load(p_ptr + offs, mask=mask), g, tl.load(m_ptr + offs, mask=mask),
                      tl.load(v_ptr + offs, mask=mask), decay, one_minus_beta1, beta2, one_minus_beta2,
                      step_size, bias_sqrt, eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_COPY:
        c_ptr = tl.load(row + 4).to(C0.dtype)
        _store_copy(c_ptr, offs, p, C0, mask)


def _tables(group: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Device tables of a group of ``(param, grad, exp_avg, exp_avg_sq, copy or None, grad layout)``, cached by
    their addresses."""
    key = tuple((p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), c.data_ptr() if c is not None else 0,
                 p.numel(), *lay) for p, g, m, v, c, lay in group)

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.tensor([list(k) for k in key], dtype=torch.int64)
        return rows, block_programs(rows[:, 5], torch.zeros(len(rows), dtype=torch.bool), BLOCK)

    return cached_tables(_TABLES, key, build, group[0][0].device)


def multi_adamw(params, grads, exp_avgs, exp_avg_sqs, copies, *, lr, betas, eps, weight_decay, step) -> None:
    """Same contract as :func:`kernels.pytorch.adamw.multi_adamw`."""
    beta1, beta2 = betas
    groups: dict[tuple, list[tuple]] = {}
    rest = []
    for p, g, m, v, c in zip(params, grads, exp_avgs, exp_avg_sqs, copies, strict=True):
        if p.numel() == 0:
            continue
        layout = read_layout(p, g)
        if layout is None or not (m.is_contiguous() and v.is_contiguous() and (c is None or c.is_contiguous())):
            rest.append((p, g, m, v, c))
            continue
        strided = layout[0] != 0
        groups.setdefault((g.dtype, None if c is None else c.dtype, strided), []).append((p, g, m, v, c, layout))
    if rest:
        reference_multi_adamw(*map(list, zip(*rest, strict=True)), lr=lr, betas=betas, eps=eps,
                              weight_decay=weight_decay, step=step)
    for (_, _, strided), group in groups.items():
        tensors, programs, count = _tables(group)
        p0, g0, _, _, c0, _ = group[0]
        _adamw_kernel[(count,)](
            tensors, programs, p0, g0, c0 if c0 is not None else p0, 1.0 - lr * weight_decay, 1.0 - beta1, beta2,
            1.0 - beta2, lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step), eps, HAS_COPY=c0 is not None,
            STRIDED=strided, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )


@triton.jit
def _row_adamw_kernel(P, M, V, SORTED, SEGMENT, SUMS, D, decay, one_minus_beta1, beta2, one_minus_beta2, step_size,
                      bias_sqrt, eps, BLOCK_D: tl.constexpr):
    # One program per entry of the sorted rows and block of columns; the first entry of each run of equal rows
    # updates its row with the run's summed gradient, the others do nothing.
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row = tl.load(SORTED + i)
    first = tl.load(SORTED + i - 1, mask=i > 0, other=-1) != row  # ids are never negative
    mask = cols < tl.where(first, D, 0)
    g = tl.load(SUMS + tl.load(SEGMENT + i) * D + cols, mask=mask, other=0.0)
    offs = row * D + cols
    p, m, v = _update(tl.load(P + offs, mask=mask), g, tl.load(M + offs, mask=mask), tl.load(V + offs, mask=mask),
                      decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bias_sqrt, eps)
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)


# The entry count follows the batch (history tokens + rows + negatives): unspecialised, a new bucket compiles nothing.
@triton.jit(do_not_specialize=["N"])
def _row_sums_kernel(SEGMENT, ORDER, G, SUMS, N, D, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per CHUNK consecutive sorted entries and block of columns: it sums the gradients of each run of
    # equal rows within its chunk and adds each run's partial sum to the run's row of SUMS once, so a row repeated
    # thousands of times (the padding tokens' id) costs one atomic add per chunk, not one per entry.
    base = tl.program_id(0) * CHUNK
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    prev = tl.load(SEGMENT + base)
    for k in range(CHUNK):
        idx = base + k
        seg = tl.load(SEGMENT + idx, mask=idx < N, other=-1)
        flush = seg != prev
        tl.atomic_add(SUMS + prev * D + cols, acc, mask=cols < tl.where(flush, D, 0))
        acc = tl.where(flush, 0.0, acc)
        prev = seg
        src = tl.load(ORDER + idx, mask=idx < N, other=0)
        acc += tl.load(G + src * D + cols, mask=cols < tl.where(idx < N, D, 0), other=0.0).to(tl.float32)
    tl.atomic_add(SUMS + prev * D + cols, acc, mask=cols < tl.where(prev >= 0, D, 0))


def _sorted_runs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows[N]`` sorted (stable), the sort's order, and each sorted entry's run of equal rows (``[N]`` each)."""
    ordered, order = torch.sort(rows, stable=True)
    starts = torch.ones(rows.numel(), dtype=torch.int64, device=rows.device)
    starts[1:] = ordered[1:] != ordered[:-1]
    return ordered, order, starts.cumsum(0) - 1


def _row_block(d: int) -> tuple[int, int]:
    """The row kernels' column block and warps for rows of ``d`` values."""
    block = min(triton.next_power_of_2(d), 512)
    return block, max(1, min(4, block // 128))


def _summed_runs(segment: torch.Tensor, order: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` float32: per run of :func:`_sorted_runs` the sum of its entries' ``values[N, D]``, zeros after
    the last run."""
    n, d = values.shape
    sums = torch.zeros(n, d, dtype=torch.float32, device=values.device)
    block, warps = _row_block(d)
    _row_sums_kernel[(triton.cdiv(n, SUM_CHUNK), triton.cdiv(d, block))](
        segment, order, values, sums, n, d, CHUNK=SUM_CHUNK, BLOCK_D=block, num_warps=warps
    )
    return sums


def sum_rows(rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`kernels.pytorch.adamw.sum_rows` (entries added per chunk, not in their order)."""
    if rows.numel() == 0:
        return torch.zeros(values.shape, dtype=torch.float32, device=values.device)
    _, order, segment = _sorted_runs(rows)
    return _summed_runs(segment, order, values)


def row_adamw(param, exp_avg, exp_avg_sq, rows, grad_rows, *, lr, betas, eps, weight_decay, step) -> None:
    """Same contract as :func:`kernels.pytorch.adamw.row_adamw`; no device sync (every array has the entries'
    count ``N``: the entries sorted by row, each one's run of equal rows numbered, the runs' gradients summed
    chunk by chunk), so it can run inside a captured CUDA graph."""
    n, d = grad_rows.shape
    if n == 0:
        return
    beta1, beta2 = betas
    ordered, order, segment = _sorted_runs(rows)
    sums = _summed_runs(segment, order, grad_rows)
    block, warps = _row_block(d)
    _row_adamw_kernel[(n, triton.cdiv(d, block))](
        param, exp_avg, exp_avg_sq, ordered, segment, sums, d, 1.0 - lr * weight_decay, 1.0 - beta1, beta2,
        1.0 - beta2, lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step), eps, BLOCK_D=block, num_warps=warps,
    )


# The entry count follows the batch: unspecialised, a new bucket compiles nothing.
@triton.jit(do_not_specialize=["N"])
def _catch_up_kernel(P, M, V, LAST, ROWS, CLOCK, SCHEDULE, LOG_DECAY, N, D, log2_beta1, log2_beta2, eps,
                     WINDOW: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per entry; the entry that swaps the clock into its row's last step catches the row up, the
    # other entries of that row find it current. The step scalars are read from the device, so a captured graph
    # replays with the current ones.
    row = tl.load(ROWS + tl.program_id(0))
    now = tl.load(CLOCK)
    base = tl.load(CLOCK + 1)
    old = tl.atomic_xchg(LAST + row, now)
    if old < now:
        stop = tl.minimum(old + WINDOW, now)
        behind = (now - old).to(tl.float32)
        far_p = tl.exp(tl.load(LOG_DECAY + now - base) - tl.load(LOG_DECAY + stop - base)).to(tl.float32)
        for start in range(0, D, BLOCK_D):
            offs = row * D + start + tl.arange(0, BLOCK_D)
            mask = start + tl.arange(0, BLOCK_D) < D
            p = tl.load(P + offs, mask=mask)
            m = tl.load(M + offs, mask=mask)
            v = tl.load(V + offs, mask=mask)
            # With a zero gradient the moments only decay, m_k = beta1^k m and sqrt(v_k) = beta2^(k/2) sqrt(v), so
            # the k-th missed update is m * (step_size beta1^k) / (sqrt(v) beta2^(k/2) / bias_sqrt + eps): one
            # division per value and step in place of the dense update's two and a square root.
            root = tl.sqrt_rn(v)
            for u in range(old + 1, stop + 1):
                entry = SCHEDULE + 3 * (u - base)
                k = (u - old).to(tl.float32)
                scale = tl.exp2(k * (0.5 * log2_beta2)) / tl.load(entry + 1)
                size = tl.load(entry) * tl.exp2(k * log2_beta1)
                p = p * tl.load(entry + 2) - m * (size / (root * scale + eps))
            tl.store(P + offs, p * far_p, mask=mask)
            tl.store(M + offs, m * tl.exp2(behind * log2_beta1), mask=mask)
            tl.store(V + offs, v * tl.exp2(behind * log2_beta2), mask=mask)


def catch_up_rows(param, exp_avg, exp_avg_sq, last_step, rows, clock, schedule, log_decay, *, betas, eps,
                  window) -> None:
    """Same contract as :func:`kernels.pytorch.adamw.catch_up_rows`; no device sync, so it can run inside a captured
    CUDA graph (the clock and the schedule are read when it runs)."""
    n, d = rows.numel(), param.shape[1]
    if n == 0:
        return
    beta1, beta2 = betas
    block, warps = _row_block(d)
    _catch_up_kernel[(n,)](
        param, exp_avg, exp_avg_sq, last_step, rows, clock, schedule, log_decay, n, d, math.log2(beta1),
        math.log2(beta2), eps, WINDOW=window, BLOCK_D=block, num_warps=warps,
    )
