"""Fixtures shared by test modules that opt in (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors: thread start-up dominates, and oversubscribed CPUs make it far worse."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
