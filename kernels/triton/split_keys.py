"""Softmax cross-attention of a few queries per sequence over long key rows, with the keys split in chunks.

A PMA's seeds (8 queries per sequence) attending to a user history of thousands of events fill one query block:
the general kernels give each (sequence, head) one program that walks every key tile of the sequence while the
rest of the GPU idles. Here every pass runs one program per (key chunk, head) instead, the chunks ``CHUNK`` keys
of one sequence each (a sequence of ``n`` keys has ``cdiv(n, CHUNK)``), so a batch's programs grow with its keys,
not with its longest sequence:

- forward: each chunk stores its queries' softmax over its own keys, ``o_c[M, Dv]`` (normalised) and
  ``lse_c[M]`` (log2 units); a second kernel per (sequence, head) combines them,
  ``lse = log2(sum_c 2^lse_c)``, ``out = sum_c 2^(lse_c - lse) o_c``, and stores ``out`` and ``lse`` as the
  general forward does;
- backward: every query of a sequence fits one tile, so a chunk's program has all it needs for its keys' rows of
  dK and dV, and it reads each key and value once for those and for its part of dQ, ``sum_{j in c} dS_ij k_j``
  (float32); a second kernel per (sequence, head) sums the parts in chunk order (no atomics: the sum repeats bit
  for bit) and scales.

The chunks of a batch are numbered in key order: sequence ``b``'s start at ``cdiv``-cumsum ``base[b]``, at most
``cdiv(L_kv, CHUNK) + B`` in all (a bound from the shapes: no device sync, the same for a static shape, so CUDA
graphs keep it); programs past the batch's chunks return at once.

Works on triton 3.6 and 3.9, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton.per_batch import per_batch

# Queries per sequence the split handles: one query tile holds them all.
MAX_QUERIES = 16
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class _Tiles:
    """Keys per chunk, keys per loaded tile, and the launch options of the chunk kernels."""

    chunk: int
    block_n: int
    num_warps: int
    num_stages: int


# The interpreter's chunks hold two key tiles, so tests cross tile and chunk boundaries.
_GPU = _Tiles(chunk=256, block_n=64, num_warps=4, num_stages=2)
_CPU = _Tiles(chunk=32, block_n=16, num_warps=4, num_stages=1)


def tiles(x: torch.Tensor) -> _Tiles:
    return _GPU if x.is_cuda else _CPU


def applies(act: str, max_q_len: int, max_kv_len: int, x: torch.Tensor) -> bool:
    """Whether a cross-attention call runs on key chunks: softmax, at most
    :data:`MAX_QUERIES` queries per sequence, and keys for more than one chunk."""
    return act == "softmax" and 0 < max_q_len <= MAX_QUERIES and max_kv_len > tiles(x).chunk


def _chunks(kv_offsets: torch.Tensor, chunk: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(base[B+1], owner[slots])`` int32: sequence ``b``'s chunks are ``base[b]:base[b+1]``, and ``owner[g]``
    is chunk ``g``'s sequence (``B`` past the batch's chunks). Built once per batch."""

    def build() -> torch.Tensor:
        counts = (kv_offsets[1:] - kv_offsets[:-1] + chunk - 1) // chunk
        base = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        owner = torch.searchsorted(base[1:], torch.arange(slots, device=base.device, dtype=base.dtype), right=True)
        return torch.cat([base, owner]).to(torch.int32)

    both = per_batch("split_keys_chunks", (kv_offsets,), build, extra=(chunk, slots))
    batch = kv_offsets.numel() - 1
    return both[: batch + 1], both[batch + 1 :]


@triton.jit
def _chunk_of(BASE, OWNER, Q_OFF, KV_OFF, B):
    """This program's (chunk ``g``, head, sequence ``b``, the chunk's index in the sequence) and the sequence's
    query start, query count, key start and key count; ``b = B`` past the batch's chunks (the program returns)."""
    g = tl.program_id(0)
    b = tl.load(OWNER + g)
    seq = tl.minimum(b, B - 1)
    q_start = tl.load(Q_OFF + seq)
    kv_start = tl.load(KV_OFF + seq)
    return (g, tl.program_id(1), b, g - tl.load(BASE + seq), q_start,
            (tl.load(Q_OFF + seq + 1) - q_start).to(tl.int32), kv_start,
            (tl.load(KV_OFF + seq + 1) - kv_start).to(tl.int32))


