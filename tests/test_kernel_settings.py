"""Kernel switches: config fields applied once per model, environment variables as overrides, both logged."""

from __future__ import annotations

import pytest
import torch

import kernels
from gem.config import ModelConfig
from gem.registry import build_model
from gem.train import changed_params, kernel_params
from kernels.settings import (
    KernelSettings,
    apply_kernel_settings,
    effective_kernel_settings,
    kernel_environment,
)
from tests.events import SCHEMA

VARIABLES = ("GEM_ATTENTION_BACKEND", "GEM_KERNELS_DETERMINISTIC", "GEM_KERNELS_TMA", "GEM_KERNELS_AUTOTUNE",
             "GEM_KERNELS_FAST_SIGMOID")


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def triton_module():
    """The Triton kernels' module, imported at run time: ``tests/kernels`` sets the interpreter before triton loads."""
    from kernels.triton import jagged_attention

    return jagged_attention


def test_building_a_model_applies_its_kernel_switches():
    triton_attention = triton_module()
    q = torch.zeros(2, 1, 4)
    assert kernels._resolve_backend("auto", q) == "pytorch"
    build_model(ModelConfig(kernels=KernelSettings(backend="triton", deterministic=True, tma=True)), SCHEMA)
    assert kernels._resolve_backend("auto", q) == "triton"
    assert kernels._resolve_backend("pytorch", q) == "pytorch", "an explicit backend is never overridden"
    assert triton_attention.deterministic() and triton_attention._use_tma(torch.zeros(2, 1, 16))
    assert effective_kernel_settings() == KernelSettings(backend="triton", deterministic=True, tma=True)


def test_environment_overrides_the_config_and_is_reported(monkeypatch):
    apply_kernel_settings(KernelSettings(backend="triton", autotune=True))
    monkeypatch.setenv("GEM_ATTENTION_BACKEND", "pytorch")
    monkeypatch.setenv("GEM_KERNELS_AUTOTUNE", "0")
    assert kernels._resolve_backend("auto", torch.zeros(2, 1, 4)) == "pytorch"
    assert not triton_module()._autotune_enabled()
    assert kernel_environment() == {"GEM_ATTENTION_BACKEND": "pytorch", "GEM_KERNELS_AUTOTUNE": "0"}
    params = kernel_params()
    assert params["kernels.effective.backend"] == "pytorch" and params["kernels.effective.autotune"] is False
    assert params["kernels.env.GEM_KERNELS_AUTOTUNE"] == "0"


def test_a_resumed_run_records_switches_that_changed():
    logged = {"train.lr": "0.001", "kernels.effective.backend": "auto", "kernels.env.GEM_KERNELS_TMA": "0"}
    now = {"train.lr": 0.001, "kernels.effective.backend": "pytorch", "kernels.env.GEM_ATTENTION_BACKEND": "pytorch"}
    assert changed_params(logged, now) == [
        "kernels.effective.backend", "kernels.env.GEM_ATTENTION_BACKEND", "kernels.env.GEM_KERNELS_TMA"
    ]
    assert changed_params(logged, {"train.lr": 0.001, "kernels.effective.backend": "auto",
                                   "kernels.env.GEM_KERNELS_TMA": "0", "model.new_field": 1}) == []


@pytest.mark.parametrize("name, value", [("GEM_KERNELS_DETERMINISTIC", "yes"), ("GEM_ATTENTION_BACKEND", "cuda")])
def test_a_bad_override_names_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        effective_kernel_settings()


def test_a_bad_backend_in_the_config_names_the_field():
    cfg = ModelConfig()
    cfg.kernels.backend = "cuda"  # as a dotted override sets it
    with pytest.raises(ValueError, match=r"kernels\.backend must be one of"):
        build_model(cfg, SCHEMA)
