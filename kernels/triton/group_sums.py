"""Column sums over a launch's programs without a reduction launch of its own: the last program of a group adds them.

A backward that sums a gradient over its rows (a norm's weight, a projection's bias) has each program store its
float32 partial sums of a ``[N]`` vector; the programs come in groups of ``GROUP``, and each program then raises its
group's arrival count (:func:`arrived_last`). The last to arrive sees every store of its group and adds the group's
partials in program order (:func:`sum_partials`), whichever finished first, then adds that into the totals with
float atomics, or, with ``GEM_KERNELS_DETERMINISTIC=1``, stores it as the group's row for the host to add in order
(:func:`put_group_sum`, :meth:`GroupSums.total`): the gradients then do not depend on which group finished first.
Used by :mod:`kernels.triton.layer_norm` and :mod:`kernels.triton.silu_split`; the per-row modulation
(:mod:`kernels.triton.row_modulate`) counts its chunks' arrivals with :func:`arrived_last`.

Works on triton 3.6 and 3.9, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import settings


@triton.jit
def arrived_last(count_ptr, programs):
    """Raises the arrival count at ``count_ptr`` once every thread of this program has stored its partial sums
    (the barrier), with acquire-release order: true in the last of ``programs`` to arrive, which then sees all of
    their stores."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr, 1, sem="acq_rel") == programs - 1


@triton.jit
def sum_partials(partial_ptr, stride, first, count, offsets, mask):
    """Float32, ``offsets``' shape: the partial sums ``partial_ptr + p * stride + offsets`` of programs ``p`` in
    ``[first, first + count)``, added in that order. A program's several sums go in as one block (e.g. ``[sums,
    N]``), so that each step of the loop issues all of their loads at once. Read past L1 (``.cg``): other SMs
    wrote them."""
    total = tl.zeros(offsets.shape, dtype=tl.float32)
    for p in range(first, first + count):
        total += tl.load(partial_ptr + p * stride + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def put_group_sum(sums_ptr, stride, group, total, offsets, mask, ATOMIC_TOTALS: tl.constexpr):
    """Adds a group's ``total`` (at ``offsets``, as :func:`sum_partials`) into the totals ``sums_ptr[N]``
    (``ATOMIC_TOTALS``), or stores it in row ``group`` of ``sums_ptr[groups, N]`` (row stride ``stride``)."""
    if ATOMIC_TOTALS:
        tl.atomic_add(sums_ptr + offsets, total, mask=mask, sem="relaxed")
    else:
        tl.store(sums_ptr + group * stride + offsets, total, mask=mask)


class GroupSums:
    """One backward launch's buffers: ``partial[programs, N]`` float32 (each program's sums), ``counts[groups,
    count_columns]`` int32 arrival counts (one per group and column tile of the launch), and ``sums``, the totals
    ``[N]`` (atomics) or each group's ``[groups, N]`` (deterministic). The counts and the sums are zero-filled by
    one launch (the sums 16-byte aligned after the counts)."""

    def __init__(self, programs: int, group: int, n: int, device: torch.device, count_columns: int = 1) -> None:
        self.groups = triton.cdiv(programs, group)
        self.atomic = not settings.deterministic()
        sums_shape = (n,) if self.atomic else (max(self.groups, 1), n)
        counts = self.groups * count_columns
        counts_len = triton.cdiv(counts, 4) * 4
        zeroed = torch.zeros(counts_len + math.prod(sums_shape), device=device, dtype=torch.int32)
        self.counts = zeroed[:counts].view(self.groups, count_columns)
        self.sums = zeroed[counts_len:].view(torch.float32).view(sums_shape)
        self.partial = torch.empty(programs, n, device=device, dtype=torch.float32)

    def total(self) -> torch.Tensor:
        """``[N]`` float32: the sums over every program (after the launch)."""
        return self.sums if self.atomic else self.sums.sum(0)
