"""Fixtures for every test."""

from __future__ import annotations

import pytest

from kernels.settings import KernelSettings, apply_kernel_settings


@pytest.fixture(autouse=True)
def default_kernel_settings():
    """Each test starts from the default kernel switches: building a model applies its config's process-wide."""
    apply_kernel_settings(KernelSettings())
    yield
    apply_kernel_settings(KernelSettings())
