"""What every model in ``foundation.model`` returns, and the losses the harness trains on.

A model is an ``nn.Module`` with:

- ``forward(batch: JaggedBatch) -> ModelOutput``;
- ``loss(batch, out) -> dict[str, Tensor]`` whose ``"loss"`` entry is minimised (other entries are
  logged);
- for ``next_item`` datasets, ``score_items(batch) -> scores[B, num_items]`` for full ranking.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from foundation.data.batch import JaggedBatch


@dataclass
class ModelOutput:
    """Per-row predictions.

    Attributes:
        logits: task -> ``[B]``: the logit of the head that belongs to each row's own domain.
        user_repr: ``[B, d]``: a function of the user's history and user features only.
        item_repr: ``[B, d]``: a function of the candidate item only.
        extra: anything else a model exposes (e.g. next-item scores).
    """

    logits: dict[str, torch.Tensor]
    user_repr: torch.Tensor | None = None
    item_repr: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


def masked_bce(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean BCE over rows where ``mask`` is True; absent labels contribute nothing (never zero-filled).

    Returns 0 (with a gradient path) when no row has a label, so a batch without conversions is fine.
    """
    per_row = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    weight = mask.to(per_row.dtype)
    return (per_row * weight).sum() / weight.sum().clamp_min(1.0)


def multitask_bce(batch: JaggedBatch, out: ModelOutput, weights: dict[str, float]) -> dict[str, torch.Tensor]:
    """Weighted sum of masked BCE over the tasks a model predicts; each task's term is logged too."""
    terms = {
        f"loss_{task}": masked_bce(logit, batch.labels[task], batch.label_mask[task])
        for task, logit in out.logits.items()
    }
    total = sum(weights.get(name.removeprefix("loss_"), 1.0) * t for name, t in terms.items())
    return {"loss": total, **terms}
