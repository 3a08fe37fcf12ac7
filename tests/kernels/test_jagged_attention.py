"""Jagged attention: the Triton kernels (interpreted on CPU) against the PyTorch reference.

The reference itself is checked first against a per-pair loop written straight from the mask
rules, so a shared misunderstanding cannot pass both. Shapes stay tiny: the interpreter runs
every program in Python.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import triton
import triton.language as tl

import kernels
from kernels import AttentionSpec, jagged_attention, jagged_cross_attention
from kernels.checks import check_num_targets, check_offsets
from kernels.flops import attention_flops, cross_attention_pairs, valid_pairs
from kernels.pytorch.jagged_attention import time_bucket
from kernels.triton import jagged_attention as triton_backend
from kernels.triton.bias import row_time_buckets

ACTS = ["softmax", "silu", "gelu", "relu", "identity"]


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _inputs(lengths, heads, dqk, dv, dtype, seed, *, pos=0, time=0, shared_bias=False):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)

    bias_heads = 1 if shared_bias else heads
    return dict(
        q=leaf(total, heads, dqk),
        k=leaf(total, heads, dqk),
        v=leaf(total, heads, dv),
        pos_bias=torch.randn(bias_heads, pos, generator=g).requires_grad_(True) if pos else None,
        time_bias=torch.randn(bias_heads, time, generator=g).requires_grad_(True) if time else None,
        timestamps=torch.randint(0, 5000, (total,), generator=g).cumsum(0) if time else None,
    )


def _next_event_times(timestamps: torch.Tensor, lengths: list[int], gen: torch.Generator) -> torch.Tensor:
    """HSTU's target times: each event's query time is the next event's time, the last one's a later
    candidate time (so query times run past every key and lie on both sides of some)."""
    out = timestamps.clone()
    start = 0
    for n in lengths:
        if n:
            out[start : start + n - 1] = timestamps[start + 1 : start + n]
            out[start + n - 1] = timestamps[start + n - 1] + int(torch.randint(0, 9000, (1,), generator=gen))
        start += n
    return out


def _run(backend, tensors, offsets, max_len, grad_seed, **kwargs):
    """Forward + backward with a fixed random upstream gradient; returns output and grads."""
    leaves = [tensors[n] for n in ("q", "k", "v", "pos_bias", "time_bias")]
    for x in leaves:
        if x is not None:
            x.grad = None
    out = jagged_attention(
        tensors["q"], tensors["k"], tensors["v"], offsets, max_len,
        pos_bias=tensors["pos_bias"], time_bias=tensors["time_bias"], timestamps=tensors["timestamps"],
        backend=backend, **kwargs,
    )
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    (out.float() * upstream.float()).sum().backward()
    return [out.detach()] + [x.grad.clone() if x is not None else None for x in leaves]


def _assert_close(got, want, tol, what, bias_tol=None):
    """`bias_tol` (default `tol`) bounds the bias tables' gradients: under softmax each row's score gradients sum
    to zero, so a bucket's gradient is a small difference of sums over many pairs and its float32 error relative to
    that difference is far larger than the other outputs' (either float32 path against float64 alike)."""
    names = ["out", "dq", "dk", "dv", "dpos_bias", "dtime_bias"][: len(want)]
    for name, a, b in zip(names, got, want, strict=True):
        if b is None:
            continue
        assert torch.isfinite(a).all(), f"{what}: {name} has non-finite values"
        err = _rel(a, b)
        bound = bias_tol if bias_tol is not None and name.endswith("_bias") else tol
        assert err < bound, f"{what}: {name} relative error {err:.2e} >= {bound}"


def _naive(q, k, v, lengths, max_len, activation, causal, alpha, num_targets, window, pos_bias, time_bias, ts, qts=None):
    """Per-pair loop straight from the documented rules, in float64."""
    qts = ts if qts is None else qts
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    start = 0
    for b, n in enumerate(lengths):
        n_hist = n - (int(num_targets[b]) if num_targets is not None else 0)
        for h in range(q.shape[1]):
            for i in range(n):
                keys, scores = [], []
                for j in range(n):
                    if causal and j > i:
                        continue
                    if j >= n_hist and j != i:
                        continue
                    pi, pj = min(i, n_hist), min(j, n_hist)
                    if window is not None and abs(pi - pj) >= window:
                        continue
                    s = alpha * float(q[start + i, h].double() @ k[start + j, h].double())
                    if pos_bias is not None:
                        s += float(pos_bias[h % pos_bias.shape[0], min(abs(pi - pj), pos_bias.shape[1] - 1)])
                    if time_bias is not None:
                        dt = abs(int(qts[start + i]) - int(ts[start + j]))
                        bucket = min(math.floor(math.log(max(dt, 1)) / 0.301), time_bias.shape[1] - 1)
                        s += float(time_bias[h % time_bias.shape[0], bucket])
                    keys.append(j)
                    scores.append(s)
                s = torch.tensor(scores, dtype=torch.float64)
                if activation == "softmax":
                    w = torch.softmax(s, 0)
                else:
                    fn = {
                        "silu": torch.nn.functional.silu,
                        "gelu": torch.nn.functional.gelu,
                        "relu": torch.relu,
                        "identity": lambda x: x,
                    }[activation]
                    w = fn(s) / max_len
                out[start + i, h] = w @ v[[start + j for j in keys], h].double()
        start += n
    return out


