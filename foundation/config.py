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

    Parameter sharing (:mod:`transfer.sharing`): ``share_from`` names a teacher checkpoint whose tables
    start the student's, matched by feature (``share_tables``, student -> teacher table, overrides the map);
    ``share_towers`` maps student submodules to teacher parameter prefixes; ``share_policy`` is ``freeze``,
    ``finetune`` or ``finetune_lower_lr`` (at ``share_lr_scale`` times ``train.lr``). ``shared_dims`` is
    filled when the student is built (teacher dim per shared table) so a trained student loads without the teacher.
    """

    teacher_outputs: dict[str, str] = field(default_factory=dict)
    checkpoint_sha256: str = ""
    share_from: str = ""
    share_tables: dict[str, str] = field(default_factory=dict)
    share_towers: dict[str, str] = field(default_factory=dict)
    share_policy: str = "freeze"
    share_lr_scale: float = 0.1
    shared_dims: dict[str, int] = field(default_factory=dict)


@dataclass
class ParallelSettings:
    """Distributed training through :mod:`foundation.parallel.strategy` (off: plain single-device Lightning).

    Attributes:
        dp_replicate, dp_shard, tp, cp, emb_shard: degrees of :class:`foundation.parallel.ParallelDims`;
            one dense degree may be ``-1`` (the rest of the world size), checked at launch by :meth:`validate`.
        backend: ``gloo``/``nccl``; empty: nccl on GPUs, gloo on CPU.
        shard_embeddings, sharding_types, sparse_optimizer, sparse_lr: torchrec table sharding and the
            fused sparse optimizer; fsdp, param_dtype, activation_checkpointing, compile, cp_attention: the dense
            part (see :class:`foundation.parallel.ParallelConfig`).
        balance: every data-parallel rank reads the same global batch (``data.batch_size`` and
            ``data.token_budget`` are then global) and keeps a share of rows with even attention work
            (``len + attention_weight * len**2``, :mod:`foundation.parallel.balance`); off: each rank
            reads its own row groups.
        checkpoints_kept: DCP step directories kept.
    """

    enabled: bool = False
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    cp: int = 1
    emb_shard: int = -1
    backend: str = ""
    shard_embeddings: bool = True
    sharding_types: tuple[str, ...] = ("table_wise",)
    sparse_optimizer: str = "rowwise_adagrad"
    sparse_lr: float = 0.01
    fsdp: bool = True
    param_dtype: str = "fp32"
    activation_checkpointing: bool = False
    compile: bool = False
    cp_attention: str = "gather"
    balance: bool = True
    attention_weight: float = 1.0
    checkpoints_kept: int = 2

    def validate(self, world_size: int) -> None:
        """Raise :class:`ConfigError` naming the first bad ``parallel.*`` field for a run of ``world_size`` ranks."""
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "emb_shard"):
            value = getattr(self, name)
            if value == 0 or value < -1:
                raise ConfigError(f"parallel.{name}={value}: must be a positive degree or -1 (inferred)")
        inferred = [n for n in ("dp_replicate", "dp_shard", "tp", "cp") if getattr(self, n) == -1]
        if len(inferred) > 1:
            raise ConfigError(f"parallel.{inferred[1]}=-1: only one degree may be inferred (also {inferred[0]}=-1)")
        known = self.dp_replicate * self.dp_shard * self.tp * self.cp * (-1 if inferred else 1)
        if (inferred and world_size % known) or (not inferred and known != world_size):
            field_name = inferred[0] if inferred else "dp_shard"
            raise ConfigError(
                f"parallel.{field_name}: degrees dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} "
                f"tp={self.tp} cp={self.cp} do not fit the world size {world_size}"
            )
        if self.emb_shard != -1 and world_size % self.emb_shard:
            raise ConfigError(f"parallel.emb_shard={self.emb_shard}: must divide the world size {world_size}")
        if self.backend not in ("", "gloo", "nccl"):
            raise ConfigError(f"parallel.backend={self.backend!r}: must be '', 'gloo' or 'nccl'")
        if self.sparse_lr <= 0:
            raise ConfigError(f"parallel.sparse_lr={self.sparse_lr}: must be positive")
        if self.attention_weight < 0:
            raise ConfigError(f"parallel.attention_weight={self.attention_weight}: must be >= 0")
        if self.checkpoints_kept < 1:
            raise ConfigError(f"parallel.checkpoints_kept={self.checkpoints_kept}: must be >= 1")


@dataclass
class ExperimentConfig:
    name: str = "debug"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)

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
