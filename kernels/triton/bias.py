"""HSTU's relative bias tables inside the attention kernels: the per-score terms and their gradients.

A (query ``i``, key ``j``) pair adds ``pos_bias[h, min(|p(i) - p(j)|, P - 1)]`` and
``time_bias[h, bucket(qts_i - ts_j)]`` to its score (:mod:`kernels.pytorch.jagged_attention`).

Per score the forward needs an index and a table read. On the GPU (``PTX``: inline PTX) both avoid
Triton's pointer tensors: a table read is one non-caching load through a 32-bit index (a ``[M, N]``
tile of 64-bit pointers spilled registers and made the pipeliner stage every gathered element
through shared memory), and the time bucket is one ``lg2.approx`` plus a truncating add instead of
the ~25-instruction precise ``log``. The interpreter runs the plain ``tl`` forms of the formulas.

The gradient of a table entry is the sum of dS over the scores that read it. One float32 atomic per
score and table (4.3e9 per layer at N=4,096, B=32, H=8) was what made the biased backward slow
(docs/benchmarks.md), so the dQ pass reduces each tile first:

- position: the entry depends on the tile's diagonal only, so the tile's dS is reduced to diagonal
  sums (:func:`add_position_grad`): a few atomics per diagonal instead of one per score. A tile whose
  every pair lies past the table's last entry reads that entry alone, and the dQ pass sums its dS
  into it once per program (:mod:`kernels.triton.jagged_attention`'s far tiles);
- time: along a row of a tile the bucket changes rarely except near the diagonal, so each row's
  two most common buckets are summed first, one atomic per row each (:func:`add_time_grad`); only
  the other scores add themselves. A mask-free tile whose every row holds one bucket
  (:func:`row_time_buckets`) skips the per-score buckets altogether: one row sum and atomic per row.

Both are exact for any positions and times (not only sorted ones); only the float summation order
changes.
"""

from __future__ import annotations

import math
import struct

import triton
import triton.language as tl

from kernels.pytorch.jagged_attention import TIME_BUCKET_DIVISOR

_TIME_DIV = tl.constexpr(TIME_BUCKET_DIVISOR)
# ln(x) / 0.301 = log2(x) * ln(2) / 0.301, the factor as a PTX float32 literal.
_LOG2_TO_BUCKET = f"0f{struct.unpack('<I', struct.pack('<f', math.log(2.0) / TIME_BUCKET_DIVISOR))[0]:08X}"

# ``floor`` of a float in [0, 2**23) is the low mantissa bits of ``x + 2**23`` added rounding toward zero,
# so the bucket's multiply and floor are one ``fma.rz`` (no conversion on the quarter-rate pipe). ``|dt|`` is
# an integer, so the logarithm is 0 at 1 (``lg2.approx`` is exact there; every diagonal score checks it) and
# >= 1 beyond: no clamp at 0, only the one to the last bucket, as an integer minimum.
_BUCKET_ASM = tl.constexpr(
    "{ .reg .f32 t; .reg .b32 u; "
    "abs.ftz.f32 t, $1; max.ftz.f32 t, t, 0f3F800000; lg2.approx.ftz.f32 t, t; "
    f"fma.rz.ftz.f32 t, t, {_LOG2_TO_BUCKET}, 0f4B000000; mov.b32 u, t; sub.s32 u, u, 0x4B000000; "
    "min.s32 $0, u, $2; }"
)
_GATHER_ASM = tl.constexpr("{ .reg .u64 a; mad.wide.s32 a, $2, 4, $1; ld.global.nc.f32 $0, [a]; }")
_SCATTER_ASM = tl.constexpr(
    "{ .reg .pred p; .reg .u64 a; setp.ne.b32 p, $3, 0; mad.wide.s32 a, $2, 4, $1; "
    "@p red.global.add.f32 [a], $4; mov.b32 $0, 0; }"
)


