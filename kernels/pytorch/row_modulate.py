"""PyTorch reference for the per-row SiLU modulation of a jagged batch's tokens (InterFormer's PFFN)."""

from __future__ import annotations

import torch


def jagged_silu_modulate(h: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``silu(h) * scale[rows] + shift[rows]``: ``h[L, N]``, ``scale``/``shift`` ``[B, N]``, ``rows[L]`` sorted.

    Autograd's backward for the row gathers is ``index_add_`` of every token into its row.
    """
    return torch.addcmul(shift.index_select(0, rows), torch.nn.functional.silu(h), scale.index_select(0, rows))
