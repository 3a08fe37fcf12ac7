"""Named experiment flavors.

``debug`` (DLRM baseline) trains in seconds on a CPU; ``default`` is `make quickstart`;
``teacher-*`` train the GEM teacher on the synthetic world; ``ml1m_hstu*`` reproduce HSTU on
MovieLens-1M (``gem data convert --format seq-tsv --input .../sequences.tsv --out data/ml1m``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from foundation.config import ConfigError, DLRMConfig, ExperimentConfig, ModelConfig, TrainConfig
from foundation.data.pipeline import DataConfig
from foundation.model.teacher_config import teacher_flavor


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


FLAVORS: dict[str, Callable[[], ExperimentConfig]] = {
    "debug": _debug,
    "default": _default,
    "teacher-debug": lambda: _teacher(
        "teacher-debug", "debug", "data/synth-debug", batch_size=128, token_budget=8192, max_epochs=2,
        checkpoint_every_n_steps=10, log_every_n_steps=5,
    ),
    "teacher-small": lambda: _teacher("teacher-small", "small", "data/synth-default", batch_size=256, token_budget=65536),
    "teacher-large": lambda: _teacher(
        "teacher-large", "large", "data/synth-large", batch_size=512, token_budget=65536, precision="bf16-mixed"
    ),
    "ml1m_hstu": lambda: _teacher(
        "ml1m_hstu", "ml1m_hstu", "data/ml1m", batch_size=128, token_budget=0, max_epochs=100, log_every_n_steps=50
    ),
    "ml1m_hstu_large": lambda: _teacher(
        "ml1m_hstu_large", "ml1m_hstu_large", "data/ml1m", batch_size=128, token_budget=0, max_epochs=100,
        log_every_n_steps=50,
    ),
}


def get_flavor(name: str) -> ExperimentConfig:
    if name not in FLAVORS:
        raise ConfigError(f"unknown flavor {name!r}; known flavors: {sorted(FLAVORS)}")
    return copy.deepcopy(FLAVORS[name]())
