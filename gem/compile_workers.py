"""Kernel compile workers started at the very top of an entry point, before the process imports torch.

A compile worker (``python -m kernels.precompile``, see :class:`kernels.precompile.KernelCompilePool`) spends
seconds importing torch, Triton and the kernel modules before it can compile anything; more where the interpreter
finds no cached bytecode for them (``PYTHONDONTWRITEBYTECODE``, a package installed without it), and more again
when a pool's workers all import at once beside the model build. Started here, that time overlaps the entry point's
own imports and set-up instead of the first step: the pool adopts them (``KernelCompilePool(processes=...)``) or,
when the cache already holds the step, closes them unused. ``experiments.bench_teacher`` starts them before it
imports torch; ``gem train`` as soon as its config says the run will precompile, before it imports the harness.

Standard library only: importing this module must not import torch (or :mod:`kernels`, whose package does).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

WORKER_MODULE = "kernels.precompile"
MAX_WORKERS = 16  # as kernels.precompile.MAX_WORKERS (tested equal)


def worker_plan(
    precompile: bool, device: str | None = None, workers: int = 0, *, cuda_present: bool | None = None
) -> tuple[int, int]:
    """``(workers, device index)`` to start for a run that precompiles (``precompile``) on ``device`` (``cuda``,
    ``cuda:N``, ``gpu``, ``auto`` or None: the default GPU), ``workers`` of them (0: ``min(16, cores)``);
    ``(0, 0)`` when no pool will run: precompile off, a CPU device, no NVIDIA device on the machine."""
    present = cuda_present if cuda_present is not None else os.path.exists("/dev/nvidiactl")
    kind, _, index = (device or "cuda").partition(":")
    if not precompile or not present or kind not in ("cuda", "gpu", "auto"):
        return 0, 0
    # A malformed index is the entry point's to report (its argument parsing or torch); here it means device 0.
    return workers or max(1, min(MAX_WORKERS, os.cpu_count() or 1)), int(index) if index.isdigit() else 0


def worker_plan_from_argv(argv: Sequence[str], *, cuda_present: bool | None = None) -> tuple[int, int]:
    """:func:`worker_plan` for a command line that takes ``--device``, ``--precompile``/``--no-precompile`` and
    ``--precompile-workers`` (``experiments.bench_teacher``); other arguments are ignored."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", default=None)
    parser.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--precompile-workers", type=int, default=0)
    known, _ = parser.parse_known_args(list(argv))
    return worker_plan(known.precompile, known.device, known.precompile_workers, cuda_present=cuda_present)


def start_compile_workers(workers: int, device: int = 0) -> list[subprocess.Popen]:
    """``workers`` compile worker processes for CUDA device ``device``, each importing every kernel module; they
    see this process's ``sys.path`` and environment, as the pool's own workers do."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    command = [sys.executable, "-m", WORKER_MODULE, "--device", str(device)]
    return [
        subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) for _ in range(workers)
    ]
