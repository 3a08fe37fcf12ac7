"""Run by ``test_precompile.py`` in a process without Triton's interpreter: record a fused LayerNorm's forward and
backward, compile them in a :class:`~kernels.precompile.KernelCompilePool` for an sm_90 target
(:mod:`tests.kernels.compile_only_driver`), then run the same calls for real with each launch stopped after the
JIT's cache lookup and compile. Prints one JSON line: the pool's report, the cache entries it made, and the entries
the real launches added (none when they found the pool's).
"""

from __future__ import annotations

import json
import os

import torch
from triton.runtime import jit

import tests.kernels.compile_only_driver  # noqa: F401  (the active driver: compile for sm_90, launch nothing)
from kernels import layer_norm
from kernels.precompile import KernelCompilePool, kernel_modules, record_launches


def step() -> None:
    x = torch.randn(6, 24, requires_grad=True)
    layer_norm(x, torch.ones(24), torch.zeros(24), 1e-5, backend="triton").sum().backward()


def entries(cache: str) -> set[str]:
    return set(os.listdir(cache)) if os.path.isdir(cache) else set()


def main() -> None:
    cache = os.environ["TRITON_CACHE_DIR"]
    with record_launches() as record:
        step()
    with KernelCompilePool(2, modules=[*kernel_modules(), "tests.kernels.compile_only_driver"]) as pool:
        report = pool.compile(record.specs)
    made = entries(cache)
    run = jit.JITFunction.run

    def compile_only(kernel, *args, grid, warmup, **kwargs):
        return run(kernel, *args, grid=grid, warmup=True, **kwargs)

    jit.JITFunction.run = compile_only
    try:
        step()
    finally:
        jit.JITFunction.run = run
    print(json.dumps({
        "specs": report.specs, "compiled": report.compiled, "failed": report.failed, "cache_entries": len(made),
        "entries_added_by_the_real_launches": sorted(entries(cache) - made),
    }))


if __name__ == "__main__":
    main()
