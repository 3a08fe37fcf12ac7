"""Triton kernels for jagged self- and cross-attention (softmax and pointwise GDPA), fwd and bwd.

One program owns one (sequence, head, row block). The grid is one-dimensional: a (sequence,
head)'s row blocks are consecutive programs, so they share that sequence's tiles in L2, and the
sequences come most pairs first (:func:`_program`). Programs past the end of their sequence
return at once, and the costliest causal blocks of each sequence start first, so short sequences
fill the gaps that the long ones leave. Where most blocks of that grid would hold no rows (heavy-tailed or
padded batches), the grid holds only those that do (:mod:`kernels.triton.work_list`). Key tiles that no mask can
touch (inside the causal triangle, inside the history, inside the sequence) run a mask-free
loop; only the boundary tiles evaluate the mask, so masking costs a few tiles per block. With a
position table shorter than the sequences (the teacher's ``position_window``), the mask-free tiles
whose every pair lies past the table's last entry run a third loop that adds that entry as one
number (:func:`_far_keys_end`, :func:`_far_queries_start`). With a time table, the forward's and dK/dV's
mask-free tiles read the batch's time-bucket plan (:mod:`kernels.triton.time_tiles`; dK/dV its transpose, keys on
its rows): where it allows, a row's one or two table entries instead of a bucket per score.

Backward: one program per key block accumulates dK and dV over its query blocks; a second
kernel, one program per query block, computes dQ (no atomics) and the bias-table gradients
(:mod:`kernels.triton.bias`: float atomics, or with ``GEM_KERNELS_DETERMINISTIC=1`` per-program rows summed
in a fixed order, :mod:`kernels.triton.bias_rows`). Softmax scores are kept in log2 units so each probability is one
FMA and one ``exp2``. The mask semantics are those of :mod:`kernels.pytorch.jagged_attention`.

On Hopper and newer the forward loads its query tile and streams its key and value tiles
through TMA tensor descriptors, for head dims of 16-256 that are powers of two: 2-15% faster than
pointer loads on the H200 (docs/benchmarks.md); in the backward passes they measured no faster (dQ)
or slower (dK/dV), so those keep pointer loads. Key and value tiles at a sequence's boundary keep
masked pointer loads too (see :func:`_load_kv`); the query tile's rows past the sequence belong to
the next one, which no stored output row reads.
``GEM_KERNELS_TMA=0`` falls back to pointer loads; ``GEM_KERNELS_TMA=1`` turns descriptors on in
the interpreter, where tests check them.

Works on triton 3.6 (the GPU machine) and 3.9, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import settings
from kernels.glue import pair_halves
from kernels.precompile import recording
from kernels.spec import AttentionSpec
from kernels.triton import split_keys
from kernels.triton.bias import (
    add_bias,
    add_bias_rows,
    add_position_grad,
    add_time_grad,
    flush_position_grad,
    store_position_grad,
    sum_time_grad,
    time_bucket,
)
from kernels.triton.bias_rows import build_bias_grad_rows, sum_position_rows, sum_time_rows
from kernels.triton.configs import (
    DKDV_CONFIGS,
    DQ_CONFIGS,
    FWD_CONFIGS,
    TUNE_KEY,
    checked_in_pick,
    configs_for,
    entry_key,
    prune,
)
from kernels.triton.per_batch import per_batch
from kernels.triton.time_tiles import (
    FLAG_MIXED,
    MAX_TIME_BUCKETS,
    add_split_time,
    build_time_tiles,
    plan_arg_names,
    split_buckets,
    split_column,
    split_flag,
    split_key,
    split_rows,
    split_time_bias,
)
from kernels.triton.work_list import build_work_list, compact_programs

_ACT_CODES = {"softmax": 0, "silu": 1, "gelu": 2, "relu": 3, "identity": 4}
_LOG2E = tl.constexpr(1.4426950408889634)
_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
# Arguments that change with the batch's contents: specializing on their divisibility would
# recompile the kernels for batches of the same shape.
_NO_SPECIALIZE = [
    "stride_lse_h", "P_SIZE", "T_SIZE", "window", "N_BUCKET", "AVG_BUCKET", "ROWS", "L", "L_Q", "L_KV", "OFF", "LD",
    "NQB", "NKT", "L_K", "NKB", "NQT",
]


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    if FAST:
        # tanh.approx is one MUFU op where exp + reciprocal are two; MUFU throughput is what
        # bounds pointwise attention once the matmuls run on wgmma.
        t = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [x * 0.5], dtype=tl.float32, is_pure=True, pack=1
        )
        return 0.5 * t + 0.5
    else:
        return tl.sigmoid(x)


@triton.jit
def _act_fwd(s, ACT: tl.constexpr, FAST: tl.constexpr):
    if ACT == 1:
        return s * _sigmoid(s, FAST)
    elif ACT == 2:
        return 0.5 * s * (1.0 + tl.erf(s * _INV_SQRT2))
    elif ACT == 3:
        return tl.maximum(s, 0.0)
    else:
        return s


@triton.jit
def _act_fwd_bwd(s, ACT: tl.constexpr, FAST: tl.constexpr):
    """(f(s), f'(s)) for the pointwise activations."""
    if ACT == 1:
        sig = _sigmoid(s, FAST)
        return s * sig, sig * (1.0 + s * (1.0 - sig))
    elif ACT == 2:
        cdf = 0.5 * (1.0 + tl.erf(s * _INV_SQRT2))
        return s * cdf, cdf + s * tl.exp(-0.5 * s * s) * _INV_SQRT_2PI
    elif ACT == 3:
        return tl.maximum(s, 0.0), tl.where(s > 0.0, 1.0, 0.0)
    else:
        return s, tl.full(s.shape, 1.0, tl.float32)


@triton.jit
def _mask(qi, kj, kv_len, n_hist, window, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Attend mask for broadcastable 2-D query positions ``qi`` and key positions ``kj``."""
    valid = (kj < kv_len) & (qi >= 0)
    if CAUSAL:
        valid = valid & (kj <= qi)
    if HAS_TARGETS:
        valid = valid & ((kj < n_hist) | (kj == qi))
    if HAS_WINDOW:
        d = tl.minimum(qi, n_hist) - tl.minimum(kj, n_hist)
        valid = valid & (tl.abs(d) < window)
    return valid


@triton.jit
def _load_kv_masked(k_base, v_base, stride_km, stride_vm, start_n, kv_len, DQK: tl.constexpr, DV: tl.constexpr,
                    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """One ``[BLOCK_N, D]`` key tile and value tile through pointers; rows past ``kv_len`` read zeros."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_n[:, None] < kv_len
    k = tl.load(k_base + offs_n[:, None] * stride_km + offs_dqk[None, :],
                mask=row_ok & (offs_dqk[None, :] < DQK), other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vm + offs_dv[None, :],
                mask=row_ok & (offs_dv[None, :] < DV), other=0.0)
    return k, v


@triton.jit
def _load_kv(k_base, v_base, stride_km, stride_vm, k_desc, v_desc, row0, col_k, col_v, start_n, kv_len,
             TMA: tl.constexpr, MASKED: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr,
             BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """One ``[BLOCK_N, D]`` key tile and value tile: through TMA descriptors, or masked pointer loads.

    Only mask-free tiles, which lie inside the sequence, use descriptors. A descriptor tile past
    the sequence's end would hold the next sequence's rows, and although the mask drops their
    scores, ``0 * NaN`` in ``P V`` would carry a neighbour's non-finite values over; the boundary
    tiles' pointer loads read zeros there instead.
    """
    if TMA and not MASKED:
        k = k_desc.load([row0 + start_n, col_k])
        v = v_desc.load([row0 + start_n, col_v])
    else:
        k, v = _load_kv_masked(k_base, v_base, stride_km, stride_vm, start_n, kv_len, DQK, DV, BLOCK_DQK, BLOCK_DV,
                               BLOCK_N)
    return k, v


@triton.jit
def _fwd_tiles(
    acc, m_i, l_i, q, k_base, v_base, ts_base, stride_km, stride_vm, offs_m, ts_m, lo, hi,
    kv_len, n_hist, window, qk_scale, bias_scale, pb_ptr, tb_ptr, P_SIZE, T_SIZE, k_desc, v_desc, row0, col_k, col_v,
    INFO, FLAGS, b, m_start, q_start, q_ok, q_len, L_Q, NQB, NKT,
    ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_PB: tl.constexpr, HAS_TB: tl.constexpr, POS_FITS: tl.constexpr, MASKED: tl.constexpr, FAR: tl.constexpr,
    FAST: tl.constexpr, PTX: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, TMA: tl.constexpr, SPLIT: tl.constexpr, TILE_Q: tl.constexpr, TILE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Key tiles ``[lo, hi)``; ``FAR`` ones (:func:`_far_keys_end`) add the position table's last entry to every score."""
    pb_far = tl.load(pb_ptr + P_SIZE - 1) * bias_scale if FAR else 0.0
    USE_SPLIT: tl.constexpr = SPLIT and not MASKED
    if USE_SPLIT:
        flag_next, info_next = _split_ahead(INFO, FLAGS, b, m_start, _clamp_key(lo, kv_len), q_start + offs_m, q_ok,
                                            q_len, NQB, NKT, L_Q, BLOCK_M, TILE_Q, TILE_K)
        first_next, last_next = split_time_bias(info_next, tb_ptr, bias_scale, PTX)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if USE_SPLIT:
            split_ok, info, first_bias, last_bias = flag_next != FLAG_MIXED, info_next, first_next, last_next
            flag_next, info_next = _split_ahead(INFO, FLAGS, b, m_start, _clamp_key(start_n + BLOCK_N, kv_len),
                                                q_start + offs_m, q_ok, q_len, NQB, NKT, L_Q, BLOCK_M, TILE_Q, TILE_K)
        else:
            split_ok: tl.constexpr = False
        k, v = _load_kv(k_base, v_base, stride_km, stride_vm, k_desc, v_desc, row0, col_k, col_v, start_n, kv_len,
                        TMA, MASKED, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_N)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if HAS_PB or HAS_TB:
            if split_ok:
                split = split_key(info, start_n, TILE_K)
                s, _ = add_bias(s, offs_m[:, None], offs_n[None, :], n_hist, ts_m[:, None], offs_n[None, :], pb_ptr,
                                tb_ptr, P_SIZE, T_SIZE, bias_scale, HAS_PB and not FAR, False, PTX, CAUSAL, POS_FITS)
                s = add_split_time(s, offs_n, split, first_bias, last_bias)
            else:
                ts_n = tl.load(ts_base + offs_n, mask=offs_n < kv_len, other=0) if HAS_TB else offs_n
                s, _ = add_bias(s, offs_m[:, None], offs_n[None, :], n_hist, ts_m[:, None], ts_n[None, :], pb_ptr,
                                tb_ptr, P_SIZE, T_SIZE, bias_scale, HAS_PB and not FAR, HAS_TB, PTX,
                                CAUSAL and not MASKED, POS_FITS)
            if FAR:
                s += pb_far
        if ACT == 0:
            if MASKED:
                valid = _mask(offs_m[:, None], offs_n[None, :], kv_len, n_hist, window, CAUSAL, HAS_TARGETS, HAS_WINDOW)
                s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
            p = tl.math.exp2(s - m_new_safe[:, None])
            corr = tl.math.exp2(m_i - m_new_safe)
            l_i = l_i * corr + tl.sum(p, 1)
            acc = acc * corr[:, None]
            m_i = m_new
        else:
            p = _act_fwd(s, ACT, FAST)
            if MASKED:
                valid = _mask(offs_m[:, None], offs_n[None, :], kv_len, n_hist, window, CAUSAL, HAS_TARGETS, HAS_WINDOW)
                p = tl.where(valid, p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc)
        if USE_SPLIT:
            first_next, last_next = split_time_bias(info_next, tb_ptr, bias_scale, PTX)
    return acc, m_i, l_i


@triton.jit
def _split_ahead(INFO, FLAGS, b, m_start, n_start, rows, rows_ok, q_len, NQB, NKT, L_Q, BLOCK_M: tl.constexpr,
                 TILE_Q: tl.constexpr, TILE_K: tl.constexpr):
    """The forward's plan of a key tile, ``(flag, info[M])``, loaded a tile ahead of its use so that the loads'
    latency hides behind a tile's work (one program per SM leaves no other warps to hide it)."""
    return (split_flag(FLAGS, b, m_start, n_start, q_len, NQB, NKT, BLOCK_M, TILE_Q, TILE_K),
            split_rows(INFO, rows, rows_ok, n_start, L_Q, TILE_K))


@triton.jit
def _clamp_key(n, kv_len):
    """A key position inside the sequence, for the loads one tile ahead past a loop's last tile."""
    return tl.maximum(tl.minimum(n, kv_len - 1), 0)


@triton.jit
def _seq_info(Q_OFF, KV_OFF, NT, b, HAS_TARGETS: tl.constexpr):
    q_start = tl.load(Q_OFF + b)
    q_len = (tl.load(Q_OFF + b + 1) - q_start).to(tl.int32)
    kv_start = tl.load(KV_OFF + b)
    kv_len = (tl.load(KV_OFF + b + 1) - kv_start).to(tl.int32)
    n_hist = kv_len
    if HAS_TARGETS:
        n_hist = kv_len - tl.load(NT + b).to(tl.int32)
    return q_start, q_len, kv_start, kv_len, n_hist


@triton.jit
def _program(ORDER, ROWS, H, BLOCK: tl.constexpr, DESCENDING: tl.constexpr, COMPACT: tl.constexpr):
    """This program's (sequence, head, row block) on the 1-D grid ``B * H * cdiv(ROWS, BLOCK)``.

    A (sequence, head)'s row blocks are consecutive programs, so the blocks that run together
    share that sequence's keys and values (or queries) in L2: 1.1–1.2x faster at N=4096-8192
    than with the blocks of every head and sequence interleaved. Sequences come in ``ORDER``,
    most pairs first, and a sequence's blocks ``DESCENDING`` (causal query blocks: the last one
    sees the most keys) or ascending (causal key blocks: the first one is seen by most queries),
    so the longest work starts first and the short work fills the tail. ``COMPACT``: the grid holds
    only the blocks with rows, in that order, and ``ORDER`` is its work list
    (:func:`kernels.triton.work_list.build_work_list`: ``(sequence * H + head, block)`` per program).
    """
    pid = tl.program_id(0)
    if COMPACT:
        sequence_head = tl.load(ORDER + 2 * pid)
        return pid, sequence_head // H, sequence_head % H, tl.load(ORDER + 2 * pid + 1)
    blocks = tl.cdiv(ROWS, BLOCK)
    rank = pid // blocks
    block = pid % blocks
    if DESCENDING:
        block = blocks - 1 - block
    return pid, tl.load(ORDER + rank // H), rank % H, block


@triton.jit
def _key_ranges(m_start, kv_len, n_hist, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key-tile ranges of a query block: [lo, full_hi) needs no mask, [full_hi, hi) does."""
    hi = tl.minimum(m_start + BLOCK_M, kv_len) if CAUSAL else kv_len
    if HAS_WINDOW:
        lo = tl.maximum(tl.minimum(m_start, n_hist) - window + 1, 0) // BLOCK_N * BLOCK_N
        full_hi = lo
    else:
        lo = 0
        full_hi = tl.minimum(m_start, n_hist) // BLOCK_N * BLOCK_N if CAUSAL else n_hist // BLOCK_N * BLOCK_N
    return lo, full_hi, hi


@triton.jit
def _far_keys_end(m_start, n_hist, lo, full_hi, P_SIZE, BLOCK_N: tl.constexpr):
    """End of the mask-free key tiles ``[lo, end)`` of a causal query block whose every (query, key) pair is
    ``P_SIZE - 1`` or more positions apart (targets sit at ``n_hist``): their scores all read the position table's
    last entry, so those tiles add one number instead of reading the table per score, and their position gradient
    is one sum. A table shorter than the sequences (exact near distances, one bucket for the far ones) leaves
    most tiles of a long sequence far."""
    end = tl.maximum(tl.minimum(m_start, n_hist) - P_SIZE + 2, 0) // BLOCK_N * BLOCK_N
    return tl.minimum(tl.maximum(end, lo), full_hi)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _fwd_kernel(
    Q, K, V, Out, LSE, Q_OFF, KV_OFF, ORDER, NT, TS, QTS, PB, TB, INFO, FLAGS,
    stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, stride_om, stride_oh,
    stride_lse_h, stride_pbh, stride_tbh, P_SIZE, T_SIZE, H, alpha, inv_n, window, N_BUCKET, AVG_BUCKET, ROWS,
    L_Q, L_KV, NQB, NKT,
    ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_PB: tl.constexpr, HAS_TB: tl.constexpr, POS_FITS: tl.constexpr, FAST: tl.constexpr, PTX: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, SPLIT: tl.constexpr, TILE_Q: tl.constexpr,
    TILE_K: tl.constexpr, COMPACT: tl.constexpr,
):
    _, b, h, pid_m = _program(ORDER, ROWS, H, BLOCK_M, True, COMPACT)
    q_start, q_len, kv_start, kv_len, n_hist = _seq_info(Q_OFF, KV_OFF, NT, b, HAS_TARGETS)
    m_start = pid_m * BLOCK_M
    if m_start >= q_len:
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ok = offs_m < q_len
    if TMA:
        # 2-D views ``[rows, H * D]`` of the (row-major, head-contiguous) inputs; a tile is one head's columns.
        q_desc = tl.make_tensor_descriptor(Q, shape=[L_Q, H * DQK], strides=[stride_qm, 1], block_shape=[BLOCK_M, DQK])
        k_desc = tl.make_tensor_descriptor(K, shape=[L_KV, H * DQK], strides=[stride_km, 1], block_shape=[BLOCK_N, DQK])
        v_desc = tl.make_tensor_descriptor(V, shape=[L_KV, H * DV], strides=[stride_vm, 1], block_shape=[BLOCK_N, DV])
        q = q_desc.load([(q_start + m_start).to(tl.int32), h * DQK])
    else:
        k_desc = K
        v_desc = V
        q = tl.load(Q + q_start * stride_qm + h * stride_qh + offs_m[:, None] * stride_qm + offs_dqk[None, :],
                    mask=q_ok[:, None] & (offs_dqk[None, :] < DQK), other=0.0)
    row0 = kv_start.to(tl.int32)
    ts_m = tl.load(QTS + q_start + offs_m, mask=q_ok, other=0) if HAS_TB else offs_m
    k_base = K + kv_start * stride_km + h * stride_kh
    v_base = V + kv_start * stride_vm + h * stride_vh
    ts_base = TS + kv_start
    pb_ptr = PB + h * stride_pbh
    tb_ptr = TB + h * stride_tbh

    # Softmax runs in log2 units (exp2 of one FMA per score); LSE is stored in them too.
    qk_scale = alpha * _LOG2E if ACT == 0 else alpha
    bias_scale = _LOG2E if ACT == 0 else 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    lo, full_hi, hi = _key_ranges(m_start, kv_len, n_hist, window, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
    # The split time buckets (kernels/triton/time_tiles.py) serve key tiles inside one of the plan's.
    SPLIT_N: tl.constexpr = SPLIT and TILE_K % BLOCK_N == 0
    near_lo = lo
    if HAS_PB and CAUSAL and not POS_FITS:
        near_lo = _far_keys_end(m_start, n_hist, lo, full_hi, P_SIZE, BLOCK_N)
        acc, m_i, l_i = _fwd_tiles(
            acc, m_i, l_i, q, k_base, v_base, ts_base, stride_km, stride_vm, offs_m, ts_m, lo, near_lo,
            kv_len, n_hist, window, qk_scale, bias_scale, pb_ptr, tb_ptr, P_SIZE, T_SIZE, k_desc, v_desc, row0,
            h * DQK, h * DV, INFO, FLAGS, b, m_start, q_start, q_ok, q_len, L_Q, NQB, NKT,
            ACT, CAUSAL, HAS_TARGETS, HAS_WINDOW, HAS_PB, HAS_TB, POS_FITS, False, True, FAST, PTX, DQK, DV,
            BLOCK_DQK, BLOCK_DV, BLOCK_N, TMA, SPLIT_N, TILE_Q, TILE_K, BLOCK_M,
        )
    acc, m_i, l_i = _fwd_tiles(
        acc, m_i, l_i, q, k_base, v_base, ts_base, stride_km, stride_vm, offs_m, ts_m, near_lo, full_hi,
        kv_len, n_hist, window, qk_scale, bias_scale, pb_ptr, tb_ptr, P_SIZE, T_SIZE, k_desc, v_desc, row0, h * DQK,
        h * DV, INFO, FLAGS, b, m_start, q_start, q_ok, q_len, L_Q, NQB, NKT,
        ACT, CAUSAL, HAS_TARGETS, HAS_WINDOW, HAS_PB, HAS_TB, POS_FITS, False, False, FAST, PTX, DQK, DV, BLOCK_DQK,
        BLOCK_DV, BLOCK_N, TMA, SPLIT_N, TILE_Q, TILE_K, BLOCK_M,
    )
    acc, m_i, l_i = _fwd_tiles(
        acc, m_i, l_i, q, k_base, v_base, ts_base, stride_km, stride_vm, offs_m, ts_m, tl.maximum(full_hi, lo), hi,
        kv_len, n_hist, window, qk_scale, bias_scale, pb_ptr, tb_ptr, P_SIZE, T_SIZE, k_desc, v_desc, row0, h * DQK,
        h * DV, INFO, FLAGS, b, m_start, q_start, q_ok, q_len, L_Q, NQB, NKT,
        ACT, CAUSAL, HAS_TARGETS, HAS_WINDOW, HAS_PB, HAS_TB, POS_FITS, True, False, FAST, PTX, DQK, DV, BLOCK_DQK,
        BLOCK_DV, BLOCK_N, TMA, SPLIT_N, TILE_Q, TILE_K, BLOCK_M,
    )
    if ACT == 0:
        empty = l_i == 0.0
        acc = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, 0.0, m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(LSE + h * stride_lse_h + q_start + offs_m, lse, mask=q_ok)
    else:
        acc = acc * inv_n
    tl.store(Out + q_start * stride_om + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :],
             acc.to(Out.dtype.element_ty), mask=q_ok[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _add_time_grad_by_rows(ds, bucket, ts_m, ts_base, start_n, dtb_ptr, T_SIZE, PTX: tl.constexpr):
    # The reference bucket of each row: its first key's, the largest time difference in order.
    ref = time_bucket(ts_m - tl.load(ts_base + start_n), T_SIZE, PTX)
    add_time_grad(ds, bucket, ref, dtb_ptr, PTX)


@triton.jit
def _bwd_dq_planned_tiles(
    dq, q, do, lse, delta, k_base, v_base, stride_km, stride_vm, offs_m, q_ok, lo, hi, kv_len, qk_scale, bias_scale,
    pb_far, tb_ptr, dtb_ptr, INFO, FLAGS, b, m_start, q_start, q_len, L_Q, NQB, NKT,
    ACT: tl.constexpr, FAST: tl.constexpr, PTX: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, TILE_Q: tl.constexpr,
    TILE_K: tl.constexpr,
):
    """dQ over far key tiles ``[lo, hi)`` (:func:`_far_keys_end`) of the plan's width ``TILE_K``, with each score's
    time bias from its row's split buckets (:mod:`kernels.triton.time_tiles`): no per-score bucket, no uniformity
    test, so the tile is as wide as the unbiased pass's and its loop is that pass's plus a compare, a select and two
    row sums per score. Tiles the plan flags ``FLAG_MIXED`` run with dS = 0 (their loads stay unconditional, so
    the loop pipelines them, but read zero keys and values: a pointwise activation's dS is then zero with no select
    per score) and are left to :func:`_bwd_dq_tiles` (``SKIP_PLANNED``). Returns ``(dq, rows[M])``:
    the rows' dS sums, for the position table's last entry."""
    far_rows = tl.zeros([BLOCK_M], dtype=tl.float32)
    rows = q_start + offs_m
    # Key columns of the tile against each row's split column, both tile-relative.
    cols = tl.arange(0, TILE_K)
    for start_n in range(lo, hi, TILE_K):
        keep = split_flag(FLAGS, b, m_start, start_n, q_len, NQB, NKT, BLOCK_M, TILE_Q, TILE_K) != FLAG_MIXED
        info = split_rows(INFO, rows, q_ok, start_n, L_Q, TILE_K)
        first_bias, last_bias = split_time_bias(info, tb_ptr, bias_scale, PTX)
        split = split_column(info)
        k, v = _load_kv_masked(k_base, v_base, stride_km, stride_vm, start_n, tl.where(keep, kv_len, 0), DQK, DV,
                               BLOCK_DQK, BLOCK_DV, TILE_K)
        # The position term rides on the rows' time terms: one select per score for both.
        s = add_split_time(tl.dot(q, tl.trans(k)) * qk_scale, cols, split, first_bias + pb_far, last_bias + pb_far)
        dp = tl.dot(do, tl.trans(v))
        if ACT == 0:  # the softmax's dS of a zero value row is -p * delta, not zero
            ds = tl.where(keep, tl.math.exp2(s - lse[:, None]) * (dp - delta[:, None]), 0.0)
        else:
            _, dact = _act_fwd_bwd(s, ACT, FAST)
            ds = dp * dact
        dq = tl.dot(ds.to(k.dtype), k, dq)
        total = tl.sum(ds, 1)
        before = tl.sum(tl.where(cols[None, :] < split[:, None], ds, 0.0), 1)
        far_rows += total
        first, last = split_buckets(info)
        tl.atomic_add(dtb_ptr + first, before, sem="relaxed")
        tl.atomic_add(dtb_ptr + last, total - before, sem="relaxed")
    return dq, far_rows


@triton.jit
def _bwd_dq_tiles(
    dq, win_lo, win_hi, time_acc, q, do, lse, delta, k_base, v_base, ts_base, stride_km, stride_vm, offs_m, q_ok,
    ts_m, lo, hi, kv_len, n_hist, window, qk_scale, bias_scale, pb_ptr, tb_ptr, dpb_ptr, dtb_ptr, P_SIZE, T_SIZE,
    m_start, OFF, LD, FLAGS, b, q_len, NQB, NKT, planned_hi,
    ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_PB: tl.constexpr, HAS_TB: tl.constexpr, MASKED: tl.constexpr, FAR: tl.constexpr, FAST: tl.constexpr,
    PTX: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DETERMINISTIC: tl.constexpr, BLOCK_T: tl.constexpr,
    SKIP_PLANNED: tl.constexpr, TILE_Q: tl.constexpr, TILE_K: tl.constexpr,
):
    """dQ over key tiles ``[lo, hi)``, and the bias-table gradients of those tiles' scores
    (:mod:`kernels.triton.bias`; rows outside the sequence or the mask carry dS = 0, so whole tiles
    are summed): by atomics, or ``DETERMINISTIC`` into the program's rows through the position window
    ``(win_lo, win_hi)`` and the time-table sums ``time_acc``. ``FAR`` tiles (:func:`_far_keys_end`; atomics only)
    read the position table's last entry alone: their dS goes into it as one sum over the tiles. ``SKIP_PLANNED``:
    the tiles before ``planned_hi`` that the plan flags ran in :func:`_bwd_dq_planned_tiles`, and only the others
    run here (a tile's body under a branch is not pipelined, a cost only the plan's mixed tiles pay)."""
    pb_far = tl.load(pb_ptr + P_SIZE - 1) * bias_scale if FAR else 0.0
    far_rows = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        if SKIP_PLANNED:
            todo = (start_n >= planned_hi) | (split_flag(FLAGS, b, m_start, start_n, q_len, NQB, NKT, BLOCK_M,
                                                         TILE_Q, TILE_K) == FLAG_MIXED)
        else:
            todo: tl.constexpr = True
        if todo:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k, v = _load_kv_masked(k_base, v_base, stride_km, stride_vm, start_n, kv_len, DQK, DV, BLOCK_DQK, BLOCK_DV,
                                   BLOCK_N)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            if HAS_PB or HAS_TB:
                ts_n = tl.load(ts_base + offs_n, mask=offs_n < kv_len, other=0) if HAS_TB else offs_n
                if MASKED:
                    s, bucket = add_bias(s, offs_m[:, None], offs_n[None, :], n_hist, ts_m[:, None], ts_n[None, :],
                                         pb_ptr, tb_ptr, P_SIZE, T_SIZE, bias_scale, HAS_PB, HAS_TB, PTX)
                else:
                    s, bucket, row_bucket, uniform = add_bias_rows(
                        s, offs_m, offs_n, n_hist, ts_m, ts_n, q_ok, offs_n < kv_len, pb_ptr, tb_ptr, P_SIZE, T_SIZE,
                        bias_scale, HAS_PB and not FAR, HAS_TB, PTX,
                    )
                    if FAR:
                        s += pb_far
            dp = tl.dot(do, tl.trans(v))
            if ACT == 0:
                p = tl.math.exp2(s - lse[:, None])
                ds = p * (dp - delta[:, None])
            else:
                _, dact = _act_fwd_bwd(s, ACT, FAST)
                ds = dp * dact
            if MASKED:
                valid = _mask(offs_m[:, None], offs_n[None, :], kv_len, n_hist, window, CAUSAL, HAS_TARGETS, HAS_WINDOW)
                ds = tl.where(valid, ds, 0.0)
            dq = tl.dot(ds.to(k.dtype), k, dq)
            if HAS_PB:
                if FAR:
                    far_rows += tl.sum(ds, 1)
                elif DETERMINISTIC:
                    win_lo, win_hi = store_position_grad(win_lo, win_hi, ds, m_start, start_n, n_hist, dpb_ptr, OFF, LD,
                                                         HAS_TARGETS, BLOCK_M, BLOCK_N)
                else:
                    add_position_grad(ds, m_start, start_n, n_hist, dpb_ptr, P_SIZE, HAS_TARGETS, BLOCK_M, BLOCK_N)
            if HAS_TB:
                if DETERMINISTIC:
                    time_acc = sum_time_grad(time_acc, ds, bucket, BLOCK_T)
                elif MASKED:
                    _add_time_grad_by_rows(ds, bucket, ts_m, ts_base, start_n, dtb_ptr, T_SIZE, PTX)
                elif uniform:
                    tl.atomic_add(dtb_ptr + row_bucket, tl.sum(ds, 1), sem="relaxed")
                else:
                    _add_time_grad_by_rows(ds, bucket, ts_m, ts_base, start_n, dtb_ptr, T_SIZE, PTX)
    if FAR:
        tl.atomic_add(dpb_ptr + P_SIZE - 1, tl.sum(far_rows, 0), sem="relaxed")
    return dq, win_lo, win_hi, time_acc


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, Q_OFF, KV_OFF, ORDER, NT, TS, QTS, PB, TB, DPB, DTB, INFO, FLAGS,
    stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, stride_dom, stride_doh,
    stride_dqm, stride_dqh, stride_lse_h, stride_pbh, stride_tbh, P_SIZE, T_SIZE, H, alpha, inv_n, window, N_BUCKET,
    AVG_BUCKET, ROWS, REPS, stride_dpb_rep, stride_dtb_rep, OFF, LD, L_Q, NQB, NKT,
    ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_PB: tl.constexpr, HAS_TB: tl.constexpr, FAST: tl.constexpr, PTX: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DETERMINISTIC: tl.constexpr, BLOCK_T: tl.constexpr,
    SPLIT: tl.constexpr, TILE_Q: tl.constexpr, TILE_K: tl.constexpr, COMPACT: tl.constexpr,
):
    pid, b, h, pid_m = _program(ORDER, ROWS, H, BLOCK_M, True, COMPACT)
    q_start, q_len, kv_start, kv_len, n_hist = _seq_info(Q_OFF, KV_OFF, NT, b, HAS_TARGETS)
    m_start = pid_m * BLOCK_M
    if m_start >= q_len:
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ok = offs_m < q_len
    q = tl.load(Q + q_start * stride_qm + h * stride_qh + offs_m[:, None] * stride_qm + offs_dqk[None, :],
                mask=q_ok[:, None] & (offs_dqk[None, :] < DQK), other=0.0)
    do = tl.load(DO + q_start * stride_dom + h * stride_doh + offs_m[:, None] * stride_dom + offs_dv[None, :],
                 mask=q_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    if ACT == 0:
        lse = tl.load(LSE + h * stride_lse_h + q_start + offs_m, mask=q_ok, other=0.0)
        delta = tl.load(DELTA + h * stride_lse_h + q_start + offs_m, mask=q_ok, other=0.0)
    else:
        lse = tl.zeros([BLOCK_M], dtype=tl.float32)
        delta = lse
    ts_m = tl.load(QTS + q_start + offs_m, mask=q_ok, other=0) if HAS_TB else offs_m
    k_base = K + kv_start * stride_km + h * stride_kh
    v_base = V + kv_start * stride_vm + h * stride_vh
    ts_base = TS + kv_start
    qk_scale = alpha * _LOG2E if ACT == 0 else alpha
    bias_scale = _LOG2E if ACT == 0 else 1.0
    # The pointwise 1/N is applied once per output instead of once per score.
    ds_scale = 1.0 if ACT == 0 else inv_n
    if DETERMINISTIC:
        # This program's own rows (kernels/triton/bias_rows.py), each entry stored once; all rows together can
        # pass 2**31 floats.
        dpb_ptr = DPB + pid.to(tl.int64) * stride_dpb_rep
        dtb_ptr = DTB + pid.to(tl.int64) * stride_dtb_rep
    else:
        # Replicated table-gradient accumulators: programs that run together add into different copies.
        dpb_ptr = DPB + (pid % REPS) * stride_dpb_rep + h * LD
        dtb_ptr = DTB + (pid % REPS) * stride_dtb_rep + h * stride_tbh
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    win_lo = tl.zeros([BLOCK_M], dtype=tl.float32)
    win_hi = tl.zeros([BLOCK_M], dtype=tl.float32)
    time_acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    lo, full_hi, hi = _key_ranges(m_start, kv_len, n_hist, window, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
    near_lo = lo
    # Far tiles inside the plan's (kernels/triton/time_tiles.py) run at its width in a loop of their own.
    PLANNED: tl.constexpr = SPLIT and HAS_TB and TILE_K % BLOCK_N == 0
    planned_hi = lo
    if HAS_PB and CAUSAL and not DETERMINISTIC:
        near_lo = _far_keys_end(m_start, n_hist, lo, full_hi, P_SIZE, BLOCK_N)
        if PLANNED:
            if lo % TILE_K == 0:
                planned_hi = lo + (near_lo - lo) // TILE_K * TILE_K
            pb_far = tl.load(PB + h * stride_pbh + P_SIZE - 1) * bias_scale
            dq, far_rows = _bwd_dq_planned_tiles(
                dq, q, do, lse, delta, k_base, v_base, stride_km, stride_vm, offs_m, q_ok, lo, planned_hi, kv_len,
                qk_scale, bias_scale, pb_far, TB + h * stride_tbh, dtb_ptr, INFO, FLAGS, b, m_start, q_start, q_len,
                L_Q, NQB, NKT, ACT, FAST, PTX, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, TILE_Q, TILE_K,
            )
            tl.atomic_add(dpb_ptr + P_SIZE - 1, tl.sum(far_rows, 0), sem="relaxed")
        dq, win_lo, win_hi, time_acc = _bwd_dq_tiles(
            dq, win_lo, win_hi, time_acc, q, do, lse, delta, k_base, v_base, ts_base, stride_km, stride_vm, offs_m,
            q_ok, ts_m, lo, near_lo, kv_len, n_hist, window, qk_scale, bias_scale, PB + h * stride_pbh,
            TB + h * stride_tbh, dpb_ptr, dtb_ptr, P_SIZE, T_SIZE, m_start, OFF, LD, FLAGS, b, q_len, NQB, NKT,
            planned_hi, ACT, CAUSAL, HAS_TARGETS, HAS_WINDOW, HAS_PB, HAS_TB, False, True, FAST, PTX, DQK, DV,
            BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, DETERMINISTIC, BLOCK_T, PLANNED, TILE_Q, TILE_K,
        )
    dq, win_lo, win_hi, time_acc = _bwd_dq_tiles(
        dq, win_lo, win_hi, time_acc, q, do, lse, delta, k_base, v_base, ts_base, stride_km, stride_vm, offs_m, q_ok,
        ts_m, near_lo, full_hi, kv_len, n_hist, window, qk_scale, bias_scale, PB + h * stride_pbh,
        TB + h * stride_tbh, dpb_ptr, dtb_ptr, P_SIZE, T_SIZE, m_start, OFF, LD, FLAGS, b, q_len, NQB, NKT, planned_hi,
        ACT, CAUSAL, HAS_TARGETS, HAS_WINDOW, HAS_PB, HAS_TB, False, False, FAST, PTX, DQK, DV, BLOCK_DQK, BLOCK_DV,
        BLOCK_M, BLOCK_N, DETERMINISTIC, BLOCK_T, False, TILE_Q, TILE_K,
    )
    dq, win_lo, win_hi, time_acc = _bwd_dq_tiles(
        dq, win_lo, win_hi, time_acc, q, do, lse, delta, k_base, v_base, ts_base, stride_km, stride_vm, offs_m, q_ok,
        ts_m, tl.maximum(full_hi, lo), hi, kv_len, n_hist, window, qk_scale, bias_scale, PB + h * stride_pbh,
        TB + h * stride_tbh, dpb_ptr, dtb_ptr, P_SIZE, T_SIZE, m_start, OFF, LD, FLAGS, b, q_len, NQB, NKT, planned_hi,
        ACT, CAUSAL, HAS_TARGETS, HAS_WINDOW, HAS_PB, HAS_TB, True, False, FAST, PTX, DQK, DV, BLOCK_DQK, BLOCK_DV,
        BLOCK_M, BLOCK_N, DETERMINISTIC, BLOCK_T, False, TILE_Q, TILE_K,
    )
    if DETERMINISTIC:
        if HAS_PB:
            flush_position_grad(win_lo, win_hi, dpb_ptr, OFF + m_start, lo, hi, BLOCK_M, BLOCK_N)
        if HAS_TB:
            entries = tl.arange(0, BLOCK_T)
            tl.store(dtb_ptr + entries, time_acc, mask=entries < T_SIZE)
    tl.store(DQ + q_start * stride_dqm + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_dqk[None, :],
             (dq * (alpha * ds_scale)).to(DQ.dtype.element_ty), mask=q_ok[:, None] & (offs_dqk[None, :] < DQK))


@triton.jit
def _bwd_dkdv_tiles(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, ts_base, stride_qm, stride_dom,
    offs_n, ts_n, q_len, lo, hi, kv_len, n_hist, window, qk_scale, bias_scale, pb_ptr, tb_ptr, P_SIZE, T_SIZE,
    INFO, FLAGS, b, n_start, kv_start, L_K, NKB, NQT,
    ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_PB: tl.constexpr, HAS_TB: tl.constexpr, POS_FITS: tl.constexpr, MASKED: tl.constexpr, FAR: tl.constexpr,
    FAST: tl.constexpr, PTX: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, TILE_KB: tl.constexpr,
    TILE_QT: tl.constexpr,
):
    """Works on transposed tiles ``[keys, queries]`` so dK and dV are plain products. ``FAR`` tiles
    (:func:`_far_queries_start`) add the position table's last entry to every score. Split time buckets come from
    the transposed plan (:mod:`kernels.triton.time_tiles`), whose per-key vectors are this tile's rows."""
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    pb_far = tl.load(pb_ptr + P_SIZE - 1) * bias_scale if FAR else 0.0
    USE_SPLIT: tl.constexpr = SPLIT and not MASKED
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < q_len
        if USE_SPLIT:
            # Loaded in the tile that uses it: carried one tile ahead, as the forward does, the plan spilled registers
            # and made this pass slower (docs/benchmarks.md).
            split_ok = split_flag(FLAGS, b, n_start, start_m, kv_len, NKB, NQT, BLOCK_N, TILE_KB,
                                  TILE_QT) != FLAG_MIXED
        else:
            split_ok: tl.constexpr = False
        q_t = tl.load(q_base + offs_m[None, :] * stride_qm + offs_dqk[:, None],
                      mask=m_ok[None, :] & (offs_dqk[:, None] < DQK), other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :],
                     mask=m_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        s_t = tl.dot(k, q_t) * qk_scale
        if HAS_PB or HAS_TB:
            if split_ok:
                info = split_rows(INFO, kv_start + offs_n, offs_n < kv_len, start_m, L_K, TILE_QT)
                split = split_key(info, start_m, TILE_QT)
                first_bias, last_bias = split_time_bias(info, tb_ptr, bias_scale, PTX)
                s_t, _ = add_bias(s_t, offs_m[None, :], offs_n[:, None], n_hist, offs_m[None, :], offs_n[:, None],
                                  pb_ptr, tb_ptr, P_SIZE, T_SIZE, bias_scale, HAS_PB and not FAR, False, PTX, CAUSAL,
                                  POS_FITS)
                s_t = add_split_time(s_t, offs_m, split, first_bias, last_bias)
            else:
                ts_m = tl.load(ts_base + offs_m, mask=m_ok, other=0) if HAS_TB else offs_m
                s_t, _ = add_bias(s_t, offs_m[None, :], offs_n[:, None], n_hist, ts_m[None, :], ts_n[:, None],
                                  pb_ptr, tb_ptr, P_SIZE, T_SIZE, bias_scale, HAS_PB and not FAR, HAS_TB, PTX,
                                  CAUSAL and not MASKED, POS_FITS)
            if FAR:
                s_t += pb_far
        dp_t = tl.dot(v, tl.trans(do))
        if ACT == 0:
            lse = tl.load(lse_base + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
            p_t = tl.math.exp2(s_t - lse[None, :])
            if MASKED:
                valid = _mask(offs_m[None, :], offs_n[:, None], kv_len, n_hist, window, CAUSAL, HAS_TARGETS, HAS_WINDOW)
                p_t = tl.where(valid, p_t, 0.0)
            ds_t = p_t * (dp_t - delta[None, :])
        else:
            p_t, dact = _act_fwd_bwd(s_t, ACT, FAST)
            ds_t = dp_t * dact
            if MASKED:
                valid = _mask(offs_m[None, :], offs_n[:, None], kv_len, n_hist, window, CAUSAL, HAS_TARGETS, HAS_WINDOW)
                p_t = tl.where(valid, p_t, 0.0)
                ds_t = tl.where(valid, ds_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk)
    return dk, dv


@triton.jit
def _far_queries_start(n_start, n_hist, mid, hi, P_SIZE, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Start of the mask-free query tiles ``[start, hi)`` of a causal key block whose every pair is ``P_SIZE - 1``
    or more positions apart (the transpose of :func:`_far_keys_end`); ``hi`` where there are none."""
    first = n_start + BLOCK_N + P_SIZE - 2
    start = tl.where(n_hist >= first, tl.cdiv(first, BLOCK_M) * BLOCK_M, hi)
    return tl.minimum(tl.maximum(start, mid), hi)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV_, LSE, DELTA, Q_OFF, KV_OFF, ORDER, NT, TS, QTS, PB, TB, INFO, FLAGS,
    stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, stride_dom, stride_doh,
    stride_dkm, stride_dkh, stride_dvm, stride_dvh, stride_lse_h, stride_pbh, stride_tbh,
    P_SIZE, T_SIZE, H, alpha, inv_n, window, N_BUCKET, AVG_BUCKET, ROWS, L_K, NKB, NQT,
    ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_PB: tl.constexpr, HAS_TB: tl.constexpr, POS_FITS: tl.constexpr, FAST: tl.constexpr, PTX: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, TILE_KB: tl.constexpr,
    TILE_QT: tl.constexpr, COMPACT: tl.constexpr,
):
    _, b, h, pid_n = _program(ORDER, ROWS, H, BLOCK_N, False, COMPACT)
    q_start, q_len, kv_start, kv_len, n_hist = _seq_info(Q_OFF, KV_OFF, NT, b, HAS_TARGETS)
    n_start = pid_n * BLOCK_N
    if n_start >= kv_len:
        return
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < kv_len
    k = tl.load(K + kv_start * stride_km + h * stride_kh + offs_n[:, None] * stride_km + offs_dqk[None, :],
                mask=n_ok[:, None] & (offs_dqk[None, :] < DQK), other=0.0)
    v = tl.load(V + kv_start * stride_vm + h * stride_vh + offs_n[:, None] * stride_vm + offs_dv[None, :],
                mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    ts_n = tl.load(TS + kv_start + offs_n, mask=n_ok, other=0) if HAS_TB else offs_n

    # Query tiles that can see this key block: causal ones start at the block's diagonal.
    lo = n_start // BLOCK_M * BLOCK_M if CAUSAL else 0
    hi = q_len
    # Mask-free tiles: every query row is past every key (causal), and no key is a target.
    if HAS_WINDOW:
        full_lo = hi
    else:
        full_lo = tl.cdiv(n_start + BLOCK_N - 1, BLOCK_M) * BLOCK_M if CAUSAL else lo
        if HAS_TARGETS:
            full_lo = tl.where(n_start + BLOCK_N <= n_hist, full_lo, hi)
    mid = tl.minimum(tl.maximum(full_lo, lo), hi)
    # Split time buckets (kernels/triton/time_tiles.py) where each query tile lies inside one of the plan's.
    SPLIT_M: tl.constexpr = SPLIT and TILE_QT % BLOCK_M == 0
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    q_base = Q + q_start * stride_qm + h * stride_qh
    do_base = DO + q_start * stride_dom + h * stride_doh
    lse_base = LSE + h * stride_lse_h + q_start
    delta_base = DELTA + h * stride_lse_h + q_start
    qk_scale = alpha * _LOG2E if ACT == 0 else alpha
    bias_scale = _LOG2E if ACT == 0 else 1.0
    ds_scale = 1.0 if ACT == 0 else inv_n
    pb_ptr = PB + h * stride_pbh
    tb_ptr = TB + h * stride_tbh
    dk, dv = _bwd_dkdv_tiles(
        dk, dv, k, v, q_base, do_base, lse_base, delta_base, QTS + q_start, stride_qm, stride_dom,
        offs_n, ts_n, q_len, lo, mid, kv_len, n_hist, window, qk_scale, bias_scale, pb_ptr, tb_ptr, P_SIZE, T_SIZE,
        INFO, FLAGS, b, n_start, kv_start, L_K, NKB, NQT,
        ACT, CAUSAL, HAS_TARGETS, HAS_WINDOW, HAS_PB, HAS_TB, POS_FITS, True, False, FAST, PTX, DQK, DV, BLOCK_DQK,
        BLOCK_DV, BLOCK_M, BLOCK_N, SPLIT_M, TILE_KB, TILE_QT,
    )
    near_hi = hi
    if HAS_PB and CAUSAL and not POS_FITS:
        near_hi = _far_queries_start(n_start, n_hist, mid, hi, P_SIZE, BLOCK_M, BLOCK_N)
    dk, dv = _bwd_dkdv_tiles(
        dk, dv, k, v, q_base, do_base, lse_base, delta_base, QTS + q_start, stride_qm, stride_dom,
        offs_n, ts_n, q_len, mid, near_hi, kv_len, n_hist, window, qk_scale, bias_scale, pb_ptr, tb_ptr, P_SIZE,
        T_SIZE, INFO, FLAGS, b, n_start, kv_start, L_K, NKB, NQT,
        ACT, CAUSAL, HAS_TARGETS, HAS_WINDOW, HAS_PB, HAS_TB, POS_FITS, False, False, FAST, PTX, DQK, DV, BLOCK_DQK,
        BLOCK_DV, BLOCK_M, BLOCK_N, SPLIT_M, TILE_KB, TILE_QT,
    )
    if HAS_PB and CAUSAL and not POS_FITS:
        dk, dv = _bwd_dkdv_tiles(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, QTS + q_start, stride_qm, stride_dom,
            offs_n, ts_n, q_len, near_hi, hi, kv_len, n_hist, window, qk_scale, bias_scale, pb_ptr, tb_ptr, P_SIZE,
            T_SIZE, INFO, FLAGS, b, n_start, kv_start, L_K, NKB, NQT,
            ACT, CAUSAL, HAS_TARGETS, HAS_WINDOW, HAS_PB, HAS_TB, POS_FITS, False, True, FAST, PTX, DQK, DV,
            BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, SPLIT_M, TILE_KB, TILE_QT,
        )
    tl.store(DK + kv_start * stride_dkm + h * stride_dkh + offs_n[:, None] * stride_dkm + offs_dqk[None, :],
             (dk * (alpha * ds_scale)).to(DK.dtype.element_ty), mask=n_ok[:, None] & (offs_dqk[None, :] < DQK))
    tl.store(DV_ + kv_start * stride_dvm + h * stride_dvh + offs_n[:, None] * stride_dvm + offs_dv[None, :],
             (dv * ds_scale).to(DV_.dtype.element_ty), mask=n_ok[:, None] & (offs_dv[None, :] < DV))


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bwd_delta_kernel(Out, DO, DELTA, stride_om, stride_oh, stride_dom, stride_doh, L,
                      DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr):
    """Softmax backward's per-row ``delta = rowsum(dO * O)`` into ``DELTA [H, L]`` (float32)."""
    h = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < L) & (offs_d[None, :] < DV)
    o = tl.load(Out + offs_m[:, None] * stride_om + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + offs_m[:, None] * stride_dom + h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + h * L + offs_m, delta, mask=offs_m < L)


_PRUNE = {"early_config_prune": prune}
_fwd_tuned = triton.autotune(FWD_CONFIGS, key=[*TUNE_KEY, "TMA"], prune_configs_by=_PRUNE)(_fwd_kernel)
_dq_tuned = triton.autotune(DQ_CONFIGS, key=TUNE_KEY, prune_configs_by=_PRUNE, reset_to_zero=["DPB", "DTB"])(
    _bwd_dq_kernel
)
_dkdv_tuned = triton.autotune(DKDV_CONFIGS, key=TUNE_KEY, prune_configs_by=_PRUNE)(_bwd_dkdv_kernel)

# Interpreter tiles: unequal M and N so tests cross tile boundaries both ways.
_CPU_FWD = {"BLOCK_M": 32, "BLOCK_N": 16}
_CPU_DKDV = {"BLOCK_M": 16, "BLOCK_N": 32}


@functools.cache
def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


@functools.cache
def _n_bucket(n: int) -> int:
    return max(64, triton.next_power_of_2(max(n, 1)))


def deterministic() -> bool:
    """``GEM_KERNELS_DETERMINISTIC=1``: no float atomics (the bias-table gradients go through per-program rows,
    :mod:`kernels.triton.bias_rows`) and no autotuning, so a backward repeats bit for bit."""
    return settings.deterministic()


@dataclass(frozen=True)
class _KernelCall:
    """A call as the kernels take it: the non-differentiable part of an :class:`AttentionSpec` in
    kernel form (int64 targets, float32 relative times, resolved scales), plus the batch's shape."""

    act: str
    causal: bool
    alpha: float
    inv_n: float
    window: int | None
    num_targets: torch.Tensor | None
    timestamps: torch.Tensor | None
    query_timestamps: torch.Tensor | None
    max_q_len: int
    max_kv_len: int
    batch: int
    # Cross-attention whose forward and backward run on key chunks (:mod:`kernels.triton.split_keys`).
    split_keys: bool = False

    @classmethod
    def of_self_attention(cls, spec: AttentionSpec, q: torch.Tensor, offsets: torch.Tensor, max_len: int):
        has_time = spec.time_bias is not None
        qts = spec.query_timestamps
        return cls(
            act=spec.activation,
            causal=spec.causal,
            alpha=spec.scale(q.shape[-1]),
            inv_n=1.0 / spec.pointwise_divisor(max_len),
            window=spec.window,
            num_targets=spec.num_targets.to(torch.int64).contiguous() if spec.num_targets is not None else None,
            timestamps=per_batch(
                "timestamps", (spec.timestamps, offsets), lambda: relative_timestamps(spec.timestamps, offsets)
            )
            if has_time
            else None,
            query_timestamps=per_batch(
                "query_timestamps", (qts, offsets, spec.timestamps),
                lambda: relative_timestamps(qts, offsets, origin=spec.timestamps),
            )
            if has_time and qts is not None
            else None,
            max_q_len=max_len,
            max_kv_len=max_len,
            batch=offsets.numel() - 1,
        )


_DUMMIES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _dummy(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A placeholder for pointer arguments a variant never reads (one per device and dtype)."""
    if (device, dtype) not in _DUMMIES:
        _DUMMIES[device, dtype] = torch.zeros(1, device=device, dtype=dtype)
    return _DUMMIES[device, dtype]


def _time_tiles_args(q, time_bias, q_offsets, kv_offsets, call, keys_on_rows: bool) -> tuple[tuple, dict]:
    """The ``(INFO, FLAGS)`` pointers and the arguments of the split time buckets
    (:mod:`kernels.triton.time_tiles`): the batch's plan with queries on its rows (the forward and dQ passes) or
    keys (``keys_on_rows``, dK/dV); placeholders and ``SPLIT=False`` without a time table or with the switch off."""
    planned = time_bias is not None and call.timestamps is not None and time_bias.shape[1] <= MAX_TIME_BUCKETS
    if not planned or not settings.time_tiles():
        dummy = _dummy(q.device, torch.int32)
        return (dummy, dummy), {**dict(zip(plan_arg_names(keys_on_rows), (1, 1, 16, 16), strict=True)), "SPLIT": False}
    ts = call.timestamps
    qts = call.query_timestamps if call.query_timestamps is not None else ts
    plan = build_time_tiles(ts, qts, q_offsets, kv_offsets, call.max_q_len, call.max_kv_len, time_bias.shape[1],
                            call.causal, keys_on_rows)
    return (plan.info, plan.flags), {**plan.kernel_args(), "SPLIT": True}


def _common_args(q, k, v, pb, tb, call):
    heads = q.shape[1]
    dummy = _dummy(q.device)
    # The kernels read float32 tables with unit stride along the bucket axis.
    pb_t = pb.to(torch.float32).contiguous() if pb is not None else dummy
    tb_t = tb.to(torch.float32).contiguous() if tb is not None else dummy
    meta = dict(
        ACT=_ACT_CODES[call.act],
        CAUSAL=call.causal,
        HAS_TARGETS=call.num_targets is not None,
        HAS_WINDOW=call.window is not None,
        HAS_PB=pb is not None,
        HAS_TB=tb is not None,
        # No distance of the call reaches the position table's last entry: its clamp is dropped.
        POS_FITS=pb is not None and pb.shape[1] >= max(call.max_q_len, call.max_kv_len),
        FAST=settings.fast_sigmoid() and q.is_cuda,
        # Inline PTX for the bias tables' reads, buckets and scatter (kernels/triton/bias.py).
        PTX=q.is_cuda,
        DQK=q.shape[2],
        DV=v.shape[2],
        BLOCK_DQK=_block_d(q.shape[2]),
        BLOCK_DV=_block_d(v.shape[2]),
    )
    scalars = dict(
        stride_pbh=pb_t.stride(0) if pb is not None and pb.shape[0] > 1 else 0,
        stride_tbh=tb_t.stride(0) if tb is not None and tb.shape[0] > 1 else 0,
        P_SIZE=pb.shape[1] if pb is not None else 1,
        T_SIZE=tb.shape[1] if tb is not None else 1,
        H=heads,
        alpha=call.alpha,
        inv_n=call.inv_n,
        window=call.window if call.window is not None else 0,
        N_BUCKET=_n_bucket(call.max_kv_len),
        AVG_BUCKET=_n_bucket(k.shape[0] // max(call.batch, 1)),
    )
    nt = call.num_targets if call.num_targets is not None else dummy
    ts = call.timestamps if call.timestamps is not None else dummy
    qts = call.query_timestamps if call.query_timestamps is not None else ts
    return pb_t, tb_t, nt, (ts, qts), meta, scalars


def _tma_ok(x: torch.Tensor) -> bool:
    """A ``[L, H, D]`` tensor that a TMA descriptor can read as ``[L, H * D]``: heads contiguous, a
    power-of-two D of 16-256 elements (the tile is one head's columns), 16-byte aligned base and rows."""
    d, size = x.shape[2], x.element_size()
    return (
        x.shape[0] > 0
        and x.stride(2) == 1
        and x.stride(1) == d
        and _block_d(d) == d <= 256
        and x.data_ptr() % 16 == 0
        and (x.stride(0) * size) % 16 == 0
    )


def _use_tma(*tensors: torch.Tensor) -> bool:
    """Whether the kernels load tiles through TMA descriptors: Hopper or newer (or the interpreter
    with ``GEM_KERNELS_TMA=1``), inputs that :func:`_tma_ok` accepts, and not ``GEM_KERNELS_TMA=0``."""
    q = tensors[0]
    enabled = settings.tma()
    if not (q.is_cuda if enabled is None else enabled):
        return False
    if not all(_tma_ok(x) for x in tensors):
        return False
    if not q.is_cuda:
        return True
    if torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    # Device-side descriptors need global scratch memory, which Triton asks this allocator for. It
    # lives in a context variable, so it is set on every call: autograd runs the backward in its own
    # thread, which does not see the forward thread's.
    triton.set_allocator(_tma_scratch)
    return True


def _tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _autotune_enabled() -> bool:
    """``GEM_KERNELS_AUTOTUNE=0`` runs each kernel's first config untuned (quick compiles for checks). So does
    :func:`deterministic`: the autotuner picks by timing, and another tile sums in another order."""
    return settings.autotune() and not deterministic()


# The config each launch took, by (kernel, dtype, tuning key): later launches skip the lookup, and
# tuned ones skip Triton's autotuner, which spends tens of microseconds of Python per call rebuilding
# its key from all ~60 arguments (that matters for short, heavy-tailed batches).
_PICKS: dict[tuple, triton.Config] = {}
# What the autotuner picked in this process, by table entry (kernels.triton.configs.write_tuned).
TUNED: dict[str, triton.Config] = {}


def _pick_key(plain, dtype: torch.dtype, tuning: bool, tuned, kwargs) -> tuple:
    """The key of ``_PICKS``: the kernel, dtype, whether autotuning is on and the autotuner's key arguments."""
    return (plain.__name__, dtype, tuning, *(kwargs[name] for name in tuned.keys))


def _launch_config(tuned, plain, cpu_blocks, kwargs, x, on_cuda) -> dict | None:
    """The block sizes and compile options a launch of ``plain`` on ``x``'s dtype and device takes, as
    :mod:`kernels.triton.configs` says; None where the autotuner is to pick them."""
    if not on_cuda:
        return cpu_blocks
    tuning = _autotune_enabled()
    pick = _pick_key(plain, x.dtype, tuning, tuned, kwargs)
    config = _PICKS.get(pick)
    if config is None:
        config = checked_in_pick(x.device, entry_key(plain.__name__, x.dtype, tuned.keys, kwargs))
        if config is None and tuning:
            return None
        config = _PICKS[pick] = config or configs_for(tuned.configs, kwargs, x.dtype)[0]
    return config.all_kwargs()


@dataclass(frozen=True)
class _Work:
    """A launch's compact grid (:mod:`kernels.triton.work_list`): the launch order it replaces among the
    arguments, the offsets ``[B+1]`` of the rows its blocks split, their total, and the blocks' direction."""

    order: torch.Tensor
    offsets: torch.Tensor
    total_rows: int
    heads: int
    descending: bool
    name: str


def _launch(tuned, plain, cpu_blocks, block_key, grid_rows, batch_heads, args, kwargs, on_cuda, work=None):
    """A 1-D grid of ``B * H * cdiv(grid_rows, block)`` programs (:func:`_program`), where
    ``block_key`` names the tile that splits the rows; the config as :func:`_launch_config` says. With
    ``work`` (a :class:`_Work`) and a known config, the compact grid where it has fewer programs."""
    kwargs = {**kwargs, "ROWS": grid_rows, "COMPACT": False}
    config = _launch_config(tuned, plain, cpu_blocks, kwargs, args[0], on_cuda)
    if config is None:
        if recording():
            # The autotuner would compile every config of the variant: record them all, and remember no
            # pick, so that the real launch still tunes.
            for candidate in configs_for(tuned.configs, kwargs, args[0].dtype):
                plain[(batch_heads * triton.cdiv(grid_rows, candidate.kwargs[block_key]),)](
                    *args, **kwargs, **candidate.all_kwargs()
                )
            return
        tuned[lambda meta: (batch_heads * triton.cdiv(grid_rows, meta[block_key]),)](*args, **kwargs)
        pick = _pick_key(plain, args[0].dtype, True, tuned, kwargs)
        _PICKS[pick] = TUNED[entry_key(plain.__name__, args[0].dtype, tuned.keys, kwargs)] = tuned.best_config
        return
    block = config[block_key]
    programs = batch_heads * triton.cdiv(grid_rows, block)
    per_head = None
    if work is not None and settings.compact_grid():
        per_head = compact_programs(work.total_rows, batch_heads // work.heads, grid_rows, block)
    if per_head is not None:
        table = build_work_list(work.offsets, work.order, work.heads, block, per_head, work.descending, work.name)
        args = tuple(table if arg is work.order else arg for arg in args)
        kwargs["COMPACT"] = True
        programs = work.heads * per_head
    plain[(programs,)](*args, **kwargs, **config)


def _longest_first(q_offsets: torch.Tensor, kv_offsets: torch.Tensor) -> torch.Tensor:
    """``[B]`` int32 sequence indices, most (query, key) pairs first: the grid's order."""

    def order() -> torch.Tensor:
        pairs = (q_offsets[1:] - q_offsets[:-1]) * (kv_offsets[1:] - kv_offsets[:-1])
        return torch.argsort(pairs, descending=True, stable=True).to(torch.int32)

    return per_batch("longest_first", (q_offsets, kv_offsets), order)


# Every score adds its gradient to one entry of a small bias table, so a single float32 copy of
# the table is one hot spot for every program of the grid: the atomics serialise (52 ms for the
# dK/dV pass of a d=32, 80k-token batch, against 0.5 ms for its forward, on the H200). Programs
# instead add into one of ``REPS`` copies, chosen by their program index: programs that run
# together have consecutive indices, so they hit different addresses; the copies are summed once
# at the end.
_MAX_BIAS_GRAD_REPLICAS = 128
_MAX_BIAS_GRAD_BYTES = 64 << 20


def _bias_grad_replicas(programs: int, *tables: torch.Tensor | None) -> int:
    """How many float32 copies of the bias-table gradients the backward accumulates into."""
    numel = sum(t.numel() for t in tables if t is not None)
    if numel == 0:
        return 1
    return max(1, min(_MAX_BIAS_GRAD_REPLICAS, programs, _MAX_BIAS_GRAD_BYTES // (4 * numel)))


def _zeros_replicated(
    reps: int, pos_bias: torch.Tensor | None, time_bias: torch.Tensor | None, pos_width: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, Callable[[float], tuple]]:
    """``[reps, rows, pos_width]`` float32 zeros for the position table ``[rows, P]`` and ``[reps, *table.shape]``
    for the time table (None without a table), and the function that sums the replicas into the tables'
    ``scale``-times gradients ``(dpb, dtb)`` (None without a table). A call reaches only the position entries below
    its longest distance, so the replicas hold ``pos_width <= P`` of them and the rest of the gradient is zero. Both
    tables' replicas are views of one buffer: one fill zeroes them, one reduction and one multiply finish them."""
    shapes = [None if pos_bias is None else (pos_bias.shape[0], pos_width),
              None if time_bias is None else tuple(time_bias.shape)]
    if shapes == [None, None]:
        return None, None, lambda scale: (None, None)
    sizes = [math.prod(shape) for shape in shapes if shape is not None]
    device = (pos_bias if pos_bias is not None else time_bias).device
    buffer = torch.zeros(reps, sum(sizes), device=device, dtype=torch.float32)

    def unpack(flat: torch.Tensor, *lead: int) -> list[torch.Tensor | None]:
        parts = iter(flat.split(sizes, -1))
        return [next(parts).view(*lead, *shape) if shape is not None else None for shape in shapes]

    def finish(scale: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        dpb, dtb = unpack(buffer.sum(0) * scale)
        if dpb is not None and pos_width < pos_bias.shape[1]:
            dpb = torch.nn.functional.pad(dpb, (0, pos_bias.shape[1] - pos_width))
        return dpb, dtb

    dpb, dtb = unpack(buffer, reps)
    return dpb, dtb, finish


def _table_grad_variant(pos_bias: torch.Tensor | None, time_bias: torch.Tensor | None) -> dict:
    """The dQ pass's table-gradient constexprs: deterministic (with a table to write) or atomic, and the
    register width of the deterministic time-table sums."""
    det = deterministic() and (pos_bias is not None or time_bias is not None)
    width = triton.next_power_of_2(time_bias.shape[1]) if det and time_bias is not None else 1
    return {"DETERMINISTIC": det, "BLOCK_T": max(16, width)}


def _table_grad_buffers(q, pos_bias, time_bias, call, dq_kwargs):
    """The dQ pass's table-gradient accumulators ``(DPB, DTB)``, their layout arguments, and the function that
    sums them into ``scale`` times ``(dpb, dtb)`` (float32, None without a table) once the pass ran: replicated
    copies for the atomics, or per-program rows (:mod:`kernels.triton.bias_rows`)."""
    heads = q.shape[1]
    if dq_kwargs["DETERMINISTIC"]:
        config = _launch_config(_dq_tuned, _bwd_dq_kernel, _CPU_FWD, dq_kwargs, q, q.is_cuda)
        rows = build_bias_grad_rows(pos_bias, time_bias, call.batch * heads, call.max_q_len, call.max_kv_len,
                                    call.causal, config["BLOCK_M"])
        dpb, dtb = rows.position, rows.time
        layout = dict(REPS=1, OFF=rows.offset, LD=dpb.shape[-1] if dpb is not None else 0)

        def table_grads(scale: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            return (
                sum_position_rows(rows, heads, pos_bias.shape[0], pos_bias.shape[1]) * scale
                if dpb is not None else None,
                sum_time_rows(rows, heads, time_bias.shape[0]) * scale if dtb is not None else None,
            )
    else:
        width = min(pos_bias.shape[1], max(call.max_q_len, call.max_kv_len)) if pos_bias is not None else 0
        reps = _bias_grad_replicas(call.batch * heads, pos_bias, time_bias)
        dpb, dtb, table_grads = _zeros_replicated(reps, pos_bias, time_bias, width)
        # LD: a head's row in the position replicas (0 for a table all heads share).
        layout = dict(REPS=reps, OFF=0, LD=width if pos_bias is not None and pos_bias.shape[0] > 1 else 0)

    layout.update(stride_dpb_rep=dpb.stride(0) if dpb is not None else 0,
                  stride_dtb_rep=dtb.stride(0) if dtb is not None else 0)
    dummy = _dummy(q.device)
    return (dpb if dpb is not None else dummy, dtb if dtb is not None else dummy), layout, table_grads


def _key_value_grads(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty dK ``[L, H, D]`` and dV, laid out as their inputs: where ``k`` and ``v`` are the two halves of one
    ``[L, 2, H, D]`` tensor (a fused key-value projection, unbound), the gradients are the halves of one fresh such
    tensor, which the kernels fill through their strides: :func:`kernels.unbind_pair` then hands that tensor on
    as the projection's gradient where ``unbind`` would stack a new one from the two."""
    if pair_halves(k, v):
        pair = torch.empty(k.shape[0], 2, *k.shape[1:], device=k.device, dtype=k.dtype)
        return pair[:, 0], pair[:, 1]
    return torch.empty_like(k), torch.empty_like(v)


class _JaggedAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos_bias, time_bias, q_offsets, kv_offsets, call):
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        batch, heads = q_offsets.numel() - 1, q.shape[1]
        out = torch.empty(q.shape[0], heads, v.shape[2], device=q.device, dtype=v.dtype)
        lse = torch.empty(heads, q.shape[0], device=q.device, dtype=torch.float32)
        pb, tb, nt, ts, meta, scalars = _common_args(q, k, v, pos_bias, time_bias, call)
        order = _longest_first(q_offsets, kv_offsets)
        if batch * heads > 0 and call.max_q_len > 0 and call.split_keys:
            split_keys.chunked_forward(q, k, v, out, lse, q_offsets, kv_offsets, call.alpha,
                                       (meta["BLOCK_DQK"], meta["BLOCK_DV"]))
        elif batch * heads > 0 and call.max_q_len > 0:
            tiles, split = _time_tiles_args(q, time_bias, q_offsets, kv_offsets, call, keys_on_rows=False)
            args = (q, k, v, out, lse, q_offsets, kv_offsets, order, nt, *ts, pb, tb, *tiles,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                    out.stride(0), out.stride(1), lse.stride(0))
            tma = _use_tma(q, k, v)
            _launch(_fwd_tuned, _fwd_kernel, _CPU_FWD, "BLOCK_M", call.max_q_len, batch * heads, args,
                    {**scalars, **meta, **split, "L_Q": q.shape[0], "L_KV": k.shape[0], "TMA": tma}, q.is_cuda,
                    _Work(order, q_offsets, q.shape[0], heads, True, "work_fwd"))
        ctx.save_for_backward(q, k, v, out, lse, q_offsets, kv_offsets, order, pos_bias, time_bias)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_offsets, kv_offsets, order, pos_bias, time_bias = ctx.saved_tensors
        call = ctx.call
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        batch, heads = q_offsets.numel() - 1, q.shape[1]
        # Every row belongs to a sequence, so the kernels write every row of dQ, dK and dV.
        dq = torch.empty_like(q)
        dk, dv = _key_value_grads(k, v)
        pb, tb, nt, ts, meta, scalars = _common_args(q, k, v, pos_bias, time_bias, call)
        # The dQ pass indexes the position table without POS_FITS's shortcuts: its time is not bound by the
        # instructions they save, and there they measured slower (docs/benchmarks.md, session 22).
        dq_meta = {key: value for key, value in meta.items() if key != "POS_FITS"}
        dq_kwargs = {**scalars, **dq_meta, **_table_grad_variant(pos_bias, time_bias)}
        (dpb_t, dtb_t), tables, table_grads = _table_grad_buffers(q, pos_bias, time_bias, call, dq_kwargs)
        delta = torch.empty_like(lse) if call.act == "softmax" else lse
        if call.act == "softmax" and q.shape[0] > 0:
            rows = _CPU_FWD["BLOCK_M"] if not q.is_cuda else 64
            _bwd_delta_kernel[(triton.cdiv(q.shape[0], rows), heads)](
                out, dout, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), q.shape[0],
                DV=v.shape[2], BLOCK_DV=meta["BLOCK_DV"], BLOCK_M=rows,
            )
        if batch * heads == 0 or call.max_q_len == 0 or call.max_kv_len == 0:
            # Nothing attends: every gradient is zero (rows may still exist on the other side).
            dq.zero_()
            dk.zero_()
            dv.zero_()
        elif call.split_keys:
            split_keys.chunked_backward(q, k, v, dout, dq, dk, dv, lse, delta, q_offsets, kv_offsets, call.alpha,
                                        (meta["BLOCK_DQK"], meta["BLOCK_DV"]))
        else:
            # The dQ pass's autotuner zeroes the table-gradient accumulators around each trial; they are
            # written by that pass only, so no earlier output is among them.
            tiles, split = _time_tiles_args(q, time_bias, q_offsets, kv_offsets, call, keys_on_rows=False)
            dq_args = (q, k, v, dout, dq, lse, delta, q_offsets, kv_offsets, order, nt, *ts, pb, tb, dpb_t, dtb_t,
                       *tiles, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                       dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), lse.stride(0))
            # Deterministic table gradients are stored per program of the full grid (kernels/triton/bias_rows.py).
            dq_work = None if dq_kwargs["DETERMINISTIC"] else _Work(order, q_offsets, q.shape[0], heads, True, "work_dq")
            _launch(_dq_tuned, _bwd_dq_kernel, _CPU_FWD, "BLOCK_M", call.max_q_len, batch * heads, dq_args,
                    {**dq_kwargs, **tables, **split, "L_Q": q.shape[0]}, q.is_cuda, dq_work)
            tiles, split = _time_tiles_args(q, time_bias, q_offsets, kv_offsets, call, keys_on_rows=True)
            dkdv_args = (q, k, v, dout, dk, dv, lse, delta, q_offsets, kv_offsets, order, nt, *ts, pb, tb, *tiles,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                         dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                         lse.stride(0))
            _launch(_dkdv_tuned, _bwd_dkdv_kernel, _CPU_DKDV, "BLOCK_N", call.max_kv_len, batch * heads, dkdv_args,
                    {**scalars, **meta, **split, "L_K": k.shape[0]}, q.is_cuda,
                    _Work(order, kv_offsets, k.shape[0], heads, False, "work_dkdv"))
        # The kernels sum raw dS into the tables; the pointwise 1/N is applied here, once per entry.
        table_scale = 1.0 if call.act == "softmax" else scalars["inv_n"]
        dpb, dtb = table_grads(table_scale)
        dpb = dpb.to(pos_bias.dtype) if dpb is not None else None
        dtb = dtb.to(time_bias.dtype) if dtb is not None else None
        return dq, dk, dv, dpb, dtb, None, None, None


def jagged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_len: int, spec: AttentionSpec
) -> torch.Tensor:
    """Triton jagged self-attention of ``spec`` (:class:`kernels.spec.AttentionSpec`; the dispatcher
    checks the inputs, this does not).

    Shapes: q, k ``[L, H, Dqk]``, v ``[L, H, Dv]``, offsets ``[B + 1]`` -> ``[L, H, Dv]``.
    """
    offsets = offsets.to(torch.int64).contiguous()
    call = _KernelCall.of_self_attention(spec, q, offsets, max_len)
    return _JaggedAttentionFn.apply(q, k, v, spec.pos_bias, spec.time_bias, offsets, offsets, call)


def relative_timestamps(
    timestamps: torch.Tensor, offsets: torch.Tensor, origin: torch.Tensor | None = None
) -> torch.Tensor:
    """``[L]`` int32 offsets of each time from its sequence's first event, ``origin[offsets[b]]``
    (``origin`` defaults to ``timestamps``; query times are measured from the keys' first event).

    The time bias needs only differences inside a sequence, so the kernels work on these instead
    of int64 times: every per-pair operation stays 32-bit, and the kernels subtract two offsets in
    int32 before converting the difference to float32, so a difference is exact whatever the span
    (float32 offsets would round the times of a sequence longer than 2**24 s, 194 days, to 2-8 s
    and move short gaps between its late events across bucket edges). Offsets are clamped to
    ``±2**30`` (34 years in seconds) so that any difference of two fits in int32: only gaps longer
    than that change bucket. Integer times only (fractions are truncated).
    """
    seq = torch.searchsorted(offsets[1:], torch.arange(timestamps.numel(), device=timestamps.device), right=True)
    origin = timestamps if origin is None else origin
    limit = 2**30
    rel = timestamps.to(torch.int64) - origin[offsets[seq]].to(torch.int64)
    return rel.clamp_(-limit, limit).to(torch.int32)


def jagged_cross_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    *,
    activation: str = "softmax",
    alpha: float | None = None,
) -> torch.Tensor:
    """Triton jagged cross-attention; see :func:`kernels.jagged_cross_attention`.

    Shapes: q ``[Lq, H, Dqk]``, k ``[Lkv, H, Dqk]``, v ``[Lkv, H, Dv]`` -> ``[Lq, H, Dv]``.
    """
    spec = AttentionSpec(activation=activation, causal=False, alpha=alpha)
    call = _KernelCall(
        act=activation, causal=False, alpha=spec.scale(q.shape[-1]), inv_n=1.0 / spec.pointwise_divisor(max_kv_len),
        window=None, num_targets=None, timestamps=None, query_timestamps=None, max_q_len=max_q_len,
        max_kv_len=max_kv_len, batch=q_offsets.numel() - 1,
        split_keys=settings.split_keys() and split_keys.applies(activation, max_q_len, max_kv_len, q),
    )
    return _JaggedAttentionFn.apply(
        q, k, v, None, None, q_offsets.to(torch.int64).contiguous(), kv_offsets.to(torch.int64).contiguous(), call
    )