@triton.jit
def _load_rows(base, stride_m, rows, row_ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    return tl.load(base + rows[:, None] * stride_m + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < D),
                   other=0.0)


@triton.jit(do_not_specialize=["B"])
def _chunk_fwd_kernel(
    Q, K, V, PART_O, PART_LSE, Q_OFF, KV_OFF, BASE, OWNER, B,
    stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, qk_scale,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    """One (chunk, head): ``PART_O[g, h, :q_len]`` and ``PART_LSE[g, h, :q_len]`` over the chunk's keys."""
    g, h, b, first, q_start, q_len, kv_start, kv_len = _chunk_of(BASE, OWNER, Q_OFF, KV_OFF, B)
    if b >= B:
        return
    H = tl.num_programs(1)
    offs_m = tl.arange(0, BLOCK_M)
    q_ok = offs_m < q_len
    q = _load_rows(Q + q_start * stride_qm + h * stride_qh, stride_qm, offs_m, q_ok, DQK, BLOCK_DQK)
    k_base = K + kv_start * stride_km + h * stride_kh
    v_base = V + kv_start * stride_vm + h * stride_vh
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(first * CHUNK, tl.minimum(first * CHUNK + CHUNK, kv_len), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_len
        k = _load_rows(k_base, stride_km, offs_n, n_ok, DQK, BLOCK_DQK)
        v = _load_rows(v_base, stride_vm, offs_n, n_ok, DV, BLOCK_DV)
        s = tl.where(n_ok[None, :], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        # Every chunk holds a key, so the first tile's maximum is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        corr = tl.math.exp2(m_i - m_new)
        l_i = l_i * corr + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * corr[:, None])
        m_i = m_new
    slot = (g * H + h) * BLOCK_M + offs_m
    cols = tl.arange(0, BLOCK_DV)
    tl.store(PART_O + slot[:, None] * BLOCK_DV + cols[None, :], acc / l_i[:, None], mask=q_ok[:, None])
    tl.store(PART_LSE + slot, m_i + tl.log2(l_i), mask=q_ok)


@triton.jit(do_not_specialize=["stride_lse_h"])
def _combine_fwd_kernel(
    PART_O, PART_LSE, Out, LSE, Q_OFF, BASE, stride_om, stride_oh, stride_lse_h,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """One (sequence, head): its chunks' partial softmaxes into ``Out`` and ``LSE`` (a sequence without keys:
    zeros, as the general forward)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    q_start = tl.load(Q_OFF + b)
    q_len = (tl.load(Q_OFF + b + 1) - q_start).to(tl.int32)
    first = tl.load(BASE + b)
    last = tl.load(BASE + b + 1)
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_DV)
    q_ok = offs_m < q_len
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for g in range(first, last):
        slot = (g * H + h) * BLOCK_M + offs_m
        lse_c = tl.load(PART_LSE + slot, mask=q_ok, other=0.0)
        o_c = tl.load(PART_O + slot[:, None] * BLOCK_DV + cols[None, :], mask=q_ok[:, None], other=0.0)
        m_new = tl.maximum(m_i, lse_c)
        corr = tl.math.exp2(m_i - m_new)
        w = tl.math.exp2(lse_c - m_new)
        acc = acc * corr[:, None] + o_c * w[:, None]
        l_i = l_i * corr + w
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, 0.0, m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + h * stride_lse_h + q_start + offs_m, lse, mask=q_ok)
    tl.store(Out + (q_start + offs_m[:, None]) * stride_om + h * stride_oh + cols[None, :],
             out.to(Out.dtype.element_ty), mask=q_ok[:, None] & (cols[None, :] < DV))


@triton.jit(do_not_specialize=["B", "stride_lse_h"])
def _chunk_bwd_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_, PART_DQ, Q_OFF, KV_OFF, BASE, OWNER, B,
    stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, stride_dom, stride_doh,
    stride_dkm, stride_dkh, stride_dvm, stride_dvh, stride_lse_h, qk_scale, alpha,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    """One (chunk, head): the chunk's rows of ``DK`` and ``DV`` (every query of the sequence is in the tile), and
    ``PART_DQ[g, h, :q_len] = sum over the chunk's keys of dS k`` (unscaled): one pass over the keys and values."""
    g, h, b, first, q_start, q_len, kv_start, kv_len = _chunk_of(BASE, OWNER, Q_OFF, KV_OFF, B)
    if b >= B:
        return
    H = tl.num_programs(1)
    offs_m = tl.arange(0, BLOCK_M)
    q_ok = offs_m < q_len
    q = _load_rows(Q + q_start * stride_qm + h * stride_qh, stride_qm, offs_m, q_ok, DQK, BLOCK_DQK)
    do = _load_rows(DO + q_start * stride_dom + h * stride_doh, stride_dom, offs_m, q_ok, DV, BLOCK_DV)
    lse = tl.load(LSE + h * stride_lse_h + q_start + offs_m, mask=q_ok, other=0.0)
    delta = tl.load(DELTA + h * stride_lse_h + q_start + offs_m, mask=q_ok, other=0.0)
    k_base = K + kv_start * stride_km + h * stride_kh
    v_base = V + kv_start * stride_vm + h * stride_vh
    dk_base = DK + kv_start * stride_dkm + h * stride_dkh
    dv_base = DV_ + kv_start * stride_dvm + h * stride_dvh
    cols_qk = tl.arange(0, BLOCK_DQK)
    cols_v = tl.arange(0, BLOCK_DV)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    for start_n in range(first * CHUNK, tl.minimum(first * CHUNK + CHUNK, kv_len), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_len
        k = _load_rows(k_base, stride_km, offs_n, n_ok, DQK, BLOCK_DQK)
        v = _load_rows(v_base, stride_vm, offs_n, n_ok, DV, BLOCK_DV)
        valid = q_ok[:, None] & n_ok[None, :]
        p = tl.where(valid, tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dv = tl.dot(tl.trans(p.to(do.dtype)), do)
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q) * alpha
        tl.store(dv_base + offs_n[:, None] * stride_dvm + cols_v[None, :], dv.to(DV_.dtype.element_ty),
                 mask=n_ok[:, None] & (cols_v[None, :] < DV))
        tl.store(dk_base + offs_n[:, None] * stride_dkm + cols_qk[None, :], dk.to(DK.dtype.element_ty),
                 mask=n_ok[:, None] & (cols_qk[None, :] < DQK))
        dq = tl.dot(ds.to(k.dtype), k, dq)
    slot = (g * H + h) * BLOCK_M + offs_m
    tl.store(PART_DQ + slot[:, None] * BLOCK_DQK + cols_qk[None, :], dq, mask=q_ok[:, None])


@triton.jit
def _sum_dq_kernel(
    PART_DQ, DQ, Q_OFF, BASE, stride_dqm, stride_dqh, alpha,
    DQK: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """One (sequence, head): its chunks' partial dQ summed in chunk order, times ``alpha``, into ``DQ``."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    q_start = tl.load(Q_OFF + b)
    q_len = (tl.load(Q_OFF + b + 1) - q_start).to(tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_DQK)
    q_ok = offs_m < q_len
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    for g in range(tl.load(BASE + b), tl.load(BASE + b + 1)):
        slot = (g * H + h) * BLOCK_M + offs_m
        dq += tl.load(PART_DQ + slot[:, None] * BLOCK_DQK + cols[None, :], mask=q_ok[:, None], other=0.0)
    tl.store(DQ + (q_start + offs_m[:, None]) * stride_dqm + h * stride_dqh + cols[None, :],
             (dq * alpha).to(DQ.dtype.element_ty), mask=q_ok[:, None] & (cols[None, :] < DQK))


def _plan(q: torch.Tensor, k: torch.Tensor, kv_offsets: torch.Tensor):
    """The tiles, the chunk slots (``cdiv(L_kv, CHUNK) + B``), ``(base, owner)`` and the kernels' shared
    constexprs."""
    t = tiles(q)
    batch = kv_offsets.numel() - 1
    slots = triton.cdiv(k.shape[0], t.chunk) + batch
    base, owner = _chunks(kv_offsets, t.chunk, slots)
    meta = dict(BLOCK_M=MAX_QUERIES, num_warps=t.num_warps)
    return t, slots, base, owner, meta


def chunked_forward(q, k, v, out, lse, q_offsets, kv_offsets, alpha: float, blocks: tuple[int, int]) -> None:
    """Fill ``out[Lq, H, Dv]`` and ``lse[H, Lq]`` (log2 units) of softmax cross-attention over key chunks.

    Shapes as :func:`kernels.triton.jagged_attention.jagged_cross_attention`; ``alpha`` the score scale,
    ``blocks`` the register widths ``(BLOCK_DQK, BLOCK_DV)`` of the head dims.
    """
    heads, dqk, dv = q.shape[1], q.shape[2], v.shape[2]
    t, slots, base, owner, meta = _plan(q, k, kv_offsets)
    block_dqk, block_dv = blocks
    part_o = torch.empty(slots, heads, MAX_QUERIES, block_dv, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(slots, heads, MAX_QUERIES, device=q.device, dtype=torch.float32)
    batch = kv_offsets.numel() - 1
    _chunk_fwd_kernel[(slots, heads)](
        q, k, v, part_o, part_lse, q_offsets, kv_offsets, base, owner, batch,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), alpha * _LOG2E,
        DQK=dqk, DV=dv, BLOCK_DQK=block_dqk, BLOCK_DV=block_dv, BLOCK_N=t.block_n, CHUNK=t.chunk,
        num_stages=t.num_stages, **meta,
    )
    _combine_fwd_kernel[(batch, heads)](
        part_o, part_lse, out, lse, q_offsets, base, out.stride(0), out.stride(1), lse.stride(0),
        DV=dv, BLOCK_DV=block_dv, **meta,
    )


def chunked_backward(q, k, v, dout, dq, dk, dv, lse, delta, q_offsets, kv_offsets, alpha: float,
                     blocks: tuple[int, int]) -> None:
    """Fill ``dq[Lq, H, Dqk]``, ``dk[Lkv, H, Dqk]`` and ``dv[Lkv, H, Dv]`` from ``dout[Lq, H, Dv]``, ``lse`` and
    ``delta`` ``[H, Lq]`` over key chunks (arguments as :func:`chunked_forward`)."""
    heads, dqk, dv_dim = q.shape[1], q.shape[2], v.shape[2]
    t, slots, base, owner, meta = _plan(q, k, kv_offsets)
    block_dqk, block_dv = blocks
    part_dq = torch.empty(slots, heads, MAX_QUERIES, block_dqk, device=q.device, dtype=torch.float32)
    batch = kv_offsets.numel() - 1
    _chunk_bwd_kernel[(slots, heads)](
        q, k, v, dout, lse, delta, dk, dv, part_dq, q_offsets, kv_offsets, base, owner, batch,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0),
        dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0), alpha * _LOG2E, alpha,
        DQK=dqk, DV=dv_dim, BLOCK_DQK=block_dqk, BLOCK_DV=block_dv, BLOCK_N=t.block_n, CHUNK=t.chunk,
        num_stages=t.num_stages, **meta,
    )
    _sum_dq_kernel[(batch, heads)](
        part_dq, dq, q_offsets, base, dq.stride(0), dq.stride(1), alpha, DQK=dqk, BLOCK_DQK=block_dqk, **meta,
    )
