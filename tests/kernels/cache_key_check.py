"""Run by ``test_precompile.py`` without Triton's interpreter: hash the named kernels of
:mod:`kernels.triton.jagged_attention` first, then :func:`kernels.precompile.settle_cache_keys`; prints one JSON
line, every kernel's cache key by ``module:name``."""

from __future__ import annotations

import importlib
import json
import sys

from triton.runtime.jit import JITFunction

import kernels.triton.jagged_attention as attention
from kernels.precompile import kernel_modules, settle_cache_keys


def main(first: list[str]) -> None:
    for name in first:
        getattr(attention, name).cache_key  # noqa: B018
    settle_cache_keys()
    keys = {
        f"{module}:{name}": value.cache_key
        for module in kernel_modules()
        for name, value in vars(importlib.import_module(module)).items()
        if isinstance(value, JITFunction)
    }
    print(json.dumps(keys, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1:])
