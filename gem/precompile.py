"""A training step's Triton kernels compiled before its first run: the trainers' side of :mod:`kernels.precompile`.

:func:`record_step` runs one step's forward and backward with the kernels' launches recorded instead of run;
:func:`precompile_step` compiles what it recorded in a process pool before the real step. Used by the Lightning
harness (:class:`gem.train.PrecompileKernels`, ``train.precompile_kernels``) and by
``experiments/bench_teacher.py --precompile``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from foundation.data.batch import JaggedBatch
from gem.loop import autocast
from kernels.precompile import KernelCompilePool, LaunchRecord, precompile, record_launches, skip_reason


def record_step(
    model: nn.Module,
    batch: JaggedBatch,
    *,
    autocast_dtype: torch.dtype | None,
    forward: Callable[[JaggedBatch], object] | None = None,
) -> LaunchRecord:
    """The Triton launches of one training step of ``model`` on the device batch ``batch``: ``model.loss(batch,
    forward(batch))`` under autocast to ``autocast_dtype`` (``forward`` defaults to ``model``) and its gradients
    with respect to the trainable parameters, with every launch recorded, not run (its outputs stay
    uninitialised; nothing in the step reads them on the host).

    Leaves nothing behind: the random state is forked (the real step draws the same negatives and dropout), the
    gradients are returned by ``torch.autograd.grad`` and dropped (no ``.grad`` is touched) and the buffers are
    restored. The step's parameter casts (:class:`~foundation.model.precision.CastOnce`, the same values and
    dtypes as autocast's) and optimizer launch no Triton kernel and are left out.
    """
    forward = forward or model
    device = batch.candidate.device
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [(b, b.clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), record_launches() as record:
            with autocast(device, autocast_dtype):
                loss = model.loss(batch, forward(batch))["loss"]
            torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return record


def precompile_step(
    model: nn.Module,
    batch: JaggedBatch,
    *,
    autocast_dtype: torch.dtype | None,
    forward: Callable[[JaggedBatch], object] | None = None,
    pool: KernelCompilePool | None = None,
    workers: int | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Record the step's launches on ``batch`` (:func:`record_step`) and compile them into Triton's cache
    (:func:`kernels.precompile.precompile`, in ``pool`` when given) before the real step runs.

    A logged no-op where nothing compiles (Triton's interpreter, no CUDA). Never raises: a kernel that fails to
    compile, or a step that fails to record (the real step will then meet the same error), costs one logged line,
    and the kernels compile at their launches, as without this. Returns ``{"specs", "launches", "record_s",
    "compiled", "failed", "compile_s", "workers", "skipped"}``.
    """
    reason = skip_reason(["step"])
    start = time.perf_counter()
    if not reason:
        try:
            record = record_step(model, batch, autocast_dtype=autocast_dtype, forward=forward)
        except Exception as err:
            reason = f"recording the step failed: {type(err).__name__}: {str(err).strip()[:200]}"
    if reason:
        log(f"kernel precompile: skipped ({reason})")
        return {"specs": 0, "launches": 0, "record_s": 0.0, "compiled": 0, "failed": [], "compile_s": 0.0,
                "workers": 0, "skipped": reason}
    if batch.candidate.is_cuda:
        torch.cuda.synchronize(batch.candidate.device)
    record_s = time.perf_counter() - start
    report = precompile(record.specs, workers, pool=pool, log=log).as_dict()
    return {
        "specs": len(record.specs), "launches": sum(record.launches.values()), "record_s": record_s,
        "compiled": report["compiled"], "failed": report["failed"], "compile_s": report["seconds"],
        "workers": report["workers"], "skipped": report["skipped"],
    }
