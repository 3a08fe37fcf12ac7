"""The batch's time-bucket plan (kernels/triton/time_tiles.py) and the attention passes that read it."""

from __future__ import annotations

import pytest
import torch

from kernels.pytorch.jagged_attention import time_bucket
from kernels.triton.jagged_attention import relative_timestamps
from kernels.triton.time_tiles import (
    FLAG_MIXED,
    FLAG_SPLIT,
    TILE_K_CPU,
    TILE_Q_CPU,
    build_time_tiles,
)
from tests.kernels.test_jagged_attention import _offsets, _run


def _times(lengths: list[int], gen: torch.Generator, order: str) -> torch.Tensor:
    """Per sequence: ``sorted`` gaps of 0-1 h, a ``burst`` (sorted, with a jump of a year mid-sequence), or
    ``shuffled`` (the sorted times in random order)."""
    parts = []
    for n in lengths:
        t = torch.randint(0, 3600, (n,), generator=gen).cumsum(0)
        if order == "burst":
            t[n // 2:] += 3600 * 24 * 365
        if order == "shuffled":
            t = t[torch.randperm(n, generator=gen)]
        parts.append(t)
    return torch.cat(parts)


@pytest.mark.parametrize("order", ["sorted", "burst", "shuffled"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("keys_on_rows", [False, True], ids=["query-rows", "key-rows"])
def test_plan_flags_exactly_the_tiles_whose_rows_split_in_two(order, causal, keys_on_rows):
    """Per (row block, column tile): ``FLAG_SPLIT`` iff every valid row holds its first column's bucket up to a split
    and its last column's after it (one bucket included), else ``FLAG_MIXED``; per flagged row the packed (first,
    last, split) give back every bucket of the tile. Rows are queries and columns keys, or the transpose
    (``keys_on_rows``, dK/dV's plan: a key's buckets along the queries). Causal plans cover the tiles before each
    block's last row, or from its first row on (the rest stay ``FLAG_MIXED``). The buckets are the reference's
    (``kernels.pytorch.jagged_attention.time_bucket``)."""
    gen = torch.Generator().manual_seed(5)
    lengths, size = [300, 33, 0, 70], 40
    offsets = _offsets(lengths)
    ts = relative_timestamps(_times(lengths, gen, order), offsets)
    plan = build_time_tiles(ts, ts, offsets, offsets, max(lengths), max(lengths), size, causal, keys_on_rows)
    tq, tk = TILE_Q_CPU, TILE_K_CPU
    seen = {FLAG_MIXED: 0, FLAG_SPLIT: 0}
    for b, n in enumerate(lengths):
        t = ts[offsets[b]: offsets[b + 1]].to(torch.int64)
        buckets = time_bucket(t[:, None] - t[None, :], size)
        if keys_on_rows:
            buckets = buckets.T
        for qb in range(-(-n // tq)):
            for kt in range(plan.flags.shape[2]):
                rows, cols = slice(qb * tq, min((qb + 1) * tq, n)), slice(kt * tk, min((kt + 1) * tk, n))
                tile = buckets[rows, cols]
                uncovered = (kt + 1) * tk <= rows.start if keys_on_rows else kt * tk >= rows.stop
                if tile.numel() == 0 or (causal and uncovered):
                    assert plan.flags[b, qb, kt] == FLAG_MIXED
                    continue
                first, last = tile[:, :1], tile[:, -1:]
                split = (tile == first).sum(1, keepdim=True)
                keys = torch.arange(tile.shape[1])[None, :]
                two = bool((torch.where(keys < split, first, last) == tile).all())
                want = FLAG_SPLIT if two else FLAG_MIXED
                assert plan.flags[b, qb, kt] == want, (order, b, qb, kt)
                seen[want] += 1
                if two:
                    info = plan.info[kt, offsets[b] + rows.start: offsets[b] + rows.stop]
                    got = torch.where(keys < (info >> 16)[:, None], (info & 255)[:, None], ((info >> 8) & 255)[:, None])
                    assert torch.equal(got.to(torch.int64), tile)
    assert seen[FLAG_MIXED] > 0
    if order != "shuffled":
        assert seen[FLAG_SPLIT] > 20, seen


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_split_time_buckets_give_the_per_score_result(activation, order, monkeypatch):
    """With the plan (the forward's and dK/dV's flagged tiles add each row's two table entries) the output and
    every gradient equal the per-score buckets' (switch off) to rounding and match the reference; a short position
    table and targets ride along. ``sorted`` times take the split path in most mask-free tiles, ``shuffled`` in
    almost none."""
    gen = torch.Generator().manual_seed(11)
    lengths = [150, 7, 0, 97]
    offsets = _offsets(lengths)
    total = sum(lengths)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_(True)

    t = dict(q=leaf(total, 2, 16), k=leaf(total, 2, 16), v=leaf(total, 2, 16), pos_bias=leaf(2, 20),
             time_bias=leaf(2, 40), timestamps=_times(lengths, gen, order))
    options = dict(activation=activation, causal=True, num_targets=torch.tensor([3, 1, 0, 6]))
    want = _run("pytorch", t, offsets, 150, 9, **options)
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("GEM_KERNELS_TIME_TILES", switch)
        runs[switch] = _run("triton", t, offsets, 150, 9, **options)
    for got, off, ref, name in zip(runs["1"], runs["0"], want, ["out", "dq", "dk", "dv", "dpos", "dtime"],
                                   strict=True):
        scale = max(ref.abs().max().item(), 1.0)
        assert (got - off).abs().max().item() <= 1e-5 * scale, name
        assert (got - ref).abs().max().item() <= 1e-4 * scale, name
