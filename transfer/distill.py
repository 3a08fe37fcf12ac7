"""Distillation losses and heads: standard KD, ExFM's auxiliary head (AH) and student adapter (SA).

All functions work on one task at a time: ``[B]`` logits, ``[B]`` labels and ``[B]`` bool masks
(absent labels are masked, never zero-filled, as in :func:`foundation.model.outputs.masked_bce`).
Teacher targets come from :mod:`transfer.teacher_outputs` (``{task}_logit`` / ``{task}_prob``).

ExFM (arXiv 2502.17494), with ``h`` the BCE:

- AH: ``L = h(ŷ_serve, y) + w · h(ŷ_distill, min(α · ŷ_teacher, 1))``. The serving head sees only
  true labels, the distillation head only teacher labels, and the distillation head's gradient into
  the shared trunk is scaled by ``β`` (:func:`scale_grad`), so stale or biased teacher labels cannot
  dominate the trunk.
- SA: ``ŷ_SA = MLP(ŷ_teacher)`` is trained on fresh true labels; its stop-gradient output is a second
  target for the distillation head, correcting the teacher for drift since it was trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from foundation.model.baseline import build_mlp
from foundation.model.outputs import masked_bce


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the incoming gradient by ``scale`` on the way back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged in the forward pass; its gradient is multiplied by ``scale`` (0 stops it)."""
    return _ScaleGrad.apply(x, scale)


def soft_bce(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean BCE of ``logits[B]`` against probabilities ``targets[B]`` in ``[0, 1]`` over ``mask`` rows.

    The targets are detached: a distillation target is never trained through the student's loss.
    """
    mask = torch.ones_like(logits, dtype=torch.bool) if mask is None else mask
    return masked_bce(logits, targets.detach().to(logits.dtype), mask)


@dataclass
class KDConfig:
    """Standard KD: ``(1 - weight) · h(s, y) + weight · T² · h(s / T, σ(t / T))``.

    ``T²`` keeps the distillation gradient's scale independent of the temperature (Hinton et al.).
    """

    weight: float = 0.5
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"kd.weight must be in [0, 1], got {self.weight}")
        if self.temperature <= 0:
            raise ValueError(f"kd.temperature must be positive, got {self.temperature}")


def kd_loss(
    student_logit: torch.Tensor,
    teacher_logit: torch.Tensor,
    label: torch.Tensor,
    label_mask: torch.Tensor,
    cfg: KDConfig,
    teacher_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``{"loss", "loss_true", "loss_kd"}`` for one task; all inputs ``[B]``.

    ``teacher_mask`` marks rows that have a teacher prediction (default: all).
    """
    t = cfg.temperature
    true = masked_bce(student_logit, label, label_mask)
    soft = soft_bce(student_logit / t, torch.sigmoid(teacher_logit / t), teacher_mask) * t * t
    return {"loss": (1 - cfg.weight) * true + cfg.weight * soft, "loss_true": true, "loss_kd": soft}


@dataclass
class AuxHeadConfig:
    """ExFM auxiliary head: label scale ``alpha`` (target ``min(α·p_teacher, 1)``), loss weight
    ``weight`` (w) and the gradient scale ``beta`` (β) on what the distillation head sends into the trunk."""

    alpha: float = 1.0
    weight: float = 1.0
    beta: float = 1.0

    def __post_init__(self) -> None:
        if self.alpha <= 0 or self.weight < 0 or self.beta < 0:
            raise ValueError(f"aux head needs alpha > 0, weight >= 0, beta >= 0; got {self}")


class AuxiliaryHeads(nn.Module):
    """A serving head and a distillation head on the same trunk features.

    ``forward(trunk[B, in_dim]) -> (serve[B, out_dim], distill[B, out_dim])``. Only the serving head is
    used at inference; the distillation head's input goes through :func:`scale_grad` with ``β``.
    """

    def __init__(self, in_dim: int, out_dim: int, cfg: AuxHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.serve = nn.Linear(in_dim, out_dim)
        self.distill = nn.Linear(in_dim, out_dim)

    def forward(self, trunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.serve(trunk), self.distill(scale_grad(trunk, self.cfg.beta))


def scaled_teacher_target(teacher_prob: torch.Tensor, alpha: float) -> torch.Tensor:
    """``min(α · p_teacher, 1)``: ExFM's label scaling (α > 1 lifts a teacher that under-predicts)."""
    return (alpha * teacher_prob).clamp(max=1.0)


def aux_head_loss(
    serve_logit: torch.Tensor,
    distill_logit: torch.Tensor,
    teacher_prob: torch.Tensor,
    label: torch.Tensor,
    label_mask: torch.Tensor,
    cfg: AuxHeadConfig,
    teacher_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``{"loss", "loss_serve", "loss_distill"}`` for one task; all inputs ``[B]``.

    The serving logit meets only true labels and the distillation logit only the teacher's, so the
    serving head's parameters never receive a teacher-label gradient.
    """
    serve = masked_bce(serve_logit, label, label_mask)
    distill = soft_bce(distill_logit, scaled_teacher_target(teacher_prob, cfg.alpha), teacher_mask)
    return {"loss": serve + cfg.weight * distill, "loss_serve": serve, "loss_distill": distill}


@dataclass
class AdapterConfig:
    """Student adapter: an MLP of ``hidden`` widths on the teacher logit; ``weight`` scales its target's loss."""

    hidden: tuple[int, ...] = (16,)
    weight: float = 1.0


class StudentAdapter(nn.Module):
    """``forward(teacher_logit[B]) -> adapted logit[B]``, a residual MLP: ``t + MLP(t)``.

    The MLP's last layer starts at zero, so an untrained adapter returns the teacher unchanged and
    fresh labels only have to learn the correction.
    """

    def __init__(self, cfg: AdapterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.mlp = build_mlp([1, *cfg.hidden, 1], last_activation=False)
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)

    def forward(self, teacher_logit: torch.Tensor) -> torch.Tensor:
        return teacher_logit + self.mlp(teacher_logit.unsqueeze(-1)).squeeze(-1)


def adapter_loss(
    adapter: StudentAdapter, teacher_logit: torch.Tensor, label: torch.Tensor, label_mask: torch.Tensor
) -> torch.Tensor:
    """BCE of the adapter on fresh true labels: the only loss the adapter's parameters learn from."""
    return masked_bce(adapter(teacher_logit.detach()), label, label_mask)


def adapter_target(adapter: StudentAdapter, teacher_logit: torch.Tensor) -> torch.Tensor:
    """``sg(σ(ŷ_SA))[B]``: the adapter's probability as a distillation target, with no gradient path."""
    with torch.no_grad():
        return torch.sigmoid(adapter(teacher_logit.detach()))


def adapter_distill_loss(
    distill_logit: torch.Tensor,
    adapter: StudentAdapter,
    teacher_logit: torch.Tensor,
    teacher_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``adapter.cfg.weight · h(ŷ_distill, sg(ŷ_SA))``: the adapter's output as the student's second target."""
    return adapter.cfg.weight * soft_bce(distill_logit, adapter_target(adapter, teacher_logit), teacher_mask)