def test_time_bias_on_a_long_span_keeps_short_gaps_between_late_events_exact():
    """A history that starts two years before its late events, which lie 1-15 s apart: float32 offsets
    from the first event (ulp 8 s there) would put those gaps in other buckets than the reference's; the
    kernels subtract int32 offsets, so forward and backward match it."""
    lengths = [40, 25]
    t = _inputs(lengths, 2, 16, 16, torch.float32, seed=17, pos=4, time=40)
    gen = torch.Generator().manual_seed(3)
    gaps = torch.randint(1, 16, (sum(lengths),), generator=gen)
    times = []
    for start, n in zip((0, lengths[0]), lengths, strict=True):
        late = 2**26 + torch.cumsum(gaps[start + 1:start + n], 0)
        times.append(torch.cat([torch.zeros(1, dtype=torch.int64), late]) + 1_600_000_000)
    t["timestamps"] = torch.cat(times)
    offsets = _offsets(lengths)
    rel = triton_backend.relative_timestamps(t["timestamps"], offsets)
    assert torch.equal(rel[1:40].diff(), gaps[2:40].to(torch.int32))
    assert not torch.equal(rel[1:40].float().diff(), rel[1:40].diff().float())  # float32 offsets lose the gaps
    kwargs = dict(activation="silu", causal=True)
    want = _run("pytorch", t, offsets, 40, 5, **kwargs)
    got = _run("triton", t, offsets, 40, 5, **kwargs)
    _assert_close(got, want, 1e-4, "long span")


def test_relative_timestamps_clamp_so_that_every_difference_fits_int32():
    offsets = torch.tensor([0, 3])
    times = torch.tensor([0, 2**40, -(2**40)], dtype=torch.int64)
    rel = triton_backend.relative_timestamps(times, offsets)
    assert rel.dtype == torch.int32 and rel.tolist() == [0, 2**30, -(2**30)]


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize(
    "flags",
    [
        dict(causal=True),
        dict(causal=False, window=3),
        dict(causal=True, targets=True, window=4, pos=5, time=6),
        dict(causal=False, targets=True, pos=4),
        dict(causal=True, targets=True, time=9, query_times=True),
    ],
)
def test_reference_matches_per_pair_loop(activation, flags):
    lengths = [0, 1, 9, 6]
    t = _inputs(lengths, 2, 8, 4, torch.float64, seed=1, pos=flags.get("pos", 0), time=flags.get("time", 0))
    num_targets = torch.tensor([0, 1, 3, 2]) if flags.get("targets") else None
    qts = _next_event_times(t["timestamps"], lengths, torch.Generator().manual_seed(3)) if flags.get("query_times") else None
    kwargs = dict(activation=activation, causal=flags["causal"], alpha=0.3, num_targets=num_targets, window=flags.get("window"))
    got = jagged_attention(
        t["q"], t["k"], t["v"], _offsets(lengths), 10, pos_bias=t["pos_bias"], time_bias=t["time_bias"],
        timestamps=t["timestamps"], query_timestamps=qts, backend="pytorch", **kwargs,
    )
    want = _naive(
        t["q"].detach(), t["k"].detach(), t["v"].detach(), lengths, 10, activation, flags["causal"], 0.3,
        num_targets, flags.get("window"), t["pos_bias"], t["time_bias"], t["timestamps"], qts,
    )
    assert _rel(got.detach(), want) < 1e-10


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize(
    "flags",
    [
        dict(causal=True),
        dict(causal=False),
        dict(causal=True, targets=True),
        dict(causal=True, window=7),
        dict(causal=False, targets=True, window=5, pos=9, time=7),
        dict(causal=True, targets=True, pos=6, time=5, shared_bias=True),
    ],
    ids=["causal", "full", "targets", "window", "noncausal-all", "causal-bias-shared"],
)
def test_triton_matches_reference_fp32(activation, flags):
    # Lengths 0, 1, the maximum and ragged ones; max_len above the longest, as in real batches.
    lengths = [37, 0, 1, 20, 5, 40]
    t = _inputs(lengths, 2, 24, 20, torch.float32, seed=zlib.crc32(f"{activation}{flags}".encode()) % 1000,
                pos=flags.get("pos", 0), time=flags.get("time", 0), shared_bias=flags.get("shared_bias", False))
    num_targets = torch.tensor([4, 0, 1, 20, 2, 3]) if flags.get("targets") else None
    kwargs = dict(activation=activation, causal=flags["causal"], num_targets=num_targets, window=flags.get("window"))
    offsets = _offsets(lengths)
    want = _run("pytorch", t, offsets, 41, 7, **kwargs)
    got = _run("triton", t, offsets, 41, 7, **kwargs)
    _assert_close(got, want, 1e-4, f"{activation} {flags}", bias_tol=1e-3)


