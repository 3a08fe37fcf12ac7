"""HSTU block (arXiv 2402.17152) over a jagged token batch.

``U, V, Q, K = silu(W·LN(x) + b)`` (one :func:`kernels.silu_split`, the bias added inside; U's SiLU in the gated norm
that reads it); ``A = silu(alpha·QKᵀ + rel_bias)/N · V``
(causal, through :func:`kernels.jagged_attention`); ``x + W_o·dropout(LN(A) ⊙ U)``, the gated norm and its
dropout one fused kernel (:func:`kernels.layer_norm`). The relative bias is a learned per-head table over
position distance plus one over log time-difference buckets.

``N`` is fixed by the config (the longest sequence the model is sized for), not the batch's
longest sequence as the kernel uses, so that a user's representation does not depend on which
other users share its batch (it is exported per user), as in HSTU, which pads to a fixed length.
``attention_norm=0`` divides by each row's own length instead (also batch-independent).

The time bias buckets ``t_i - ts_j`` where ``t_i`` is the query event's time, or with
``query_timestamps`` the time the query is asked for (the reference HSTU's ``ts[i+1] - ts[j]``: the
time of the event the position predicts).

Switches for the A/Bs against the reference HSTU (``docs/ml1m_reference_diff.md``): ``norm`` (learned-affine
LayerNorms or the reference's plain ones), ``init`` (``torch``: ``nn.Linear``'s defaults and zero bias
tables, or the reference's, :func:`apply_reference_init`), ``uvqk_bias`` and ``rel_bias`` (bias tables per
head or shared by the heads, as the reference's are).
"""

from __future__ import annotations

import torch
from torch import nn

from foundation.model.norms import (
    apply_layer_norm,
    apply_residual_layer_norm,
    build_layer_norm,
    deferred_bias,
)
from foundation.model.profiling import ATTENTION, profile_region
from foundation.model.teacher_config import BLOCK_INITS, REL_BIASES
from kernels import SiluGate, jagged_attention, silu_split

# The reference HSTU draws its uvqk matrix and its relative-bias tables from N(0, 0.02).
REFERENCE_INIT_STD = 0.02


