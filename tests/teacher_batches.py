"""Hand-built ``JaggedBatch`` es and tiny teacher configs for the teacher tests (no Parquet, no synthetic world)."""

from __future__ import annotations

import dataclasses

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from foundation.data.batch import JaggedBatch
from foundation.data.schema import EventSchema, SparseFeature
from foundation.model.teacher_config import TeacherConfig

CTR_SCHEMA = EventSchema(
    num_users=50,
    num_items=40,
    num_domains=3,
    num_actions=3,
    sparse=[
        SparseFeature("user_age", 5, "user"),
        SparseFeature("user_country", 7, "user"),
        SparseFeature("item_category", 6, "item"),
    ],
    dense_dim=2,
)
NEXT_ITEM_SCHEMA = EventSchema(
    num_users=30,
    num_items=25,
    num_actions=6,
    sparse=[SparseFeature("user_gender", 2, "user")],
    task="next_item",
)


def tiny_config(**changes) -> TeacherConfig:
    """Every block present, as small as it gets."""
    cfg = TeacherConfig(
        d_model=16,
        item_dim=12,
        num_layers=2,
        num_heads=2,
        attn_dim=8,
        value_dim=8,
        max_len=32,
        time_buckets=16,
        age_buckets=16,
        num_cls=2,
        num_pma_seeds=2,
        num_recent=3,
        pffn_hidden=16,
        interaction_tokens=4,
        num_final_interaction_blocks=1,
        wukong_rank=3,
        wukong_hidden=16,
        dcn_rank=4,
        num_shared_experts=2,
        num_domain_experts=1,
        expert_hidden=16,
        expert_dim=8,
        repr_dim=8,
        num_negatives=8,
        dropout=0.1,
    )
    return dataclasses.replace(cfg, **changes)


def make_batch(schema: EventSchema, lengths: list[int], *, seed: int = 0) -> JaggedBatch:
    """A batch with histories of the given lengths (0 allowed), random ids, labels and features.

    Conversion labels are absent on about half of the rows.
    """
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths, dtype=torch.int64)
    b, num_tokens = len(lengths), int(lens.sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    timestamp = torch.randint(10_000, 20_000, (b,), generator=g)
    hist_ts = [
        torch.sort(torch.randint(0, int(t), (n,), generator=g)).values
        for t, n in zip(timestamp, lengths, strict=True)
    ]
    history = {
        "item_ids": torch.randint(0, schema.num_items, (num_tokens,), generator=g),
        "actions": torch.randint(0, schema.num_actions, (num_tokens,), generator=g),
        "timestamps": torch.cat([torch.zeros(0, dtype=torch.int64), *hist_ts]),
        "domains": torch.randint(0, schema.num_domains, (num_tokens,), generator=g),
    }
    keys = [f.name for f in schema.sparse]
    values = [torch.randint(0, f.cardinality, (b,), generator=g) for f in schema.sparse]
    sparse = KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([torch.zeros(0, dtype=torch.int64), *values]),
        lengths=torch.ones(b * len(keys), dtype=torch.int32),
        stride=b,
    )
    click = torch.randint(0, 2, (b,), generator=g).float()
    conversion = click * torch.randint(0, 2, (b,), generator=g).float()
    return JaggedBatch(
        history=history,
        offsets=offsets,
        max_len=max(lengths, default=0),
        sparse=sparse,
        dense=torch.randn(b, schema.dense_dim, generator=g),
        candidate=torch.randint(0, schema.num_items, (b,), generator=g),
        domain=torch.randint(0, schema.num_domains, (b,), generator=g),
        timestamp=timestamp,
        user_id=torch.arange(b),
        example_id=torch.arange(b),
        labels={"click": click, "conversion": conversion},
        label_mask={"click": torch.ones(b, dtype=torch.bool), "conversion": torch.rand(b, generator=g) < 0.5},
    )


def with_other_candidates(batch: JaggedBatch, schema: EventSchema, *, seed: int) -> JaggedBatch:
    """The same users and histories shown other candidates (ids, item features) on other surfaces."""
    g = torch.Generator().manual_seed(seed)
    b = batch.batch_size
    values = []
    for f in schema.sparse:
        own = batch.sparse[f.name].values()
        values.append(torch.randint(0, f.cardinality, (b,), generator=g) if f.side == "item" else own)
    sparse = KeyedJaggedTensor(
        keys=batch.sparse.keys(),
        values=torch.cat([torch.zeros(0, dtype=torch.int64), *values]),
        lengths=batch.sparse.lengths(),
        stride=b,
    )
    return dataclasses.replace(
        batch,
        candidate=(batch.candidate + 1 + torch.randint(0, schema.num_items - 1, (b,), generator=g))
        % schema.num_items,
        domain=(batch.domain + 1) % schema.num_domains,
        sparse=sparse,
        dense=torch.randn(b, schema.dense_dim, generator=g),
    )
