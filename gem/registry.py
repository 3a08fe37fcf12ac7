"""The architectures a run can name as ``model.arch``: how each is built, and its item-id table.

Building a model also applies its kernel switches (``model.kernels``, :mod:`kernels.settings`) to the
process, so every model runs the kernels its config asks for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from foundation.data.schema import EventSchema
from foundation.model.baseline import ITEM_TABLE as DLRM_ITEM_TABLE
from foundation.model.baseline import DLRMBaseline
from foundation.model.embeddings import ITEM_TABLE as TEACHER_ITEM_TABLE
from foundation.model.teacher import build_teacher
from gem.config import ModelConfig
from kernels.settings import apply_kernel_settings
from value_models.student import ITEM_TABLE as STUDENT_ITEM_TABLE
from value_models.student import StudentRanker


@dataclass(frozen=True)
class Arch:
    """``build(cfg, schema)`` makes the model; ``item_table`` names its item-id embedding table (every other
    table is ``t_<feature>`` in all of them), which parameter sharing translates between archs."""

    build: Callable[[ModelConfig, EventSchema], nn.Module]
    item_table: str


ARCHS: dict[str, Arch] = {
    "dlrm": Arch(lambda cfg, schema: DLRMBaseline(cfg.dlrm, schema, cfg.loss_weights), DLRM_ITEM_TABLE),
    "teacher": Arch(lambda cfg, schema: build_teacher(cfg.teacher, schema), TEACHER_ITEM_TABLE),
    "student": Arch(lambda cfg, schema: StudentRanker(cfg.student, schema), STUDENT_ITEM_TABLE),
}
ITEM_TABLES: dict[str, str] = {name: arch.item_table for name, arch in ARCHS.items()}
# Archs whose outputs and user/item vectors may be taught and exported; the student is a value model.
TEACHER_ARCHS: tuple[str, ...] = ("dlrm", "teacher")


def build_model(cfg: ModelConfig, schema: EventSchema) -> nn.Module:
    """The ``cfg.arch`` model for ``schema``, with ``cfg.kernels`` applied to the process."""
    if cfg.arch not in ARCHS:
        raise ValueError(f"unknown model.arch {cfg.arch!r}; choose one of {sorted(ARCHS)}")
    apply_kernel_settings(cfg.kernels)
    return ARCHS[cfg.arch].build(cfg, schema)
