"""The teacher's FLOP counter: attention pairs agree with the kernels' count, dense FLOPs agree with
``torch.utils.flop_counter`` on the real forward+loss and on the real training step (forward+backward),
and the MFU helpers."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from foundation.model import flops as teacher_flops_module
from foundation.model.flops import (
    data_input_flops,
    peak_flops,
    self_attention_pairs,
    teacher_flop_breakdown,
    teacher_flops,
    throughput_metrics,
)
from foundation.model.jagged import SuffixLayout
from foundation.model.teacher import build_teacher
from kernels.flops import valid_pairs
from tests.teacher_batches import CTR_SCHEMA, NEXT_ITEM_SCHEMA, make_batch, tiny_config

LENGTHS = [0, 1, 7, 4, 12]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("num_suffix", [0, 1, 3])
def test_attention_pairs_match_the_kernel_count(num_suffix):
    offsets = torch.tensor([0, 0, 1, 8, 12, 24])
    layout = SuffixLayout.build(offsets, 24, num_suffix)
    num_targets = layout.num_targets() if num_suffix else None
    expected = valid_pairs(layout.offsets, 12 + num_suffix, causal=True, num_targets=num_targets)
    assert self_attention_pairs(offsets[1:] - offsets[:-1], num_suffix) == expected


def _no_attention(monkeypatch):
    """Replace both attention kernels by FLOP-free stand-ins of the same output shape."""

    def zeros_like_output(q, k, v, *args, **kwargs):
        return v.new_zeros(q.shape[0], v.shape[1], v.shape[2]) + 0 * v.sum() + 0 * q.sum()

    monkeypatch.setattr("foundation.model.hstu.jagged_attention", zeros_like_output)
    monkeypatch.setattr("foundation.model.sasrec.jagged_attention", zeros_like_output)
    monkeypatch.setattr("foundation.model.interformer.jagged_cross_attention", zeros_like_output)


CASES = {
    "ctr_wukong": ("ctr", {"generative": True, "in_batch_negatives": True}),
    "ctr_dcnv2": ("ctr", {"interaction": "dcnv2", "num_final_interaction_blocks": 2}),
    "ctr_plain": ("ctr", {"interleave": False, "target_aware": False}),
    "next_item_interleaved": ("next_item", {"in_batch_negatives": True}),
    "next_item_hstu": ("next_item", {"interleave": False, "num_cls": 0, "history_features": ()}),
    "next_item_per_position": ("next_item", {"negatives": "position"}),
    "next_item_sasrec": (
        "next_item", {"interleave": False, "num_cls": 0, "history_features": (), "sequence_block": "sasrec", "ffn_hidden": 24}
    ),
    "ctr_sasrec": ("ctr", {"sequence_block": "sasrec"}),
}


def _counted(case: str, monkeypatch, *, backward: bool):
    """``(FLOPs torch's counter saw, cfg, schema, batch)`` for one loss (and backward) of a case, attention-free."""
    task, changes = CASES[case]
    schema = CTR_SCHEMA if task == "ctr" else NEXT_ITEM_SCHEMA
    cfg = tiny_config(**changes)
    torch.manual_seed(0)
    model = build_teacher(cfg, schema)
    batch = make_batch(schema, LENGTHS)
    _no_attention(monkeypatch)
    counter = FlopCounterMode(display=False)
    with counter:
        loss = model.loss(batch, model(batch))["loss"]
        if backward:
            loss.backward()
    return counter.get_total_flops(), cfg, schema, batch


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_flops_match_torch_flop_counter(case, monkeypatch):
    counted, cfg, schema, batch = _counted(case, monkeypatch, backward=False)
    parts = teacher_flop_breakdown(cfg, schema, batch.offsets)
    dense = sum(v for k, v in parts.items() if k != "attention")
    assert counted == pytest.approx(dense, rel=1e-9)
    assert parts["attention"] > 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_step_dense_flops_match_torch_flop_counter(case, monkeypatch):
    """Forward + backward as the optimiser step needs it: every product's input and weight gradients, except
    the input gradient of layers fed by data."""
    counted, cfg, schema, batch = _counted(case, monkeypatch, backward=True)
    attention = teacher_flop_breakdown(cfg, schema, batch.offsets)["attention"]
    assert counted == pytest.approx(teacher_flops(cfg, schema, batch.offsets) - 3 * attention, rel=1e-9)
    assert (data_input_flops(cfg, schema, batch.batch_size) > 0) == (schema is CTR_SCHEMA)


def test_training_step_flops_weigh_backward():
    cfg = tiny_config()
    offsets = torch.tensor([0, 3, 3, 10])
    parts = teacher_flop_breakdown(cfg, CTR_SCHEMA, offsets)
    forward = sum(parts.values())
    assert teacher_flops(cfg, CTR_SCHEMA, offsets, training=False) == pytest.approx(forward)
    # Model FLOPs: attention's backward is 2x its forward too (the kernels' recomputed QKᵀ is not counted).
    assert teacher_flops(cfg, CTR_SCHEMA, offsets) == pytest.approx(
        3 * forward - data_input_flops(cfg, CTR_SCHEMA, 3)
    )
    longer = teacher_flops(cfg, CTR_SCHEMA, torch.tensor([0, 6, 6, 20]))
    assert longer > teacher_flops(cfg, CTR_SCHEMA, offsets)
    model = build_teacher(cfg, CTR_SCHEMA)
    assert model.flops(make_batch(CTR_SCHEMA, [3, 0, 7])) == teacher_flops(cfg, CTR_SCHEMA, offsets)


def test_peak_and_throughput_metrics(monkeypatch):
    assert peak_flops("NVIDIA H200", "bf16-mixed") == pytest.approx(989.4e12)
    assert peak_flops("Some CPU", "bf16-mixed") is None
    monkeypatch.setattr(teacher_flops_module.torch, "get_float32_matmul_precision", lambda: "highest")
    assert peak_flops("NVIDIA H200", "32-true") == pytest.approx(66.9e12)
    metrics = throughput_metrics(flops=2e12, tokens=1000, seconds=0.5, peak=4e12)
    assert metrics == pytest.approx({"tokens_per_s": 2000.0, "tflops_per_s": 4.0, "mfu": 1.0})
    assert "mfu" not in throughput_metrics(1.0, 1, 1.0, None)
