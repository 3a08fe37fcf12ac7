"""Distributed checkpoints (torch.distributed.checkpoint) of a parallelized model that reshard on load.

One checkpoint holds, under flat fully-qualified keys:

- ``model.*``: the model's ``state_dict`` (FSDP's DTensors, torchrec's ShardedTensors, plain tensors);
- ``dense_optim.<param fqn>.<state>``: AdamW's per-parameter state (DTensors, like the parameters);
- ``sparse_optim.<module fqn>.<param key>.<state>``: the fused sparse optimizer's state per table
  (ShardedTensors laid out like the tables);
- ``progress.step``: how many optimizer steps were taken (the data position to resume from);
- optionally ``extra.pt`` beside DCP's files: small picklable-free state from rank 0 (a Lightning
  checkpoint's loops, callbacks, data position and RNG), read back by :func:`load_extra`.

Checkpoints live in ``root/step_<N>/`` and are published atomically (see :func:`save_checkpoint`).

Every tensor is saved with its global shape and shard offsets, so a checkpoint written at one world
size and layout (e.g. 4 ranks, HSDP 2 x 2, tables row/column-wise) loads into another (2 ranks
table-wise, or 1 rank): DCP reads into whatever shards the loading ranks own. Optimizer state that
depends on the layout (row-wise Adagrad under column-wise sharding keeps one scalar per row shard)
cannot reshard exactly; use exact ``adagrad`` or ``adam`` for tables that change layout.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torchrec.distributed.types import ShardedModule


def fused_optimizers(model: nn.Module) -> dict[str, object]:
    """Module fqn -> the torchrec ``KeyedOptimizer`` fused into each sharded embedding module."""
    return {
        path: m.fused_optimizer
        for path, m in model.named_modules()
        if isinstance(m, ShardedModule) and hasattr(m, "fused_optimizer")
    }


def ensure_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate AdamW's state (zeros) where it does not exist yet, so that a load can fill it in place."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }


def dense_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``<param fqn>.<state name>`` -> tensor, for every parameter the optimizer holds state for."""
    out = {}
    for name, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            out[f"{name}.{key}"] = value
    return out


def sparse_optimizer_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``<module fqn>.<param key>.<state name>`` -> the fused optimizer's state tensors (views of the kernel's)."""
    out = {}
    for path, optimizer in fused_optimizers(model).items():
        for param_key, states in optimizer.state_dict()["state"].items():
            for name, value in states.items():
                out[f"{path}.{param_key}.{name}"] = value
    return out


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, object]:
    """The flat dict DCP saves or loads in place (see the module docstring for its keys)."""
    state: dict[str, object] = {f"model.{k}": v for k, v in model.state_dict().items()}
    state.update({f"dense_optim.{k}": v for k, v in dense_optimizer_state(model, optimizer).items()})
    state.update({f"sparse_optim.{k}": v for k, v in sparse_optimizer_state(model).items()})
    state["progress.step"] = torch.tensor(step)
    return state


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    """A checkpoint is complete once it was renamed into place with DCP's metadata (written last)."""
    return path.is_dir() and not path.name.startswith(".") and (path / ".metadata").is_file()


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete ``step_*`` checkpoint with the highest step under ``root`` (partial writes are ignored)."""
    root = Path(root)
    done = [p for p in root.glob("step_*") if is_complete(p)] if root.is_dir() else []
    return max(done, key=lambda p: int(p.name.removeprefix("step_")), default=None)


EXTRA_FILE = "extra.pt"


def save_checkpoint(
    root: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Collective: write ``root/step_<step>`` atomically; returns its path.

    Every rank writes its shards into a hidden temporary directory (rank 0 adds ``extra``); after
    all ranks are done, rank 0 renames it into place. A run killed mid-save leaves only the
    temporary directory, which :func:`latest_checkpoint` never picks. A checkpoint already at
    ``step`` (saved twice at one step, e.g. by a callback and at the end of training) is replaced.
    """
    final = step_dir(root, step)
    tmp = final.with_name(f".{final.name}.tmp")
    if dist.get_rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left by a save that was killed; DCP would mix its files with ours
    dist.barrier()
    dcp.save(checkpoint_state(model, optimizer, step), checkpoint_id=str(tmp))
    if dist.get_rank() == 0 and extra is not None:
        torch.save(extra, tmp / EXTRA_FILE)
    dist.barrier()
    if dist.get_rank() == 0:
        replace_directory(tmp, final)
    dist.barrier()
    return final


def replace_directory(src: Path, dst: Path) -> None:
    """Rename ``src`` over ``dst``; an existing ``dst`` is moved aside first (a rename cannot replace a
    non-empty directory), so a reader sees the old or the new checkpoint, or none at that step."""
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        if old.exists():
            shutil.rmtree(old)
        dst.replace(old)
        src.replace(dst)
        shutil.rmtree(old)
    else:
        src.replace(dst)


def load_extra(path: str | Path) -> dict[str, Any]:
    """The ``extra`` dict saved with the checkpoint at ``path`` (``{}`` if none), loaded without pickle code."""
    file = Path(path) / EXTRA_FILE
    return torch.load(file, map_location="cpu", weights_only=True) if file.is_file() else {}


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints under ``root`` (rank 0 only); returns the deleted."""
    done = sorted((p for p in Path(root).glob("step_*") if is_complete(p)), key=lambda p: int(p.name[5:]))
    stale = done[:-keep] if keep > 0 else done
    for path in stale:
        shutil.rmtree(path)
    return stale


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Collective: fill ``model``, the dense and the fused sparse optimizer from ``path``; returns the step.

    ``model`` must already be parallelized (any layout); the optimizer must be the one built for it.
    """
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no DCP .metadata); use latest_checkpoint()"
        )
    ensure_adamw_state(optimizer)
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    state = checkpoint_state(model, optimizer, step=0)
    # Parameters that had no optimizer state when saved (never received a gradient, e.g. a head
    # the loss does not read) must stay fresh: AdamW starts their state at their first gradient.
    state = {k: v for k, v in state.items() if k in saved or not k.startswith("dense_optim.")}
    drop_unsaved_adamw_state(model, optimizer, saved)
    # In place: FSDP2's state_dict holds the sharded parameters themselves, torchrec's holds views
    # of the fused kernel's tables and optimizer state, so filling them updates the live model.
    dcp.load(state, checkpoint_id=str(path))
    return int(state["progress.step"])


def drop_unsaved_adamw_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: set[str]) -> None:
    for name, p in model.named_parameters():
        if p in optimizer.state and f"dense_optim.{name}.step" not in saved:
            del optimizer.state[p]
