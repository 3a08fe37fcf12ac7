"""Evaluation metrics: NE, AUC, calibration for binary tasks; HR@K, NDCG@K, MRR for next-item ranking.

All functions take CPU or GPU tensors and compute in float64 on the CPU, so results do not depend
on the batch split or the device. Accumulators keep every prediction (or rank) and compute from the
concatenation, so streaming over many batches gives exactly the one-shot result, AUC included.

Binary metrics (``probs[S]`` in [0, 1], ``labels[S]`` in {0, 1}, optional ``mask[S]`` bool — False
means the label is absent and the example is ignored — and ``weights[S] >= 0``):

- ``logloss`` = ``-Σ w (y log p + (1-y) log(1-p)) / Σ w`` with ``p`` clamped to ``[eps, 1-eps]``;
- ``ne`` (normalized entropy) = ``logloss / H(b)``, the logloss of the constant predictor of the
  base rate ``b = Σ w y / Σ w``. When ``b`` is 0 or 1, ``H(b) = 0`` and every predictor's NE would be
  ``x / 0``; NE is then reported as nan (undefined), not inf, since there is nothing to normalise by;
- ``auc`` = P(score of a positive > score of a negative) + ½ P(tie), weighted by ``w_pos·w_neg``
  (Mann–Whitney with average ranks for unit weights); nan unless both classes are present;
- ``calibration`` = ``Σ w p / Σ w y``; nan without positives;
- ``count`` (unmasked examples), ``base_rate``.

Every metric is nan when no example is left after masking (and ``count`` is 0).

Ranking (full ranking over the catalogue): see :func:`target_ranks` for how candidates, the user's
history and ties are treated.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from foundation.data.schema import TASKS

if TYPE_CHECKING:
    from foundation.data.batch import JaggedBatch

EPS = 1e-7
"""Probability clamp for logloss. Predictions usually arrive as float32, whose spacing just below 1
is 6e-8, so a finer clamp would not change ``1 - p`` for any float32 ``p`` short of 1."""

BINARY_KEYS = ("ne", "auc", "calibration", "logloss", "count", "base_rate")

NAN = float("nan")


def _flat(x: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(x).detach().reshape(-1).to("cpu", torch.float64)


def _flat_mask(mask: torch.Tensor | None, size: int, what: str) -> torch.Tensor:
    if mask is None:
        return torch.ones(size, dtype=torch.bool)
    m = torch.as_tensor(mask).detach().reshape(-1).to("cpu", torch.bool)
    if m.numel() != size:
        raise ValueError(f"mask and {what} differ in size: {m.numel()} vs {size}")
    return m


def _prepare(
    probs: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None,
    weights: torch.Tensor | None,
    *,
    probabilities: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked float64 ``(probs[S'], labels[S'], weights[S'])`` of the unmasked examples.

    ``probabilities=False`` accepts any finite-or-infinite scores instead of values in [0, 1].
    """
    p, y = _flat(probs), _flat(labels)
    if p.shape != y.shape:
        raise ValueError(f"predictions and labels differ in size: {p.numel()} vs {y.numel()}")
    w = torch.ones_like(p) if weights is None else _flat(weights)
    if w.shape != p.shape:
        raise ValueError(f"weights and predictions differ in size: {w.numel()} vs {p.numel()}")
    m = _flat_mask(mask, p.numel(), "predictions")
    p, y, w = p[m], y[m], w[m]
    # Checked after masking: absent labels are often stored as a filler value.
    if probabilities and not bool(((p >= 0) & (p <= 1)).all()):
        raise ValueError("probs must lie in [0, 1] (NaN found or out of range); pass probabilities, not logits")
    if bool(torch.isnan(p).any()):
        raise ValueError("scores contain NaN")
    if not bool(((y == 0) | (y == 1)).all()):
        raise ValueError("labels must be 0 or 1 where the mask is set")
    if not bool((torch.isfinite(w) & (w >= 0)).all()):
        raise ValueError("weights must be finite and non-negative")
    return p, y, w