class HSTUBlock(nn.Module):
    """One HSTU layer: ``x[L, d]`` -> ``[L, d]`` on sequences given by ``offsets[B+1]``."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        attn_dim: int,
        value_dim: int,
        *,
        dropout: float,
        alpha: float | None,
        pos_buckets: int,
        time_buckets: int,
        attention_norm: int,
        norm: str = "affine",
        init: str = "torch",
        uvqk_bias: bool = True,
        rel_bias: str = "head",
    ) -> None:
        super().__init__()
        self.num_heads, self.attn_dim, self.value_dim = num_heads, attn_dim, value_dim
        self.alpha = alpha
        self.attention_norm = attention_norm
        self.input_norm = build_layer_norm(d_model, norm)
        self.uvqk = nn.Linear(d_model, num_heads * (2 * value_dim + 2 * attn_dim), bias=uvqk_bias)
        self.attn_norm = build_layer_norm(num_heads * value_dim, norm)
        self.output = nn.Linear(num_heads * value_dim, d_model)
        self.dropout = nn.Dropout(dropout)
        if rel_bias not in REL_BIASES:
            raise ValueError(f"teacher.rel_bias must be one of {REL_BIASES}, got {rel_bias!r}")
        # A [1, buckets] table is one bias for every head (the kernels broadcast it).
        rows = num_heads if rel_bias == "head" else 1
        # Zero tables (init="torch") start the block as plain pointwise attention.
        self.pos_bias = nn.Parameter(torch.zeros(rows, pos_buckets))
        self.time_bias = nn.Parameter(torch.zeros(rows, time_buckets)) if time_buckets else None
        if init == "reference":
            apply_reference_init(self)
        elif init not in BLOCK_INITS:
            raise ValueError(f"teacher.block_init must be one of {BLOCK_INITS}, got {init!r}")

    def split_uvqk(self, x: torch.Tensor, normed: torch.Tensor | None = None) -> tuple[SiluGate | torch.Tensor, ...]:
        """``x[L, d]`` -> ``u`` (a :class:`~kernels.glue.SiluGate` over ``[L, H*Dv]``: ``u.value()`` is the gate),
        ``v[L, H, Dv]``, ``q[L, H, Dqk]``, ``k[L, H, Dqk]``; ``normed``: x's input norm when the caller computed it."""
        h, dv, dqk = self.num_heads, self.value_dim, self.attn_dim
        normed = apply_layer_norm(self.input_norm, x) if normed is None else normed
        # The bias joins in the SiLU's kernel, whose backward sums its gradient from small per-tile partials; u's
        # SiLU (and its bias) waits for the gated norm, which reads u only there.
        projected = nn.functional.linear(normed, self.uvqk.weight)
        u, v, q, k = silu_split(projected, [h * dv, h * dv, h * dqk, h * dqk], bias=self.uvqk.bias, gate_first=True)
        return u, v.view(-1, h, dv), q.view(-1, h, dqk), k.view(-1, h, dqk)

    def forward(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        max_len: int,
        timestamps: torch.Tensor,
        num_targets: torch.Tensor | None = None,
        query_timestamps: torch.Tensor | None = None,
        *,
        branch: torch.Tensor | None = None,
        branch_bias: torch.Tensor | None = None,
        defer_residual: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Args:
        x: ``[L, d]`` tokens.
        offsets: ``[B+1]``.
        max_len: longest sequence of the batch (the kernel's ``N``, rescaled to ``attention_norm``).
        timestamps: ``[L]`` int64 event times for the time bias.
        num_targets: ``[B]`` or None: the last tokens of each row that see the history and
            themselves only (CLS and candidate tokens).
        query_timestamps: ``[L]`` int64 or None: the times queries measure the time bias from
            (None: ``timestamps``).
        branch: ``[L, d]`` or None: the previous block's output, not yet added to ``x`` (its
            ``defer_residual``); added here in the input norm's pass, the block's input being
            ``x + branch + branch_bias``.
        branch_bias: ``[d]`` or None: the bias of the projection that made ``branch``.
        defer_residual: return ``(x, out, bias)`` instead of ``x + out + bias`` (``out[L, d]``: the block's output
            before its projection's bias, ``bias[d]``), for the next consumer of the stream to add in its own norm's
            pass, which also sums the bias's gradient.
        """
        normed = None
        if branch is not None:
            x, normed = apply_residual_layer_norm(self.input_norm, x, branch, branch_bias=branch_bias)
        u, v, q, k = self.split_uvqk(x, normed)
        with profile_region(ATTENTION):
            attn = jagged_attention(
                q,
                k,
                v,
                offsets,
                max_len,
                activation="silu",
                causal=True,
                alpha=self.alpha,
                num_targets=num_targets,
                pos_bias=self.pos_bias,
                time_bias=self.time_bias,
                timestamps=timestamps if self.time_bias is not None else None,
                query_timestamps=query_timestamps if self.time_bias is not None else None,
            )
        # The kernel divides by the batch's max_len; rescale to the fixed 1/N (inside the fused norm),
        # or to each row's own length.
        scale = max_len / self.attention_norm if self.attention_norm else 1.0
        if not self.attention_norm:
            lengths = offsets[1:] - offsets[:-1]
            row_length = torch.repeat_interleave(lengths, lengths, output_size=x.shape[0])
            attn = attn * (max_len / row_length.to(attn.dtype))[:, None, None]
        gated = apply_layer_norm(self.attn_norm, attn.reshape(x.shape[0], -1), scale=scale, gate=u, dropout=self.dropout)
        if defer_residual:
            return x, nn.functional.linear(gated, self.output.weight), deferred_bias(self.output)
        return x + self.output(gated)


@torch.no_grad()
def apply_reference_init(block: HSTUBlock) -> None:
    """The reference HSTU's initialisation of a block: ``uvqk`` weight N(0, 0.02) (its bias, when it has one,
    zero: the reference's projection has none), output weight Xavier-uniform (its bias keeps ``nn.Linear``'s),
    relative position and time bias tables N(0, 0.02)."""
    nn.init.normal_(block.uvqk.weight, std=REFERENCE_INIT_STD)
    if block.uvqk.bias is not None:
        nn.init.zeros_(block.uvqk.bias)
    nn.init.xavier_uniform_(block.output.weight)
    for table in (block.pos_bias, block.time_bias):
        if table is not None:
            nn.init.normal_(table, std=REFERENCE_INIT_STD)
