"""Time buckets per (row, key tile), computed once per batch so the attention passes skip them per score.

The time bias of a score is ``time_bias[h, bucket(qts_i - ts_j)]``: per score a subtraction, a logarithm, a
clamp, an address and a table read. Those instructions bound the biased tiles (docs/benchmarks.md), yet the
buckets are the same for every head, every layer and every pass of a step: only the table differs. For times
in order, a row's buckets along a key tile fall as the keys' times rise, and away from the diagonal a tile
spans a small part of the row's distance to it, so most rows of most tiles hold at most two buckets, the
first key's and the last key's, split at one key. :func:`build_time_tiles` finds, for every ``TILE_Q`` rows
and ``TILE_K`` keys of a sequence, whether each row has that form, and stores per (row, key tile)

    ``info = first | last << 8 | split << 16``  (``split``: keys of the tile in bucket ``first``)

and per (row block, key tile) a flag: every row of the block has the form (``FLAG_SPLIT``) or not
(``FLAG_MIXED``). A forward or dK/dV tile that lies inside blocks of form then adds
``where(key < split, time_bias[first], time_bias[last])``: two table reads per row and a compare and a select per
score (:func:`add_split_time`). Other tiles take the per-score buckets. Exact: the same bucket function on the
same int32 times decides both; nothing assumes the times are in order, only the flags' hit rate does. The dQ pass
reads the forward's plan in its far tiles (every pair past the position table's last entry) only, in a loop of the
plan's width of its own, where the split rows also give the time table's gradient as two row sums per row; its
other tiles keep their per-row path (:func:`kernels.triton.bias.add_bias_rows`), where reading the plan measured no
faster (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton.bias import gather, time_bucket
from kernels.triton.per_batch import per_batch

# Row-block heights of the flags; a pass's query tile covers one or several blocks (or lies inside one).
TILE_Q_GPU = 64
TILE_Q_CPU = 16
# Key-tile widths: a pass tile of ``BLOCK_N`` keys uses the plan whose width ``BLOCK_N`` divides. The forward takes
# the narrow one (its biased tiles have 32-64 keys), dK/dV the wide one (64-128 keys).
TILE_K_GPU = (64, 128)
TILE_K_CPU = (32, 32)
# ``first`` and ``last`` are packed in 8 bits each.
MAX_TIME_BUCKETS = 256
# A (row block, key tile)'s flag: some row holds other buckets, or every row splits in two (or holds one).
FLAG_MIXED = tl.constexpr(0)
FLAG_SPLIT = tl.constexpr(1)


@dataclass(frozen=True)
class TimeTiles:
    """One batch's plan at one key-tile width: ``info[NKT, L_Q]`` int32 (module doc) and ``flags[B, NQB, NKT]``
    int32 (1: every row of the ``TILE_Q`` block has the two-bucket form in that key tile)."""

    info: torch.Tensor
    flags: torch.Tensor
    tile_q: int
    tile_k: int

    def kernel_args(self) -> dict:
        return dict(NQB=self.flags.shape[1], NKT=self.flags.shape[2], TILE_Q=self.tile_q, TILE_K=self.tile_k)


@triton.jit
def _time_tiles_kernel(TS, QTS, Q_OFF, KV_OFF, INFO, FLAGS, T_SIZE, L_Q, NQB, NKT, CAUSAL: tl.constexpr,
                       PTX: tl.constexpr, TILE_Q: tl.constexpr, TILE_K: tl.constexpr):
    """One program per (row block, sequence): the block's rows against each key tile a mask-free pass tile can
    cover (causal: the tiles before the block's last row)."""
    qb = tl.program_id(0)
    b = tl.program_id(1)
    q_start = tl.load(Q_OFF + b)
    q_len = (tl.load(Q_OFF + b + 1) - q_start).to(tl.int32)
    kv_start = tl.load(KV_OFF + b)
    kv_len = (tl.load(KV_OFF + b + 1) - kv_start).to(tl.int32)
    m0 = qb * TILE_Q
    if m0 >= q_len:
        return
    rows = m0 + tl.arange(0, TILE_Q)
    rows_ok = rows < q_len
    ts_q = tl.load(QTS + q_start + rows, mask=rows_ok, other=0)
    kt_end = tl.cdiv(kv_len, TILE_K)
    if CAUSAL:
        kt_end = tl.minimum(kt_end, tl.cdiv(m0 + TILE_Q, TILE_K))
    for kt in range(0, kt_end):
        n0 = kt * TILE_K
        cols = n0 + tl.arange(0, TILE_K)
        cols_ok = cols < kv_len
        ts_k = tl.load(TS + kv_start + cols, mask=cols_ok, other=0)
        bucket = time_bucket(ts_q[:, None] - ts_k[None, :], T_SIZE, PTX)
        last_col = tl.minimum(n0 + TILE_K, kv_len) - 1
        first = tl.sum(tl.where(cols[None, :] == n0, bucket, 0), 1)
        last = tl.sum(tl.where(cols[None, :] == last_col, bucket, 0), 1)
        split = tl.sum(((bucket == first[:, None]) & cols_ok[None, :]).to(tl.int32), 1)
        want = tl.where(cols[None, :] < n0 + split[:, None], first[:, None], last[:, None])
        bad = tl.max(tl.max((rows_ok[:, None] & cols_ok[None, :] & (bucket != want)).to(tl.int32), 1), 0)
        tl.store(INFO + kt * L_Q + q_start + rows, first | (last << 8) | (split << 16), mask=rows_ok)
        tl.store(FLAGS + (b * NQB + qb) * NKT + kt, tl.where(bad != 0, FLAG_MIXED, FLAG_SPLIT))


def _build(ts: torch.Tensor, qts: torch.Tensor, q_offsets: torch.Tensor, kv_offsets: torch.Tensor, max_q_len: int,
           max_kv_len: int, t_size: int, causal: bool, tile_q: int, tile_k: int, on_cuda: bool) -> TimeTiles:
    batch = q_offsets.numel() - 1
    nqb = triton.cdiv(max_q_len, tile_q)
    nkt = triton.cdiv(max_kv_len, tile_k)
    info = torch.zeros(nkt, qts.numel(), device=ts.device, dtype=torch.int32)
    flags = torch.zeros(batch, nqb, nkt, device=ts.device, dtype=torch.int32)
    if batch > 0 and nqb > 0 and nkt > 0:
        _time_tiles_kernel[(nqb, batch)](
            ts, qts, q_offsets, kv_offsets, info, flags, t_size, qts.numel(), nqb, nkt,
            CAUSAL=causal, PTX=on_cuda, TILE_Q=tile_q, TILE_K=tile_k, num_warps=4,
        )
    return TimeTiles(info, flags, tile_q, tile_k)


def build_time_tiles(ts: torch.Tensor, qts: torch.Tensor, q_offsets: torch.Tensor, kv_offsets: torch.Tensor,
                     max_q_len: int, max_kv_len: int, t_size: int, causal: bool, tile_k: int) -> TimeTiles:
    """The plan of a batch's int32 relative key times ``ts[L_KV]`` and query times ``qts[L_Q]``
    (:func:`kernels.triton.jagged_attention.relative_timestamps`) for a ``t_size``-entry time table at key tiles of
    ``tile_k`` (``causal``: only the tiles before each row block's last row, the ones a causal pass's mask-free tiles
    lie in); computed once per batch and width (:mod:`kernels.triton.per_batch`), then shared by every layer."""
    on_cuda = ts.is_cuda
    tile_q = TILE_Q_GPU if on_cuda else TILE_Q_CPU
    return per_batch(
        f"time_tiles_{tile_k}", (ts, qts, q_offsets, kv_offsets),
        lambda: _build(ts, qts, q_offsets, kv_offsets, max_q_len, max_kv_len, t_size, causal, tile_q, tile_k,
                       on_cuda),
        extra=(max_q_len, max_kv_len, t_size, causal),
    )


@triton.jit
def split_flag(FLAGS, b, m_start, n_start, q_len, NQB, NKT, BLOCK_M: tl.constexpr, TILE_Q: tl.constexpr,
               TILE_K: tl.constexpr):
    """The flag of query rows ``[m_start, m_start + BLOCK_M)`` of sequence ``b`` in the key tile holding ``n_start``:
    ``FLAG_MIXED`` if any row block the rows cover or lie inside has that flag (blocks past the sequence have no
    rows and count as ``FLAG_SPLIT``)."""
    qb = m_start // TILE_Q
    base = FLAGS + (b * NQB + qb) * NKT + n_start // TILE_K
    flag = tl.load(base)
    for i in tl.static_range(1, BLOCK_M // TILE_Q):
        flag = tl.minimum(flag, tl.load(base + i * NKT, mask=(qb + i) * TILE_Q < q_len, other=FLAG_SPLIT))
    return flag


@triton.jit
def split_rows(INFO, rows, rows_ok, n_start, L_Q, TILE_K: tl.constexpr):
    """``info[M]``: the packed buckets and split of global rows ``rows[M]`` in the key tile holding ``n_start``."""
    return tl.load(INFO + n_start // TILE_K * L_Q + rows, mask=rows_ok, other=0)


@triton.jit
def split_buckets(info):
    """``(first[M], last[M])``: each packed row's two buckets."""
    return info & 255, (info >> 8) & 255


@triton.jit
def split_column(info):
    """``split[M]``: each packed row's first column of the key tile in bucket ``last``."""
    return info >> 16


@triton.jit
def split_time_bias(info, tb_ptr, scale, PTX: tl.constexpr):
    """The time-table entries of each row's two buckets, times ``scale``: ``(first_bias[M], last_bias[M])``."""
    first, last = split_buckets(info)
    return gather(tb_ptr, first, PTX) * scale, gather(tb_ptr, last, PTX) * scale


@triton.jit
def split_key(info, n_start, TILE_K: tl.constexpr):
    """``split[M]``: each packed row's first key (sequence-relative) in bucket ``last``, in the key tile holding
    ``n_start``."""
    return n_start // TILE_K * TILE_K + split_column(info)


@triton.jit
def add_split_time(s, keys, split, first_bias, last_bias, KEYS_ON_ROWS: tl.constexpr):
    """``s`` plus each score's time bias from its row's split: ``keys`` are the tile's key positions and the
    per-query vectors come from :func:`split_time_rows`; ``KEYS_ON_ROWS``: a transposed ``[keys, queries]`` tile."""
    if KEYS_ON_ROWS:
        return s + tl.where(keys[:, None] < split[None, :], first_bias[None, :], last_bias[None, :])
    else:
        return s + tl.where(keys[None, :] < split[:, None], first_bias[:, None], last_bias[:, None])
