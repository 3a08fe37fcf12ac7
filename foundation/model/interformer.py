"""InterFormer-style interleaving pieces (arXiv 2411.09852).

- :class:`PersonalizedFFN`: the non-sequence summary conditions every sequence token;
- :class:`SequenceSummary`: CLS tokens, PMA seeds attending to the history (jagged cross
  attention) and the K most recent tokens, gated, for the interaction arch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from foundation.model.jagged import RecentTokens
from foundation.model.norms import apply_layer_norm, apply_residual_layer_norm, fused_dropout
from foundation.model.profiling import ATTENTION, profile_region
from kernels import jagged_cross_attention, jagged_silu_modulate


class PersonalizedFFN(nn.Module):
    """``x + W2·dropout(silu(W1·LN(x)) ⊙ (1 + g_b) + s_b)`` with ``g_b, s_b`` generated from row ``b``'s summary.

    The effective FFN of row ``b`` is ``W2·diag(1 + g_b)·W1`` (plus a per-row shift): personal weights
    at ``O(L·hidden)`` cost, without materialising a matrix per row. The summary tokens are first
    narrowed to ``summary_dim`` each, so the generator stays small when ``d_model`` is large.
    """

    def __init__(
        self, d_model: int, summary_tokens: int, summary_dim: int, hidden: int, dropout: float
    ) -> None:
        super().__init__()
        self.hidden = hidden
        self.norm = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)
        self.narrow = nn.Linear(d_model, summary_dim)
        self.condition = nn.Linear(summary_tokens * summary_dim, 2 * hidden)
        # Small so the block starts close to a plain FFN, non-zero so the summary gets a gradient.
        nn.init.normal_(self.condition.weight, std=0.01)
        nn.init.zeros_(self.condition.bias)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, rows: torch.Tensor, summary: torch.Tensor, *, defer_residual: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x[L, d]``, ``rows[L]`` (row of each token, sorted), ``summary[B, n, d]`` -> ``[L, d]``.

        ``defer_residual``: return ``(x, branch)`` instead of ``x + branch``, for the next block to add in its input
        norm (:func:`~foundation.model.norms.apply_residual_layer_norm`): one pass over the stream instead of two.
        """
        gain, shift = self.condition(self.narrow(summary).flatten(1)).chunk(2, dim=-1)
        # The stream passes through the norm's op, whose backward adds its gradient to the norm's in one pass.
        x, normed = apply_residual_layer_norm(self.norm, x, None)
        # The up projection's bias and the 1 of 1 + g join in the modulation's kernel, whose backward sums the
        # bias's gradient per row.
        up = nn.functional.linear(normed, self.up.weight)
        hidden = jagged_silu_modulate(
            up, gain, shift, rows, bias=self.up.bias, scale_offset=1.0,
            **fused_dropout(self.dropout, up.shape, up.device),
        )
        branch = self.down(hidden)
        return (x, branch) if defer_residual else x + branch


@dataclass
class SummaryLayout:
    """What every layer's :class:`SequenceSummary` of one batch needs from its offsets, built once per batch.

    Attributes:
        seed_offsets: ``[B+1]`` offsets of the PMA seed queries (``num_seeds`` per row), or None without seeds.
        recent: the K most recent history tokens of every row, or None without them.
    """

    seed_offsets: torch.Tensor | None
    recent: RecentTokens | None

    @classmethod
    def build(cls, offsets: torch.Tensor, num_seeds: int, num_recent: int) -> SummaryLayout:
        batch = offsets.numel() - 1
        seeds = torch.arange(batch + 1, device=offsets.device) * num_seeds if num_seeds else None
        return cls(seeds, RecentTokens.build(offsets, num_recent) if num_recent else None)


class SequenceSummary(nn.Module):
    """History tokens -> ``[B, num_cls + num_seeds + num_recent, d]`` summary tokens, self-gated.

    PMA: learned seeds cross-attend (softmax) to the history; rows with an empty history get the
    bare seeds. Recent slots before the start of a short history hold a learned filler.
    """

    def __init__(self, d_model: int, num_heads: int, num_seeds: int, num_recent: int) -> None:
        super().__init__()
        self.num_heads, self.num_seeds, self.num_recent = num_heads, num_seeds, num_recent
        if num_seeds:
            if d_model % num_heads:
                raise ValueError(f"PMA needs d_model={d_model} divisible by num_heads={num_heads}")
            self.seeds = nn.Parameter(torch.randn(num_seeds, d_model) * 0.02)
            self.kv_norm = nn.LayerNorm(d_model)
            self.query = nn.Linear(d_model, d_model)
            self.key_value = nn.Linear(d_model, 2 * d_model)
            self.pma_out = nn.Linear(d_model, d_model)
        if num_recent:
            self.recent_fill = nn.Parameter(torch.zeros(num_recent, d_model))
        self.gate = nn.Linear(d_model, d_model)

    def pool_by_seeds(
        self, history: torch.Tensor, offsets: torch.Tensor, max_len: int, seed_offsets: torch.Tensor
    ) -> torch.Tensor:
        """PMA: ``history[L, d]`` -> ``[B, num_seeds, d]``; ``seed_offsets[B+1]`` from :class:`SummaryLayout`."""
        batch, d = offsets.numel() - 1, history.shape[-1]
        h, s = self.num_heads, self.num_seeds
        q = (
            self.query(self.seeds)
            .view(1, s, h, d // h)
            .expand(batch, s, h, d // h)
            .reshape(batch * s, h, d // h)
        )
        k, v = self.key_value(apply_layer_norm(self.kv_norm, history)).view(-1, 2, h, d // h).unbind(1)
        # max_len may be 0 (every history empty); any bound >= the longest is valid, and 1 keeps the
        # padded key axis non-empty.
        with profile_region(ATTENTION):
            pooled = jagged_cross_attention(q, k, v, seed_offsets, offsets, s, max(max_len, 1), activation="softmax")
        return self.seeds + self.pma_out(pooled.reshape(batch, s, d))

    def forward(
        self,
        history: torch.Tensor,
        offsets: torch.Tensor,
        max_len: int,
        cls_tokens: torch.Tensor,
        layout: SummaryLayout | None = None,
    ) -> torch.Tensor:
        """``history[L, d]``, ``offsets[B+1]``, ``cls_tokens[B, C, d]`` -> ``[B, C + S + K, d]``; ``layout``: the
        batch's :class:`SummaryLayout` (built here when None; a model with a summary per layer builds it once)."""
        layout = layout or SummaryLayout.build(offsets, self.num_seeds, self.num_recent)
        parts = [cls_tokens]
        if self.num_seeds:
            parts.append(self.pool_by_seeds(history, offsets, max_len, layout.seed_offsets))
        if self.num_recent:
            parts.append(layout.recent.gather(history, self.recent_fill))
        summary = torch.cat(parts, dim=1)
        return summary * torch.sigmoid(self.gate(summary))
