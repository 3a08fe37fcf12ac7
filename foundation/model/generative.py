"""Generative next-item objective: autoregressive targets and sampled softmax on L2-normalised embeddings.

As in HSTU's ML-1M recipe: every history position predicts the next item, logits are cosine
similarities divided by a temperature, and negatives are sampled uniformly from the catalogue
(optionally plus the batch's candidates, "in-batch" negatives). Negatives that happen to equal the
target are masked out rather than counted as wrong.

Two ways to draw the uniform negatives (``TeacherConfig.negatives``):

- ``"batch"``: ``K`` ids drawn once per batch and shared by every position. Their ``[K, e]`` rows are
  normalised once and scored by one GEMM ``[P, e] @ [e, K]``; nothing of size ``P x K x e`` exists.
- ``"position"``: ``K`` ids per position (HSTU's ``LocalNegativesSampler`` draws this way). Their
  ``[P, K, e]`` rows come from the item table; :class:`PositionCosine` scores them without
  materialising a normalised copy (backward: one ``[P, K, e]`` gradient, which the table needs anyway).

The loss runs in float32 whatever the autocast state: logits are cosines divided by a temperature of
about 0.05, which multiplies a bf16 rounding of the cosine twentyfold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from foundation.model.jagged import token_rows

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=-1, eps=L2_EPS)


def next_item_targets(
    item_ids: torch.Tensor, offsets: torch.Tensor, candidate: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive targets for every history token.

    Token ``i`` of a row predicts the row's item ``i + 1``; the row's last token predicts
    ``candidate`` (next_item data, where the candidate is the next item), or nothing when
    ``candidate`` is None (ctr data, where the candidate is only an impression).

    Args:
        item_ids: ``[L]`` history item ids.
        offsets: ``[B+1]``.
        candidate: ``[B]`` or None.

    Returns:
        ``(targets[L] int64, valid[L] bool)``.
    """
    num_tokens = item_ids.numel()
    rows = token_rows(offsets, num_tokens)
    is_last = torch.arange(num_tokens, device=item_ids.device) == (offsets[1:] - 1)[rows]
    targets = item_ids.roll(-1) if num_tokens else item_ids
    if candidate is None:
        return targets, ~is_last
    return torch.where(is_last, candidate[rows], targets), torch.ones_like(is_last)


class PositionCosine(torch.autograd.Function):
    """``cos[p, k] = q[p] . v[p, k] / max(|v[p, k]|, eps)`` for unnormalised ``v[P, K, e]`` and unit ``q[P, e]``.

    Equal to ``einsum("pe,pke->pk", q, l2_normalize(v))`` without the normalised ``[P, K, e]`` copy
    (and the copies of its autograd graph); the backward writes the one ``[P, K, e]`` gradient of ``v``.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dots = torch.bmm(v, q[:, :, None])[:, :, 0]
        norms = torch.linalg.vector_norm(v, dim=-1)
        ctx.save_for_backward(q, v, dots, norms)
        return dots / norms.clamp_min(L2_EPS)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, v, dots, norms = ctx.saved_tensors
        clamped = norms.clamp_min(L2_EPS)
        per_dot = grad / clamped  # d cos / d dot
        grad_q = torch.bmm(per_dot[:, None, :], v)[:, 0]
        grad_v = torch.bmm(per_dot[:, :, None], q[:, None, :])
        # Through the norm, only where it is not clamped: d(1/|v|)/dv = -v / |v|^3.
        per_v = torch.where(norms > L2_EPS, -grad * dots / (clamped * clamped * clamped), 0.0)
        grad_v.addcmul_(v, per_v[:, :, None])
        return grad_q, grad_v


def masked_logits(logits: torch.Tensor, negative_ids: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """``-inf`` where a negative is the position's own target (an accidental hit), ``logits`` elsewhere.

    ``negative_ids`` is ``[K]`` (shared) or ``[P, K]`` (per position); ``logits`` and the result ``[P, K]``.
    """
    ids = negative_ids[None, :] if negative_ids.dim() == 1 else negative_ids
    return logits.masked_fill(ids == target_ids[:, None], float("-inf"))


def sampled_softmax_loss(
    queries: torch.Tensor,
    target_ids: torch.Tensor,
    target_vectors: torch.Tensor,
    temperature: float,
    *,
    shared_ids: torch.Tensor | None = None,
    shared_vectors: torch.Tensor | None = None,
    shared_valid: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    position_vectors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-position sampled softmax loss ``[P]``: ``logsumexp(positive, negatives) - positive`` in float32.

    Args:
        queries: ``[P, e]`` L2-normalised queries.
        target_ids, target_vectors: ``[P]``, ``[P, e]`` each position's positive (a raw item-table row).
        temperature: logits are ``cos / temperature``.
        shared_ids, shared_vectors: ``[M]``, ``[M, e]`` raw rows every position scores against (the batch's
            shared uniform negatives and/or its candidates), or None.
        shared_valid: ``[M]`` bool, False for shared rows no position may score against (a padding row's
            candidate), or None (all valid).
        position_ids, position_vectors: ``[P, K]``, ``[P, K, e]`` raw rows of per-position negatives, or None.
    """
    device_type = queries.device.type
    with torch.autocast(device_type, enabled=False):
        queries = queries.float()
        positive = (queries * l2_normalize(target_vectors.float())).sum(-1) / temperature
        terms = [positive]
        if shared_ids is not None:
            logits = masked_logits(queries @ l2_normalize(shared_vectors.float()).T / temperature, shared_ids, target_ids)
            if shared_valid is not None:
                logits = logits.masked_fill(~shared_valid, float("-inf"))
            terms.append(torch.logsumexp(logits, dim=1))
        if position_ids is not None:
            cosine = PositionCosine.apply(queries, position_vectors.float())
            terms.append(torch.logsumexp(masked_logits(cosine / temperature, position_ids, target_ids), dim=1))
        return torch.logsumexp(torch.stack(terms), dim=0) - positive
