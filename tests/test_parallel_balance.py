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


def test_take_rows_keeps_each_rows_history_features_and_labels(tmp_path):
    from foundation.data.batch import take_rows
    from foundation.data.pipeline import DataConfig, EventStream
    from tests.events import write_dataset

    data = write_dataset(tmp_path, rows={"train": 20}, shards=1)
    batch = next(iter(EventStream(data, "train", DataConfig(path=str(data), batch_size=8), training=True)))
    rows = torch.tensor([6, 1, 3, 0])
    part = take_rows(batch, rows)
    assert part.example_id.tolist() == batch.example_id[rows].tolist() and part.position == batch.position
    for new, old in enumerate(rows.tolist()):
        a, b = batch.offsets[old], batch.offsets[old + 1]
        c, d = part.offsets[new], part.offsets[new + 1]
        for name, values in batch.history.items():
            assert part.history[name][c:d].tolist() == values[a:b].tolist(), name
        for key, bags in batch.sparse.to_dict().items():  # 1 or 2 ids per bag
            assert part.sparse[key].to_padded_dense(3)[new].tolist() == bags.to_padded_dense(3)[old].tolist(), key
    assert part.max_len == int(batch.lengths[rows].max())
    assert part.labels["conversion"].tolist() == batch.labels["conversion"][rows].tolist()
    assert part.dense.tolist() == batch.dense[rows].tolist()


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_rank_shares_partition_the_batch_and_weights_average_to_one(num_ranks):
    from foundation.parallel.balance import rank_share

    lengths = torch.tensor([9, 0, 4, 7, 1, 3, 8])
    shares = [rank_share(lengths, num_ranks, r) for r in range(num_ranks)]
    assert sorted(torch.cat([s.rows for s in shares]).tolist()) == list(range(7))
    # Mean over ranks of (weight x per-rank row mean) is the global row mean.
    assert sum(s.loss_weight for s in shares) / num_ranks == pytest.approx(1.0)
    assert all(s.imbalance >= 1.0 for s in shares)


def test_a_batch_smaller_than_the_ranks_gives_the_spare_ranks_a_zero_weight_row():
    from foundation.parallel.balance import rank_share

    lengths = torch.tensor([5])
    first, spare = rank_share(lengths, 2, 0), rank_share(lengths, 2, 1)
    assert first.rows.tolist() == [0] and first.loss_weight == 2.0
    assert spare.rows.tolist() == [0] and spare.loss_weight == 0.0
