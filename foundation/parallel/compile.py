"""``torch.compile`` per block: each block compiled on its own, the rest of the model left eager.

Per-block compilation (torchtitan's choice) keeps compile time bounded by one block's graph, reuses
one compiled graph for every block of the same shape, and leaves the torchrec lookups and jagged
bookkeeping between blocks eager. ``nn.Module.compile`` compiles in place, so parameter names,
``state_dict`` keys and the FSDP units applied afterwards are unchanged. Jagged batches change the
token count every step, hence ``dynamic=True``.

Applied after tensor parallelism and activation checkpointing and before FSDP. Not combined with
context parallelism: its forward hooks run collectives that would split the compiled graph.
"""

from __future__ import annotations

from torch import nn

from foundation.parallel.fsdp import find_unit_paths


def apply_compile(model: nn.Module, units: tuple[str, ...] | None = None) -> list[str]:
    """Compile every block (see :func:`find_unit_paths`) in place; returns their paths."""
    paths = find_unit_paths(model, units)
    for path in paths:
        model.get_submodule(path).compile(dynamic=True)
    return paths
