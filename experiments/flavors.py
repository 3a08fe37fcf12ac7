"""Named experiment flavors. ``debug`` trains in seconds on a CPU; ``default`` is `make quickstart`."""

from __future__ import annotations

import copy
from collections.abc import Callable

from foundation.config import ConfigError, DLRMConfig, ExperimentConfig, ModelConfig, TrainConfig
from foundation.data.pipeline import DataConfig


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


FLAVORS: dict[str, Callable[[], ExperimentConfig]] = {
    "debug": _debug,
    "default": _default,
}


def get_flavor(name: str) -> ExperimentConfig:
    if name not in FLAVORS:
        raise ConfigError(f"unknown flavor {name!r}; known flavors: {sorted(FLAVORS)}")
    return copy.deepcopy(FLAVORS[name]())
