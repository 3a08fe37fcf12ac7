"""PyTorch reference for the per-row SiLU modulation of a jagged batch's tokens (InterFormer's PFFN)."""

from __future__ import annotations

import torch


def jagged_silu_modulate(
    h: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    rows: torch.Tensor,
    *,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``dropout(silu(h) * scale[rows] + shift[rows])``: ``h[L, N]``, ``scale``/``shift`` ``[B, N]``, ``rows[L]`` sorted,
    ``dropout_mask[L, N]`` bool (kept elements, scaled by ``1 / (1 - dropout_p)``) or None.

    Autograd's backward for the row gathers is ``index_add_`` of every token into its row.
    """
    y = torch.addcmul(shift.index_select(0, rows), torch.nn.functional.silu(h), scale.index_select(0, rows))
    if dropout_mask is None:
        return y
    # The dropout's product in float32, as CUDA's dropout and the kernel compute it.
    return (y.float() * dropout_mask * (1.0 / (1.0 - dropout_p))).to(y.dtype)
