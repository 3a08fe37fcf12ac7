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
(``FLAG_MIXED``). A forward tile that lies inside blocks of form then adds
``where(key < split, time_bias[first], time_bias[last])``: two table reads per row and a compare and a select per
score (:func:`add_split_time`). Other tiles take the per-score buckets. Exact: the same bucket function on the
same int32 times decides both; nothing assumes the times are in order, only the flags' hit rate does.

The dK/dV pass works on transposed ``[keys, queries]`` tiles, so it reads the transposed plan (``keys_on_rows``):
per (key, query tile) the buckets along the queries, which rise with the queries' times, split at one query. Its
per-tile vectors are then its tile's rows, as the forward's are: read by query columns, the same loads, unpacking
and selects cost per element (each thread holds many more distinct columns than rows of a dot result). The dQ pass
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
# Column-tile widths; a pass's tile lies inside one (its columns divide this width).
TILE_K_GPU = 64
TILE_K_CPU = 32
# ``first`` and ``last`` are packed in 8 bits each.
MAX_TIME_BUCKETS = 256
# A (row block, key tile)'s flag: some row holds other buckets, or every row splits in two (or holds one).
FLAG_MIXED = tl.constexpr(0)
FLAG_SPLIT = tl.constexpr(1)


@dataclass(frozen=True)
class TimeTiles:
    """One batch's plan in one orientation: ``info[NCT, L_ROWS]`` int32 (module doc) and ``flags[B, NRB, NCT]``
    int32 (1: every row of the ``tile_q`` block has the two-bucket form in that ``tile_k``-column tile). Rows are
    queries, or keys (``keys_on_rows``)."""

    info: torch.Tensor
    flags: torch.Tensor
    tile_q: int
    tile_k: int
    keys_on_rows: bool

    def kernel_args(self) -> dict:
        """The launch's plan arguments, named by :func:`plan_arg_names`."""
        return dict(zip(plan_arg_names(self.keys_on_rows), (*self.flags.shape[1:], self.tile_q, self.tile_k),
                        strict=True))


def plan_arg_names(keys_on_rows: bool) -> tuple[str, str, str, str]:
    """A kernel's names for a plan's row blocks, column tiles, block height and tile width: ``NQB, NKT, TILE_Q,
    TILE_K`` for query rows (the forward and dQ passes), ``NKB, NQT, TILE_KB, TILE_QT`` for key rows (dK/dV)."""
    return ("NKB", "NQT", "TILE_KB", "TILE_QT") if keys_on_rows else ("NQB", "NKT", "TILE_Q", "TILE_K")


# The token count and the block counts change with the batch: specializing on their divisibility would compile the
# kernel again for a batch of another bucket (a few more rows, the same token budget) in the middle of training.
@triton.jit(do_not_specialize=["T_SIZE", "L_ROWS", "NRB", "NCT"])
def _time_tiles_kernel(ROW_TS, COL_TS, ROW_OFF, COL_OFF, INFO, FLAGS, T_SIZE, L_ROWS, NRB, NCT, CAUSAL: tl.constexpr,
                       KEYS_ON_ROWS: tl.constexpr, PTX: tl.constexpr, TILE_Q: tl.constexpr, TILE_K: tl.constexpr):
    """One program per (row block, sequence): the block's ``TILE_Q`` rows against each ``TILE_K``-column tile a
    mask-free pass tile can cover. Rows are queries and columns keys, or the transpose (``KEYS_ON_ROWS``); causal:
    the column tiles before the block's last row, or from the block's first row on."""
    rb = tl.program_id(0)
    b = tl.program_id(1)
    r_start = tl.load(ROW_OFF + b)
    r_len = (tl.load(ROW_OFF + b + 1) - r_start).to(tl.int32)
    c_start = tl.load(COL_OFF + b)
    c_len = (tl.load(COL_OFF + b + 1) - c_start).to(tl.int32)
    m0 = rb * TILE_Q
    if m0 >= r_len:
        return
    rows = m0 + tl.arange(0, TILE_Q)
    rows_ok = rows < r_len
    ts_r = tl.load(ROW_TS + r_start + rows, mask=rows_ok, other=0)
    ct_lo = 0
    ct_hi = tl.cdiv(c_len, TILE_K)
    if CAUSAL:
        if KEYS_ON_ROWS:
            ct_lo = m0 // TILE_K
        else:
            ct_hi = tl.minimum(ct_hi, tl.cdiv(m0 + TILE_Q, TILE_K))
    for ct in range(ct_lo, ct_hi):
        n0 = ct * TILE_K
        cols = n0 + tl.arange(0, TILE_K)
        cols_ok = cols < c_len
        ts_c = tl.load(COL_TS + c_start + cols, mask=cols_ok, other=0)
        if KEYS_ON_ROWS:
            bucket = time_bucket(ts_c[None, :] - ts_r[:, None], T_SIZE, PTX)
        else:
            bucket = time_bucket(ts_r[:, None] - ts_c[None, :], T_SIZE, PTX)
        last_col = tl.minimum(n0 + TILE_K, c_len) - 1
        first = tl.sum(tl.where(cols[None, :] == n0, bucket, 0), 1)
        last = tl.sum(tl.where(cols[None, :] == last_col, bucket, 0), 1)
        split = tl.sum(((bucket == first[:, None]) & cols_ok[None, :]).to(tl.int32), 1)
        want = tl.where(cols[None, :] < n0 + split[:, None], first[:, None], last[:, None])
        bad = tl.max(tl.max((rows_ok[:, None] & cols_ok[None, :] & (bucket != want)).to(tl.int32), 1), 0)
        tl.store(INFO + ct * L_ROWS + r_start + rows, first | (last << 8) | (split << 16), mask=rows_ok)
        tl.store(FLAGS + (b * NRB + rb) * NCT + ct, tl.where(bad != 0, FLAG_MIXED, FLAG_SPLIT))


