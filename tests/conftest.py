"""Fixtures for every test, and ones that test modules opt in to
(``pytestmark = pytest.mark.usefixtures("one_thread")``)."""

from __future__ import annotations

import pytest
import torch

from kernels.settings import KernelSettings, apply_kernel_settings


@pytest.fixture(autouse=True)
def default_kernel_settings():
    """Each test starts from the default kernel switches: building a model applies its config's process-wide."""
    apply_kernel_settings(KernelSettings())
    yield
    apply_kernel_settings(KernelSettings())


@pytest.fixture
def one_thread():
    """Tiny tensors: thread start-up dominates, and oversubscribed CPUs make it far worse."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
