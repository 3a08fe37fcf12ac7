"""``bench_jagged_attention --teacher --kernel-profile``: per-kernel times of a teacher-shaped forward+backward,
here on the CPU dry run's interpreter (operators instead of CUDA kernels)."""

from __future__ import annotations

import torch

from experiments import bench_jagged_attention as bench


def test_kernel_times_split_a_call_by_pass_and_leave_no_gradient_behind(monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    batch = bench.teacher_batch([5, 3], torch.Generator().manual_seed(0), biased=True)
    times = bench.kernel_times(batch, calls=1)
    # The forward and the backward pass each show up, the slowest first.
    assert {"_JaggedAttentionFn", "_JaggedAttentionFnBackward"} <= set(times)
    assert list(times.values()) == sorted(times.values(), reverse=True) and min(times.values()) > 0
    assert all(x.grad is None for x in batch["grads"])
