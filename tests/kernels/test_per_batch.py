"""Batch-level tensors the Triton wrappers derive once per batch (:mod:`kernels.triton.per_batch`): reused across
layers on the same tensors, recomputed when the batch's tensors change, even in place (a CUDA graph's static
buffers are refilled in place)."""

from __future__ import annotations

import torch

from kernels import jagged_silu_modulate
from kernels.triton import per_batch as memo
from tests.kernels.test_jagged_attention import _inputs, _offsets, _rel, _run


def test_value_is_kept_for_the_same_unchanged_tensors_only():
    calls = []

    def compute(x):
        calls.append(1)
        return x * 2

    x, y = torch.arange(4), torch.arange(4)
    first = memo.per_batch("test", (x, None), lambda: compute(x))
    assert memo.per_batch("test", (x, None), lambda: compute(x)) is first and len(calls) == 1
    assert memo.per_batch("test", (x, None), lambda: compute(x), extra=(1,)) is not first  # other arguments
    memo.per_batch("test", (y, None), lambda: compute(y))  # equal values, another tensor
    assert len(calls) == 3
    assert memo.per_batch("test", (x, None), lambda: compute(x)) is first and len(calls) == 3  # kept beside y's
    for i in range(memo.KEEP):
        memo.per_batch("test", (torch.arange(i),), lambda i=i: compute(torch.arange(i)))
    assert memo.per_batch("test", (x, None), lambda: compute(x)) is not first  # pushed out by newer batches
    x.add_(1)  # in place: same object, new version
    calls.clear()
    assert torch.equal(memo.per_batch("test", (x, None), lambda: compute(x)), torch.arange(1, 5) * 2)
    assert len(calls) == 1


def test_attention_layers_share_the_batch_order_and_times_and_see_in_place_refills():
    """Two calls on the same offsets and times (two layers) reuse what the first derived; refilling the
    timestamps and offsets in place (as a static buffer is) gives the reference's answer for the new values."""
    lengths = [9, 0, 1, 14]
    t = _inputs(lengths, 2, 16, 16, torch.float32, seed=3, pos=8, time=16)
    offsets = _offsets(lengths)
    kwargs = dict(activation="silu", causal=True, num_targets=torch.tensor([2, 0, 1, 3]))
    first = _run("triton", t, offsets, 14, 5, **kwargs)
    derived = {name: memo._LAST[name][0][1] for name in ("longest_first", "timestamps")}
    second = _run("triton", t, offsets, 14, 5, **kwargs)
    assert all(memo._LAST[name][0][1] is value for name, value in derived.items())
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True) if a is not None)
    # Refill in place: other times, and the same total split into other lengths.
    t["timestamps"].copy_(torch.randint(0, 10_000, t["timestamps"].shape).sort().values)
    offsets.copy_(_offsets([3, 12, 0, 9]))
    kwargs["num_targets"] = torch.tensor([1, 2, 0, 3])
    got = _run("triton", t, offsets, 14, 5, **kwargs)
    want = _run("pytorch", t, offsets, 14, 5, **kwargs)
    assert max(_rel(a, b) for a, b in zip(got, want, strict=True) if b is not None) < 1e-4


def test_row_modulation_sees_new_rows():
    h, scale, shift = torch.randn(6, 8), torch.randn(3, 8), torch.randn(3, 8)
    rows = torch.tensor([0, 0, 1, 1, 1, 2])
    out = jagged_silu_modulate(h, scale, shift, rows, backend="triton")
    torch.testing.assert_close(out, jagged_silu_modulate(h, scale, shift, rows, backend="pytorch"))
    rows.copy_(torch.tensor([0, 1, 1, 2, 2, 2]))
    torch.testing.assert_close(
        jagged_silu_modulate(h, scale, shift, rows, backend="triton"),
        jagged_silu_modulate(h, scale, shift, rows, backend="pytorch"),
    )