@pytest.mark.parametrize("dims", [(16, 16), (64, 32), (40, 72)])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_triton_head_dims_fp16(dims, activation):
    dqk, dv = dims
    lengths = [1, 33, 0, 12]
    t = _inputs(lengths, 3, dqk, dv, torch.float16, seed=dqk + dv)
    kwargs = dict(activation=activation, causal=True, num_targets=torch.tensor([1, 3, 0, 0]))
    offsets = _offsets(lengths)
    want = _run("pytorch", t, offsets, 33, 3, **kwargs)
    got = _run("triton", t, offsets, 33, 3, **kwargs)
    assert all(g.dtype == torch.float16 for g in got[:4])
    _assert_close(got, want, 1e-2, f"fp16 {dims} {activation}")


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize(
    "flags", [dict(), dict(targets=True, window=9, pos=6, time=5)], ids=["plain", "targets-window-bias"]
)
def test_triton_forward_through_tma_descriptors_matches_reference(activation, flags, monkeypatch):
    """``GEM_KERNELS_TMA=1``: query tiles read past a sequence's end (into the next one, and past the
    tensor's last row, which TMA fills with zeros), and key tiles switch between descriptors and
    pointer loads at each sequence's boundary; the output must still match the reference."""
    monkeypatch.setenv("GEM_KERNELS_TMA", "1")
    lengths = [37, 0, 1, 20, 45]  # the last sequence ends at the tensor's end, mid-tile
    t = _inputs(lengths, 2, 16, 32, torch.float32, seed=11, pos=flags.get("pos", 0), time=flags.get("time", 0))
    assert triton_backend._use_tma(t["q"], t["k"], t["v"])
    assert not triton_backend._use_tma(t["q"][:, :, :12], t["k"][:, :, :12], t["v"])  # D=12: pointer loads
    num_targets = torch.tensor([3, 0, 1, 2, 4]) if flags.get("targets") else None
    kwargs = dict(activation=activation, causal=True, num_targets=num_targets, window=flags.get("window"))
    offsets = _offsets(lengths)
    want = _run("pytorch", t, offsets, 45, 5, **kwargs)
    got = _run("triton", t, offsets, 45, 5, **kwargs)
    _assert_close(got, want, 1e-4, f"TMA {activation} {flags}")


# The interpreter's numpy warns while it computes the poisoned sequence itself.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("tma", ["0", "1"], ids=["pointer-loads", "tma"])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_non_finite_values_stay_in_their_own_sequence(activation, tma, monkeypatch):
    """NaN and inf in one sequence's keys and values must not reach its neighbour, though a
    descriptor tile at the neighbour's end reads those rows (0 * NaN is NaN in ``P V``)."""
    monkeypatch.setenv("GEM_KERNELS_TMA", tma)
    lengths = [37, 20, 9]  # 37 ends mid-tile; the poisoned sequence follows it
    t = _inputs(lengths, 2, 16, 16, torch.float32, seed=17)
    q, k, v = (t[n].detach().clone() for n in ("q", "k", "v"))
    k[37:57, 0] = float("nan")
    v[37:57, 0] = float("nan")
    v[37:57, 1] = float("inf")
    offsets = _offsets(lengths)
    kwargs = dict(activation=activation, causal=True)
    with torch.no_grad():
        got = triton_backend.jagged_attention(q, k, v, offsets, 37, AttentionSpec(**kwargs))
        for b in (0, 2):
            rows = slice(int(offsets[b]), int(offsets[b + 1]))
            want = kernels.jagged_attention(q[rows], k[rows], v[rows], _offsets([lengths[b]]), 37,
                                            backend="pytorch", **kwargs)
            assert torch.isfinite(got[rows]).all(), f"sequence {b} caught its neighbour's NaN/inf"
            assert _rel(got[rows], want) < 1e-5


