"""Static-shape batches (:mod:`foundation.model.padding`): the padded layout, and padding that changes
neither the teacher's loss nor any gradient."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from foundation.data.batch import JaggedBatch
from foundation.model.padding import (
    PaddedBatch,
    StaticShapes,
    bucket_stand_in,
    pad_batch,
    static_shapes,
)
from foundation.model.teacher import build_teacher
from tests.teacher_batches import CTR_SCHEMA, NEXT_ITEM_SCHEMA, make_batch, tiny_config
from tests.test_ml1m_reference import ALL_SWITCHES

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTHS = [0, 1, 5, 9, 3, 2]  # 20 tokens, 6 rows, longest 9


def test_padded_layout():
    batch = make_batch(CTR_SCHEMA, LENGTHS)
    shapes = StaticShapes(tokens=40, rows=(8, 12, 16), max_len=12)
    padded = pad_batch(batch, shapes)
    # 20 missing tokens need two rows of at most 12: 6 + 2 = 8 rows.
    assert isinstance(padded, PaddedBatch) and padded.batch_size == 8 and padded.num_tokens == 40
    assert padded.max_len == 12 and (padded.real_rows, padded.real_tokens) == (6, 20)
    assert padded.lengths.tolist() == [*LENGTHS, 12, 8]
    assert padded.row_is_real.tolist() == [True] * 6 + [False] * 2
    for name, values in batch.history.items():
        assert torch.equal(padded.history[name][:20], values) and not padded.history[name][20:].any()
    assert not padded.label_mask["click"][6:].any() and torch.equal(padded.label_mask["click"][:6], batch.label_mask["click"])
    assert padded.example_id[6:].tolist() == [-1, -1]
    for key in [f.name for f in CTR_SCHEMA.sparse]:
        assert padded.sparse[key].lengths().tolist() == [*batch.sparse[key].lengths().tolist(), 0, 0]
        assert torch.equal(padded.sparse[key].values(), batch.sparse[key].values())
    # More rows: the next bucket; exactly full: no padding tokens, only empty rows to the bucket.
    assert pad_batch(batch, StaticShapes(tokens=40, rows=(7, 9), max_len=12)).batch_size == 9
    exact = pad_batch(batch, StaticShapes(tokens=20, rows=(7,), max_len=9))
    assert exact.lengths.tolist() == [*LENGTHS, 0] and exact.num_tokens == 20


def test_batches_no_bucket_holds_are_left_alone():
    batch = make_batch(CTR_SCHEMA, LENGTHS)
    assert pad_batch(batch, StaticShapes(tokens=40, rows=(7,), max_len=12)) is None  # needs 8 rows
    assert pad_batch(batch, StaticShapes(tokens=19, rows=(64,), max_len=12)) is None  # more tokens than the budget
    assert StaticShapes(tokens=40, rows=(8, 16), max_len=12).rows_for(6, 20) == 8


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda b: pad_batch(b, StaticShapes(tokens=40, rows=(8,), max_len=8)), "has 9 history tokens"),
        (lambda b: pad_batch(pad_batch(b, StaticShapes(tokens=40, rows=(8,), max_len=12)), StaticShapes(40, (8,), 12)), "padded already"),
        (lambda b: StaticShapes(tokens=40, rows=(16, 8), max_len=12), "ascending"),
        (lambda b: static_shapes(40, 12, "8,x"), "comma-separated"),
        (lambda b: StaticShapes(tokens=0, rows=(8,), max_len=12), "positive"),
    ],
)
def test_bad_shapes_and_batches_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        bad(make_batch(CTR_SCHEMA, LENGTHS))


def loss_and_grads(model, batch, seed: int = 5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the generative loss's shared negatives: the same draw for both batches
    loss = model.loss(batch, model(batch))["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = {
    "ctr": (CTR_SCHEMA, {"generative": True}),
    "ctr_in_batch_negatives": (CTR_SCHEMA, {"generative": True, "in_batch_negatives": True}),
    "ctr_no_interleave": (CTR_SCHEMA, {"generative": True, "interleave": False, "interaction": "dcnv2"}),
    "next_item": (NEXT_ITEM_SCHEMA, {"in_batch_negatives": True}),
    # Issue 16's reference-HSTU switches, all on: plain norms, no uvqk bias, bias tables shared by the heads.
    "next_item_reference_block": (NEXT_ITEM_SCHEMA, {"in_batch_negatives": True, **ALL_SWITCHES}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("max_len", [9, 16], ids=["same_max_len", "larger_max_len"])
def test_padding_changes_neither_the_loss_nor_a_gradient(case, max_len):
    schema, changes = CASES[case]
    torch.manual_seed(0)
    model = build_teacher(tiny_config(dropout=0.0, **changes), schema)  # train mode: the training loss
    batch = make_batch(schema, LENGTHS, seed=2)
    padded = pad_batch(batch, StaticShapes(tokens=64, rows=(16,), max_len=max_len))
    assert padded.batch_size == 16 and padded.num_tokens == 64
    loss, grads = loss_and_grads(model, batch)
    padded_loss, padded_grads = loss_and_grads(model, padded)
    assert set(grads) == set(padded_grads)
    # Only float32 rounding differs: reductions over more terms (the padding's exact zeros, the item table's
    # gradient summed in another order) and, with a larger max_len, the kernel's 1/max_len undone after it. A
    # sum's rounding scales with its largest terms, so the absolute bound scales with the tensor's largest entry.
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=1e-7)
    for name, grad in grads.items():
        atol = 1e-6 * max(1.0, float(grad.abs().max()))
        torch.testing.assert_close(
            padded_grads[name], grad, rtol=1e-5, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert model.flops(padded) == model.flops(batch)


def test_padding_rows_would_change_the_loss_without_their_masks():
    """The invariance above is the masks' doing: the same padded batch with its padding rows counted as real
    rows (labels present, generative positions counted) gives another loss."""
    torch.manual_seed(0)
    model = build_teacher(tiny_config(dropout=0.0, generative=True), CTR_SCHEMA)
    batch = make_batch(CTR_SCHEMA, LENGTHS, seed=2)
    padded = pad_batch(batch, StaticShapes(tokens=64, rows=(16,), max_len=9))
    fields = {f.name: getattr(padded, f.name) for f in dataclasses.fields(JaggedBatch)}
    counted = JaggedBatch(**{**fields, "label_mask": {k: torch.ones_like(v) for k, v in padded.label_mask.items()}})
    loss, _ = loss_and_grads(model, batch)
    assert not torch.allclose(loss_and_grads(model, counted)[0], loss, rtol=1e-3)


def test_padding_to_a_chosen_bucket():
    batch = make_batch(CTR_SCHEMA, LENGTHS)  # 20 tokens: 6 rows need 8 once padded to 40 tokens
    shapes = StaticShapes(tokens=40, rows=(6, 8, 12), max_len=12)
    assert pad_batch(batch, shapes).batch_size == 8
    wide = pad_batch(batch, shapes, rows=12)
    assert wide.batch_size == 12 and wide.lengths.tolist() == [*LENGTHS, 12, 8, 0, 0, 0, 0]
    assert pad_batch(batch, shapes, rows=6) is None
    with pytest.raises(ValueError, match="10 rows is not a bucket"):
        pad_batch(batch, shapes, rows=10)


def test_bucket_stand_ins_take_the_first_rows_each_bucket_holds():
    batch = make_batch(CTR_SCHEMA, LENGTHS)
    shapes = StaticShapes(tokens=40, rows=(4, 6, 8, 12), max_len=12)
    padded = pad_batch(batch, shapes)
    for source in (batch, padded):
        stand_ins = {rows: bucket_stand_in(source, shapes, rows) for rows in shapes.rows}
        # 4 rows hold not even the first row with the 40 tokens' padding (1 + 4 rows); 6 hold the first 3 rows
        # (6 tokens: 3 padding rows), 8 and 12 all six.
        assert stand_ins[4] is None
        assert [(s.batch_size, s.real_rows, s.num_tokens) for s in (stand_ins[6], stand_ins[8], stand_ins[12])] == [
            (6, 3, 40), (8, 6, 40), (12, 6, 40)
        ]
        assert stand_ins[6].lengths.tolist() == [0, 1, 5, 12, 12, 10]
        assert torch.equal(stand_ins[6].candidate[:3], batch.candidate[:3])
