"""Input checks of the attention dispatchers: each raises ValueError naming the argument.

Every call checks what costs no device sync: shapes, dtypes, devices, and the values of CPU
tensors. The values of device offsets and ``num_targets`` (sorted, in range) are validated once
where batches are built (the data pipeline builds offsets from lengths on the host); inside a
training step a check of them would stall the host on the GPU at every call. :func:`check_values`
turns those checks on for CUDA tensors too, to debug a pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

_CHECK_VALUES: ContextVar[bool] = ContextVar("jagged_attention_check_values", default=False)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@contextlib.contextmanager
def check_values(enabled: bool = True) -> Iterator[None]:
    """Inside the context the dispatchers also check the values of offsets and ``num_targets`` on
    CUDA tensors (one device sync per call); outside, only on CPU tensors, where it costs no sync."""
    token = _CHECK_VALUES.set(enabled)
    try:
        yield
    finally:
        _CHECK_VALUES.reset(token)


def values_checked(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" or _CHECK_VALUES.get()


def check_offsets(name: str, offsets: torch.Tensor, rows: int, max_len: int, device: torch.device) -> int:
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor [B + 1], got {getattr(offsets, 'shape', offsets)}")
    if offsets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be int64 or int32, got {offsets.dtype}")
    if offsets.device != device:
        raise ValueError(f"{name} is on {offsets.device} but the inputs are on {device}")
    if not isinstance(max_len, int) or max_len < 0:
        raise ValueError(f"the max length for {name} must be a non-negative int, got {max_len!r}")
    if values_checked(offsets):
        _check_offset_values(name, offsets, rows, max_len)
    return offsets.numel() - 1


def _check_offset_values(name: str, offsets: torch.Tensor, rows: int, max_len: int) -> None:
    lengths = offsets[1:] - offsets[:-1]
    # One device sync for every value check together.
    first, last, shortest, longest = torch.stack(
        [
            offsets[0],
            offsets[-1],
            lengths.min() if lengths.numel() else offsets[0] * 0,
            lengths.max() if lengths.numel() else offsets[0] * 0,
        ]
    ).tolist()
    if first != 0 or last != rows:
        raise ValueError(f"{name} must start at 0 and end at the row count {rows}, got {first}..{last}")
    if shortest < 0:
        raise ValueError(f"{name} must be non-decreasing")
    if longest > max_len:
        raise ValueError(f"{name} has a sequence of length {longest} > max length {max_len}")


def check_num_targets(num_targets: torch.Tensor, offsets: torch.Tensor, batch: int, device: torch.device) -> None:
    if not isinstance(num_targets, torch.Tensor) or num_targets.shape != (batch,):
        raise ValueError(f"num_targets must be [B]=[{batch}], got {getattr(num_targets, 'shape', num_targets)}")
    if num_targets.device != device or num_targets.dtype.is_floating_point:
        raise ValueError(f"num_targets must be an integer tensor on {device}")
    if values_checked(num_targets):
        lengths = offsets[1:] - offsets[:-1]
        if bool(((num_targets < 0) | (num_targets > lengths)).any()):
            raise ValueError("num_targets must lie in [0, length] for every sequence")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, same_rows: bool) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [L, H, D], got {getattr(x, 'shape', x)}")
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be a floating tensor, got {x.dtype}")
        if x.device != q.device or x.dtype != q.dtype:
            raise ValueError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), got {x.dtype}, {x.device}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on [L, H]")
    if q.shape[1] != k.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on H and Dqk")
    if same_rows and q.shape[0] != k.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same rows L")


def check_table(name: str, table: torch.Tensor | None, heads: int, q: torch.Tensor) -> None:
    if table is None:
        return
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] not in (1, heads):
        raise ValueError(f"{name} must be [H, P] or [1, P] with H={heads}, got {getattr(table, 'shape', table)}")
    if table.shape[1] < 1 or table.device != q.device or not table.dtype.is_floating_point:
        raise ValueError(f"{name} must be a non-empty floating table on {q.device}")


def check_timestamps(name: str, ts: torch.Tensor, q: torch.Tensor) -> None:
    if not isinstance(ts, torch.Tensor) or ts.shape != (q.shape[0],) or ts.dtype != torch.int64 or ts.device != q.device:
        raise ValueError(f"{name} must be int64 [L]=[{q.shape[0]}] on {q.device}, got {getattr(ts, 'shape', ts)}")