def test_time_bias_on_epoch_timestamps_uses_exact_offsets_within_each_sequence():
    """Epoch-second times (~1.7e9, beyond float32's 24 bits) give the reference's buckets: the kernels
    see int32 offsets from each sequence's first event."""
    lengths = [30, 0, 1, 17]
    t = _inputs(lengths, 2, 16, 16, torch.float32, seed=13, pos=4, time=40)
    t["timestamps"] = t["timestamps"] * 97 + 1_700_000_000
    offsets = _offsets(lengths)
    rel = triton_backend.relative_timestamps(t["timestamps"], offsets)
    assert rel.dtype == torch.int32 and rel[0] == 0 and rel[30] == 0 and rel[31] == 0
    assert torch.equal(rel[32:].double(), (t["timestamps"][32:] - t["timestamps"][31]).double())
    kwargs = dict(activation="silu", causal=True)
    want = _run("pytorch", t, offsets, 30, 2, **kwargs)
    got = _run("triton", t, offsets, 30, 2, **kwargs)
    _assert_close(got, want, 1e-4, "epoch timestamps")


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize(
    "flags", [dict(causal=True, targets=True, pos=7), dict(causal=False, window=6)], ids=["causal-targets", "window"]
)
def test_query_timestamps_match_reference(activation, flags):
    """The time bias of pair (i, j) from ``query_timestamps[i] - timestamps[j]`` (HSTU's target time:
    the next event's), on epoch-second times: output and every gradient, both tables."""
    lengths = [37, 0, 1, 20, 5, 40]
    t = _inputs(lengths, 2, 16, 24, torch.float32, seed=23, pos=flags.get("pos", 0), time=24)
    t["timestamps"] = t["timestamps"] + 1_700_000_000
    qts = _next_event_times(t["timestamps"], lengths, torch.Generator().manual_seed(4))
    num_targets = torch.tensor([4, 0, 1, 20, 2, 3]) if flags.get("targets") else None
    kwargs = dict(activation=activation, causal=flags["causal"], num_targets=num_targets, window=flags.get("window"),
                  query_timestamps=qts)
    offsets = _offsets(lengths)
    want = _run("pytorch", t, offsets, 41, 8, **kwargs)
    got = _run("triton", t, offsets, 41, 8, **kwargs)
    _assert_close(got, want, 1e-4, f"query timestamps {activation} {flags}")
    # They change the answer: the same call without them is far from it.
    default = _run("pytorch", t, offsets, 41, 8, **{**kwargs, "query_timestamps": None})
    assert _rel(default[0], want[0]) > 1e-2


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_bias_table_gradients_for_times_out_of_order_and_every_distance(activation):
    """The table gradients are reduced per tile (diagonal sums for positions, per-row bucket sums for
    times, see kernels/triton/bias.py), which is cheapest for times in order; they must stay exact for
    times in any order, buckets that change at every key, a position table shorter than the sequence
    (clamped distances) and targets."""
    lengths = [45, 3, 0, 38]
    t = _inputs(lengths, 2, 16, 16, torch.float32, seed=31, pos=11, time=30)
    g = torch.Generator().manual_seed(8)
    t["timestamps"] = torch.randint(0, 10**6, (sum(lengths),), generator=g)
    qts = torch.randint(0, 10**6, (sum(lengths),), generator=g)
    kwargs = dict(activation=activation, causal=True, num_targets=torch.tensor([2, 1, 0, 5]), query_timestamps=qts)
    offsets = _offsets(lengths)
    want = _run("pytorch", t, offsets, 45, 3, **kwargs)
    got = _run("triton", t, offsets, 45, 3, **kwargs)
    _assert_close(got, want, 1e-4, f"unordered times {activation}")


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [True, False])
def test_position_table_longer_than_every_sequence_matches_reference(activation, causal):
    """A position table with an entry for every distance of the call (the teacher's case) lets the kernels drop
    the clamp to its last entry (``POS_FITS``) and the backward's table-gradient copies the entries no distance
    reaches; with targets, both tables, output and every gradient. The same sequences with a table exactly as long
    as the longest one (the largest distance is its last entry) too, and with one table all heads share."""
    lengths = [45, 3, 0, 38, 17]
    for pos, shared in ((64, False), (45, False), (64, True)):
        t = _inputs(lengths, 2, 16, 16, torch.float32, seed=37, pos=pos, time=12, shared_bias=shared)
        kwargs = dict(activation=activation, causal=causal, num_targets=torch.tensor([2, 1, 0, 5, 0]))
        offsets = _offsets(lengths)
        want = _run("pytorch", t, offsets, 45, 5, **kwargs)
        got = _run("triton", t, offsets, 45, 5, **kwargs)
        _assert_close(got, want, 1e-4, f"table of {pos} shared={shared} {activation} causal={causal}")


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_position_table_shorter_than_the_sequences_matches_reference(activation, deterministic, monkeypatch):
    """A short position table (exact near distances, one last entry for every farther pair) leaves most tiles of a
    long causal sequence far: every pair of theirs reads the last entry, which the kernels add as one number and
    whose gradient the dQ pass sums per tile (atomics; the deterministic rows keep the per-score path). Tables of 2,
    17 and 40 entries, per head and shared, with targets and both tables: the output and every gradient against the
    reference, the last entry's gradient included."""
    monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", "1" if deterministic else "0")
    lengths = [130, 7, 0, 97]
    for pos, shared in ((2, False), (17, False), (40, True)):
        t = _inputs(lengths, 2, 16, 16, torch.float32, seed=41, pos=pos, time=20, shared_bias=shared)
        kwargs = dict(activation=activation, causal=True, num_targets=torch.tensor([3, 1, 0, 6]))
        offsets = _offsets(lengths)
        want = _run("pytorch", t, offsets, 130, 7, **kwargs)
        got = _run("triton", t, offsets, 130, 7, **kwargs)
        _assert_close(got, want, 1e-4, f"table of {pos} shared={shared} {activation}")
        last = want[4][:, -1].abs().max().item()
        assert last > 0 and abs(got[4][:, -1] - want[4][:, -1]).max().item() < 1e-4 * max(last, 1.0)