def _binary_entropy(b: float) -> float:
    if b <= 0.0 or b >= 1.0:
        return 0.0
    return -(b * math.log(b) + (1.0 - b) * math.log(1.0 - b))


def _log_loss(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> float:
    total = float(w.sum())
    if total == 0:
        return NAN
    p = p.clamp(eps, 1.0 - eps)
    # Summed per class and then weighted, as the entropy below is: a constant predictor equal to
    # the base rate then gives NE == 1 up to the rounding of the two sums.
    pos = float((w * y * torch.log(p)).sum())
    neg = float((w * (1 - y) * torch.log1p(-p)).sum())
    return -(pos + neg) / total


def _auc(s: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    w_pos, w_neg = w * y, w * (1 - y)
    total_pos, total_neg = float(w_pos.sum()), float(w_neg.sum())
    if total_pos == 0 or total_neg == 0:
        return NAN
    order = torch.argsort(s)
    s, w_pos, w_neg = s[order], w_pos[order], w_neg[order]
    # One bucket per distinct score: a positive beats every negative in lower buckets and ties
    # half of those in its own, which is the average-rank (Mann–Whitney) treatment of ties.
    _, group = torch.unique_consecutive(s, return_inverse=True)
    n_groups = int(group[-1]) + 1
    pos_g = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, w_pos)
    neg_g = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, w_neg)
    neg_below = torch.cumsum(neg_g, 0) - neg_g
    return float((pos_g * (neg_below + 0.5 * neg_g)).sum()) / (total_pos * total_neg)


