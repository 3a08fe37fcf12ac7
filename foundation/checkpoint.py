"""Single-file training checkpoints, as every layer below the training harness reads them.

``gem train`` writes one file per run (``checkpoints/last.ckpt``, a Lightning checkpoint): its
``hyper_parameters`` hold the run's experiment config (``config``, a dict) and the dataset's event
schema (``schema``), its ``state_dict`` the model's parameters under the prefix ``model.``. The run's
MLflow id is recorded beside ``checkpoints/`` in ``mlflow_run_id``. Files are read with
``weights_only=True``: a checkpoint never runs pickled code.

A layer that needs a trained model takes a :class:`TrainedModel` (the composition root builds it from
a checkpoint); one that needs only parameters reads them with :func:`read_training_checkpoint`.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundation.data.io import CorruptFileError
from foundation.data.schema import EventSchema
from foundation.messages import clip

RUN_ID_FILE = "mlflow_run_id"
MODEL_PREFIX = "model."


def load_checkpoint_file(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` (no pickle code execution).

    Raises :class:`CorruptFileError` with one line naming the file and why: empty, refused (it holds
    objects beyond tensors and plain containers, which only an unsafe load could build), or unreadable.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint not found")
    if path.stat().st_size == 0:
        raise CorruptFileError(f"{path}: empty file (0 bytes), not a checkpoint; was its copy or save interrupted?")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        culprit = re.search(r"GLOBAL (\S+)|Unsupported operand \S+", str(exc))
        detail = f" ({culprit.group(1) or culprit.group(0)})" if culprit else ""
        raise CorruptFileError(
            f"{path}: refused: not a weights-only checkpoint{detail}; it was not loaded, since only an "
            "unsafe load (one that can run code from the file) could build it"
        ) from None
    except Exception as exc:
        first = clip(f"{type(exc).__name__}: {' '.join(str(exc).split())}", 160)
        raise CorruptFileError(f"{path}: unreadable checkpoint (truncated or corrupt?): {first}") from None


def checkpoint_run_id(ckpt_path: str | Path) -> str | None:
    """The MLflow run id that ``gem train`` leaves beside ``checkpoints/``, if any."""
    path = Path(ckpt_path).resolve().parent.parent / RUN_ID_FILE
    return path.read_text().strip() if path.is_file() else None


@dataclass
class TrainingCheckpoint:
    """A checkpoint's parts: ``config`` (the experiment config dict, empty for a bare state dict), ``schema``
    (None for a bare state dict) and ``state``, the model's tensors by model-relative name."""

    path: Path
    config: dict[str, Any]
    schema: EventSchema | None
    state: dict[str, torch.Tensor]

    @property
    def arch(self) -> str | None:
        """The checkpoint's ``model.arch`` (None for a bare state dict)."""
        return self.config.get("model", {}).get("arch")


def read_training_checkpoint(path: str | Path, *, allow_bare: bool = False) -> TrainingCheckpoint:
    """Read a ``gem train`` checkpoint; with ``allow_bare`` also a plain state dict (no config, no schema).

    A file that is neither raises ``ValueError`` naming it.
    """
    ckpt = load_checkpoint_file(path)
    hparams = ckpt.get("hyper_parameters") or {}
    if not allow_bare and ("config" not in hparams or "schema" not in hparams):
        raise ValueError(f"{path}: not a gem training checkpoint (no config/schema hyper-parameters)")
    state = ckpt.get("state_dict", ckpt)
    return TrainingCheckpoint(
        path=Path(path),
        config=hparams.get("config") or {},
        schema=EventSchema(**hparams["schema"]) if "schema" in hparams else None,
        state={k.removeprefix(MODEL_PREFIX): v for k, v in state.items() if isinstance(v, torch.Tensor)},
    )


@dataclass
class TrainedModel:
    """A model restored from the training checkpoint ``path``, with the run facts its consumers record.

    ``config`` is the run's experiment config as saved (``config["data"]["max_len"]``, ...); ``model``
    follows the model protocol of :mod:`foundation.model.outputs`.
    """

    model: nn.Module
    schema: EventSchema
    path: Path
    config: dict[str, Any]

    @property
    def arch(self) -> str:
        return self.config["model"]["arch"]

    @property
    def flavor(self) -> str:
        return self.config["name"]

    @property
    def max_len(self) -> int:
        """The history cap the model was trained with."""
        return self.config["data"]["max_len"]

    @property
    def batch_size(self) -> int:
        return self.config["data"]["batch_size"]
