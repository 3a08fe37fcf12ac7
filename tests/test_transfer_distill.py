"""Distillation losses: values, and above all where each gradient flows (KD, AH with β, SA with stop-gradient)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transfer.distill import (
    AdapterConfig,
    AuxHeadConfig,
    AuxiliaryHeads,
    KDConfig,
    StudentAdapter,
    adapter_distill_loss,
    adapter_loss,
    adapter_target,
    aux_head_loss,
    kd_loss,
    scale_grad,
    scaled_teacher_target,
)

B, D = 16, 5


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(B, D, generator=g),
        "label": (torch.rand(B, generator=g) < 0.4).float(),
        "mask": torch.rand(B, generator=g) < 0.8,
        "teacher_logit": torch.randn(B, generator=g),
    }


def _grads(params) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in params]


def test_scale_grad_is_identity_forward_and_scales_backward():
    x = torch.randn(4, 3, requires_grad=True)
    y = scale_grad(x, 0.25)
    assert torch.equal(y, x)
    (y * torch.arange(3.0)).sum().backward()
    torch.testing.assert_close(x.grad, 0.25 * torch.arange(3.0).expand(4, 3))
    x.grad = None
    scale_grad(x, 0.0).sum().backward()
    assert torch.count_nonzero(x.grad) == 0


def test_kd_loss_mixes_true_and_tempered_teacher_terms(data):
    s = torch.randn(B, requires_grad=True)
    cfg = KDConfig(weight=0.3, temperature=2.0)
    out = kd_loss(s, data["teacher_logit"], data["label"], data["mask"], cfg)
    m = data["mask"].float()
    true = (F.binary_cross_entropy_with_logits(s, data["label"], reduction="none") * m).sum() / m.sum()
    soft = F.binary_cross_entropy_with_logits(s / 2, torch.sigmoid(data["teacher_logit"] / 2)) * 4
    torch.testing.assert_close(out["loss"], 0.7 * true + 0.3 * soft)

    t = data["teacher_logit"].clone().requires_grad_()
    kd_loss(s, t, data["label"], data["mask"], cfg)["loss"].backward()
    assert t.grad is None, "the teacher is a target, never trained through the student's loss"
    with pytest.raises(ValueError, match="temperature"):
        KDConfig(temperature=0)


def test_kd_loss_is_minimised_by_the_teacher_when_weight_is_one(data):
    cfg = KDConfig(weight=1.0, temperature=3.0)
    at_teacher = kd_loss(data["teacher_logit"], data["teacher_logit"], data["label"], data["mask"], cfg)["loss"]
    shifted = kd_loss(data["teacher_logit"] + 0.5, data["teacher_logit"], data["label"], data["mask"], cfg)["loss"]
    assert at_teacher < shifted


def test_scaled_teacher_target_clips_at_one():
    p = torch.tensor([0.1, 0.4, 0.6, 0.9])
    torch.testing.assert_close(scaled_teacher_target(p, 2.0), torch.tensor([0.2, 0.8, 1.0, 1.0]))


def _ah_setup(data, beta: float):
    torch.manual_seed(0)
    trunk = nn.Linear(D, 8)
    heads = AuxiliaryHeads(8, 1, AuxHeadConfig(alpha=1.5, weight=0.7, beta=beta))
    serve, distill = heads(torch.relu(trunk(data["x"])))
    return trunk, heads, serve.squeeze(-1), distill.squeeze(-1)


def test_aux_head_routes_true_labels_to_serving_and_teacher_labels_to_distill_head(data):
    trunk, heads, serve, distill = _ah_setup(data, beta=0.3)
    teacher_prob = torch.sigmoid(data["teacher_logit"])
    losses = aux_head_loss(serve, distill, teacher_prob, data["label"], data["mask"], heads.cfg)
    torch.testing.assert_close(losses["loss"], losses["loss_serve"] + 0.7 * losses["loss_distill"])

    losses["loss_distill"].backward(retain_graph=True)
    assert all(p.grad is None for p in heads.serve.parameters()), "serving head got a teacher-label gradient"
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads.distill.parameters())

    heads.zero_grad(set_to_none=True)
    trunk.zero_grad(set_to_none=True)
    losses["loss_serve"].backward()
    assert all(p.grad is None for p in heads.distill.parameters()), "distill head got a true-label gradient"
    assert all(p.grad is not None for p in heads.serve.parameters())


def test_aux_head_trunk_gradient_from_distill_branch_is_beta_times_unscaled(data):
    teacher_prob = torch.sigmoid(data["teacher_logit"])
    trunk_grads = {}
    for beta in (1.0, 0.3, 0.0):
        trunk, heads, serve, distill = _ah_setup(data, beta)
        aux_head_loss(serve, distill, teacher_prob, data["label"], data["mask"], heads.cfg)["loss_distill"].backward()
        trunk_grads[beta] = _grads(trunk.parameters())
        # The distillation head's own gradient does not depend on β: only what it sends on is scaled.
        if beta == 1.0:
            head_grad = _grads(heads.distill.parameters())
        else:
            for a, b in zip(_grads(heads.distill.parameters()), head_grad, strict=True):
                torch.testing.assert_close(a, b)
    for beta in (0.3, 0.0):
        for scaled, unscaled in zip(trunk_grads[beta], trunk_grads[1.0], strict=True):
            torch.testing.assert_close(scaled, beta * unscaled)

    # The serving branch's gradient into the trunk is never scaled.
    trunk, heads, serve, distill = _ah_setup(data, beta=0.0)
    aux_head_loss(serve, distill, teacher_prob, data["label"], data["mask"], heads.cfg)["loss"].backward()
    total = _grads(trunk.parameters())
    trunk, heads, serve, _ = _ah_setup(data, beta=0.0)
    F.binary_cross_entropy_with_logits(serve, data["label"], weight=data["mask"].float(), reduction="sum").div(
        data["mask"].sum()
    ).backward()
    for a, b in zip(total, _grads(trunk.parameters()), strict=True):
        torch.testing.assert_close(a, b)


def test_adapter_starts_as_the_teacher_and_learns_only_from_true_labels(data):
    adapter = StudentAdapter(AdapterConfig(hidden=(8,)))
    torch.testing.assert_close(adapter(data["teacher_logit"]), data["teacher_logit"])

    teacher = data["teacher_logit"].clone().requires_grad_()
    adapter_loss(adapter, teacher, data["label"], data["mask"]).backward()
    assert teacher.grad is None
    assert all(p.grad is not None for p in adapter.parameters())

    # Fresh labels that disagree with a stale teacher move the adapter toward them.
    opt = torch.optim.Adam(adapter.parameters(), lr=0.05)
    stale = torch.full((64,), 2.0)
    fresh = torch.zeros(64)
    for _ in range(100):
        opt.zero_grad()
        adapter_loss(adapter, stale, fresh, torch.ones(64, dtype=torch.bool)).backward()
        opt.step()
    assert adapter_target(adapter, stale).mean() < 0.3 < torch.sigmoid(stale).mean()


def test_student_never_backprops_into_the_adapter(data):
    adapter = StudentAdapter(AdapterConfig(hidden=(8,), weight=0.5))
    nn.init.normal_(adapter.mlp[-1].weight)
    student = nn.Linear(D, 1)
    teacher = data["teacher_logit"].clone().requires_grad_()
    distill_logit = student(data["x"]).squeeze(-1)
    loss = adapter_distill_loss(distill_logit, adapter, teacher)
    loss.backward()
    assert all(p.grad is None for p in adapter.parameters()), "the student's loss trained the adapter"
    assert teacher.grad is None
    assert all(p.grad is not None for p in student.parameters())
    target = adapter_target(adapter, teacher)
    assert not target.requires_grad
    expected = 0.5 * F.binary_cross_entropy_with_logits(distill_logit.detach(), target)
    torch.testing.assert_close(loss.detach(), expected)
