"""The generative loss: shared and per-position negatives against a plain reference (values and gradients),
accidental hits masked, one item-table lookup per training step, and a loss that falls in either mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foundation.model.generative import PositionCosine, l2_normalize, sampled_softmax_loss
from foundation.model.teacher import build_teacher
from tests.teacher_batches import CTR_SCHEMA, NEXT_ITEM_SCHEMA, make_batch, tiny_config

TEMPERATURE = 0.07


pytestmark = pytest.mark.usefixtures("one_thread")


def reference_loss(
    queries, target_ids, target_vectors, shared_ids, shared_vectors, position_ids, position_vectors
):
    """Every position's candidates spelled out as ``[P, 1 + M + K, e]``, normalised, scored, hits at -inf."""
    p = queries.shape[0]
    ids, vectors = [target_ids[:, None]], [target_vectors[:, None]]
    if shared_ids is not None:
        ids.append(shared_ids.expand(p, -1))
        vectors.append(shared_vectors.expand(p, -1, -1))
    if position_ids is not None:
        ids.append(position_ids)
        vectors.append(position_vectors)
    ids, vectors = torch.cat(ids, 1), l2_normalize(torch.cat(vectors, 1))
    logits = torch.einsum("pe,pce->pc", queries, vectors) / TEMPERATURE
    hit = ids == target_ids[:, None]
    hit[:, 0] = False
    logits = logits.masked_fill(hit, float("-inf"))
    return F.cross_entropy(logits, torch.zeros(p, dtype=torch.int64), reduction="none")


