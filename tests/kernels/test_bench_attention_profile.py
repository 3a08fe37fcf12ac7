"""``bench_jagged_attention --teacher --kernel-profile``: per-kernel times of a teacher-shaped forward+backward,
here on the CPU dry run's interpreter (operators instead of CUDA kernels)."""

from __future__ import annotations

import torch

from experiments import bench_jagged_attention as bench


def test_kernel_times_split_a_call_by_pass_and_leave_no_gradient_behind(monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    batch = bench.teacher_batch([5, 3], torch.Generator().manual_seed(0), bench.TEACHER_VARIANTS["biased"])
    times = bench.kernel_times(batch, calls=1)
    # The forward and the backward pass each show up, the slowest first.
    assert {"_JaggedAttentionFn", "_JaggedAttentionFnBackward"} <= set(times)
    assert list(times.values()) == sorted(times.values(), reverse=True) and min(times.values()) > 0
    assert all(x.grad is None for x in batch["grads"])
    # Each profiled call starts from fresh gradients: no accumulation into the previous call's is timed.
    assert "aten::add_" not in times


def test_teacher_tables_time_each_bias_table_alone(monkeypatch):
    """``--teacher-tables``: the position-only and time-only variants carry their own table and not the other, and
    each gets its times and its ratio to the unbiased variant beside the biased one's."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    gen = torch.Generator().manual_seed(0)
    time_only = bench.teacher_batch([5, 3], gen, tables=("time",))["options"]
    position_only = bench.teacher_batch([5, 3], gen, tables=("position",))["options"]
    assert "time_bias" in time_only and "timestamps" in time_only and "pos_bias" not in time_only
    assert "pos_bias" in position_only and "time_bias" not in position_only
    _, rows = bench.bench_teacher([8], ["full"], tokens=16, repeats=1, rep=1, tables=True)
    (row,) = rows
    for variant in ("unbiased", "biased", "position", "time"):
        assert row[f"{variant}_fwdbwd_ms"] > 0
    assert row["time_ratio_fwdbwd"] == row["time_fwdbwd_ms"] / row["unbiased_fwdbwd_ms"]
    assert "position table only" in bench.fmt_teacher(row)