def _binary_from_prepared(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> dict[str, float]:
    total = float(w.sum())
    positives = float((w * y).sum())
    base_rate = positives / total if total > 0 else NAN
    logloss = _log_loss(p, y, w, eps)
    entropy = _binary_entropy(base_rate) if total > 0 else 0.0
    return {
        "ne": logloss / entropy if entropy > 0 else NAN,
        "auc": _auc(p, y, w),
        "calibration": float((w * p).sum()) / positives if positives > 0 else NAN,
        "logloss": logloss,
        "count": int(p.numel()),
        "base_rate": base_rate,
    }


def binary_metrics(
    probs: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    *,
    eps: float = EPS,
) -> dict[str, float]:
    """All of :data:`BINARY_KEYS` for ``probs[S]``, ``labels[S]``, ``mask[S]``, ``weights[S]``."""
    return _binary_from_prepared(*_prepare(probs, labels, mask, weights), eps)


def log_loss(probs, labels, mask=None, weights=None, *, eps: float = EPS) -> float:
    """Weighted mean binary cross-entropy of ``probs[S]`` against ``labels[S]``; nan when empty."""
    return _log_loss(*_prepare(probs, labels, mask, weights), eps)


def normalized_entropy(probs, labels, mask=None, weights=None, *, eps: float = EPS) -> float:
    """NE = logloss / entropy of the base rate; nan when the base rate is 0 or 1 or nothing is left."""
    return binary_metrics(probs, labels, mask, weights, eps=eps)["ne"]


def auc(scores, labels, mask=None, weights=None) -> float:
    """Exact ROC AUC of ``scores[S]`` (any real values) with ties at ½; nan unless both classes occur."""
    return _auc(*_prepare(scores, labels, mask, weights, probabilities=False))


def calibration(probs, labels, mask=None, weights=None) -> float:
    """``Σ w p / Σ w y`` over ``probs[S]``, ``labels[S]``: 1 is calibrated; nan without positives."""
    p, y, w = _prepare(probs, labels, mask, weights)
    positives = float((w * y).sum())
    return float((w * p).sum()) / positives if positives > 0 else NAN


def compute_grouped(
    probs: torch.Tensor,
    labels: torch.Tensor,
    groups: torch.Tensor,
    mask: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    *,
    eps: float = EPS,
) -> dict[int, dict[str, float]]:
    """:func:`binary_metrics` separately for each group id in ``groups[S]`` (e.g. the domain).

    Groups whose examples are all masked are absent from the result; each group's NE is normalised
    by that group's own base rate.
    """
    g = torch.as_tensor(groups).detach().reshape(-1).to("cpu", torch.int64)
    keep = _flat_mask(mask, g.numel(), "groups")
    p, y, w = _prepare(probs, labels, keep, weights)
    g = g[keep]
    return {int(k): _binary_from_prepared(p[g == k], y[g == k], w[g == k], eps) for k in torch.unique(g).tolist()}


class BinaryMetrics:
    """Streaming :func:`binary_metrics` over many batches; exact because every example is kept.

    Memory: 24 bytes per unmasked example (float64 prob, label, weight) on the CPU.
    """

    def __init__(self, *, eps: float = EPS) -> None:
        self.eps = eps
        self.reset()

    def reset(self) -> None:
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def update(
        self,
        probs: torch.Tensor,
        labels: torch.Tensor,
        mask: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Add ``probs[S]``, ``labels[S]`` with optional ``mask[S]`` (False = absent) and ``weights[S]``."""
        self._parts.append(_prepare(probs, labels, mask, weights))

    def merge(self, other: BinaryMetrics) -> None:
        """Add everything ``other`` has seen (e.g. another rank's accumulator, gathered by the caller)."""
        self._parts.extend(other._parts)

    def _state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._parts:
            empty = torch.zeros(0, dtype=torch.float64)
            return empty, empty, empty
        p, y, w = (torch.cat(parts) for parts in zip(*self._parts, strict=True))
        # Keep one tensor per field so repeated compute() calls do not re-concatenate.
        self._parts = [(p, y, w)]
        return p, y, w

    def compute(self) -> dict[str, float]:
        """``{ne, auc, calibration, logloss, count, base_rate}`` over all updates so far."""
        return _binary_from_prepared(*self._state(), self.eps)


class GroupedBinaryMetrics:
    """Streaming binary metrics keyed by ``(task, domain)``, plus each task pooled over domains.

    ``compute()`` returns ``{(task, domain): metrics}``; ``compute_flat()`` returns MLflow-ready
    ``{"<task>/d<domain>/<metric>": value}`` with ``"<task>/all/<metric>"`` for the pooled task.
    """

    def __init__(self, *, eps: float = EPS) -> None:
        self.eps = eps
        self.reset()

    def reset(self) -> None:
        self._by_task: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._metrics: dict[str, BinaryMetrics] = {}

    def update(
        self,
        task: str,
        probs: torch.Tensor,
        labels: torch.Tensor,
        domain: torch.Tensor,
        mask: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Add one batch of ``task``: ``probs[B]``, ``labels[B]``, ``domain[B]``, ``mask[B]``, ``weights[B]``."""
        d = torch.as_tensor(domain).detach().reshape(-1).to("cpu", torch.int64)
        keep = _flat_mask(mask, d.numel(), "domain")
        acc = self._metrics.setdefault(task, BinaryMetrics(eps=self.eps))
        acc.update(probs, labels, keep, weights)
        self._by_task.setdefault(task, []).append(d[keep])

    def merge(self, other: GroupedBinaryMetrics) -> None:
        for task, acc in other._metrics.items():
            self._metrics.setdefault(task, BinaryMetrics(eps=self.eps)).merge(acc)
            self._by_task.setdefault(task, []).extend(other._by_task[task])

    def compute(self) -> dict[tuple[str, int], dict[str, float]]:
        out: dict[tuple[str, int], dict[str, float]] = {}
        for task, acc in self._metrics.items():
            p, y, w = acc._state()
            d = torch.cat(self._by_task[task])
            self._by_task[task] = [d]
            for k in torch.unique(d).tolist():
                sel = d == k
                out[(task, int(k))] = _binary_from_prepared(p[sel], y[sel], w[sel], self.eps)
        return out

    def compute_flat(self) -> dict[str, float]:
        flat = {f"{task}/d{domain}/{k}": v for (task, domain), m in self.compute().items() for k, v in m.items()}
        for task, acc in self._metrics.items():
            flat.update({f"{task}/all/{k}": v for k, v in acc.compute().items()})
        return flat


def _history_mask(
    batch: int,
    columns: int,
    first: int,
    targets: torch.Tensor,
    history_values: torch.Tensor | None,
    history_offsets: torch.Tensor | None,
) -> torch.Tensor:
    """``[B, columns]`` bool: items ``first .. first+columns-1`` in each row's history, bar its target."""
    mask = torch.zeros(batch, columns, dtype=torch.bool, device=targets.device)
    if history_values is None:
        return mask
    lengths = (history_offsets[1:] - history_offsets[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(batch, device=targets.device), lengths)
    cols = history_values.long() - first
    inside = (cols >= 0) & (cols < columns)
    mask[rows[inside], cols[inside]] = True
    hit = (targets >= first) & (targets < first + columns)
    # A re-consumed target stays a candidate: masking it would make the hit impossible.
    mask[torch.arange(batch, device=targets.device)[hit], (targets - first)[hit]] = False
    return mask


def _check_ranking_inputs(num_items, targets, history_values, history_offsets, valid_items):
    batch = targets.numel()
    if targets.dim() != 1:
        raise ValueError(f"targets must be [B], got shape {tuple(targets.shape)}")
    if batch and not bool(((targets >= 0) & (targets < num_items)).all()):
        raise ValueError(f"targets must be item ids in [0, {num_items})")
    if valid_items is not None:
        if valid_items.dtype != torch.bool or valid_items.shape != (num_items,):
            raise ValueError(f"valid_items must be bool [{num_items}], got {valid_items.dtype} {tuple(valid_items.shape)}")
        if batch and not bool(valid_items[targets].all()):
            raise ValueError("a target is not a valid item (valid_items is False for it)")
    if (history_values is None) != (history_offsets is None):
        raise ValueError("pass history_values and history_offsets together")
    if history_values is not None:
        if history_offsets.shape != (batch + 1,) or int(history_offsets[-1]) != history_values.numel():
            raise ValueError(
                f"history_offsets must be [B+1] = [{batch + 1}] ending at len(history_values) = "
                f"{history_values.numel()}, got shape {tuple(history_offsets.shape)}"
            )
        if history_values.numel() and not bool(((history_values >= 0) & (history_values < num_items)).all()):
            raise ValueError(f"history item ids must be in [0, {num_items})")


def _count_at_or_above(
    scores: torch.Tensor,
    first: int,
    target_scores: torch.Tensor,
    targets: torch.Tensor,
    history_values: torch.Tensor | None,
    history_offsets: torch.Tensor | None,
    valid_items: torch.Tensor | None,
) -> torch.Tensor:
    """``[B]`` candidates among columns ``first ..`` of ``scores[B, C]`` scoring ``>=`` the target."""
    batch, columns = scores.shape
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores contain NaN")
    candidate = ~_history_mask(batch, columns, first, targets, history_values, history_offsets)
    if valid_items is not None:
        candidate &= valid_items[first : first + columns].unsqueeze(0)
    item = torch.arange(first, first + columns, device=scores.device)
    candidate &= item.unsqueeze(0) != targets.unsqueeze(1)
    return ((scores >= target_scores.unsqueeze(1)) & candidate).sum(dim=1)


def target_ranks(
    scores: torch.Tensor,
    targets: torch.Tensor,
    history_values: torch.Tensor | None = None,
    history_offsets: torch.Tensor | None = None,
    *,
    valid_items: torch.Tensor | None = None,
) -> torch.Tensor:
    """0-based rank ``[B]`` int64 of each target among all candidate items (full ranking).

    Args:
        scores: ``[B, N]`` score of every item id ``0 .. N-1`` for each row (higher is better).
        targets: ``[B]`` the held-out item of each row.
        history_values: ``[L]`` item ids of the rows' histories, jagged by ``history_offsets[B+1]``.
        valid_items: ``[N]`` bool, False for ids that are not items (padding id 0, ids never used).

    Candidates of a row are the valid items not in its history (the HSTU protocol removes the
    user's history from the candidates). If the target itself is in the history (a re-consumed
    item), it stays a candidate; it is never masked away, since that would make a hit impossible.

    The rank counts candidates other than the target whose score is ``>=`` the target's: ties go
    against the target, so a model that scores everything equally gets the worst rank, not the
    best, and the result does not depend on the sort order of equal scores.
    """
    if scores.dim() != 2 or scores.shape[0] != targets.numel():
        raise ValueError(f"scores must be [B, N] with B = len(targets), got {tuple(scores.shape)}")
    targets = targets.long()
    _check_ranking_inputs(scores.shape[1], targets, history_values, history_offsets, valid_items)
    target_scores = scores.gather(1, targets.unsqueeze(1)).squeeze(1)
    return _count_at_or_above(scores, 0, target_scores, targets, history_values, history_offsets, valid_items)


def _score_chunk(score_fn: Callable[[int, int], torch.Tensor], first: int, stop: int, batch: int) -> torch.Tensor:
    chunk = score_fn(first, stop)
    if chunk.shape != (batch, stop - first):
        raise ValueError(f"score_fn({first}, {stop}) returned {tuple(chunk.shape)}, expected {(batch, stop - first)}")
    return chunk


def target_ranks_chunked(
    score_fn: Callable[[int, int], torch.Tensor],
    num_items: int,
    targets: torch.Tensor,
    history_values: torch.Tensor | None = None,
    history_offsets: torch.Tensor | None = None,
    *,
    valid_items: torch.Tensor | None = None,
    chunk_size: int = 65536,
) -> torch.Tensor:
    """:func:`target_ranks` for catalogues too large for one ``[B, N]`` score matrix.

    ``score_fn(start, stop)`` returns ``scores[B, stop-start]`` for items ``start .. stop-1`` and must
    be deterministic. The target scores are taken from the same chunked calls that are ranked
    (a first pass over the chunks that hold a target), never from a separate dot product, whose
    rounding could differ and break ties the wrong way.
    """
    targets = targets.long()
    _check_ranking_inputs(num_items, targets, history_values, history_offsets, valid_items)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    batch = targets.numel()
    target_scores: torch.Tensor | None = None
    for start in torch.unique(targets // chunk_size).tolist():
        first = start * chunk_size
        chunk = _score_chunk(score_fn, first, min(first + chunk_size, num_items), batch)
        here = (targets >= first) & (targets < first + chunk_size)
        picked = chunk.gather(1, (targets - first).clamp(0, chunk.shape[1] - 1).unsqueeze(1)).squeeze(1)
        if target_scores is None:
            target_scores = torch.empty(batch, dtype=chunk.dtype, device=chunk.device)
        target_scores[here] = picked[here]
    ranks = torch.zeros(batch, dtype=torch.int64, device=targets.device)
    if target_scores is None:
        return ranks
    for first in range(0, num_items, chunk_size):
        chunk = _score_chunk(score_fn, first, min(first + chunk_size, num_items), batch)
        ranks += _count_at_or_above(chunk, first, target_scores, targets, history_values, history_offsets, valid_items)
    return ranks


def ranking_metrics(ranks: torch.Tensor, ks: Iterable[int] = (10, 50, 200)) -> dict[str, float]:
    """``hr<K>``, ``ndcg<K>`` (``hr10``: names MLflow accepts, the same in JSON and MLflow) for each K, ``mrr``
    and ``count`` from 0-based ``ranks[B]``.

    HR@K = mean 1[rank < K]; NDCG@K = mean 1[rank < K] / log2(rank + 2) (one relevant item, so the
    ideal DCG is 1); MRR = mean 1 / (rank + 1). nan when ``ranks`` is empty.
    """
    r = torch.as_tensor(ranks).detach().reshape(-1).to("cpu", torch.float64)
    out: dict[str, float] = {}
    for k in ks:
        if k < 1:
            raise ValueError(f"K must be positive, got {k}")
        hit = r < k
        out[f"hr{k}"] = float(hit.double().mean()) if r.numel() else NAN
        out[f"ndcg{k}"] = float((hit / torch.log2(r + 2)).mean()) if r.numel() else NAN
    out["mrr"] = float((1.0 / (r + 1)).mean()) if r.numel() else NAN
    out["count"] = int(r.numel())
    return out


class RankingMetrics:
    """Streaming HR@K / NDCG@K / MRR over batches of full-ranking evaluation; keeps every rank."""

    def __init__(self, ks: Iterable[int] = (10, 50, 200)) -> None:
        self.ks = tuple(ks)
        self.reset()

    def reset(self) -> None:
        self._ranks: list[torch.Tensor] = []

    def update(
        self,
        scores: torch.Tensor,
        targets: torch.Tensor,
        history_values: torch.Tensor | None = None,
        history_offsets: torch.Tensor | None = None,
        *,
        valid_items: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rank a batch (arguments as :func:`target_ranks`), record it and return ``ranks[B]``."""
        ranks = target_ranks(scores, targets, history_values, history_offsets, valid_items=valid_items)
        self.update_ranks(ranks)
        return ranks

    def update_ranks(self, ranks: torch.Tensor) -> None:
        """Record 0-based ``ranks[B]`` computed elsewhere (e.g. by :func:`target_ranks_chunked`)."""
        self._ranks.append(torch.as_tensor(ranks).detach().reshape(-1).to("cpu", torch.int64))

    def merge(self, other: RankingMetrics) -> None:
        self._ranks.extend(other._ranks)

    def compute(self) -> dict[str, float]:
        ranks = torch.cat(self._ranks) if self._ranks else torch.zeros(0, dtype=torch.int64)
        self._ranks = [ranks]
        return ranking_metrics(ranks, self.ks)


class PredictionLog:
    """Collects predictions per task and domain across batches, for exact metrics at the end."""

    def __init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = defaultdict(list)

    def add(self, batch: JaggedBatch, logits: dict[str, torch.Tensor]) -> None:
        self.rows["domain"].append(batch.domain.cpu())
        for task in TASKS:
            if task not in logits:
                continue
            self.rows[f"{task}/prob"].append(torch.sigmoid(logits[task].detach().float()).cpu())
            self.rows[f"{task}/label"].append(batch.labels[task].cpu())
            self.rows[f"{task}/mask"].append(batch.label_mask[task].cpu())
            if task in batch.oracle:
                self.rows[f"{task}/oracle"].append(batch.oracle[task].cpu())

    def metrics(self, num_domains: int, *, prefix: str = "") -> dict[str, float]:
        """``{f"{prefix}{task}/{metric}": v, f"{prefix}{task}/{metric}/d{k}": v_k, ...}``."""
        if not self.rows:
            return {}
        cat = {k: torch.cat(v) for k, v in self.rows.items()}
        out: dict[str, float] = {}
        for task in TASKS:
            if f"{task}/prob" not in cat:
                continue
            groups = {"": torch.ones_like(cat["domain"], dtype=torch.bool)}
            groups.update({f"/d{k}": cat["domain"] == k for k in range(num_domains)})
            for suffix, rows in groups.items():
                mask = cat[f"{task}/mask"] & rows
                for name, preds, keep in (
                    ("", cat[f"{task}/prob"], ("ne", "auc", "calibration", "logloss", "count", "base_rate")),
                    ("oracle_", cat.get(f"{task}/oracle"), ("ne", "auc")),
                ):
                    if preds is None:
                        continue
                    acc = BinaryMetrics()
                    acc.update(preds, cat[f"{task}/label"], mask)
                    for metric, value in acc.compute().items():
                        if metric in keep:
                            out[f"{prefix}{task}/{name}{metric}{suffix}"] = float(value)
        return out
