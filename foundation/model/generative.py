"""Generative next-item objective: autoregressive targets and sampled softmax on L2-normalised embeddings.

As in HSTU's ML-1M recipe: every history position predicts the next item, logits are cosine
similarities divided by a temperature, and negatives are sampled uniformly from the catalogue
(optionally plus the batch's candidates, "in-batch" negatives). Negatives that happen to equal the
target are masked out rather than counted as wrong.
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


def sampled_softmax_loss(
    queries: torch.Tensor,
    target_ids: torch.Tensor,
    target_vectors: torch.Tensor,
    negative_ids: torch.Tensor,
    negative_vectors: torch.Tensor,
    temperature: float,
    shared_negative_ids: torch.Tensor | None = None,
    shared_negative_vectors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-position sampled softmax loss ``[N]`` (all vectors L2-normalised).

    Args:
        queries: ``[N, e]``.
        target_ids, target_vectors: ``[N]``, ``[N, e]``: the positive of each position.
        negative_ids, negative_vectors: ``[N, K]``, ``[N, K, e]``: per-position uniform negatives.
        temperature: logits are ``cos / temperature``.
        shared_negative_ids, shared_negative_vectors: ``[M]``, ``[M, e]`` negatives every position
            shares (the batch's candidates), or None.
    """
    positive = (queries * target_vectors).sum(-1, keepdim=True)
    negative = torch.einsum("ne,nke->nk", queries, negative_vectors)
    negative = negative.masked_fill(negative_ids == target_ids[:, None], float("-inf"))
    logits = [positive, negative]
    if shared_negative_ids is not None:
        shared = queries @ shared_negative_vectors.T
        logits.append(shared.masked_fill(shared_negative_ids[None, :] == target_ids[:, None], float("-inf")))
    logits = torch.cat(logits, dim=1) / temperature
    return torch.logsumexp(logits, dim=1) - logits[:, 0]
