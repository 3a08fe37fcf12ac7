"""Interaction arch for non-sequence feature tokens: Wukong (arXiv 2403.02545) or DCNv2.

Every block maps ``[B, n_in, d]`` tokens to ``[B, n_out, d]`` tokens, so blocks stack and the
choice of arch is a config switch (:func:`build_interaction_block`).
"""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import nn

from foundation.model.norms import FusedLayerNorm, autocast_dtype
from foundation.model.teacher_config import TeacherConfig


class TokenMix(nn.Module):
    """Linear map along the token axis: ``[B, n_in, d]`` -> ``[B, n_out, d]`` (Wukong's linear compression)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / max(n_in, 1) ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mix_tokens(self.weight, x)


def mix_tokens(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weight[n_out, n_in]``, ``x[B, n_in, d]`` -> ``[B, n_out, d]``: ``out[b] = weight @ x[b]``.

    One batched product that reads ``x`` and writes the output where they lie. ``einsum`` folds the rows into the
    columns of a single product instead: a copy of ``x`` into that layout and one of the output back, and a weight
    gradient whose reduction runs over all ``B * d`` columns in one small product, which the GPU runs far below
    its peak (docs/benchmarks.md)."""
    return torch.bmm(weight.expand(x.shape[0], *weight.shape), x)


def gemm_weights(x: torch.Tensor, *weights: torch.Tensor) -> list[torch.Tensor]:
    """``weights`` in the dtype a GEMM on ``x`` computes in (autocast's, else their own).

    Each parameter is cast before any view or concatenation, so that autograd's only use of it is that one
    cast, the form :class:`~foundation.model.precision.CastOnce` replaces by a copy cast once per step.
    """
    dtype = autocast_dtype(x)
    return [w if dtype is None else w.to(dtype) for w in weights]


class WukongBlock(nn.Module):
    """Factorization-machine block + linear compression block, with a residual and layer norm.

    FMB: ``X (Xᵀ P)`` (Wukong's optimised FM, ``P[n_in, rank]``) -> flatten -> LN -> MLP ->
    ``n_fm`` tokens. LCB: ``n_lc`` linear mixes of the input tokens. Output:
    ``LN(cat(FMB, LCB) + mix(X))`` with ``n_out = n_fm + n_lc``.
    """

    def __init__(self, n_in: int, n_out: int, d: int, *, rank: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.n_fm, self.d = max(n_out // 2, 1), d
        self.projection = nn.Parameter(torch.randn(n_in, rank) / max(n_in, 1) ** 0.5)
        self.fm_mlp = nn.Sequential(
            FusedLayerNorm(n_in * rank, feeds_gemm=True),
            nn.Linear(n_in * rank, hidden),
            nn.SiLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, self.n_fm * d),
        )
        self.compress = TokenMix(n_in, n_out - self.n_fm)
        self.residual = TokenMix(n_in, n_out)
        self.norm = FusedLayerNorm(d, feeds_gemm=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[B, n_in, d]`` -> ``[B, n_out, d]``.

        The FM projection ``Xᵀ P`` and both token mixes contract the token axis of the same ``X``: one GEMM
        computes all three (``[Pᵀ; compress; residual] X``), so the step casts and permutes ``X`` once for them.
        """
        projection, compress, residual = gemm_weights(x, self.projection, self.compress.weight, self.residual.weight)
        mixed = mix_tokens(torch.cat([projection.T, compress, residual]), x)  # [B, rank + n_lc + n_out, d]
        projected, compressed, mixed_residual = mixed.split([projection.shape[1], compress.shape[0], residual.shape[0]], 1)
        interactions = x @ projected.transpose(1, 2)  # [B, n_in, rank]
        fm = self.fm_mlp(interactions.flatten(1)).view(x.shape[0], self.n_fm, self.d)
        return self.norm(torch.cat([fm, compressed], dim=1) + mixed_residual)


class DCNv2Block(nn.Module):
    """Low-rank DCNv2 cross layers on the flattened tokens, then a token mix to ``n_out`` tokens.

    ``x_{l+1} = x_0 ⊙ (U_l V_l x_l + b_l) + x_l`` on ``x_0 = flatten(X)`` ``[B, n_in·d]``.
    """

    def __init__(self, n_in: int, n_out: int, d: int, *, rank: int, num_layers: int, dropout: float) -> None:
        super().__init__()
        width = n_in * d
        self.down = nn.ModuleList(nn.Linear(width, rank, bias=False) for _ in range(num_layers))
        self.up = nn.ModuleList(nn.Linear(rank, width) for _ in range(num_layers))
        self.dropout = nn.Dropout(dropout)
        self.mix = TokenMix(n_in, n_out)
        self.norm = FusedLayerNorm(d, feeds_gemm=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[B, n_in, d]`` -> ``[B, n_out, d]``."""
        x0 = x.flatten(1)
        xl = x0
        for down, up in zip(self.down, self.up, strict=True):
            xl = x0 * self.dropout(up(down(xl))) + xl
        return self.norm(self.mix(xl.view_as(x)))


def build_interaction_block(cfg: TeacherConfig, n_in: int, n_out: int) -> nn.Module:
    """The configured interaction block, ``[B, n_in, d_model]`` -> ``[B, n_out, d_model]``."""
    if cfg.interaction == "wukong":
        return WukongBlock(
            n_in, n_out, cfg.d_model, rank=cfg.wukong_rank, hidden=cfg.wukong_hidden, dropout=cfg.dropout
        )
    return DCNv2Block(
        n_in, n_out, cfg.d_model, rank=cfg.dcn_rank, num_layers=cfg.dcn_cross_layers, dropout=cfg.dropout
    )


def build_interaction_stack(cfg: TeacherConfig, n_in: int, num_blocks: int) -> nn.Sequential:
    """``num_blocks`` stacked blocks: ``[B, n_in, d]`` -> ``[B, interaction_tokens, d]``."""
    sizes = [n_in] + [cfg.interaction_tokens] * num_blocks
    return nn.Sequential(*(build_interaction_block(cfg, a, b) for a, b in pairwise(sizes)))
