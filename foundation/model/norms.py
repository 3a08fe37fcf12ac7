"""LayerNorms that feed a GEMM, through the fused :func:`kernels.layer_norm`.

Under autocast, PyTorch runs LayerNorm in float32 and the next ``nn.Linear`` casts its float32
output to bf16; handing the GEMM the autocast dtype directly gives the same values in one pass
(the ``nn.LayerNorm`` modules stay as the parameters' holders, so checkpoints are unchanged).

Two kinds of norm (``TeacherConfig.block_norm``): ``affine``, an ``nn.LayerNorm`` with a learned gain and
bias and eps 1e-5, and ``plain``, :class:`PlainLayerNorm`, the reference HSTU's: no parameters, eps 1e-6.
"""

from __future__ import annotations

import torch
from torch import nn

from foundation.model.teacher_config import BLOCK_NORMS
from kernels import draw_dropout_mask, layer_norm, residual_layer_norm

PLAIN_EPS = 1e-6


class PlainLayerNorm(nn.Module):
    """LayerNorm over the last axis with no learned gain or bias: ``(x - mean) / sqrt(var + eps)``.

    ``weight`` (ones) and ``bias`` (zeros) are constant, non-persistent buffers, so that the fused kernel
    takes this norm as it takes an ``nn.LayerNorm`` while the model has no parameters and no checkpoint
    entries for it.
    """

    def __init__(self, dim: int, eps: float = PLAIN_EPS) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim), persistent=False)
        self.register_buffer("bias", torch.zeros(dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., dim]`` -> the same shape."""
        return apply_layer_norm(self, x)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


def build_layer_norm(dim: int, kind: str) -> nn.Module:
    """A LayerNorm over ``dim`` features of ``kind`` (:data:`BLOCK_NORMS`)."""
    if kind == "affine":
        return nn.LayerNorm(dim)
    if kind == "plain":
        return PlainLayerNorm(dim)
    raise ValueError(f"teacher.block_norm must be one of {BLOCK_NORMS}, got {kind!r}")


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast gives GEMMs on x's device, or None outside autocast."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def apply_layer_norm(
    norm: nn.LayerNorm | PlainLayerNorm,
    x: torch.Tensor,
    *,
    scale: float = 1.0,
    gate: torch.Tensor | None = None,
    dropout: nn.Dropout | None = None,
) -> torch.Tensor:
    """``dropout(norm(scale * x) * gate)`` (``x``, ``gate`` ``[..., N]``) in the dtype the next GEMM computes in."""
    return layer_norm(
        x, norm.weight, norm.bias, norm.eps, scale=scale, gate=gate, out_dtype=autocast_dtype(x),
        **fused_dropout(dropout, x.shape, x.device),
    )


def fused_dropout(dropout: nn.Dropout | None, shape: torch.Size, device: torch.device) -> dict:
    """The glue kernels' dropout arguments for an output of ``shape``: a fresh keep mask and ``p`` while ``dropout``
    trains with ``p > 0``, else none (the kernels' path without dropout)."""
    if dropout is None or not dropout.training or dropout.p == 0.0:
        return {}
    return {"dropout_mask": draw_dropout_mask(shape, dropout.p, device), "dropout_p": dropout.p}


def apply_residual_layer_norm(
    norm: nn.LayerNorm | PlainLayerNorm, x: torch.Tensor, branch: torch.Tensor | None,
    picks: torch.Tensor | None = None, branch_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(s, norm(s))`` with ``s = x + branch + branch_bias`` (``[..., N]``): a block's output joins the residual
    stream and the stream is normalised for the next block in one pass, the norm in the dtype the next GEMM computes
    in. ``branch=None``: the stream passes through, and the backward adds its gradient to the norm's in the same
    pass. ``picks[P]``: also the sum's rows ``picks`` (``[P, N]``), their gradient added in that pass too.
    ``branch_bias[N]``: the bias of the projection that made the branch (its gradient summed in the same pass)."""
    return residual_layer_norm(
        x, branch, norm.weight, norm.bias, norm.eps, branch_bias=branch_bias, out_dtype=autocast_dtype(x), picks=picks
    )


def add_branch(x: torch.Tensor, branch: torch.Tensor | None, branch_bias: torch.Tensor | None) -> torch.Tensor:
    """``x + branch + branch_bias``: a deferred block output joins the stream where no norm follows to add it, in the
    dtype of ``x + branch`` (as :func:`apply_residual_layer_norm` adds it: a bf16 stream stays bf16)."""
    if branch is None:
        return x
    x = x + branch
    return x + branch_bias.to(x.dtype) if branch_bias is not None else x


def deferred_bias(linear: nn.Linear) -> torch.Tensor | None:
    """A copy of ``linear``'s bias for the next norm to add (:func:`apply_residual_layer_norm`), or None.

    A copy, not the parameter: the value outlives this module's forward, after which a sharding wrapper may free the
    parameter's gathered storage; the copy's gradient still reaches the parameter."""
    return linear.bias.clone() if linear.bias is not None else None


class FusedLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state dict) through the fused :func:`kernels.layer_norm`.

    ``feeds_gemm=True``: the output is in the autocast dtype, for a GEMM that would cast it (one pass
    instead of autocast's input cast, float32 norm and the GEMM's cast). ``False``: float32 output, as
    autocast's LayerNorm gives, without its separate input cast.
    """

    def __init__(self, normalized_shape: int, *, feeds_gemm: bool) -> None:
        super().__init__(normalized_shape)
        self.feeds_gemm = feeds_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.feeds_gemm:
            return apply_layer_norm(self, x)
        return layer_norm(x, self.weight, self.bias, self.eps, out_dtype=torch.promote_types(x.dtype, torch.float32))
