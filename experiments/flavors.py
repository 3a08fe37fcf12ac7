"""Named experiment flavors.

``debug`` (DLRM baseline) trains in seconds on a CPU; ``default`` is `make quickstart`;
``teacher-*`` train the GEM teacher on the synthetic world; ``ml1m_hstu*`` reproduce HSTU on
MovieLens-1M (``gem data convert --format seq-tsv --input .../sequences.tsv --out data/ml1m``).

``student-*`` train the small value model; it learns from a teacher through teacher outputs, e.g.
``gem train --flavor student-debug-ah-sa 'transfer.teacher_outputs={"train": "to/train", "valid": "to/valid"}'``.
Each transfer method is a list of overrides (:data:`STUDENT_METHODS`); representation transfer also
needs the teacher's dims: ``model.student.teacher_repr=true model.student.user_repr_dim=64
model.student.item_repr_dim=64`` (:func:`repr_overrides` reads them from a teacher-output manifest);
parameter sharing (:data:`SHARING_METHODS`) needs the teacher checkpoint: ``transfer.share_from=PATH``
(:func:`sharing_overrides`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from foundation.config import (
    ConfigError,
    DLRMConfig,
    ExperimentConfig,
    ModelConfig,
    TrainConfig,
    apply_overrides,
)
from foundation.data.pipeline import DataConfig
from foundation.model.teacher_config import teacher_flavor
from value_models.student import StudentConfig


def _debug() -> ExperimentConfig:
    return ExperimentConfig(
        name="debug",
        data=DataConfig(path="data/synth-debug", max_len=64, batch_size=128, token_budget=4096),
        model=ModelConfig(arch="dlrm", dlrm=DLRMConfig(embedding_dim=16, bottom_mlp=(32,), top_mlp=(64, 32))),
        train=TrainConfig(max_epochs=2, lr=3e-3, checkpoint_every_n_steps=10, log_every_n_steps=5),
    )


def _default() -> ExperimentConfig:
    return ExperimentConfig(
        name="default",
        data=DataConfig(path="data/synth-default", max_len=256, batch_size=512, token_budget=65536),
        model=ModelConfig(arch="dlrm", dlrm=DLRMConfig(embedding_dim=32)),
        train=TrainConfig(max_epochs=1, lr=2e-3, checkpoint_every_n_steps=100, log_every_n_steps=20),
    )


def _teacher(name: str, teacher: str, data_path: str, *, batch_size: int, token_budget: int, **train) -> ExperimentConfig:
    """A GEM-teacher experiment; the data's ``max_len`` follows the teacher's, which fixes HSTU's 1/N."""
    cfg = teacher_flavor(teacher)
    return ExperimentConfig(
        name=name,
        data=DataConfig(path=data_path, max_len=cfg.max_len, batch_size=batch_size, token_budget=token_budget),
        model=ModelConfig(arch="teacher", teacher=cfg),
        train=TrainConfig(**{"max_epochs": 1, "lr": 1e-3, "checkpoint_every_n_steps": 200, **train}),
    )


def _student(name: str, data_path: str, *, history_len: int, batch_size: int, **train) -> ExperimentConfig:
    """A student ranker with no transfer; :data:`STUDENT_METHODS` turn a transfer method on."""
    return ExperimentConfig(
        name=name,
        data=DataConfig(path=data_path, max_len=history_len, batch_size=batch_size),
        model=ModelConfig(arch="student", student=StudentConfig(embedding_dim=8, hidden=(64, 32), history_len=history_len)),
        train=TrainConfig(**{"max_epochs": 1, "lr": 3e-3, "checkpoint_every_n_steps": 100, **train}),
    )


_AH_SA = ("model.student.distill=ah", "model.student.use_adapter=true")
# Transfer method -> overrides of a student flavor. ``repr`` methods also need :func:`repr_overrides`,
# :data:`SHARING_METHODS` also :func:`sharing_overrides`. ``sharing`` is parameter sharing alone (true
# labels only); ``ah-sa-sharing`` adds it to AH + SA; ``full`` is the whole stack, AH + SA + sharing +
# representations.
STUDENT_METHODS: dict[str, tuple[str, ...]] = {
    "alone": (),
    "kd": ("model.student.distill=kd",),
    "ah": ("model.student.distill=ah",),
    "ah-sa": _AH_SA,
    "ah-sa-repr": (*_AH_SA, "model.student.teacher_repr=true"),
    "sharing": (),
    "ah-sa-sharing": _AH_SA,
    "full": (*_AH_SA, "model.student.teacher_repr=true"),
}
# Methods whose students start from the teacher's tables.
SHARING_METHODS = ("sharing", "ah-sa-sharing", "full")


