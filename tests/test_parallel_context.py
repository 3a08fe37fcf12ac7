"""Context parallelism in one process: the zigzag token layout, and the prefix attention every rank computes
(against the whole batch's keys, which the all-gather gives it) assembling into whole-sequence attention.
Multi-process CP training is in ``test_parallel_training``."""

from __future__ import annotations

import pytest
import torch

from foundation.model.teacher import build_teacher
from foundation.parallel.context import (
    attend_over_prefixes,
    build_context_plan,
    causal_work,
    check_heads_divide,
    chunk_bounds,
    sequence_regions,
    zigzag_shard,
)
from kernels import jagged_attention
from tests.teacher_batches import CTR_SCHEMA, tiny_config


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


def whole_and_sharded_attention(cp: int, causal: bool, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """``jagged_attention`` of a ragged batch, and the same assembled from every cp rank's prefix attention.

    The ranks' queries are their zigzag tokens; their keys and values are the whole batch's (what the all-gather
    hands them), so this checks the prefix construction: global positions, targets, biases and ``1/max_len``.
    """
    g = torch.Generator().manual_seed(cp)
    lengths = [0, 1, 2, 5, 9, 16]
    offsets = offsets_of(lengths)
    num_tokens, heads = sum(lengths), 2
    q, k, v = (torch.randn(num_tokens, heads, 4, generator=g) for _ in range(3))
    options.update(
        num_targets=torch.tensor([0, 1, 2, 2, 3, 4]),
        pos_bias=torch.randn(heads, 8, generator=g),
        time_bias=torch.randn(heads, 6, generator=g),
        timestamps=torch.randint(0, 1000, (num_tokens,), generator=g).sort().values,
    )
    max_len = 20  # larger than the longest row: HSTU's fixed 1/N, passed through unchanged
    whole = jagged_attention(q, k, v, offsets, max_len, causal=causal, **options)
    sharded = torch.empty_like(whole)
    for rank in range(cp):
        plan = build_context_plan(offsets, cp, rank)
        mine = plan.mine.token_index
        prefixes = plan.prefixes(causal)
        sharded[mine] = attend_over_prefixes(q[mine], k, v, offsets, max_len, prefixes, causal=causal, **options)
    return whole, sharded


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_prefix_attention_of_every_rank_equals_whole_sequence_attention(cp, activation):
    whole, sharded = whole_and_sharded_attention(cp, causal=True, activation=activation)
    torch.testing.assert_close(sharded, whole, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cp", [2, 3])
def test_prefix_attention_measures_each_query_from_its_own_query_time(cp):
    query_timestamps = torch.randint(0, 1000, (33,), generator=torch.Generator().manual_seed(cp))
    whole, sharded = whole_and_sharded_attention(cp, causal=True, activation="silu", query_timestamps=query_timestamps)
    torch.testing.assert_close(sharded, whole, atol=1e-6, rtol=1e-5)
    without, _ = whole_and_sharded_attention(cp, causal=True, activation="silu")
    assert (without - whole).abs().max() > 1e-3


def test_prefix_attention_without_causal_mask_and_with_a_window_uses_the_right_keys():
    for causal, window in ((False, None), (True, 3)):
        whole, sharded = whole_and_sharded_attention(2, causal=causal, window=window)
        torch.testing.assert_close(sharded, whole, atol=1e-6, rtol=1e-5)


def test_causal_prefixes_end_at_each_rows_last_own_token():
    offsets = offsets_of([0, 1, 8])
    plan = build_context_plan(offsets, 2, 1)  # chunks 1 and 2 of 4: positions 2..5 of the 8-token row
    assert plan.mine.positions.tolist() == [2, 3, 4, 5]
    prefixes = plan.prefixes(causal=True)
    assert prefixes.offsets.tolist() == [0, 0, 0, 6]  # the 1-token row is all rank 0's
    assert prefixes.token_index.tolist() == list(range(1, 7))
    assert prefixes.query_slots.tolist() == [2, 3, 4, 5]
    assert plan.prefixes(causal=False).offsets.tolist() == [0, 0, 0, 8]


def test_regions_are_per_layer_when_interleaved_and_span_the_stack_otherwise():
    interleaved = build_teacher(tiny_config(dropout=0.0), CTR_SCHEMA)
    regions = sequence_regions(interleaved)
    assert [(a, b) for a, b in regions] == list(zip(interleaved.pffns, interleaved.blocks, strict=True))
    flat = build_teacher(tiny_config(dropout=0.0, interleave=False), CTR_SCHEMA)
    assert sequence_regions(flat) == [(flat.blocks[0], flat.blocks[-1])]
    with pytest.raises(ValueError, match="ModuleList of HSTUBlock"):
        sequence_regions(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_head_parallel_attention_needs_cp_to_divide_the_heads():
    model = build_teacher(tiny_config(dropout=0.0), CTR_SCHEMA)  # 2 heads per block
    check_heads_divide(model, 2)
    with pytest.raises(ValueError, match=r"blocks\.0 has 2 heads, not divisible by cp=4"):
        check_heads_divide(model, 4)
