"""PyTorch reference for the fused LayerNorm: ``dropout(LN(scale * x) * gate)`` computed in float32, cast once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.glue import SiluGate


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    scale: float = 1.0,
    gate: torch.Tensor | SiluGate | None = None,
    out_dtype: torch.dtype | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``dropout(LN(scale * x) * gate)`` over the last axis, in float32 whatever the autocast state, as ``out_dtype``.

    Args:
        x: ``[..., N]``.
        weight, bias: ``[N]``.
        gate: ``[..., N]`` (x's shape), a :class:`~kernels.glue.SiluGate` (``silu(pre + bias)`` in float32), or None.
        out_dtype: the result's dtype; None means x's dtype promoted with gate's (``pre``'s).
        dropout_mask: ``[..., N]`` bool, the elements kept (each scaled by ``1 / (1 - dropout_p)``), or None.
    """
    gate_dtype = (gate.pre if isinstance(gate, SiluGate) else gate).dtype if gate is not None else x.dtype
    dtype = out_dtype or torch.promote_types(x.dtype, gate_dtype)
    with torch.autocast(x.device.type, enabled=False):
        scaled = x.float() if scale == 1.0 else x.float() * scale
        y = F.layer_norm(scaled, (x.shape[-1],), weight.float(), bias.float(), eps)
        if isinstance(gate, SiluGate):
            y = y * gate.value()
        elif gate is not None:
            y = y * gate.float()
        if dropout_mask is not None:
            y = y * dropout_mask * (1.0 / (1.0 - dropout_p))
    return y.to(dtype)


def residual_layer_norm(
    x: torch.Tensor,
    branch: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    branch_bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    picks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(s, LN(s))`` with ``s = x + branch + branch_bias`` (the residual stream after a block, and its norm for the
    next one); with ``picks``, also ``s``'s rows ``picks`` (over its leading axes flattened), ``[P, N]``.

    Args:
        x: ``[..., N]`` the residual stream.
        branch: ``[..., N]`` (x's shape) the block's output, or None (``s`` is x).
        branch_bias: ``[N]`` the bias of the branch's projection, added in x's dtype promoted with the branch's; or
            None. Only with a branch.
        weight, bias: ``[N]``.
        out_dtype: the norm's dtype; None means the sum's (x's dtype promoted with the branch's).
    """
    total = x if branch is None else x + branch
    if branch_bias is not None:
        total = total + branch_bias.to(total.dtype)
    normed = layer_norm(total, weight, bias, eps, out_dtype=out_dtype)
    if picks is None:
        return total, normed
    return total, normed, total.reshape(-1, total.shape[-1]).index_select(0, picks)