def _build(row_ts: torch.Tensor, col_ts: torch.Tensor, row_offsets: torch.Tensor, col_offsets: torch.Tensor,
           max_rows: int, max_cols: int, t_size: int, causal: bool, keys_on_rows: bool, on_cuda: bool) -> TimeTiles:
    tile_q, tile_k = (TILE_Q_GPU, TILE_K_GPU) if on_cuda else (TILE_Q_CPU, TILE_K_CPU)
    batch = row_offsets.numel() - 1
    nrb = triton.cdiv(max_rows, tile_q)
    nct = triton.cdiv(max_cols, tile_k)
    info = torch.zeros(nct, row_ts.numel(), device=row_ts.device, dtype=torch.int32)
    flags = torch.zeros(batch, nrb, nct, device=row_ts.device, dtype=torch.int32)
    if batch > 0 and nrb > 0 and nct > 0:
        _time_tiles_kernel[(nrb, batch)](
            row_ts, col_ts, row_offsets, col_offsets, info, flags, t_size, row_ts.numel(), nrb, nct,
            CAUSAL=causal, KEYS_ON_ROWS=keys_on_rows, PTX=on_cuda, TILE_Q=tile_q, TILE_K=tile_k, num_warps=4,
        )
    return TimeTiles(info, flags, tile_q, tile_k, keys_on_rows)


def build_time_tiles(ts: torch.Tensor, qts: torch.Tensor, q_offsets: torch.Tensor, kv_offsets: torch.Tensor,
                     max_q_len: int, max_kv_len: int, t_size: int, causal: bool, keys_on_rows: bool) -> TimeTiles:
    """The plan of a batch's int32 relative key times ``ts[L_KV]`` and query times ``qts[L_Q]``
    (:func:`kernels.triton.jagged_attention.relative_timestamps`) for a ``t_size``-entry time table: rows are the
    queries and columns the keys (the forward's and dQ's ``[queries, keys]`` tiles), or the transpose
    (``keys_on_rows``, dK/dV's ``[keys, queries]`` tiles, whose per-row vectors are then the plan's rows; ``info``
    is ``[NCT, L_KV]`` and ``split`` a query). Causal plans cover only the tiles a causal pass's mask-free tiles lie
    in. Computed once per batch and orientation (:mod:`kernels.triton.per_batch`), then shared by every layer."""
    if keys_on_rows:
        args = (ts, qts, kv_offsets, q_offsets, max_kv_len, max_q_len)
    else:
        args = (qts, ts, q_offsets, kv_offsets, max_q_len, max_kv_len)
    return per_batch(
        f"time_tiles_{'keys' if keys_on_rows else 'queries'}", (ts, qts, q_offsets, kv_offsets),
        lambda: _build(*args, t_size, causal, keys_on_rows, ts.is_cuda),
        extra=(max_q_len, max_kv_len, t_size, causal),
    )


@triton.jit
def split_flag(FLAGS, b, m_start, n_start, q_len, NQB, NKT, BLOCK_M: tl.constexpr, TILE_Q: tl.constexpr,
               TILE_K: tl.constexpr):
    """The flag of rows ``[m_start, m_start + BLOCK_M)`` (queries, or keys in the transposed plan) of sequence ``b``
    in the column tile holding ``n_start``: ``FLAG_MIXED`` if any row block the rows cover or lie inside has that
    flag (blocks past the sequence's ``q_len`` rows have no rows and count as ``FLAG_SPLIT``)."""
    qb = m_start // TILE_Q
    base = FLAGS + (b * NQB + qb) * NKT + n_start // TILE_K
    flag = tl.load(base)
    for i in tl.static_range(1, BLOCK_M // TILE_Q):
        flag = tl.minimum(flag, tl.load(base + i * NKT, mask=(qb + i) * TILE_Q < q_len, other=FLAG_SPLIT))
    return flag


@triton.jit
def split_rows(INFO, rows, rows_ok, n_start, L_Q, TILE_K: tl.constexpr):
    """``info[M]``: the packed buckets and split of global rows ``rows[M]`` in the column tile holding ``n_start``."""
    return tl.load(INFO + n_start // TILE_K * L_Q + rows, mask=rows_ok, other=0)


@triton.jit
def split_buckets(info):
    """``(first[M], last[M])``: each packed row's two buckets."""
    return info & 255, (info >> 8) & 255


@triton.jit
def split_column(info):
    """``split[M]``: each packed row's first column of its tile in bucket ``last``."""
    return info >> 16


@triton.jit
def split_time_bias(info, tb_ptr, scale, PTX: tl.constexpr):
    """The time-table entries of each row's two buckets, times ``scale``: ``(first_bias[M], last_bias[M])``."""
    first, last = split_buckets(info)
    return gather(tb_ptr, first, PTX) * scale, gather(tb_ptr, last, PTX) * scale


@triton.jit
def split_key(info, n_start, TILE_K: tl.constexpr):
    """``split[M]``: each packed row's first column (a sequence-relative key, or query in the transposed plan) in
    bucket ``last``, in the column tile holding ``n_start``."""
    return n_start // TILE_K * TILE_K + split_column(info)


@triton.jit
def add_split_time(s, cols, split, first_bias, last_bias):
    """``s[M, N]`` plus each score's time bias from its row's split: ``cols[N]`` are the tile's column positions
    (keys, or queries in a transposed tile) and the per-row vectors ``[M]`` come from :func:`split_key` and
    :func:`split_time_bias`."""
    return s + tl.where(cols[None, :] < split[:, None], first_bias[:, None], last_bias[:, None])
