"""InterFormer-style interleaving pieces (arXiv 2411.09852).

- :class:`PersonalizedFFN`: the non-sequence summary conditions every sequence token;
- :class:`SequenceSummary`: CLS tokens, PMA seeds attending to the history (jagged cross
  attention) and the K most recent tokens, gated, for the interaction arch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from foundation.model.jagged import RecentTokens, SuffixLayout, gather_rows
from foundation.model.norms import add_branch, apply_residual_layer_norm, deferred_bias, fused_dropout
from foundation.model.profiling import ATTENTION, profile_region
from kernels import jagged_cross_attention, jagged_silu_modulate, sigmoid_gate, unbind_pair


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
        self, x: torch.Tensor, rows: torch.Tensor, summary: torch.Tensor, *, branch: torch.Tensor | None = None,
        branch_bias: torch.Tensor | None = None, defer_residual: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``x[L, d]``, ``rows[L]`` (row of each token, sorted), ``summary[B, n, d]`` -> ``[L, d]``.

        ``branch[L, d]``, ``branch_bias[d]``: the previous block's output and its projection's bias, not yet added
        to ``x`` (its ``defer_residual``), added here in the norm's pass. ``defer_residual``: return
        ``(x, out, bias)`` instead of ``x + out + bias`` (the down projection's bias apart), for the next block to add
        in its input norm (:func:`~foundation.model.norms.apply_residual_layer_norm`): one pass over the stream
        instead of two, and the bias's gradient summed in it.
        """
        gain, shift = self.condition(self.narrow(summary).flatten(1)).chunk(2, dim=-1)
        # The stream passes through the norm's op, whose backward adds its gradient to the norm's in one pass.
        x, normed = apply_residual_layer_norm(self.norm, x, branch, branch_bias=branch_bias)
        # The up projection's bias and the 1 of 1 + g join in the modulation's kernel, whose backward sums the
        # bias's gradient per row.
        up = nn.functional.linear(normed, self.up.weight)
        hidden = jagged_silu_modulate(
            up, gain, shift, rows, bias=self.up.bias, scale_offset=1.0,
            **fused_dropout(self.dropout, up.shape, up.device),
        )
        if defer_residual:
            return x, nn.functional.linear(hidden, self.down.weight), deferred_bias(self.down)
        return x + self.down(hidden)


@dataclass
class SummaryLayout:
    """Where every layer's :class:`SequenceSummary` of one batch finds its tokens in the combined stream
    (:class:`~foundation.model.jagged.SuffixLayout`: row ``b`` is ``[history_b, suffix_b]``), built once per batch.

    The summary reads the stream where it lies instead of splitting it into history and suffix at every layer
    (a permutation of the whole float32 stream each way). Row ``b``'s history is the contiguous range
    ``[c_b, c_b + n_b)`` of the stream, so the PMA attends over ``2B`` key sequences, history and suffix of each
    row in turn, the suffix ones without queries.

    Attributes:
        num_cls: ``C``, the CLS tokens (the first of each row's suffix tokens).
        seed_offsets: ``[2B+1]`` PMA queries: ``num_seeds`` for each history, none for each suffix; or None.
        key_offsets: ``[2B+1]`` the stream as ``2B`` key sequences, ``c_b, c_b + n_b, c_{b+1}, ...``; or None.
        max_keys: at least the most keys of any of those sequences.
        has_history: ``[B]`` bool: row ``b``'s history is not empty (its PMA queries have keys).
        picks: ``[B, C + K]`` stream positions of the CLS tokens, then of the K most recent history tokens.
        pick_valid: ``[B, C + K]`` bool: False for recent slots before the start of a shorter history.
    """

    num_cls: int
    seed_offsets: torch.Tensor | None
    key_offsets: torch.Tensor | None
    max_keys: int
    has_history: torch.Tensor
    picks: torch.Tensor
    pick_valid: torch.Tensor

    @classmethod
    def build(
        cls, offsets: torch.Tensor, layout: SuffixLayout, max_len: int, num_cls: int, num_seeds: int, num_recent: int
    ) -> SummaryLayout:
        """``offsets[B+1]`` of the histories, ``layout`` of the combined stream, ``max_len`` the longest history."""
        batch, device = offsets.numel() - 1, offsets.device
        starts = layout.offsets[:-1]
        seeds = keys = None
        if num_seeds:
            seeds = (torch.arange(2 * batch + 1, device=device) + 1) // 2 * num_seeds
            ends = starts + (offsets[1:] - offsets[:-1])
            keys = torch.cat([torch.stack([starts, ends], 1).flatten(), layout.offsets[-1:]])
        cls_picks = layout.suffix_index[:, :num_cls]
        recent = RecentTokens.build(offsets, num_recent)
        # History token i of row b sits at i + b * S in the stream.
        rows = torch.arange(batch, device=device)[:, None]
        picks = torch.cat([cls_picks, recent.index + rows * layout.num_suffix], 1)
        valid = torch.cat([torch.ones_like(cls_picks, dtype=torch.bool), recent.valid], 1)
        has_history = offsets[1:] > offsets[:-1]
        return cls(num_cls, seeds, keys, max(max_len, layout.num_suffix, 1), has_history, picks, valid)


