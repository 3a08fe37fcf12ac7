"""Tensors the kernels derive from a batch's layout, kept for the next call on the same batch.

Every layer of a model runs its kernels over the same batch: the sequences' launch order, their relative
timestamps, the row boundaries of a modulation are the same at every layer. :func:`per_batch` returns the
value computed for the same input tensors (the same objects, unchanged since: same ``_version``) instead of
launching the few kernels that compute it again. A few values are kept per name; new batches replace them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# The latest values per name, newest first: a model may alternate a few (self- and cross-attention offsets).
_LAST: dict[str, list[tuple[tuple, torch.Tensor]]] = {}
KEEP = 4


def per_batch(
    name: str, inputs: tuple[torch.Tensor | None, ...], compute: Callable[[], torch.Tensor], *, extra: tuple = ()
) -> torch.Tensor:
    """``compute()``, or its value from one of the last ``KEEP`` calls of ``name`` on the same, unmodified
    ``inputs`` and equal ``extra`` (the non-tensor arguments ``compute`` depends on)."""
    key = (extra, *((t, t._version) if t is not None else None for t in inputs))
    entries = _LAST.setdefault(name, [])
    for i, (last, value) in enumerate(entries):
        if _same_key(last, key):
            entries.insert(0, entries.pop(i))
            return value
    value = compute()
    entries.insert(0, (key, value))
    del entries[KEEP:]
    return value


def _same_key(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and a[0] == b[0] and all(_same(x, y) for x, y in zip(a[1:], b[1:], strict=True))


def _same(a: tuple | None, b: tuple | None) -> bool:
    return a is b if a is None or b is None else a[0] is b[0] and a[1] == b[1]
