"""A Triton driver that compiles for a fixed CUDA target and launches nothing, for tests without a GPU.

Importing this module makes it the process's active driver. :mod:`kernels.precompile`'s workers import it when it
is named in their fork server's preload list, so the JIT's own ``warmup`` compiles in them as on a GPU machine
of that target (Triton bundles ``ptxas``).
"""

from __future__ import annotations

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.driver import DriverBase

TARGET = GPUTarget("cuda", 90, 32)


class CompileOnlyDriver(DriverBase):
    """The current device is 0 of :data:`TARGET`; no stream, no launcher, no benchmarker."""

    @classmethod
    def is_active(cls) -> bool:
        return True

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("a compile-only driver launches nothing")

    def get_benchmarker(self):
        raise NotImplementedError("a compile-only driver launches nothing")


driver.set_active(CompileOnlyDriver())
