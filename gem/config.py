"""The experiment config tree: one typed dataclass per section, flattened into MLflow params.

An :class:`ExperimentConfig` names a model (``model.arch``, built by :mod:`gem.registry`), its data, its
training, its knowledge transfer and its parallelism. Named flavors live in :mod:`gem.flavors`; the CLI
takes a flavor and ``section.field=value`` overrides (:func:`foundation.config.apply_overrides`), e.g.
``gem train --flavor debug train.max_epochs=2 data.max_len=64``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from foundation.config import dataclass_from_dict
from foundation.data.pipeline import DataConfig
from foundation.model.baseline import DLRMConfig
from foundation.model.teacher_config import TeacherConfig
from foundation.parallel.settings import ParallelSettings
from kernels.settings import KernelSettings
from value_models.student import StudentConfig


def _default_teacher() -> TeacherConfig:
    # The registry builds its flavors from this module's classes, so it is read when a default is made.
    from gem.flavors import teacher_flavor

    return teacher_flavor("debug")


@dataclass
class ModelConfig:
    """``arch`` (``dlrm``, ``teacher`` or ``student``) picks the builder in :mod:`gem.registry`; the
    matching sub-config is used. ``loss_weights`` weigh the DLRM's tasks; the teacher carries its own.
    ``kernels`` are the process-wide kernel switches, applied when the model is built.
    """

    arch: str = "dlrm"
    dlrm: DLRMConfig = field(default_factory=DLRMConfig)
    teacher: TeacherConfig = field(default_factory=_default_teacher)
    student: StudentConfig = field(default_factory=StudentConfig)
    loss_weights: dict[str, float] = field(default_factory=lambda: {"click": 1.0, "conversion": 1.0})
    kernels: KernelSettings = field(default_factory=KernelSettings)


@dataclass
class TrainConfig:
    """How a model trains. Validation runs every ``check_val_every_n_epoch`` epochs and after the last epoch
    (:class:`gem.callbacks.ValidateLastEpoch`); ``deterministic`` asks torch for deterministic algorithms
    (Lightning's ``Trainer(deterministic=...)``).

    The learning rate (:mod:`gem.schedule`) rises linearly to ``lr`` over ``warmup_steps`` optimizer steps, then
    falls on a cosine to ``final_lr_frac * lr`` at ``max_steps`` (which it then needs); the defaults (0, 1) keep
    ``lr`` throughout.

    The teacher's step has three switches (:mod:`gem.step_options`; none changes what is learned):
    ``cast_once`` (under ``bf16-mixed``: each parameter autocast casts at every use is cast once per step,
    :class:`~foundation.model.precision.CastOnce`); ``bucket_rows`` (row counts, ascending: each training
    batch is padded to ``data.token_budget`` tokens and the smallest count that holds it, in the DataLoader's
    workers, and trained through :class:`~gem.loop.StaticStep` on static buffers per bucket; empty: off);
    ``cuda_graphs`` (with ``bucket_rows``, on CUDA: each bucket's dense forward and backward are captured into
    a CUDA graph after ``graph_warmup`` eager steps and replayed; every bucket's warm-up and capture run right
    after the first step: :meth:`~gem.loop.StaticStep.prepare`). Single-device only: under
    ``parallel.enabled`` they are off, with one logged line. ``precompile_kernels`` (on CUDA, single device):
    the first step's Triton kernels are compiled in parallel before it runs (:mod:`gem.precompile`).
    """

    max_epochs: int = 1
    max_steps: int = -1
    lr: float = 1e-3
    warmup_steps: int = 0
    final_lr_frac: float = 1.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    precision: str = "32-true"
    accelerator: str = "auto"
    devices: int = 1
    log_every_n_steps: int = 10
    checkpoint_every_n_steps: int = 50
    val_check_interval: float = 1.0
    check_val_every_n_epoch: int = 1
    deterministic: bool = True
    out_dir: str = "runs"
    experiment: str = "gem"
    tracking_uri: str = ""
    progress_bar: bool = True
    # Log the final checkpoint as an MLflow artifact (off for models too large to copy).
    log_checkpoint: bool = True
    cast_once: bool = True
    bucket_rows: tuple[int, ...] = ()
    cuda_graphs: bool = False
    graph_warmup: int = 2
    precompile_kernels: bool = True


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


def experiment_from_dict(d: dict[str, Any]) -> ExperimentConfig:
    """An :class:`ExperimentConfig` from its ``to_dict`` form (a checkpoint's); absent sections take defaults."""
    return dataclass_from_dict(ExperimentConfig, d)