def repr_overrides(user_repr_dim: int, item_repr_dim: int) -> tuple[str, ...]:
    """Overrides giving a student the teacher's representation dims (from a teacher-output schema)."""
    return (f"model.student.user_repr_dim={user_repr_dim}", f"model.student.item_repr_dim={item_repr_dim}")


def sharing_overrides(teacher_ckpt: str, policy: str = "freeze", lr_scale: float = 0.1) -> tuple[str, ...]:
    """Overrides that start a student from the tables of ``teacher_ckpt`` (:mod:`transfer.sharing`)."""
    return (
        f"transfer.share_from={teacher_ckpt}", f"transfer.share_policy={policy}", f"transfer.share_lr_scale={lr_scale}"
    )


def with_method(make: Callable[[], ExperimentConfig], method: str) -> Callable[[], ExperimentConfig]:
    """The flavor ``make`` with transfer method ``method`` on, named ``{name}-{method}``."""

    def build() -> ExperimentConfig:
        cfg = apply_overrides(make(), list(STUDENT_METHODS[method]))
        cfg.name = f"{cfg.name}-{method}"
        return cfg

    return build


# Methods whose flavors need nothing from a particular teacher (``ah-sa-repr`` needs its dims, sharing its checkpoint).
TEACHER_FREE_METHODS = ("kd", "ah", "ah-sa")


def _student_debug() -> ExperimentConfig:
    return _student(
        "student-debug", "data/synth-debug", history_len=8, batch_size=128, max_epochs=2, checkpoint_every_n_steps=10,
        log_every_n_steps=5,
    )


def _student_default() -> ExperimentConfig:
    return _student("student-default", "data/synth-default", history_len=16, batch_size=512, log_every_n_steps=20)


FLAVORS: dict[str, Callable[[], ExperimentConfig]] = {
    "student-debug": _student_debug,
    **{f"student-debug-{m}": with_method(_student_debug, m) for m in TEACHER_FREE_METHODS},
    "student-default": _student_default,
    **{f"student-default-{m}": with_method(_student_default, m) for m in TEACHER_FREE_METHODS},
    "debug": _debug,
    "default": _default,
    "teacher-debug": lambda: _teacher(
        "teacher-debug", "debug", "data/synth-debug", batch_size=128, token_budget=8192, max_epochs=2,
        checkpoint_every_n_steps=10, log_every_n_steps=5,
    ),
    # Two epochs: the recipe's best valid epoch was the first or the second over five seeds.
    "teacher-small": lambda: _teacher(
        "teacher-small", "small", "data/synth-default", batch_size=256, token_budget=65536, max_epochs=2
    ),
    "teacher-large": lambda: _teacher(
        "teacher-large", "large", "data/synth-large", batch_size=512, token_budget=16384, precision="bf16-mixed"
    ),
    "ml1m_hstu": lambda: _teacher(
        "ml1m_hstu", "ml1m_hstu", "data/ml1m", batch_size=128, token_budget=0, max_epochs=100, log_every_n_steps=50
    ),
    "ml1m_hstu_large": lambda: _teacher(
        "ml1m_hstu_large", "ml1m_hstu_large", "data/ml1m", batch_size=128, token_budget=0, max_epochs=100,
        log_every_n_steps=50,
    ),
    "sasrec": lambda: _teacher("sasrec", "sasrec", "data/ml1m", batch_size=128, token_budget=0, max_epochs=100),
}


def get_flavor(name: str) -> ExperimentConfig:
    if name not in FLAVORS:
        raise ConfigError(f"unknown flavor {name!r}; known flavors: {sorted(FLAVORS)}")
    return copy.deepcopy(FLAVORS[name]())