def random_inputs(p: int, m: int, k: int, e: int, num_items: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    queries = l2_normalize(torch.randn(p, e, generator=g))
    target_ids = torch.randint(num_items, (p,), generator=g)
    shared_ids = torch.randint(num_items, (m,), generator=g) if m else None
    position_ids = torch.randint(num_items, (p, k), generator=g) if k else None
    # Force accidental hits in both kinds of negatives.
    if m:
        shared_ids[0] = target_ids[0]
    if k:
        position_ids[1, :2] = target_ids[1]
    tensors = {
        "queries": queries,
        "target_vectors": torch.randn(p, e, generator=g),
        "shared_vectors": torch.randn(m, e, generator=g) if m else None,
        "position_vectors": torch.randn(p, k, e, generator=g) if k else None,
    }
    return tensors, {"target_ids": target_ids, "shared_ids": shared_ids, "position_ids": position_ids}


@pytest.mark.parametrize("m,k", [(6, 0), (0, 5), (4, 3), (1, 1)])
def test_loss_and_gradients_match_the_reference(m, k):
    tensors, ids = random_inputs(p=9, m=m, k=k, e=8, num_items=12, seed=m * 10 + k)
    leaves = {n: t.clone().requires_grad_() for n, t in tensors.items() if t is not None}
    args = {**{n: leaves.get(n) for n in tensors}, **ids}
    ref_leaves = {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}
    ref_args = {**{n: ref_leaves.get(n) for n in tensors}, **ids}
    loss = sampled_softmax_loss(
        args["queries"],
        args["target_ids"],
        args["target_vectors"],
        TEMPERATURE,
        shared_ids=args["shared_ids"],
        shared_vectors=args["shared_vectors"],
        position_ids=args["position_ids"],
        position_vectors=args["position_vectors"],
    )
    expected = reference_loss(
        **{
            n: ref_args[n]
            for n in (
                "queries",
                "target_ids",
                "target_vectors",
                "shared_ids",
                "shared_vectors",
                "position_ids",
                "position_vectors",
            )
        }
    )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    weights = torch.rand(loss.shape[0])
    (loss * weights).sum().backward()
    (expected * weights).sum().backward()
    for name, leaf in leaves.items():
        torch.testing.assert_close(leaf.grad, ref_leaves[name].grad, rtol=1e-4, atol=5e-5, msg=name)


def test_position_cosine_gradients_with_a_zero_row():
    q = l2_normalize(torch.randn(3, 4, dtype=torch.float64)).requires_grad_()
    v = torch.randn(3, 2, 4, dtype=torch.float64)
    v[2, 1] = 0.0  # its norm is clamped: the reference's F.normalize gradient holds there too
    v.requires_grad_()
    torch.autograd.gradcheck(PositionCosine.apply, (q, v))
    expected = torch.einsum("pe,pke->pk", q, l2_normalize(v))
    torch.testing.assert_close(PositionCosine.apply(q, v), expected)


def test_accidental_hits_are_masked_not_counted():
    q = l2_normalize(torch.randn(3, 4))
    vectors = torch.randn(3, 4)
    target_ids = torch.tensor([1, 2, 3])
    # Shared negatives: id 1 is position 0's target, id 3 position 2's.
    shared = torch.tensor([1, 3, 7])
    shared_vectors = torch.randn(3, 4)
    loss = sampled_softmax_loss(q, target_ids, vectors, 0.1, shared_ids=shared, shared_vectors=shared_vectors)
    for position, kept in ((0, [1, 2]), (1, [0, 1, 2]), (2, [0, 2])):
        alone = sampled_softmax_loss(
            q[position : position + 1],
            target_ids[position : position + 1],
            vectors[position : position + 1],
            0.1,
            shared_ids=shared[kept],
            shared_vectors=shared_vectors[kept],
        )
        torch.testing.assert_close(loss[position], alone[0])
    # Per position: row 2's only negatives are its target: nothing competes, loss 0 with finite gradients.
    q.requires_grad_()
    position_ids = torch.tensor([[1, 5], [6, 7], [3, 3]])
    loss = sampled_softmax_loss(
        q, target_ids, vectors, 0.1, position_ids=position_ids, position_vectors=torch.randn(3, 2, 4)
    )
    assert loss[2] == 0 and loss[0] > 0
    loss.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_loss_is_float32_under_autocast():
    tensors, ids = random_inputs(p=5, m=4, k=0, e=8, num_items=50, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = sampled_softmax_loss(
            tensors["queries"].bfloat16(),
            ids["target_ids"],
            tensors["target_vectors"],
            TEMPERATURE,
            shared_ids=ids["shared_ids"],
            shared_vectors=tensors["shared_vectors"].bfloat16(),
        )
    assert loss.dtype == torch.float32


@pytest.mark.parametrize("negatives", ["batch", "position"])
@pytest.mark.parametrize("schema", [CTR_SCHEMA, NEXT_ITEM_SCHEMA], ids=["ctr", "next_item"])
def test_training_forward_draws_negatives_into_the_one_lookup(negatives, schema):
    cfg = tiny_config(generative=True, negatives=negatives, in_batch_negatives=True, dropout=0.0)
    torch.manual_seed(0)
    model = build_teacher(cfg, schema)
    batch = make_batch(schema, [3, 0, 5, 1])
    lookups = []
    model.items.register_forward_hook(lambda module, args, out: lookups.append(args[0].numel()))
    out = model(batch)
    positions = batch.num_tokens + (batch.batch_size if schema is NEXT_ITEM_SCHEMA else 0)
    expected = (cfg.num_negatives,) if negatives == "batch" else (positions, cfg.num_negatives)
    assert out.extra["negative_ids"].shape == expected
    loss = model.loss(batch, out)["loss_next_item"]
    # One lookup: history, candidates and every negative (a fused optimiser steps each looked-up row once).
    assert lookups == [batch.num_tokens + batch.batch_size + out.extra["negative_ids"].numel()]
    assert torch.isfinite(loss)
    loss.backward()
    assert model.items.collection.embeddings["t_item"].weight.grad.abs().sum() > 0


def test_ml1m_flavors_keep_per_position_negatives_and_ctr_flavors_share_them():
    from foundation.model.teacher_config import TeacherConfig
    from gem.flavors import TEACHER_FLAVORS

    modes = {name: cfg.negatives for name, cfg in TEACHER_FLAVORS.items()}
    assert modes == {
        "debug": "batch",
        "small": "batch",
        "large": "batch",
        "ml1m_hstu": "position",
        "ml1m_hstu_large": "position",
        "sasrec": "position",
    }
    with pytest.raises(ValueError, match=r"teacher\.negatives"):
        TeacherConfig(negatives="row")
    cfg = tiny_config()
    cfg.negatives = "rows"  # as a CLI override sets it, past __init__
    with pytest.raises(ValueError, match=r"teacher\.negatives"):
        build_teacher(cfg, CTR_SCHEMA)