@triton.jit
def gather(table, idx, PTX: tl.constexpr):
    """``table[idx]`` for a float32 table and an int32 index tile whose every entry is in range."""
    if PTX:
        return tl.inline_asm_elementwise(
            _GATHER_ASM, "=f,l,r", [table.to(tl.uint64), idx], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.load(table + idx)


@triton.jit
def time_bucket(dt, T_SIZE, PTX: tl.constexpr):
    """``min(floor(ln(max(|dt|, 1)) / 0.301), T - 1)`` of time differences, as int32.

    ``dt`` is converted to float32 here, after the subtraction: the kernels take times as int32 offsets
    (:func:`kernels.triton.jagged_attention.relative_timestamps`), whose differences are exact.
    """
    dt = dt.to(tl.float32)
    if PTX:
        return tl.inline_asm_elementwise(
            _BUCKET_ASM, "=r,f,r", [dt, T_SIZE - 1], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        bucket = tl.floor(tl.log(tl.maximum(tl.abs(dt), 1.0)) / _TIME_DIV).to(tl.int32)
        return tl.minimum(tl.maximum(bucket, 0), T_SIZE - 1)


@triton.jit
def position_index(qi, kj, n_hist, P_SIZE, ORDERED: tl.constexpr = False, FITS: tl.constexpr = False):
    """Position-table index of broadcastable query and key positions (targets sit at ``n_hist``). ``ORDERED``:
    every key is a history event at or before its query (a causal tile without masks), so the distance needs
    neither the keys' clamp nor its absolute value. ``FITS``: the table is longer than any distance of the call,
    so the clamp to its last entry never binds. Each saves instructions per score, which bound the forward's and
    dK/dV's biased tiles (not dQ's, which uses neither)."""
    if ORDERED:
        distance = tl.minimum(qi, n_hist) - kj
    else:
        distance = tl.abs(tl.minimum(qi, n_hist) - tl.minimum(kj, n_hist))
    if FITS:
        return distance
    else:
        return tl.minimum(distance, P_SIZE - 1)


@triton.jit
def add_bias(s, qi, kj, n_hist, ts_q, ts_k, pb_ptr, tb_ptr, P_SIZE, T_SIZE, scale,
             HAS_PB: tl.constexpr, HAS_TB: tl.constexpr, PTX: tl.constexpr, ORDERED: tl.constexpr = False,
             FITS: tl.constexpr = False):
    """``s + scale * (bias terms)`` for a score tile, and the tile's time buckets (0 without a time table).

    ``qi``/``kj`` and ``ts_q``/``ts_k`` are broadcastable query and key positions and times, in either
    orientation of the tile.
    """
    bucket = qi * 0 + kj * 0
    if HAS_PB:
        s += gather(pb_ptr, position_index(qi, kj, n_hist, P_SIZE, ORDERED, FITS), PTX) * scale
    if HAS_TB:
        bucket = time_bucket(ts_q - ts_k, T_SIZE, PTX)
        s += gather(tb_ptr, bucket, PTX) * scale
    return s, bucket


_INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def row_time_buckets(ts_rows, ts_cols, rows_ok, cols_ok, T_SIZE, PTX: tl.constexpr):
    """``(bucket[M], uniform)`` for a tile that pairs row times ``ts_rows[M]`` with column times ``ts_cols[N]``:
    each row's bucket at the columns' latest time, and whether every valid pair of every valid row falls in its
    row's bucket.

    The bucket grows with ``|dt|``, and for a row time outside the columns' ``(min, max)`` the pairs' ``|dt|``
    lie between their values at those two ends, so equal buckets at both ends are the bucket of every pair, for
    times in any order. Far from the diagonal a tile's times span a small fraction of the row's gap to them, and
    the dQ pass then reads one time-table entry and adds one gradient sum per row instead of one bucket, read and
    mask per score. (In the forward and dK/dV passes the check's reductions across warps cost more than they saved,
    docs/benchmarks.md; those passes read the batch's plan instead, :mod:`kernels.triton.time_tiles`.)
    """
    lo = tl.min(tl.where(cols_ok, ts_cols, _INT32_MAX), 0)
    hi = tl.max(tl.where(cols_ok, ts_cols, -_INT32_MAX), 0)
    near = time_bucket(ts_rows - hi, T_SIZE, PTX)
    far = time_bucket(ts_rows - lo, T_SIZE, PTX)
    split = rows_ok & ((near != far) | ((ts_rows < hi) & (ts_rows > lo)))
    return near, tl.max(split.to(tl.int32), 0) == 0


@triton.jit
def add_bias_rows(s, pos_rows, pos_cols, n_hist, ts_rows, ts_cols, rows_ok, cols_ok, pb_ptr, tb_ptr, P_SIZE, T_SIZE,
                  scale, HAS_PB: tl.constexpr, HAS_TB: tl.constexpr, PTX: tl.constexpr):
    """:func:`add_bias` for a tile given as vectors of its rows' (``[M]``) and columns' (``[N]``) positions and
    times, either orientation; returns ``(s, bucket[M, N], row_bucket[M], uniform)``. Where
    :func:`row_time_buckets` finds the tile uniform the time bias is one table read per row, added to the whole
    row, and ``bucket`` is ``row_bucket`` broadcast; otherwise every score takes its own, as in :func:`add_bias`.
    """
    if HAS_PB:
        s += gather(pb_ptr, position_index(pos_rows[:, None], pos_cols[None, :], n_hist, P_SIZE), PTX) * scale
    row_bucket = pos_rows * 0
    uniform = tl.max(row_bucket, 0) != 0
    bucket = row_bucket[:, None] + pos_cols[None, :] * 0
    if HAS_TB:
        row_bucket, uniform = row_time_buckets(ts_rows, ts_cols, rows_ok, cols_ok, T_SIZE, PTX)
        if uniform:
            s += gather(tb_ptr, row_bucket, PTX)[:, None] * scale
            bucket = row_bucket[:, None] + pos_cols[None, :] * 0
        else:
            bucket = time_bucket(ts_rows[:, None] - ts_cols[None, :], T_SIZE, PTX)
            s += gather(tb_ptr, bucket, PTX) * scale
    return s, bucket, row_bucket, uniform


@triton.jit
def _take_target_rows(ds, m_start, n_start, n_hist, dpb_ptr, P_SIZE, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Adds the target rows (queries at ``n_hist``) of a ``[queries, keys]`` dS tile per key into the
    position-table gradient; returns the tile with those rows zeroed."""
    if m_start + BLOCK_M > n_hist:
        is_target = (m_start + tl.arange(0, BLOCK_M))[:, None] >= n_hist
        per_key = tl.sum(tl.where(is_target, ds, 0.0), 0)
        keys = n_start + tl.arange(0, BLOCK_N)
        tl.atomic_add(dpb_ptr + position_index(n_hist, keys, n_hist, P_SIZE), per_key, sem="relaxed")
        ds = tl.where(is_target, 0.0, ds)
    return ds


# A warp's rows in a dot result's register layout: each warp owns 16 consecutive rows of the tile.
_WARP_ROWS = tl.constexpr(16)


@triton.jit
def add_position_grad(ds, m_start, n_start, n_hist, dpb_ptr, P_SIZE,
                      HAS_TARGETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Adds a ``[queries, keys]`` dS tile (``BLOCK_M`` a multiple of 16) into the position-table gradient.

    History query ``m_start + r`` and key ``n_start + c`` read the entry of distance ``d0 + r - c``
    (``d0 = m_start - n_start``): each diagonal of the tile reads one entry. The tile is cut into groups of
    16 rows, one warp's rows, and inside each group column ``c`` is gathered at rows ``(r' + c) mod 16``: row
    ``r'`` of group ``g`` then holds distance ``d0 + 16 (g - w) + r'`` in the columns where ``r' + c``
    wrapped ``w`` times, so ``BLOCK_N / 16 + 1`` row sums and atomics per row replace one atomic per score.
    Rotating inside a warp's rows moves data between lanes only, where rotating the whole tile went through
    shared memory with barriers (docs/benchmarks.md). Target queries all sit at ``n_hist``, so their distance
    depends on the key only: they are summed per key instead.
    """
    if HAS_TARGETS:
        ds = _take_target_rows(ds, m_start, n_start, n_hist, dpb_ptr, P_SIZE, BLOCK_M, BLOCK_N)
    GROUPS: tl.constexpr = BLOCK_M // _WARP_ROWS
    tl.static_assert(GROUPS * _WARP_ROWS == BLOCK_M)
    shift = tl.arange(0, _WARP_ROWS)[None, :, None] + tl.arange(0, BLOCK_N)[None, None, :]
    index = shift % _WARP_ROWS + tl.zeros((GROUPS, _WARP_ROWS, BLOCK_N), dtype=tl.int32)
    diagonals = tl.gather(tl.reshape(ds, (GROUPS, _WARP_ROWS, BLOCK_N)), index, 1)
    wraps = shift // _WARP_ROWS
    distance = (m_start - n_start + _WARP_ROWS * tl.arange(0, GROUPS)[:, None]
                + tl.arange(0, _WARP_ROWS)[None, :])
    for w in tl.static_range((BLOCK_N + _WARP_ROWS - 2) // _WARP_ROWS + 1):
        sums = tl.sum(tl.where(wraps == w, diagonals, 0.0), 2)
        tl.atomic_add(dpb_ptr + tl.minimum(tl.abs(distance - _WARP_ROWS * w), P_SIZE - 1), sums, sem="relaxed")


@triton.jit
def scatter_add(table, idx, value, mask, PTX: tl.constexpr):
    """``table[idx] += value`` where ``mask``: one float32 atomic per active element (indices in range).

    On the GPU each thread adds its own elements in the tile's register layout: Triton's atomics would
    first move pointers, values and masks through shared memory into a coalescing layout (and recompute
    what feeds them there), a cost paid for every element though few are active. This requires a
    layout in which every element has one owner (a ``[BLOCK_M, BLOCK_N]`` dot result with
    ``BLOCK_M >= 16 * num_warps``; :func:`kernels.triton.jagged_attention._configs` checks it).
    """
    if PTX:
        tl.inline_asm_elementwise(
            _SCATTER_ASM, "=r,l,r,r,f", [table.to(tl.uint64), idx, mask.to(tl.int32), value], dtype=tl.int32,
            is_pure=False, pack=1,
        )
    else:
        tl.atomic_add(table + idx, value, mask=mask, sem="relaxed")


@triton.jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def add_time_grad(ds, bucket, bucket_ref, dtb_ptr, PTX: tl.constexpr):
    """Adds a ``[queries, keys]`` dS tile into the time-table gradient.

    Along a row of a tile the time difference spans a narrow range except near the diagonal, so a
    row's scores mostly fall in its reference bucket ``bucket_ref`` (that of its first key, the
    largest difference for times in order) or the one below: those two are summed per row and go in
    by one atomic per row each; only the other scores add themselves. Exact for any times and any
    reference. (Summing the rows' sums by runs of equal buckets first, a scan across warps, cost more
    than the atomics it saved: docs/benchmarks.md.)
    """
    ref = bucket_ref[:, None]
    in_ref = bucket == ref
    in_below = bucket == ref - 1
    outside = ~(in_ref | in_below)
    # One reduction for the three row sums keeps them in the tile's register layout.
    ref_sum, below_sum, n_outside = tl.reduce(
        (tl.where(in_ref, ds, 0.0), tl.where(in_below, ds, 0.0), tl.where(outside, 1.0, 0.0)), 1, _add3
    )
    tl.atomic_add(dtb_ptr + bucket_ref, ref_sum, sem="relaxed")
    tl.atomic_add(dtb_ptr + tl.maximum(bucket_ref - 1, 0), below_sum, mask=bucket_ref > 0, sem="relaxed")
    # Far from the diagonal no score is outside, and the tile skips the per-score atomics.
    if tl.max(n_outside, 0) > 0:
        scatter_add(dtb_ptr, bucket, ds, outside, PTX)


# Deterministic table gradients (``GEM_KERNELS_DETERMINISTIC=1``). Float atomics add in the order threads and
# programs happen to run, so the same backward can differ in its last bits. Instead each dQ program writes a row
# of its own, every entry once, with plain stores, and the host sums the rows in a fixed order
# (kernels/triton/bias_rows.py). Position row: the tile's scores summed by ``e = OFF + m - n`` (the signed
# history distance plus an offset) in a register window, each ``e`` stored once it is final; its second half
# (``+ LD``) holds the target rows' per-key sums at ``OFF + n_hist - n``. Time row: the table's entries, summed
# in registers.


@triton.jit
def _diagonal_half(ds, e0, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sums of a ``[queries, keys]`` dS tile into slots ``HALF * BLOCK_M + [0, BLOCK_M)`` of a circular window of
    ``2 * BLOCK_M`` slots: score ``(r, c)`` goes to slot ``(e0 + r - c) mod 2 * BLOCK_M``. A tile's
    ``BLOCK_M + BLOCK_N - 1`` distances take distinct slots, so a (slot, column) pair holds one row at most:
    ``r = (slot - e0 + c) mod 2 * BLOCK_M``, where that is below ``BLOCK_M``."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    src = (HALF * BLOCK_M + rows[:, None] - e0 + cols[None, :]) & (2 * BLOCK_M - 1)
    picked = tl.gather(ds, tl.minimum(src, BLOCK_M - 1), 0)
    return tl.sum(tl.where(src < BLOCK_M, picked, 0.0), 1)


@triton.jit
def _flush_half(row, acc, e0, e_lo, e_hi, HALF: tl.constexpr, BLOCK_M: tl.constexpr):
    """Stores the slots of one window half whose ``e`` (in ``[e0 - BLOCK_M, e0 + BLOCK_M)``) lies in
    ``[e_lo, e_hi)`` at ``row[e]``; returns the half with those slots zeroed."""
    slots = HALF * BLOCK_M + tl.arange(0, BLOCK_M)
    e = e0 - BLOCK_M + ((slots - e0 + BLOCK_M) & (2 * BLOCK_M - 1))
    done = (e >= e_lo) & (e < e_hi)
    tl.store(row + e, acc, mask=done)
    return tl.where(done, 0.0, acc)


@triton.jit
def _store_target_rows(ds, m_start, n_start, n_hist, target_row, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores the target rows' (queries at ``n_hist``) per-key sums over history keys of a dS tile at
    ``target_row[n_hist - key]`` (each key once per program); returns the tile without them. A target's score
    on a key past the history is its own, at distance 0: it stays in the tile for the diagonal sums."""
    if m_start + BLOCK_M > n_hist:
        keys = n_start + tl.arange(0, BLOCK_N)
        taken = ((m_start + tl.arange(0, BLOCK_M))[:, None] >= n_hist) & (keys[None, :] < n_hist)
        tl.store(target_row + n_hist - keys, tl.sum(tl.where(taken, ds, 0.0), 0), mask=keys < n_hist)
        ds = tl.where(taken, 0.0, ds)
    return ds


@triton.jit
def store_position_grad(win_lo, win_hi, ds, m_start, n_start, n_hist, row, OFF, LD,
                        HAS_TARGETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Adds a ``[queries, keys]`` dS tile into the program's position row through the window ``(win_lo, win_hi)``
    (the ``e`` of ``[e0 - BLOCK_M, e0 + BLOCK_M)``, ``e0 = OFF + m_start - n_start``); the next tile, keys
    ``BLOCK_N`` further, reaches ``e < e0 + BLOCK_M - BLOCK_N`` only, so the ``e`` above are stored now."""
    e0 = OFF + m_start - n_start
    if HAS_TARGETS:
        ds = _store_target_rows(ds, m_start, n_start, n_hist, row + LD + OFF, BLOCK_M, BLOCK_N)
    win_lo += _diagonal_half(ds, e0, 0, BLOCK_M, BLOCK_N)
    win_hi += _diagonal_half(ds, e0, 1, BLOCK_M, BLOCK_N)
    win_lo = _flush_half(row, win_lo, e0, e0 + BLOCK_M - BLOCK_N, e0 + BLOCK_M, 0, BLOCK_M)
    win_hi = _flush_half(row, win_hi, e0, e0 + BLOCK_M - BLOCK_N, e0 + BLOCK_M, 1, BLOCK_M)
    return win_lo, win_hi


@triton.jit
def flush_position_grad(win_lo, win_hi, row, e_query, lo, hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores what the window still holds after the program's key tiles ``[lo, hi)`` (``e_query`` is
    ``OFF + m_start``; the last tile's ``e0`` follows)."""
    if hi > lo:
        e0 = e_query - (lo + (hi - lo - 1) // BLOCK_N * BLOCK_N)
        _flush_half(row, win_lo, e0, e0 - BLOCK_M, e0 + BLOCK_M - BLOCK_N, 0, BLOCK_M)
        _flush_half(row, win_hi, e0, e0 - BLOCK_M, e0 + BLOCK_M - BLOCK_N, 1, BLOCK_M)


@triton.jit
def sum_time_grad(acc, ds, bucket, BLOCK_T: tl.constexpr):
    """``acc[t] +=`` the sum of a dS tile over its scores in bucket ``t``, bucket by bucket in increasing order:
    a fixed order, in registers. A tile holds few distinct buckets except near the diagonal."""
    entries = tl.arange(0, BLOCK_T)
    pending = ds != 0.0
    # Buckets are below T <= BLOCK_T: the minimum is BLOCK_T once none is pending.
    t = tl.min(tl.min(tl.where(pending, bucket, BLOCK_T), 1), 0)
    while t < BLOCK_T:
        chosen = bucket == t
        acc = tl.where(entries == t, acc + tl.sum(tl.sum(tl.where(chosen, ds, 0.0), 1), 0), acc)
        pending = pending & ~chosen
        t = tl.min(tl.min(tl.where(pending, bucket, BLOCK_T), 1), 0)
    return acc
