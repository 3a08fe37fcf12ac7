"""One place that maps ``model.arch`` to a builder; the harness never imports a model class directly."""

from __future__ import annotations

from torch import nn

from foundation.config import ModelConfig
from foundation.data.schema import EventSchema
from foundation.model.baseline import DLRMBaseline
from foundation.model.teacher import build_teacher
from value_models.student import StudentRanker


def build_model(cfg: ModelConfig, schema: EventSchema) -> nn.Module:
    builders = {
        "dlrm": lambda: DLRMBaseline(cfg.dlrm, schema, cfg.loss_weights),
        "teacher": lambda: build_teacher(cfg.teacher, schema),
        "student": lambda: StudentRanker(cfg.student, schema),
    }
    if cfg.arch not in builders:
        raise ValueError(f"unknown model.arch {cfg.arch!r}; choose one of {sorted(builders)}")
    return builders[cfg.arch]()
