"""Parquet -> JaggedBatch: coverage, determinism, token budgets, truncation, sharding and resume."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from foundation.data.io import list_shards
from foundation.data.pipeline import DataConfig, EventStream, build_dataloader
from tests.events import write_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("events"), rows={"train": 300, "valid": 60}, shards=3)


def _cfg(dataset, **kw) -> DataConfig:
    return DataConfig(path=str(dataset), **{"max_len": 8, "batch_size": 16, **kw})


def _ids(batches) -> list[int]:
    return [i for b in batches for i in b.example_id.tolist()]


def _raw(dataset, split="train") -> dict[int, dict]:
    table = pa.concat_tables(pq.read_table(s) for s in list_shards(dataset, split))
    return {r["example_id"]: r for r in table.to_pylist()}


@pytest.mark.parametrize("window", [1, 2, 0])
def test_every_row_exactly_once_with_most_recent_history(dataset, window):
    raw = _raw(dataset)
    batches = list(EventStream(dataset, "train", _cfg(dataset, shuffle_window=window), training=True))
    assert sorted(_ids(batches)) == sorted(raw)
    for b in batches:
        assert b.offsets[0] == 0 and b.offsets[-1] == b.history["item_ids"].numel()
        assert b.max_len == int(b.lengths.max()) <= 8
        for row, eid in enumerate(b.example_id.tolist()):
            start, end = b.offsets[row].item(), b.offsets[row + 1].item()
            expected = raw[eid]["history_item_ids"][-8:] if raw[eid]["history_item_ids"] else []
            assert b.history["item_ids"][start:end].tolist() == expected
            assert b.history["timestamps"][start:end].tolist() == (raw[eid]["history_timestamps"][-8:] or [])
            assert b.candidate[row] == raw[eid]["item_id"]
            mask = b.label_mask["conversion"][row].item()
            assert mask == (raw[eid]["conversion"] is not None)
            assert b.sparse["user_age"].to_dense()[row].tolist() == raw[eid]["user_age"]


def test_empty_histories_are_kept(dataset):
    batches = list(EventStream(dataset, "train", _cfg(dataset), training=False))
    assert any((b.lengths == 0).any() for b in batches)


def test_order_is_deterministic_and_changes_with_epoch_and_seed(dataset):
    def order(seed=0, epoch=0):
        stream = EventStream(dataset, "train", _cfg(dataset, seed=seed), training=True)
        stream.set_epoch(epoch)
        return _ids(stream)

    assert order() == order()
    assert order() != order(epoch=1)
    assert order() != order(seed=1)
    assert sorted(order(epoch=1)) == sorted(order())


def test_eval_order_is_file_order(dataset):
    ids = _ids(EventStream(dataset, "valid", _cfg(dataset), training=False))
    assert ids == list(_raw(dataset, "valid"))


@pytest.mark.parametrize("budget", [8, 20, 64])
def test_token_budget_is_respected(dataset, budget):
    batches = list(EventStream(dataset, "train", _cfg(dataset, token_budget=budget, batch_size=1000), training=True))
    assert all(b.num_tokens <= budget for b in batches)
    assert sorted(_ids(batches)) == sorted(_raw(dataset))
    # Greedy packing: a batch closes only when the next row would not fit.
    assert max(b.num_tokens for b in batches) > budget - 8


def test_token_budget_below_max_len_is_rejected(dataset):
    with pytest.raises(ValueError, match="token_budget"):
        _cfg(dataset, token_budget=4)


@pytest.mark.parametrize("world_size, workers", [(2, 1), (2, 2), (3, 2)])
def test_ranks_and_workers_partition_the_data(dataset, world_size, workers):
    seen = []
    for rank in range(world_size):
        stream = EventStream(dataset, "train", _cfg(dataset, num_workers=workers), training=True, rank=rank, world_size=world_size)
        loader = build_dataloader(stream, stream.cfg)
        seen.append(_ids(loader))
    flat = [i for ids in seen for i in ids]
    assert sorted(flat) == sorted(_raw(dataset))
    assert all(seen)


def _row_group_of(dataset) -> dict[int, tuple[int, int]]:
    out = {}
    for i, shard in enumerate(list_shards(dataset, "train")):
        file = pq.ParquetFile(shard)
        for g in range(file.num_row_groups):
            out.update({eid: (i, g) for eid in file.read_row_group(g, columns=["example_id"])["example_id"].to_pylist()})
    return out


def test_a_whole_window_shuffles_rows_across_row_groups(dataset):
    """One row group at a time, a batch holds rows of the few row groups it straddles; a window of
    all of them is one permutation of the split: batches draw on many row groups, and the order changes with
    the epoch."""
    group_of = _row_group_of(dataset)

    def batches(window, epoch=0):
        stream = EventStream(dataset, "train", _cfg(dataset, shuffle_window=window), training=True)
        stream.set_epoch(epoch)
        return [b.example_id.tolist() for b in stream]

    def groups(batches) -> list[int]:
        return [len({group_of[i] for i in ids}) for ids in batches]

    per_group, whole = batches(1), batches(0)
    assert max(groups(per_group)) <= 3 and sorted(groups(per_group))[len(per_group) // 2] <= 2
    assert sorted(groups(whole))[len(whole) // 2] >= 6
    assert batches(0, epoch=1) != whole


def test_shuffle_window_must_not_be_negative(dataset):
    with pytest.raises(ValueError, match="shuffle_window=-1"):
        _cfg(dataset, shuffle_window=-1)


@pytest.mark.parametrize("workers, window", [(0, 1), (2, 1), (3, 1), (0, 0), (2, 2)])
@pytest.mark.parametrize("where", [0.1, 0.5, 0.99])
def test_skip_resumes_each_stream_exactly(dataset, workers, window, where):
    cfg = _cfg(dataset, num_workers=workers, shuffle_window=window)
    full = list(build_dataloader(EventStream(dataset, "train", cfg, training=True), cfg))
    cut = max(1, int(len(full) * where))
    consumed: dict[int, int] = {}
    for b in full[:cut]:
        consumed[b.position.stream] = b.position.index + 1
    stream = EventStream(dataset, "train", cfg, training=True)
    stream.set_skip(consumed, first_worker_stream=(full[cut - 1].position.stream + 1) % max(workers, 1))
    rest = list(build_dataloader(stream, cfg))
    assert _ids(full[:cut]) + _ids(rest) == _ids(full)


def test_batch_moves_and_pins(dataset):
    batch = next(iter(EventStream(dataset, "train", _cfg(dataset), training=True)))
    moved = batch.to("cpu")
    assert torch.equal(moved.offsets, batch.offsets)
    assert moved.sparse.keys() == batch.sparse.keys()


def test_cached_blocks_give_the_same_batches_and_read_each_row_group_once(dataset, monkeypatch):
    import foundation.data.pipeline as pipeline

    reads = []
    real = pipeline.iter_valid_row_groups

    def counting(shard, *args, row_groups, **kwargs):
        reads.append((shard, *row_groups))
        return real(shard, *args, row_groups=row_groups, **kwargs)

    monkeypatch.setattr(pipeline, "iter_valid_row_groups", counting)
    plain = EventStream(dataset, "train", _cfg(dataset), training=True)
    cached = EventStream(dataset, "train", _cfg(dataset), training=True, cache_blocks=True)
    for epoch in range(3):
        plain.set_epoch(epoch)
        cached.set_epoch(epoch)
        before = len(reads)
        expected = list(plain)
        units = len(reads) - before
        got = list(cached)
        assert [b.example_id.tolist() for b in got] == [b.example_id.tolist() for b in expected]
        assert all(torch.equal(g.history["item_ids"], e.history["item_ids"]) for g, e in zip(got, expected, strict=True))
        assert len(reads) - before - units == (units if epoch == 0 else 0)
