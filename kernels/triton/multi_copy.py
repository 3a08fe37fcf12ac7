"""Triton multi-tensor copy with a dtype conversion: many ``dst[i].copy_(src[i])`` in one launch.

A mixed-precision step converts every GEMM weight to bf16 before the forward and every such weight's bf16
gradient back to float32 after the backward: hundreds of tensors, from a few elements (biases) to millions.
``torch._foreach_copy_`` between dtypes falls back to one copy kernel per tensor, each too small to fill the
GPU; here one launch walks all of them. Each program copies ``BLOCK`` elements of one tensor: a device table
names, per program, its tensor, its first element and whether its block is whole and aligned (16-byte loads
without masks); per tensor, the source and destination addresses (read as
integers and cast to pointers), the element count, and the source's two strides for a 2-D source laid out
differently from its destination (a gradient that reached its weight through a transpose).

The tables are built on the host from the tensors' addresses and copied to the device once per set of
addresses, outside CUDA graph captures: a capture uses the table an eager call on the same tensors made before
it (and keeps it for its replays), or captures ``torch._foreach_copy_`` where there is none. Works on triton 3.6 and 3.9, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl

BLOCK = 4096
# Device tables of the latest sets of addresses (eager steps bring new ones), and those a CUDA graph captured,
# which its replays read: kept for the process's life.
KEEP_TABLES = 16
_TABLES: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = OrderedDict()
_CAPTURED: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}


@triton.jit
def _multi_copy_kernel(TENSORS, PROGRAMS, SRC0, DST0, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(PROGRAMS + 3 * pid)
    start = tl.load(PROGRAMS + 3 * pid + 1)
    whole = tl.load(PROGRAMS + 3 * pid + 2)  # BLOCK elements, both addresses 16-byte aligned, same layout
    row = TENSORS + 6 * t
    src = tl.load(row).to(SRC0.dtype)
    dst = tl.load(row + 1).to(DST0.dtype)
    numel = tl.load(row + 2)
    cols = tl.load(row + 3)
    block = tl.arange(0, BLOCK)
    offs = start + block.to(tl.int64)
    if whole != 0:
        # Told what the host checked, the compiler moves 16 bytes per load and store.
        src = tl.multiple_of(src, 16) + tl.multiple_of(start, BLOCK)
        dst = tl.multiple_of(dst, 16) + tl.multiple_of(start, BLOCK)
        tl.store(dst + block, _convert(tl.load(src + block), SRC0, DST0))
    else:
        mask = offs < numel
        if cols == 0:  # laid out as its destination: element i of both
            x = tl.load(src + offs, mask=mask)
        else:
            x = tl.load(src + (offs // cols) * tl.load(row + 4) + (offs % cols) * tl.load(row + 5), mask=mask)
        tl.store(dst + offs, _convert(x, SRC0, DST0), mask=mask)


@triton.jit
def _convert(x, SRC0, DST0):
    if SRC0.dtype.element_ty == tl.float32 and DST0.dtype.element_ty == tl.bfloat16:
        return bf16_nearest_even(x)
    return x.to(DST0.dtype.element_ty)


@triton.jit
def bf16_nearest_even(x):
    # Rounds as torch's cast does (to nearest, ties to even; NaN stays NaN), also in the interpreter, whose
    # conversion truncates.
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF)
    rounded = (bits >> 16).to(tl.uint16)
    return tl.where(x != x, 0x7FC0, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)


def read_layout(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int] | None:
    """``(cols, stride0, stride1)`` of ``src`` read in ``dst``'s (contiguous) order: ``cols`` 0 where both are
    contiguous; None where the kernel cannot copy the pair (a non-contiguous destination, or a source of more than
    two dimensions laid out otherwise)."""
    if not dst.is_contiguous():
        return None
    if src.is_contiguous():
        return 0, 0, 0
    if src.dim() == 2 and src.shape[1] > 0:
        return src.shape[1], src.stride(0), src.stride(1)
    return None


def _key(dsts, srcs, layouts) -> tuple:
    return tuple((d.data_ptr(), s.data_ptr(), d.numel(), *lay) for d, s, lay in zip(dsts, srcs, layouts, strict=True))


def _tables(key: tuple, dsts, srcs, layouts):
    """``(tensors [T, 6] int64, programs [P, 3] int64, P)`` on the device, cached by ``key`` (:func:`_key`: the
    tensors' addresses and layouts)."""

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.tensor([[s.data_ptr(), d.data_ptr(), d.numel(), *lay]
                             for d, s, lay in zip(dsts, srcs, layouts, strict=True)])
        aligned = (rows[:, 3] == 0) & (rows[:, 0] % 16 == 0) & (rows[:, 1] % 16 == 0)
        return rows, block_programs(rows[:, 2], aligned, BLOCK)

    return cached_tables(_TABLES, key, build, dsts[0].device)


def cached_tables(cache: OrderedDict, key: tuple, build, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(rows, programs, P)`` of ``key`` on ``device`` from ``cache``, the ``KEEP_TABLES`` latest sets kept; made
    from ``build() -> (rows, programs)`` and copied to the device (through pinned memory on CUDA) where absent."""
    cached = cache.get(key)
    if cached is not None:
        cache.move_to_end(key)
        return cached
    rows, programs = build()
    pin = device.type == "cuda"
    tensors = (rows.pin_memory() if pin else rows).to(device, non_blocking=True)
    table = (programs.pin_memory() if pin else programs).to(device, non_blocking=True)
    cache[key] = cached = (tensors, table, len(programs))
    while len(cache) > KEEP_TABLES:
        cache.popitem(last=False)
    return cached


def block_programs(numel: torch.Tensor, aligned: torch.Tensor, block: int) -> torch.Tensor:
    """``[P, 3]`` int64 programs (tensor, first element, whole) covering tensors of ``numel[T]`` elements in blocks
    of ``block``; a block is whole when it is full and its tensor ``aligned[T]`` (16-byte addresses, one layout).
    Built with tensor ops: a model's weights need ~10^5 programs."""
    blocks = (numel + block - 1) // block
    tensor = torch.repeat_interleave(torch.arange(len(numel)), blocks)
    start = (torch.arange(len(tensor)) - torch.repeat_interleave(torch.cumsum(blocks, 0) - blocks, blocks)) * block
    whole = aligned[tensor] & (start + block <= numel[tensor])
    return torch.stack([tensor, start, whole.long()], 1)


def multi_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Same contract as :func:`kernels.pytorch.multi_copy.multi_copy`."""
    pairs, rest = [], []
    for d, s in zip(dsts, srcs, strict=True):
        if d.numel() == 0:
            continue
        layout = read_layout(d, s)
        (pairs if layout is not None else rest).append((d, s, layout))
    for d, s, _ in rest:
        d.copy_(s)
    # One launch per (source, destination) dtype pair: the kernel's pointer types come from its first tensors.
    groups: dict[tuple[torch.dtype, torch.dtype], list] = {}
    for pair in pairs:
        groups.setdefault((pair[1].dtype, pair[0].dtype), []).append(pair)
    capturing = dsts[0].is_cuda and torch.cuda.is_current_stream_capturing()
    for group in groups.values():
        ds, ss, lays = zip(*group, strict=True)
        key = _key(ds, ss, lays)
        if capturing:
            if key not in _TABLES and key not in _CAPTURED:
                # A table copied to the device during a capture would be read from freed host memory at each
                # replay: made only outside captures.
                torch._foreach_copy_(list(ds), list(ss))
                continue
            _CAPTURED.setdefault(key, _TABLES.pop(key, None))
        tensors, programs, count = _CAPTURED.get(key) or _tables(key, ds, ss, lays)
        _multi_copy_kernel[(count,)](tensors, programs, ss[0], ds[0], BLOCK=BLOCK, num_warps=8)
