"""Balanced row assignment across data-parallel ranks (pure functions, no processes)."""

from __future__ import annotations

import pytest
import torch

from foundation.parallel.balance import BalanceConfig, balance_rows, imbalance_ratio, row_work


def contiguous(num_rows: int, num_ranks: int) -> list[torch.Tensor]:
    return list(torch.arange(num_rows).chunk(num_ranks))


def test_every_row_lands_on_exactly_one_rank_and_no_rank_is_empty():
    lengths = torch.tensor([0, 0, 0, 0, 7, 0])
    groups = balance_rows(lengths, 3)
    assert sorted(torch.cat(groups).tolist()) == list(range(6))
    assert all(len(g) for g in groups)


def test_long_histories_are_spread_instead_of_piled_on_one_rank():
    # Sorted by length (as a length-bucketing sampler emits them): contiguous slices are skewed.
    lengths = torch.tensor([1, 2, 2, 3, 3, 4, 20, 30, 40, 50, 60, 64])
    balanced = balance_rows(lengths, 4)
    work = row_work(lengths, BalanceConfig())
    # No assignment beats the rank that holds the heaviest row alone.
    best_possible = float(work.max() / (work.sum() / 4))
    assert imbalance_ratio(lengths, balanced) == pytest.approx(best_possible)
    assert imbalance_ratio(lengths, contiguous(12, 4)) > 2.0


def test_known_assignment_and_determinism():
    lengths = torch.tensor([3, 1, 2, 2])  # work with attention_weight=0: the lengths themselves
    groups = balance_rows(lengths, 2, BalanceConfig(attention_weight=0.0))
    assert [g.tolist() for g in groups] == [[0, 1], [2, 3]]
    assert imbalance_ratio(lengths, groups, BalanceConfig(attention_weight=0.0)) == 1.0
    assert [g.tolist() for g in balance_rows(lengths, 2)] == [g.tolist() for g in balance_rows(lengths, 2)]


def test_attention_weight_changes_what_counts_as_heavy():
    lengths = torch.tensor([10, 4, 4, 4, 4, 4])
    linear = balance_rows(lengths, 2, BalanceConfig(attention_weight=0.0))
    quadratic = balance_rows(lengths, 2, BalanceConfig(attention_weight=1.0))
    # Linear: 10 ~ 4+4+4 (rows split 2/4). Quadratic: 110 vs 5*20=100, the long row stays alone.
    assert sorted(len(g) for g in linear) == [2, 4]
    assert sorted(len(g) for g in quadratic) == [1, 5]


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="each of 3 ranks"):
        balance_rows(torch.tensor([1, 2]), 3)
    with pytest.raises(ValueError, match="num_ranks must be positive"):
        balance_rows(torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="attention_weight"):
        BalanceConfig(attention_weight=-1.0)
