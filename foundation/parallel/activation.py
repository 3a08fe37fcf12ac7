"""Activation checkpointing per block: recompute a block's activations in backward instead of storing them.

Applied before FSDP so that each ``fully_shard`` unit wraps the checkpointed block (the gathered
parameters are then needed once more in backward, which FSDP2 handles by re-gathering).
``checkpoint_wrapper`` strips its own prefix from ``state_dict`` keys, so checkpoints and exports
keep the single-device names.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from foundation.parallel.fsdp import find_unit_paths


def apply_activation_checkpointing(model: nn.Module, units: tuple[str, ...] | None = None) -> list[str]:
    """Replace every block (see :func:`find_unit_paths`) by its checkpointed wrapper; returns their paths.

    Recomputation replays the block's forward, so random ops (dropout) must draw the same numbers:
    ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``) restores the RNG state.
    """
    paths = find_unit_paths(model, units)
    for path in paths:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        # setattr works for ModuleList items too: their children are registered under "0", "1", ...
        setattr(parent, child, checkpoint_wrapper(parent.get_submodule(child)))
    return paths
