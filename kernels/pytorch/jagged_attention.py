"""PyTorch references for jagged self- and cross-attention.

These are the ground truth the Triton kernels are tested against, and the backend used on CPU.
They pad each batch to dense ``[B, N, H, D]`` tensors, build the attention mask explicitly and
compute in float32 (float64 stays float64), so they are simple rather than fast.

Mask semantics shared with the kernels (positions ``i`` (query) and ``j`` (key) count from 0
inside each sequence of length ``n``; ``n_h = n - num_targets[b]`` is the history length):

- causal: ``j <= i``;
- targets: a key ``j >= n_h`` (a target) is seen only by itself, so targets attend to the
  whole history plus themselves and history tokens never see targets;
- window ``w``: with effective positions ``p(i) = min(i, n_h)`` (every target sits where the
  next history item would), query ``i`` sees key ``j`` only when ``|p(i) - p(j)| < w``;
- ``pos_bias[h, min(|p(i) - p(j)|, P - 1)]`` and
  ``time_bias[h, bucket(qts_i - ts_j)]`` (``qts`` is ``query_timestamps``, by default ``ts``) with
  ``bucket(dt) = min(floor(ln(max(|dt|, 1)) / 0.301), T - 1)`` (HSTU's log bucketing) are added
  to ``alpha * q_i . k_j`` before the activation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.spec import AttentionSpec

TIME_BUCKET_DIVISOR = 0.301
POINTWISE_ACTIVATIONS = ("silu", "gelu", "relu", "identity")
ACTIVATIONS = ("softmax", *POINTWISE_ACTIVATIONS)


def pad_jagged(x: torch.Tensor, offsets: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter jagged rows into a zero-padded dense tensor.

    Args:
        x: ``[L, *rest]`` rows of all sequences, sequence after sequence.
        offsets: ``[B + 1]`` int64, ``offsets[b]:offsets[b + 1]`` are the rows of sequence ``b``.
        max_len: ``N``, at least the longest sequence.

    Returns:
        ``([B, N, *rest]`` padded tensor, ``[B, N]`` bool validity mask``)``.
    """
    lengths = offsets[1:] - offsets[:-1]
    valid = torch.arange(max_len, device=x.device)[None, :] < lengths[:, None]
    padded = x.new_zeros((lengths.numel(), max_len, *x.shape[1:]))
    padded[valid] = x
    return padded, valid


