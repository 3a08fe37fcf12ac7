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


def test_every_row_exactly_once_with_most_recent_history(dataset):
    raw = _raw(dataset)
    batches = list(EventStream(dataset, "train", _cfg(dataset), training=True))
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


@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("where", [0.1, 0.5, 0.99])
def test_skip_resumes_each_stream_exactly(dataset, workers, where):
    cfg = _cfg(dataset, num_workers=workers)
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
