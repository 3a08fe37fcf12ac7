"""Index helpers for jagged token batches (``tokens[L, ...]`` with ``offsets[B+1]``), never padding.

All helpers build gather indices on the tokens' device without host syncs, so they run the same on
CPU and GPU and stay differentiable with respect to the gathered tokens. Gathers go through
``index_select`` (or :class:`PermuteRows`) rather than advanced indexing, whose backward is
``index_put_(accumulate=True)``: on the GPU that sorts the indices and runs
``indexing_backward_kernel``, where a permutation needs only the inverse gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def token_rows(offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[L]`` row (sequence) index of every token, from ``offsets[B+1]``."""
    lengths = offsets[1:] - offsets[:-1]
    rows = torch.arange(lengths.numel(), device=offsets.device)
    return torch.repeat_interleave(rows, lengths, output_size=num_tokens)


def token_positions(offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[L]`` position of every token inside its sequence (0 = oldest)."""
    return torch.arange(rows.numel(), device=rows.device) - offsets[rows]


def gather_rows(
    tokens: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, fill: torch.Tensor
) -> torch.Tensor:
    """``tokens[index]`` where ``valid`` else ``fill``; safe when ``tokens`` is empty.

    Args:
        tokens: ``[L, D]``.
        index: ``[...]`` int64 into ``tokens`` (ignored where not valid).
        valid: ``[...]`` bool.
        fill: broadcastable to ``[..., D]``.
    """
    if tokens.shape[0] == 0:
        return fill.expand(*index.shape, tokens.shape[-1]).to(tokens.dtype)
    flat = index.clamp(0, tokens.shape[0] - 1).flatten()
    picked = tokens.index_select(0, flat).view(*index.shape, tokens.shape[-1])
    return torch.where(valid.unsqueeze(-1), picked, fill.to(picked.dtype))


@dataclass
class RecentTokens:
    """Where the ``k`` most recent tokens of every sequence are, oldest first (read with :func:`gather_rows`).

    Attributes:
        index: ``[B, k]`` token index of each slot, oldest first (ignored where not valid).
        valid: ``[B, k]`` bool, False for slots before the start of a shorter sequence.
    """

    index: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def build(cls, offsets: torch.Tensor, k: int) -> RecentTokens:
        index = offsets[1:, None] - k + torch.arange(k, device=offsets.device)
        return cls(index, index >= offsets[:-1, None])



class PermuteRows(torch.autograd.Function):
    """``x[index]`` along dim 0 for a permutation ``index`` whose inverse is ``inverse``: the backward is
    the inverse gather ``grad[inverse]``, not a scatter-add."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


@dataclass
class SuffixLayout:
    """Where ``S`` per-row suffix tokens (CLS, candidate) sit once appended after every history.

    Row ``b`` of the combined sequence is ``[history_b (n_b tokens), suffix_b (S tokens)]``, so the
    suffix tokens are the last ``S`` tokens of each sequence: the attention kernel's targets.

    Attributes:
        offsets: ``[B+1]`` offsets of the combined sequences.
        history_index: ``[L]`` where each history token lands.
        suffix_index: ``[B, S]`` where each suffix token lands.
        order: ``[L + B*S]`` gather index from ``cat(history, suffix.flatten(0, 1))`` to combined.
        inverse: ``[L + B*S]`` the inverse permutation, ``cat(history_index, suffix_index.flatten())``:
            where each element of ``cat(history, suffix.flatten(0, 1))`` lands.
        num_suffix: ``S``.
    """

    offsets: torch.Tensor
    history_index: torch.Tensor
    suffix_index: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor
    num_suffix: int

    @classmethod
    def build(cls, offsets: torch.Tensor, num_tokens: int, num_suffix: int) -> SuffixLayout:
        device = offsets.device
        batch = offsets.numel() - 1
        rows = token_rows(offsets, num_tokens)
        combined_offsets = offsets + torch.arange(batch + 1, device=device) * num_suffix
        history_index = torch.arange(num_tokens, device=device) + rows * num_suffix
        suffix_index = combined_offsets[1:, None] - num_suffix + torch.arange(num_suffix, device=device)
        inverse = torch.cat([history_index, suffix_index.flatten()])
        order = torch.empty_like(inverse)
        order[inverse] = torch.arange(inverse.numel(), device=device)
        return cls(combined_offsets, history_index, suffix_index, order, inverse, num_suffix)

    def combine(self, history: torch.Tensor, suffix: torch.Tensor) -> torch.Tensor:
        """``history[L, ...]`` and ``suffix[B, S, ...]`` -> combined ``[L + B*S, ...]``."""
        return PermuteRows.apply(torch.cat([history, suffix.flatten(0, 1)]), self.order, self.inverse)

    def split(self, combined: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Combined ``[L + B*S, ...]`` -> ``(history[L, ...], suffix[B, S, ...])``."""
        parts = PermuteRows.apply(combined, self.inverse, self.order)
        history, suffix = parts.split([self.history_index.numel(), self.suffix_index.numel()])
        return history, suffix.view(*self.suffix_index.shape, *combined.shape[1:])

    def num_targets(self) -> torch.Tensor:
        """``[B]``: every row's suffix tokens are attention targets."""
        return torch.full_like(self.offsets[1:], self.num_suffix)