class SequenceSummary(nn.Module):
    """The combined stream -> ``[B, num_cls + num_seeds + num_recent, d]`` summary tokens, self-gated.

    CLS tokens; PMA: learned seeds cross-attend (softmax) to the history, rows with an empty history
    get the bare seeds; the K most recent history tokens, slots before the start of a short history
    holding a learned filler.

    The PMA's key projection has no bias: a bias on the keys adds the same ``q·b`` to every score of a query, which
    the softmax cancels. The value bias is added to the pooled output instead of to every value (the softmax
    weights of a query with keys sum to one), so its gradient is a sum over ``B x seeds`` rows, not over the
    stream's tokens. Checkpoints with the former ``key_value.bias`` load into this form (:meth:`_load_from_state_dict`).
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
            # Drawn as the former projection with both biases was (same initial function, same random stream).
            self.key_value = nn.Linear(d_model, 2 * d_model)
            self.value_bias = nn.Parameter(self.key_value.bias.detach()[d_model:].clone())
            self.key_value.bias = None
            self.pma_out = nn.Linear(d_model, d_model)
        if num_recent:
            self.recent_fill = nn.Parameter(torch.zeros(num_recent, d_model))
        self.gate = nn.Linear(d_model, d_model)

    def pool_by_seeds(self, normed: torch.Tensor, layout: SummaryLayout) -> torch.Tensor:
        """PMA: ``normed[L + B*S, d]`` (the normalised stream) -> ``[B, num_seeds, d]``."""
        batch, d = layout.picks.shape[0], normed.shape[-1]
        h, s = self.num_heads, self.num_seeds
        q = (
            self.query(self.seeds)
            .view(1, s, h, d // h)
            .expand(batch, s, h, d // h)
            .reshape(batch * s, h, d // h)
        )
        k, v = unbind_pair(self.key_value(normed).view(-1, 2, h, d // h))
        with profile_region(ATTENTION):
            pooled = jagged_cross_attention(
                q, k, v, layout.seed_offsets, layout.key_offsets, s, layout.max_keys, activation="softmax"
            )
        pooled = pooled.reshape(batch, s, d) + self.value_bias * layout.has_history[:, None, None]
        return self.seeds + self.pma_out(pooled)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The former projection's bias ``[keys; values]``: the keys' half cancels in the softmax (class doc).
        old = state_dict.pop(prefix + "key_value.bias", None)
        if old is not None and self.num_seeds:
            state_dict.setdefault(prefix + "value_bias", old[old.shape[0] // 2 :])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(
        self, seq: torch.Tensor, layout: SummaryLayout, branch: torch.Tensor | None = None,
        branch_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq[L + B*S, d]`` (the combined stream) -> ``(seq, summary[B, C + num_seeds + K, d])``.

        The stream comes back through the PMA's norm, whose backward adds the stream's gradient and the picked
        tokens' (CLS and recent) in its own pass; the next block reads the returned stream. ``branch[L + B*S, d]``,
        ``branch_bias[d]``: the previous block's output and its projection's bias, not yet added to ``seq`` (its
        ``defer_residual``), added in that norm's pass.
        """
        fill = self.recent_fill if self.num_recent else seq.new_zeros(0, seq.shape[-1])
        fill = torch.cat([fill.new_zeros(layout.num_cls, seq.shape[-1]), fill])
        pooled = []
        if self.num_seeds:
            # The picks come out of the norm that hands the stream on: their gradient joins the stream's there.
            rows = layout.picks.clamp(0, max(seq.shape[0] - 1, 0)).flatten()
            seq, normed, picked = apply_residual_layer_norm(self.kv_norm, seq, branch, picks=rows,
                                                            branch_bias=branch_bias)
            picked = torch.where(layout.pick_valid.unsqueeze(-1), picked.view(*layout.picks.shape, seq.shape[-1]),
                                 fill.to(picked.dtype))
            pooled.append(self.pool_by_seeds(normed, layout))
        else:
            seq = add_branch(seq, branch, branch_bias)
            picked = gather_rows(seq, layout.picks, layout.pick_valid, fill)
        parts = [picked[:, : layout.num_cls], *pooled, picked[:, layout.num_cls :]]
        summary = torch.cat(parts, dim=1)
        return seq, sigmoid_gate(summary, self.gate(summary))