def time_bucket(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """HSTU log time bucket of an int64 time difference, as int64 in ``[0, num_buckets)``."""
    x = dt.abs().clamp(min=1).to(torch.float32)
    return (torch.log(x) / TIME_BUCKET_DIVISOR).floor().to(torch.int64).clamp(0, num_buckets - 1)


def self_attention_mask(
    lengths: torch.Tensor,
    max_len: int,
    *,
    causal: bool,
    num_targets: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query, key) pairs attend, and the effective positions used by window and bias.

    Args:
        lengths: ``[B]`` int64 sequence lengths.
        max_len: ``N``.
        causal, num_targets (``[B]`` or None), window: see the module docstring.

    Returns:
        ``(mask [B, N, N] bool, positions [B, N] int64)``; the mask is False on padding.
    """
    device = lengths.device
    idx = torch.arange(max_len, device=device)
    i = idx[None, :, None]
    j = idx[None, None, :]
    n = lengths[:, None, None]
    n_hist = n - num_targets.to(torch.int64)[:, None, None] if num_targets is not None else n
    mask = (i < n) & (j < n)
    if causal:
        mask &= j <= i
    if num_targets is not None:
        mask &= (j < n_hist) | (j == i)
    pos = torch.minimum(idx[None, :], n_hist[:, :, 0])
    if window is not None:
        mask &= (pos[:, :, None] - pos[:, None, :]).abs() < window
    return mask, pos


def _activate(s: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(s)
    if activation == "gelu":
        return torch.nn.functional.gelu(s)
    if activation == "relu":
        return torch.relu(s)
    return s


def _attend(
    scores: torch.Tensor, mask: torch.Tensor, v: torch.Tensor, activation: str, inv_n: float
) -> torch.Tensor:
    """``scores``/``mask``: [B, H, Nq, Nk]; ``v``: [B, H, Nk, Dv] -> [B, H, Nq, Dv]."""
    if activation == "softmax":
        if scores.shape[-1] == 0:  # no key in any sequence (max_kv_len = 0): every query reads nothing
            return scores @ v
        masked = scores.masked_fill(~mask, float("-inf"))
        row_max = masked.amax(dim=-1, keepdim=True).detach()
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        e = torch.exp(masked - row_max)
        weights = e / e.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(e.dtype).tiny)
    else:
        weights = torch.where(mask, _activate(scores, activation), torch.zeros_like(scores)) * inv_n
    return weights @ v


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def jagged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_len: int, spec: AttentionSpec
) -> torch.Tensor:
    """Reference jagged self-attention of ``spec`` (:class:`kernels.spec.AttentionSpec`).

    Shapes: q, k ``[L, H, Dqk]``, v ``[L, H, Dv]``, offsets ``[B + 1]`` -> ``[L, H, Dv]``.
    """
    dtype = _compute_dtype(q)
    lengths = offsets[1:] - offsets[:-1]
    qp, valid = pad_jagged(q.to(dtype), offsets, max_len)
    kp, _ = pad_jagged(k.to(dtype), offsets, max_len)
    vp, _ = pad_jagged(v.to(dtype), offsets, max_len)
    mask, pos = self_attention_mask(
        lengths, max_len, causal=spec.causal, num_targets=spec.num_targets, window=spec.window
    )
    scores = spec.scale(q.shape[-1]) * torch.einsum("bihd,bjhd->bhij", qp, kp)
    if spec.pos_bias is not None:
        dist = (pos[:, :, None] - pos[:, None, :]).abs().clamp(max=spec.pos_bias.shape[1] - 1)
        scores = scores + spec.pos_bias.to(dtype)[:, dist].permute(1, 0, 2, 3)
    if spec.time_bias is not None:
        tsp, _ = pad_jagged(spec.timestamps, offsets, max_len)
        qts = spec.query_timestamps
        qtsp = tsp if qts is None else pad_jagged(qts, offsets, max_len)[0]
        bucket = time_bucket(qtsp[:, :, None] - tsp[:, None, :], spec.time_bias.shape[1])
        scores = scores + spec.time_bias.to(dtype)[:, bucket].permute(1, 0, 2, 3)
    inv_n = 1.0 / spec.pointwise_divisor(max_len)
    out = _attend(scores, mask[:, None], vp.transpose(1, 2), spec.activation, inv_n)
    return out.transpose(1, 2)[valid].to(v.dtype)


def jagged_cross_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    *,
    activation: str = "softmax",
    alpha: float | None = None,
) -> torch.Tensor:
    """Reference jagged cross-attention; see :func:`kernels.jagged_cross_attention`.

    Shapes: q ``[Lq, H, Dqk]``, k ``[Lkv, H, Dqk]``, v ``[Lkv, H, Dv]`` -> ``[Lq, H, Dv]``.
    """
    dtype = _compute_dtype(q)
    alpha = 1.0 / math.sqrt(q.shape[-1]) if alpha is None else alpha
    qp, q_valid = pad_jagged(q.to(dtype), q_offsets, max_q_len)
    kp, kv_valid = pad_jagged(k.to(dtype), kv_offsets, max_kv_len)
    vp, _ = pad_jagged(v.to(dtype), kv_offsets, max_kv_len)
    mask = q_valid[:, None, :, None] & kv_valid[:, None, None, :]
    scores = alpha * torch.einsum("bihd,bjhd->bhij", qp, kp)
    out = _attend(scores, mask, vp.transpose(1, 2), activation, 1.0 / max(max_kv_len, 1))
    return out.transpose(1, 2)[q_valid].to(v.dtype)
