"""Balanced batches across data-parallel ranks: even out attention work, not row counts.

A rank's step time is dominated by jagged attention, whose work grows with the square of each
sequence's length, plus per-token work (projections, FFNs). Cutting a global batch into contiguous
slices of equal row count can leave one rank with all the long histories while the others wait at
the gradient reduction. :func:`balance_rows` assigns rows greedily, heaviest first, to the
least-loaded rank (LPT scheduling: within 4/3 of the optimal makespan), and
:func:`imbalance_ratio` is the heaviest-rank / mean work figure to log.

Ranks then hold different row counts: a per-rank mean loss would weigh rows unequally, so train
with each rank's loss summed over its rows and divided by the global row count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BalanceConfig:
    """Work model of one row: ``length + attention_weight * length**2``.

    Attributes:
        attention_weight: attention cost of one (query, key) pair relative to one token's
            non-attention cost; about ``attn_dim / (layer FLOPs per token / d_model)``, i.e. small
            for wide models with short histories and near 1 when attention dominates.
    """

    attention_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.attention_weight < 0:
            raise ValueError(f"balance.attention_weight must be >= 0, got {self.attention_weight}")


def row_work(lengths: torch.Tensor, cfg: BalanceConfig) -> torch.Tensor:
    """``lengths[B]`` history lengths -> ``[B]`` float64 estimated work per row."""
    n = lengths.to(torch.float64)
    return n + cfg.attention_weight * n * n


def balance_rows(
    lengths: torch.Tensor, num_ranks: int, cfg: BalanceConfig | None = None
) -> list[torch.Tensor]:
    """Split rows ``0..B-1`` into ``num_ranks`` groups of near-equal work; returns sorted row indices per rank.

    Deterministic (ties go to the lower row, then the lower rank), so every rank computes the same
    assignment from the same global batch without communicating.
    """
    cfg = cfg or BalanceConfig()
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    if lengths.numel() < num_ranks:
        raise ValueError(f"cannot give each of {num_ranks} ranks a row: the batch has {lengths.numel()} rows")
    work = row_work(lengths, cfg)
    # Stable sort on -work: heaviest first, lower row index first among equals.
    order = torch.sort(-work, stable=True).indices.tolist()
    load = [0.0] * num_ranks
    rows: list[list[int]] = [[] for _ in range(num_ranks)]
    for row in order:
        # Least-loaded rank; among equally loaded ones the one with fewer rows, then the lower rank,
        # so that rows of zero work still spread out and no rank ends up empty.
        rank = min(range(num_ranks), key=lambda r: (load[r], len(rows[r]), r))
        rows[rank].append(row)
        load[rank] += float(work[row])
    return [torch.tensor(sorted(r), dtype=torch.int64) for r in rows]


def imbalance_ratio(
    lengths: torch.Tensor, groups: list[torch.Tensor], cfg: BalanceConfig | None = None
) -> float:
    """Heaviest rank's work over the mean rank's work (1.0 is perfect balance)."""
    work = row_work(lengths, cfg or BalanceConfig())
    per_rank = torch.stack([work[g].sum() for g in groups])
    mean = per_rank.mean()
    return float(per_rank.max() / mean) if mean > 0 else 1.0


@dataclass
class RankShare:
    """One data-parallel rank's part of a global batch.

    Attributes:
        rows: ``[R]`` row indices of the global batch this rank trains on.
        loss_weight: ``dp * R_real / B``: a per-rank mean loss times this, averaged over ranks by
            the gradient reduction, is the mean over the global batch's rows (0 for a padding row).
        imbalance: heaviest rank's work over the mean rank's work for this batch.
    """

    rows: torch.Tensor
    loss_weight: float
    imbalance: float


def rank_share(lengths: torch.Tensor, num_ranks: int, rank: int, cfg: BalanceConfig | None = None) -> RankShare:
    """``lengths[B]`` of the global batch -> this ``rank``'s balanced :class:`RankShare`.

    A global batch with fewer rows than ranks (the last of an epoch) leaves some ranks without a
    row: they train on row 0 with weight 0, so every rank still runs the step's collectives.
    """
    cfg = cfg or BalanceConfig()
    total = lengths.numel()
    if total >= num_ranks:
        groups = balance_rows(lengths, num_ranks, cfg)
    else:
        groups = [torch.tensor([r]) if r < total else torch.zeros(0, dtype=torch.int64) for r in range(num_ranks)]
    mine = groups[rank]
    ratio = imbalance_ratio(lengths, groups, cfg)
    if mine.numel() == 0:
        return RankShare(torch.zeros(1, dtype=torch.int64), 0.0, ratio)
    return RankShare(mine, num_ranks * mine.numel() / total, ratio)
