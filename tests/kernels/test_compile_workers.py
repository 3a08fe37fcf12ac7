"""Compile workers started before the entry point imports torch (`gem.compile_workers`), adopted by the pool."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

import kernels.precompile
from experiments import bench_teacher
from gem.compile_workers import MAX_WORKERS, start_compile_workers, worker_plan, worker_plan_from_argv
from kernels.precompile import KernelCompilePool, LaunchSpec

pytestmark = pytest.mark.usefixtures("one_thread")


def test_importing_the_starter_imports_no_torch():
    code = "import sys, gem.compile_workers; sys.exit(int('torch' in sys.modules or 'kernels' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_plan_follows_the_command_line_the_config_and_the_machine():
    cores = max(1, min(MAX_WORKERS, os.cpu_count() or 1))
    assert MAX_WORKERS == kernels.precompile.MAX_WORKERS
    assert worker_plan_from_argv([], cuda_present=True) == (cores, 0)
    assert worker_plan_from_argv(["--flavor", "large", "--device", "cuda:1", "--precompile-workers", "3"],
                                 cuda_present=True) == (3, 1)
    assert worker_plan_from_argv(["--no-precompile"], cuda_present=True) == (0, 0)
    assert worker_plan_from_argv(["--device", "cpu"], cuda_present=True) == (0, 0)
    assert worker_plan_from_argv([], cuda_present=False) == (0, 0)
    # The harness's accelerators: Lightning's "auto" and "gpu" train on CUDA where there is one.
    assert worker_plan(True, "auto", cuda_present=True) == worker_plan(True, "gpu", cuda_present=True) == (cores, 0)
    assert worker_plan(True, "cpu", cuda_present=True) == (0, 0)
    assert worker_plan(True, "cuda:x", cuda_present=True) == (cores, 0)  # the entry point reports it, not this


def test_the_pool_adopts_early_workers_and_they_answer():
    """Workers started by the starter (default preload: every kernel module) take the pool's specs and stop on its
    close. On this CPU their set-up or the unknown kernel fails the spec: either way, the adopted process answered."""
    early = start_compile_workers(2)
    pool = KernelCompilePool(processes=early)
    assert pool.workers == 2 and pool.processes == early
    report = pool.compile([LaunchSpec("kernels.triton.layer_norm:no_such_kernel", (), (), ())])
    assert report.specs == 1 and len(report.failed) == 1 and "compile worker died" not in report.failed[0]
    pool.close(timeout_s=60)
    assert [p.returncode for p in early] == [0, 0]


def test_the_bench_closes_early_workers_it_does_not_need():
    """No pool on a CPU device: the early workers are told to exit, not left waiting for input."""
    early = start_compile_workers(1)
    args = argparse.Namespace(precompile=True, precompile_workers=0)
    assert bench_teacher.compile_pool(args, torch.device("cpu"), None, early) is None
    assert early[0].wait(timeout=60) == 0


def test_the_harness_tells_early_workers_to_exit_where_it_does_not_precompile():
    """`gem train` hands its early workers to the trainer: with the switch off they are told to exit at once; with
    it on, the callback adopts them at the fit's start, or (here: no CUDA) tells them to exit."""
    from foundation.config import apply_overrides
    from gem.flavors import get_flavor
    from gem.train import PrecompileKernels, build_trainer

    off = start_compile_workers(1)
    build_trainer(apply_overrides(get_flavor("teacher-large"), ["train.precompile_kernels=false"]), None, None, off)
    assert off[0].wait(timeout=60) == 0
    on = start_compile_workers(1)
    trainer = build_trainer(get_flavor("teacher-large"), None, None, on)
    callback = next(c for c in trainer.callbacks if isinstance(c, PrecompileKernels))
    assert on[0].poll() is None
    callback.on_fit_start(trainer, argparse.Namespace(step_options=None))
    assert on[0].wait(timeout=60) == 0 and callback.pool is None
