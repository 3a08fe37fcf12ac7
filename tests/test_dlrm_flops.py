"""The DLRM's FLOP counter against ``torch.utils.flop_counter`` on the real forward and the real training step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from foundation.model.baseline import DLRMBaseline, DLRMConfig, dlrm_flops
from tests.teacher_batches import CTR_SCHEMA, make_batch

LENGTHS = [0, 1, 7, 4, 12]
CASES = {
    "default": DLRMConfig(embedding_dim=8, bottom_mlp=(6, 4), top_mlp=(16, 8), repr_dim=5),
    "no_history": DLRMConfig(embedding_dim=8, bottom_mlp=(6,), top_mlp=(12,), use_history=False, repr_dim=4),
    "no_bottom_hidden": DLRMConfig(embedding_dim=4, bottom_mlp=(), top_mlp=(8, 8, 4), repr_dim=3),
}
SCHEMAS = {"dense": CTR_SCHEMA, "no_dense": dataclasses.replace(CTR_SCHEMA, dense_dim=0)}


def _counted(cfg: DLRMConfig, schema, *, backward: bool) -> tuple[float, DLRMBaseline, object]:
    torch.manual_seed(0)
    model = DLRMBaseline(cfg, schema, {"click": 1.0, "conversion": 1.0})
    batch = make_batch(schema, LENGTHS)
    counter = FlopCounterMode(display=False)
    with counter:
        loss = model.loss(batch, model(batch))["loss"]
        if backward:
            loss.backward()
    return counter.get_total_flops(), model, batch


@pytest.mark.parametrize("schema_name", sorted(SCHEMAS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_flops_match_torch_flop_counter(case, schema_name):
    counted, model, batch = _counted(CASES[case], SCHEMAS[schema_name], backward=False)
    assert counted > 0
    assert model.flops(batch, training=False) == pytest.approx(counted, rel=1e-12)


@pytest.mark.parametrize("schema_name", sorted(SCHEMAS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_training_step_flops_match_torch_flop_counter(case, schema_name):
    counted, model, batch = _counted(CASES[case], SCHEMAS[schema_name], backward=True)
    assert model.flops(batch) == pytest.approx(counted, rel=1e-12)


def test_flops_grow_with_width_and_rows_but_not_history():
    cfg = CASES["default"]
    wider = dataclasses.replace(cfg, embedding_dim=16, top_mlp=(32, 16))
    assert dlrm_flops(wider, CTR_SCHEMA, 5) > dlrm_flops(cfg, CTR_SCHEMA, 5)
    assert dlrm_flops(cfg, CTR_SCHEMA, 10) == pytest.approx(2 * dlrm_flops(cfg, CTR_SCHEMA, 5))
    model = DLRMBaseline(cfg, CTR_SCHEMA, {})
    assert model.flops(make_batch(CTR_SCHEMA, [1, 1, 1])) == model.flops(make_batch(CTR_SCHEMA, [0, 30, 2]))
