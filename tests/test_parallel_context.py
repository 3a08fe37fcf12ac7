"""Zigzag context-parallel token layout (pure function, no processes)."""

from __future__ import annotations

import pytest
import torch

from foundation.parallel.context import causal_work, chunk_bounds, zigzag_shard


def offsets_of(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_token_is_held_by_exactly_one_rank_with_its_own_position(cp):
    lengths = [0, 1, 5, 16, 7, 33]
    offsets = offsets_of(lengths)
    shards = [zigzag_shard(offsets, cp, r) for r in range(cp)]
    held = torch.cat([s.token_index for s in shards])
    assert sorted(held.tolist()) == list(range(sum(lengths)))
    row_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    for s in shards:
        assert s.offsets[-1] == s.token_index.numel()
        torch.testing.assert_close(s.positions, s.token_index - offsets[row_of[s.token_index]])
        # Within each row, tokens stay in sequence order.
        for a, b in zip(s.offsets[:-1].tolist(), s.offsets[1:].tolist(), strict=True):
            assert s.positions[a:b].tolist() == sorted(s.positions[a:b].tolist())


def test_zigzag_evens_causal_work_where_contiguous_splits_do_not():
    offsets = offsets_of([64, 128, 40])
    work = [causal_work(zigzag_shard(offsets, 4, r)) for r in range(4)]
    assert max(work) / (sum(work) / 4) < 1.05
    # Contiguous quarters of every sequence for comparison: the last quarter does ~7/4 of the mean.
    contiguous = [0] * 4
    for length in (64, 128, 40):
        bounds = chunk_bounds(length, 4)
        for r in range(4):
            contiguous[r] += int((torch.arange(bounds[r], bounds[r + 1]) + 1).sum())
    assert max(contiguous) / (sum(contiguous) / 4) > 1.6


def test_chunk_bounds_and_bad_ranks():
    assert chunk_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert chunk_bounds(2, 4) == [0, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="cp_rank must be in"):
        zigzag_shard(offsets_of([3]), 2, 2)
