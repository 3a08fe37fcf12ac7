"""Typed experiment configs and dotted overrides.

An :class:`ExperimentConfig` is a tree of dataclasses. Named flavors live in
``experiments/flavors.py``; the CLI takes a flavor and ``section.field=value`` overrides, e.g.
``gem train --flavor debug train.max_epochs=2 data.max_len=64``.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from foundation.data.pipeline import DataConfig
from foundation.model.teacher_config import TeacherConfig, teacher_flavor
from value_models.student import StudentConfig


@dataclass
class DLRMConfig:
    """DLRM-style baseline: pooled embeddings, dot interaction, MLP, per-domain task heads."""

    embedding_dim: int = 32
    bottom_mlp: tuple[int, ...] = (64, 32)
    top_mlp: tuple[int, ...] = (256, 128)
    use_history: bool = True
    repr_dim: int = 64


@dataclass
class ModelConfig:
    """``arch`` (``dlrm``, ``teacher`` or ``student``) picks the builder in ``foundation.model.registry``; the
    matching sub-config is used. ``loss_weights`` weigh the DLRM's tasks; the teacher carries its own.
    """

    arch: str = "dlrm"
    dlrm: DLRMConfig = field(default_factory=DLRMConfig)
    teacher: TeacherConfig = field(default_factory=lambda: teacher_flavor("debug"))
    student: StudentConfig = field(default_factory=StudentConfig)
    loss_weights: dict[str, float] = field(default_factory=lambda: {"click": 1.0, "conversion": 1.0})


@dataclass
class TrainConfig:
    max_epochs: int = 1
    max_steps: int = -1
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    precision: str = "32-true"
    accelerator: str = "auto"
    devices: int = 1
    log_every_n_steps: int = 10
    checkpoint_every_n_steps: int = 50
    val_check_interval: float = 1.0
    out_dir: str = "runs"
    experiment: str = "gem"
    tracking_uri: str = ""
    progress_bar: bool = True


@dataclass
class TransferConfig:
    """Teacher outputs (:mod:`transfer.teacher_outputs`) a student trains and is evaluated with.

    ``teacher_outputs`` maps a split name (``train``, ``valid``, ``test``) to its output directory; a
    model whose ``forward`` takes ``teacher=`` gets each batch's rows, joined by ``example_id``. Every
    directory must come from one teacher checkpoint: ``checkpoint_sha256`` when set, else the first read.
    """

    teacher_outputs: dict[str, str] = field(default_factory=dict)
    checkpoint_sha256: str = ""


@dataclass
class ExperimentConfig:
    name: str = "debug"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def flat(self) -> dict[str, Any]:
        """``{"train.lr": 1e-3, ...}``: the resolved config as MLflow params."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            else:
                out[prefix] = value

        walk("", self.to_dict())
        return out


def dataclass_from_dict(cls: type, d: dict[str, Any]) -> Any:
    """Rebuild a (nested) config dataclass from ``dataclasses.asdict`` output, e.g. a checkpoint's."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        value, hint = d[f.name], hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = dataclass_from_dict(hint, value)
        elif typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def experiment_from_dict(d: dict[str, Any]) -> ExperimentConfig:
    return dataclass_from_dict(ExperimentConfig, d)


class ConfigError(ValueError):
    """A bad flavor name or override; the message says which and what is allowed."""


def _coerce(raw: str, target_type: Any, key: str) -> Any:
    origin = typing.get_origin(target_type)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(target_type) if a is not type(None)]
        return None if raw.lower() in ("none", "null") else _coerce(raw, args[0], key)
    try:
        if target_type is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if target_type in (int, float, str):
            return target_type(raw)
        if origin is tuple:
            (elem, *_) = typing.get_args(target_type)
            parts = [p for p in raw.strip("()[] ").split(",") if p.strip()]
            return tuple(_coerce(p.strip(), elem, key) for p in parts)
        if origin is dict:
            return json.loads(raw)
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"override {key}={raw!r}: cannot parse as {target_type}") from exc
    raise ConfigError(f"override {key}: unsupported field type {target_type}")


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Apply ``section.field=value`` strings in place; values are parsed by the field's declared type."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        node = cfg
        parts = key.strip().split(".")
        for depth, part in enumerate(parts):
            if not dataclasses.is_dataclass(node):
                raise ConfigError(f"override {key!r}: {'.'.join(parts[:depth])} is not a config section")
            names = {f.name: f for f in dataclasses.fields(node)}
            if part not in names:
                raise ConfigError(f"override {key!r}: unknown field {part!r}; valid: {sorted(names)}")
            if depth == len(parts) - 1:
                hints = typing.get_type_hints(type(node))
                setattr(node, part, _coerce(raw.strip(), hints[part], key))
            else:
                node = getattr(node, part)
    return cfg
