"""PyTorch reference for the per-row SiLU modulation of a jagged batch's tokens (InterFormer's PFFN)."""

from __future__ import annotations

import torch


def jagged_silu_modulate(
    h: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    rows: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    scale_offset: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``dropout(silu(h + bias) * (scale_offset + scale[rows]) + shift[rows])``: ``h[L, N]``, ``scale``/``shift``
    ``[B, N]``, ``rows[L]`` sorted, ``bias[N]`` or None, ``dropout_mask[L, N]`` bool (kept elements, scaled by
    ``1 / (1 - dropout_p)``) or None. The bias is added in h's dtype and the offset in scale's, as a GEMM's bias
    epilogue and an eager ``scale_offset + scale`` round them.

    Autograd's backward for the row gathers is ``index_add_`` of every token into its row.
    """
    pre = h if bias is None else h + bias.to(h.dtype)
    factor = scale if scale_offset == 0.0 else scale_offset + scale
    y = torch.addcmul(shift.index_select(0, rows), torch.nn.functional.silu(pre), factor.index_select(0, rows))
    if dropout_mask is None:
        return y
    # The dropout's product in float32, as CUDA's dropout and the kernel compute it.
    return (y.float() * dropout_mask * (1.0 / (1.0 - dropout_p))).to(y.dtype)
