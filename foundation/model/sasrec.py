"""SASRec block (Kang & McAuley, arXiv 1808.09781) over a jagged token batch: the softmax Transformer
baseline that HSTU's ML-1M numbers are compared with.

``q_in = LN(x)``; ``A = softmax(Q Kᵀ / sqrt(D)) V`` with ``Q = W_q q_in``, ``K = W_k x``, ``V = W_v x``
(causal, through :func:`kernels.jagged_attention` with ``activation="softmax"``);
``h = LN(q_in + dropout(W_o A))``; ``out = h + dropout(W_2 dropout(relu(W_1 h)))``.

This is the block of the sampled-softmax SASRec baseline the HSTU paper reports (queries read the
normalised input, keys and values the raw one; no residual around the first norm; a pointwise
two-layer ReLU FFN). The kernel has no dropout on attention probabilities, so the attention's
dropout acts on its projected output instead.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from foundation.model.norms import add_branch
from kernels import jagged_attention


class SASRecBlock(nn.Module):
    """One SASRec layer: ``x[L, d]`` -> ``[L, d]`` on sequences given by ``offsets[B+1]``.

    The signature of ``forward`` is :class:`foundation.model.hstu.HSTUBlock`'s, so the teacher can
    stack either; SASRec has no relative bias, so it ignores the timestamps.
    """

    def __init__(
        self, d_model: int, num_heads: int, attn_dim: int, value_dim: int, *, ffn_hidden: int, dropout: float
    ) -> None:
        super().__init__()
        self.num_heads, self.attn_dim, self.value_dim = num_heads, attn_dim, value_dim
        self.query_norm = nn.LayerNorm(d_model)
        self.query = nn.Linear(d_model, num_heads * attn_dim)
        self.key_value = nn.Linear(d_model, num_heads * (attn_dim + value_dim))
        self.output = nn.Linear(num_heads * value_dim, d_model)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.ffn_in = nn.Linear(d_model, ffn_hidden)
        self.ffn_out = nn.Linear(ffn_hidden, d_model)
        self.dropout = nn.Dropout(dropout)
        # SASRec's initialisation: Xavier-normal weight matrices (the Q/K/V projections as the one
        # [H*(2*Dqk + Dv), d] matrix they are in the reference), zero attention biases.
        qkv_std = math.sqrt(2.0 / (d_model + num_heads * (2 * attn_dim + value_dim)))
        for linear in (self.query, self.key_value):
            nn.init.normal_(linear.weight, std=qkv_std)
        for linear in (self.output, self.ffn_in, self.ffn_out):
            nn.init.xavier_normal_(linear.weight)
        for linear in (self.query, self.key_value, self.output):
            nn.init.zeros_(linear.bias)

    def forward(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        max_len: int,
        timestamps: torch.Tensor | None = None,
        num_targets: torch.Tensor | None = None,
        query_timestamps: torch.Tensor | None = None,
        *,
        branch: torch.Tensor | None = None,
        branch_bias: torch.Tensor | None = None,
        defer_residual: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
        """Args:
        x: ``[L, d]`` tokens.
        offsets: ``[B+1]``.
        max_len: longest sequence of the batch.
        timestamps, query_timestamps: ``[L]``; unused (no time bias).
        num_targets: ``[B]`` or None: the last tokens of each row that see the history and
            themselves only (CLS and candidate tokens).
        branch: ``[L, d]`` or None: the previous block's output not yet added to ``x``; the block's input is
            ``x + branch + branch_bias`` (its keys and values read it unnormalised, so the add is not fused here).
        branch_bias: ``[d]`` or None: the bias of the projection that made ``branch``.
        defer_residual: return ``(hidden, ffn, None)`` instead of their sum, as :class:`~foundation.model.hstu.HSTUBlock`
            (its FFN's bias stays in its GEMM: a dropout follows it).
        """
        x = add_branch(x, branch, branch_bias)
        h, dqk, dv = self.num_heads, self.attn_dim, self.value_dim
        q_in = self.query_norm(x)
        k, v = torch.split(self.key_value(x), [h * dqk, h * dv], -1)
        attn = jagged_attention(
            self.query(q_in).view(-1, h, dqk),
            k.reshape(-1, h, dqk),
            v.reshape(-1, h, dv),
            offsets,
            max_len,
            activation="softmax",
            causal=True,
            num_targets=num_targets,
        )
        hidden = self.ffn_norm(q_in + self.dropout(self.output(attn.reshape(x.shape[0], -1))))
        ffn = self.dropout(self.ffn_out(self.dropout(torch.relu(self.ffn_in(hidden)))))
        return (hidden, ffn, None) if defer_residual else hidden + ffn