@triton.jit
def _row_buckets_kernel(TR, TC, OKR, OKC, OUT, FLAG, T_SIZE, M: tl.constexpr, N: tl.constexpr):
    rows, cols = tl.arange(0, M), tl.arange(0, N)
    bucket, uniform = row_time_buckets(tl.load(TR + rows), tl.load(TC + cols), tl.load(OKR + rows) != 0,
                                       tl.load(OKC + cols) != 0, T_SIZE, False)
    tl.store(OUT + rows, bucket)
    tl.store(FLAG, uniform.to(tl.int32))


def _row_buckets(ts_rows, ts_cols, rows_ok, cols_ok, size=40):
    out, flag = torch.zeros(len(ts_rows), dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    _row_buckets_kernel[(1,)](ts_rows.to(torch.int32), ts_cols.to(torch.int32), rows_ok.to(torch.int32),
                              cols_ok.to(torch.int32), out, flag, size, M=len(ts_rows), N=len(ts_cols))
    return out, bool(flag)


def test_row_time_buckets_claim_a_tile_uniform_only_when_every_pair_agrees():
    """A tile found uniform must hold its row's bucket at every valid pair, for times in any order; rows and
    columns outside the tile's valid part do not count. Bursts of events far apart are found uniform (the fast
    path is taken), a row time between the columns' times never is, even where both ends share a bucket."""
    g = torch.Generator().manual_seed(3)
    found = 0
    for trial in range(300):
        spread = int(10 ** (trial % 7))
        ts_cols = torch.randint(0, spread, (16,), generator=g) + 10**6 * (trial % 3)
        ts_rows = torch.randint(0, 10**7, (8,), generator=g)
        if trial % 2:
            ts_rows = ts_rows % (10 * spread) + ts_cols.max()
        rows_ok, cols_ok = torch.rand(8, generator=g) > 0.2, torch.rand(16, generator=g) > 0.2
        cols_ok[0] = True
        bucket, uniform = _row_buckets(ts_rows, ts_cols, rows_ok, cols_ok)
        pairs = time_bucket(ts_rows[:, None] - ts_cols[None, :], 40)
        assert torch.equal(bucket.long(), time_bucket(ts_rows - ts_cols[cols_ok].max(), 40).long())
        if uniform:
            found += 1
            agree = pairs == bucket[:, None].long()
            assert agree[rows_ok][:, cols_ok].all(), f"trial {trial}: a uniform tile with a pair in another bucket"
    assert found > 30
    # Both ends of the columns' span 1,000-1,100 s from the row (bucket 22 or 23 of ln/0.301), the row inside it.
    ts_cols = torch.tensor([0, 2100, 1000, 1050])
    assert not _row_buckets(torch.tensor([1050]), ts_cols, torch.ones(1, dtype=torch.bool),
                            torch.ones(4, dtype=torch.bool))[1]
    # ...and the same row outside it is uniform once the near columns are out of the tile.
    assert _row_buckets(torch.tensor([3100]), ts_cols, torch.ones(1, dtype=torch.bool),
                        torch.tensor([False, True, False, False]))[1]


def _burst_times(lengths, gen, *, shuffled):
    """Events in bursts of 8, one second apart inside a burst and 10^5-10^6 s between bursts: the tiles of a
    later burst's rows on an earlier burst's keys are uniform (:func:`kernels.triton.bias.row_time_buckets`)."""
    out = []
    for n in lengths:
        gaps = torch.where(torch.arange(n) % 8 == 0, torch.randint(10**5, 10**6, (n,), generator=gen), 1)
        t = gaps.cumsum(0)
        out.append(t[torch.randperm(n, generator=gen)] if shuffled else t)
    return torch.cat(out)


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("shuffled", [False, True], ids=["in-order", "shuffled"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_time_bias_on_uniform_tiles_matches_reference(activation, shuffled, deterministic, monkeypatch):
    """Bursty times make most mask-free tiles uniform, where the kernels read one time-table entry per row and
    the dQ pass adds one row sum per row; in order and shuffled, with targets and query times, both tables,
    atomics and deterministic: the output and every gradient against the reference."""
    monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", "1" if deterministic else "0")
    lengths = [96, 3, 0, 70]
    t = _inputs(lengths, 2, 16, 16, torch.float32, seed=37, pos=50, time=40)
    g = torch.Generator().manual_seed(9)
    t["timestamps"] = _burst_times(lengths, g, shuffled=shuffled)
    qts = t["timestamps"] + torch.randint(0, 3, (sum(lengths),), generator=g)
    kwargs = dict(activation=activation, causal=True, num_targets=torch.tensor([3, 1, 0, 2]), query_timestamps=qts)
    offsets = _offsets(lengths)
    want = _run("pytorch", t, offsets, 96, 5, **kwargs)
    got = _run("triton", t, offsets, 96, 5, **kwargs)
    _assert_close(got, want, 1e-4, f"uniform tiles {activation} shuffled={shuffled}")


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_triton_split_dq_pass_matches_reference(activation, monkeypatch):
    monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", "1")
    lengths = [37, 0, 1, 20]
    t = _inputs(lengths, 2, 24, 20, torch.float32, seed=9, pos=5, time=4)
    kwargs = dict(activation=activation, causal=True, num_targets=torch.tensor([3, 0, 1, 2]), window=9)
    offsets = _offsets(lengths)
    want = _run("pytorch", t, offsets, 37, 4, **kwargs)
    got = _run("triton", t, offsets, 37, 4, **kwargs)
    _assert_close(got, want, 1e-4, f"split dQ {activation}")


@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_autotuner_resets_never_touch_an_earlier_pass_output(activation, monkeypatch):
    """On CUDA the autotuner zeroes a kernel's ``reset_to_zero`` arguments around each trial, on
    every first call of a new tuning key. A later backward pass must therefore never receive, under
    those names, a tensor an earlier pass of the same backward was given: the dK/dV pass once got
    the split dQ pass's finished dQ and table gradients there, and the first step of every new
    length bucket returned dQ = 0 and zero table gradients. The interpreter does not autotune, so
    this records the real launches and checks the arguments themselves."""
    launches = []
    real_launch = triton_backend._launch

    def recording_launch(tuned, plain, cpu_blocks, block_key, grid_rows, batch_heads, args, kwargs, on_cuda, work=None):
        launches.append((tuned, dict(zip(plain.arg_names, args, strict=False))))
        real_launch(tuned, plain, cpu_blocks, block_key, grid_rows, batch_heads, args, kwargs, on_cuda, work)

    monkeypatch.setattr(triton_backend, "_launch", recording_launch)
    lengths = [37, 1, 20]
    t = _inputs(lengths, 2, 16, 16, torch.float32, seed=21, pos=5, time=4)
    offsets = _offsets(lengths)
    got = _run("triton", t, offsets, 37, 6, activation=activation, causal=True)
    assert len(launches) == 3
    placeholder = triton_backend._dummy(t["q"].device)
    for i, (tuned, bound) in enumerate(launches):
        for name in tuned.reset_to_zero:
            reset = bound[name]
            if reset is placeholder:
                continue
            for _, earlier in launches[:i]:
                assert all(
                    not isinstance(x, torch.Tensor) or x.data_ptr() != reset.data_ptr() for x in earlier.values()
                ), f"launch {i} would reset {name}, a tensor an earlier pass was given"
    want = _run("pytorch", t, offsets, 37, 6, activation=activation, causal=True)
    _assert_close(got, want, 1e-4, activation)


def test_grid_runs_the_sequences_with_most_pairs_first():
    """The kernels' grid walks sequences in this order (ties keep batch order), so the longest work
    starts first; cross-attention counts query x key pairs."""
    self_offsets = _offsets([3, 0, 7, 7, 1])
    assert triton_backend._longest_first(self_offsets, self_offsets).tolist() == [2, 3, 0, 4, 1]
    q_offsets, kv_offsets = _offsets([1, 4, 2]), _offsets([10, 2, 5])
    assert triton_backend._longest_first(q_offsets, kv_offsets).tolist() == [0, 2, 1]


@pytest.mark.parametrize("backend", ["pytorch", "triton"])
def test_divisor_replaces_max_len_for_pointwise_activations(backend):
    """HSTU divides by a fixed N, not the batch's longest sequence: with ``divisor`` the output is the
    max_len-divided one scaled by max_len / divisor, and so is every gradient (softmax ignores it)."""
    lengths = [9, 0, 14]
    t = _inputs(lengths, 2, 16, 16, torch.float32, seed=4, pos=6, time=5)
    offsets = _offsets(lengths)
    base = _run(backend, t, offsets, 14, 2, activation="silu", causal=True)
    fixed = _run(backend, t, offsets, 14, 2, activation="silu", causal=True, divisor=40)
    _assert_close(fixed, [x * (14 / 40) for x in base], 1e-5, f"divisor {backend}")
    soft = _run(backend, t, offsets, 14, 2, activation="softmax", causal=True)
    soft_fixed = _run(backend, t, offsets, 14, 2, activation="softmax", causal=True, divisor=40)
    _assert_close(soft_fixed, soft, 1e-6, f"softmax divisor {backend}")


def test_all_empty_batch():
    t = _inputs([0, 0], 2, 16, 16, torch.float32, seed=0)
    got = _run("triton", t, _offsets([0, 0]), 0, 0, activation="softmax")
    assert got[0].shape == (0, 2, 16)
    assert got[1].shape == (0, 2, 16)


@pytest.mark.parametrize("activation", ["softmax", "silu", "gelu"])
@pytest.mark.parametrize(
    "shape",
    [([3, 0, 2, 1], [40, 5, 0, 17]), ([33, 2, 17], [3, 1, 5])],
    ids=["short-q-long-kv", "long-q-short-kv"],
)
def test_cross_attention_matches_reference(activation, shape):
    q_lens, kv_lens = shape
    g = torch.Generator().manual_seed(11)
    heads, dqk, dv = 2, 32, 24
    q = torch.randn(sum(q_lens), heads, dqk, generator=g).requires_grad_(True)
    k = torch.randn(sum(kv_lens), heads, dqk, generator=g).requires_grad_(True)
    v = torch.randn(sum(kv_lens), heads, dv, generator=g).requires_grad_(True)
    q_off, kv_off = _offsets(q_lens), _offsets(kv_lens)
    results = []
    for backend in ("pytorch", "triton"):
        for x in (q, k, v):
            x.grad = None
        out = jagged_cross_attention(q, k, v, q_off, kv_off, max(q_lens), max(kv_lens), activation=activation, backend=backend)
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        (out * upstream).sum().backward()
        results.append([out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
    _assert_close(results[1], results[0], 1e-4, f"cross {activation} {shape}")
    # A query whose sequence has no keys reads nothing.
    if 0 in kv_lens:
        b = kv_lens.index(0)
        rows = slice(int(q_off[b]), int(q_off[b + 1]))
        assert torch.equal(results[1][0][rows], torch.zeros_like(results[1][0][rows]))


@pytest.mark.parametrize("kv_lens", [[40, 5, 0, 17], [0, 7, 0, 3]])
def test_cross_attention_on_a_key_value_pair_returns_one_gradient_tensor(kv_lens):
    """Keys and values unbound from one ``[L, 2, H, D]`` projection (the PMA's): the Triton backward writes dK and
    dV as the halves of one fresh such tensor, which :func:`kernels.unbind_pair` hands on as the projection's
    gradient without stacking; gradients against the reference with a plain ``unbind``."""
    q_lens = [3, 0, 2, 1]
    g = torch.Generator().manual_seed(5)
    heads, dim = 2, 16
    q = torch.randn(sum(q_lens), heads, dim, generator=g).requires_grad_(True)
    kv = torch.randn(sum(kv_lens), 2 * heads * dim, generator=g).requires_grad_(True)
    upstream = torch.randn(sum(q_lens), heads, dim, generator=g)
    q_off, kv_off = _offsets(q_lens), _offsets(kv_lens)
    grads = {}
    for backend in ("pytorch", "triton"):
        pair = (kv * 1).view(-1, 2, heads, dim)
        k, v = pair.unbind(1) if backend == "pytorch" else kernels.unbind_pair(pair)
        seen = []
        k.register_hook(seen.append)
        out = jagged_cross_attention(q, k, v, q_off, kv_off, 3, max(kv_lens), backend=backend)
        grads[backend] = torch.autograd.grad((out * upstream).sum(), [q, pair])
        if backend == "triton":
            dpair = grads[backend][1]
            assert dpair.is_contiguous() and dpair.data_ptr() == seen[0].data_ptr()
    _assert_close(grads["triton"], grads["pytorch"], 1e-4, "pair")


@pytest.mark.parametrize("backend", ["triton", "pytorch"])
@pytest.mark.parametrize("deterministic", ["0", "1"])
@pytest.mark.parametrize(("q_lens", "kv_lens"), [([2, 1], [0, 0]), ([0, 0], [3, 2])])
def test_cross_attention_with_nothing_to_attend(q_lens, kv_lens, deterministic, backend, monkeypatch):
    monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", deterministic)
    q = torch.randn(sum(q_lens), 2, 16).requires_grad_(True)
    k = torch.randn(sum(kv_lens), 2, 16).requires_grad_(True)
    v = torch.randn(sum(kv_lens), 2, 16).requires_grad_(True)
    out = jagged_cross_attention(q, k, v, _offsets(q_lens), _offsets(kv_lens), max(q_lens), max(kv_lens), backend=backend)
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out))
    for x in (q, k, v):
        assert torch.equal(x.grad, torch.zeros_like(x))


def test_auto_backend_uses_reference_on_cpu():
    t = _inputs([4, 3], 1, 16, 16, torch.float32, seed=2)
    offsets = _offsets([4, 3])
    auto = jagged_attention(t["q"], t["k"], t["v"], offsets, 4)
    ref = jagged_attention(t["q"], t["k"], t["v"], offsets, 4, backend="pytorch")
    assert torch.equal(auto, ref)


def test_env_var_overrides_auto_backend_only(monkeypatch):
    t = _inputs([4, 3], 1, 16, 16, torch.float32, seed=2)
    offsets = _offsets([4, 3])
    monkeypatch.setenv("GEM_ATTENTION_BACKEND", "triton")
    assert kernels._resolve_backend("auto", t["q"]) == "triton"
    assert kernels._resolve_backend("pytorch", t["q"]) == "pytorch"
    forced = jagged_attention(t["q"], t["k"], t["v"], offsets, 4)
    triton_out = jagged_attention(t["q"], t["k"], t["v"], offsets, 4, backend="triton")
    assert torch.equal(forced, triton_out)
    monkeypatch.setenv("GEM_ATTENTION_BACKEND", "auto")
    assert kernels._resolve_backend("auto", t["q"]) == "pytorch"
    monkeypatch.setenv("GEM_ATTENTION_BACKEND", "cuda")
    with pytest.raises(ValueError, match="GEM_ATTENTION_BACKEND"):
        jagged_attention(t["q"], t["k"], t["v"], offsets, 4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(offsets=torch.tensor([0, 3, 6])), "offsets"),
        (dict(offsets=torch.tensor([0.0, 7.0])), "offsets"),
        (dict(max_len=3), "max length"),
        (dict(v=torch.randn(6, 2, 8)), "v"),
        (dict(k=torch.randn(7, 2, 4)), "q"),
        (dict(activation="tanh"), "activation"),
        (dict(num_targets=torch.tensor([5, 0])), "num_targets"),
        (dict(num_targets=torch.tensor([1])), "num_targets"),
        (dict(window=0), "window"),
        (dict(pos_bias=torch.randn(3, 4)), "pos_bias"),
        (dict(time_bias=torch.randn(2, 4)), "timestamps"),
        (dict(query_timestamps=torch.arange(7)), "time_bias"),
        (dict(time_bias=torch.randn(2, 4), timestamps=torch.arange(7), query_timestamps=torch.arange(6)),
         "query_timestamps"),
        (dict(time_bias=torch.randn(2, 4), timestamps=torch.arange(7), query_timestamps=torch.arange(7.0)),
         "query_timestamps"),
        (dict(backend="cuda"), "backend"),
        (dict(causl=True), "unknown options"),
        (dict(divisor=0), "divisor"),
    ],
)
def test_bad_input_names_the_argument(change, message):
    args = dict(q=torch.randn(7, 2, 8), k=torch.randn(7, 2, 8), v=torch.randn(7, 2, 8), offsets=_offsets([4, 3]), max_len=4)
    args.update(change)
    positional = [args.pop(n) for n in ("q", "k", "v", "offsets", "max_len")]
    with pytest.raises(ValueError, match=message):
        jagged_attention(*positional, **args)


def test_device_values_are_checked_only_on_request():
    """On a GPU a check of offsets' or num_targets' values stalls the host at every call, so the
    dispatchers check them only for CPU tensors unless check_values() asks. Meta tensors stand in for
    device ones: they have no values, and reading one raises."""
    offsets = torch.empty(3, dtype=torch.int64, device="meta")
    num_targets = torch.empty(2, dtype=torch.int64, device="meta")
    meta = torch.device("meta")
    assert check_offsets("offsets", offsets, 7, 4, meta) == 2
    check_num_targets(num_targets, offsets, 2, meta)
    with kernels.check_values():
        with pytest.raises(NotImplementedError, match="meta"):
            check_offsets("offsets", offsets, 7, 4, meta)
        with pytest.raises(RuntimeError, match="meta"):
            check_num_targets(num_targets, offsets, 2, meta)
    # Metadata is checked everywhere.
    with pytest.raises(ValueError, match="int64 or int32"):
        check_offsets("offsets", offsets.float(), 7, 4, meta)


def test_cross_attention_bad_offsets():
    q, k = torch.randn(3, 1, 8), torch.randn(5, 1, 8)
    with pytest.raises(ValueError, match="kv_offsets"):
        jagged_cross_attention(q, k, k, _offsets([1, 2]), _offsets([2, 2]), 2, 2)
    with pytest.raises(ValueError, match="B="):
        jagged_cross_attention(q, k, k, _offsets([1, 2]), _offsets([5]), 2, 5)


def test_time_bucket_is_log_base_e_over_0301():
    dt = torch.tensor([0, 1, 2, 3, 10, -10, 100, 10**9])
    want = [0, 0, 2, 3, 7, 7, 15, 19]
    assert time_bucket(dt, 20).tolist() == want


def test_flop_counts_on_valid_pairs():
    offsets = _offsets([3, 0, 2])
    assert valid_pairs(offsets, 3, causal=True) == 6 + 3
    assert valid_pairs(offsets, 3, causal=False) == 9 + 4
    # Targets: 3 tokens with 1 target: history pairs (0,0),(1,0),(1,1) + target sees 2 + itself.
    assert valid_pairs(_offsets([3]), 3, causal=True, num_targets=torch.tensor([1])) == 6
    assert valid_pairs(_offsets([4]), 4, causal=True, window=2) == 7
    assert attention_flops(10, 2, 64, 32) == 2.0 * 10 * 2 * 96
    assert attention_flops(10, 2, 64, 32, backward=True) == 2.5 * attention_flops(10, 2, 64, 32)
    assert cross_attention_pairs(_offsets([2, 1]), _offsets([5, 0])) == 10
