"""A training step's Triton kernels compiled before its first run: the trainers' side of :mod:`kernels.precompile`.

:func:`record_step` runs one step's forward and backward with the kernels' launches recorded instead of run;
:func:`start_precompile_step` sends each kernel it records to a process pool's compile workers as it meets it,
and the real step runs while they compile, each of its launches waiting only for its own kernel
(:meth:`StepPrecompile.gate`); :func:`precompile_step` waits for them all instead. Given the step's key
(:func:`step_key`) and a cache that holds what the step needs (:func:`kernels.precompile.cached_step`), neither
records nor compiles: on a warm cache both cost seconds and compile nothing. Used by the Lightning
harness (:class:`gem.train.PrecompileKernels`, ``train.precompile_kernels``) and by
``experiments/bench_teacher.py --precompile``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import foundation
from foundation.data.batch import JaggedBatch
from foundation.model.deferred_rows import DeferredRows, sparse_tables
from gem.loop import autocast
from kernels import multi_adamw, multi_copy, row_adamw
from kernels.precompile import (
    SLOWEST_REPORTED,
    CompileJob,
    KernelCompilePool,
    LaunchRecord,
    LaunchSpec,
    cached_step,
    conclude,
    launches_wait_for,
    record_launches,
    skip_reason,
)
from kernels.precompile import step_key as kernels_step_key


def module_identity(model: nn.Module) -> str:
    """What of ``model`` decides its step's kernels, as text: its class and module tree (with each module's
    settings, as ``repr`` shows them) and the name, shape, dtype and trainability of every parameter and buffer."""
    tensors = [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()]
    tensors += [(n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()]
    return f"{type(model).__module__}.{type(model).__qualname__}\n{model!r}\n{tensors!r}"


def step_key(identity: Sequence[str], *, autocast_dtype: torch.dtype | None, device: torch.device) -> str:
    """The manifest key (:func:`kernels.precompile.step_key`) of a training step described by ``identity`` (e.g.
    :func:`module_identity`, the config and the batch shapes) under autocast to ``autocast_dtype`` on ``device``.
    The source of :mod:`foundation` and :mod:`gem` is part of it: the models and the step decide which kernels
    launch, with which block sizes, where no config or parameter shape shows it."""
    index = device.index if device.type == "cuda" and device.index is not None else 0
    sources = [Path(foundation.__file__).resolve().parent, Path(__file__).resolve().parent]
    return kernels_step_key([*identity, f"autocast {autocast_dtype}"], device=index, sources=sources)


def warm_cache(key: str | None) -> bool:
    """Whether a pool started for the step ``key`` would find nothing to do (the step's manifest holds): the
    callers that start a pool before the step ask this first, silently (:func:`precompile_step` logs the
    decision). Ask before any kernel launches: where it holds, no pool will start to settle this process's kernel
    keys to the workers', so this does (:func:`kernels.precompile.cached_step`)."""
    return key is not None and not skip_reason(["step"]) and bool(cached_step(key, log=lambda line: None))


def record_step(
    model: nn.Module,
    batch: JaggedBatch,
    *,
    autocast_dtype: torch.dtype | None,
    forward: Callable[[JaggedBatch], object] | None = None,
    cast_dtype: torch.dtype | None = None,
    master_adamw: bool = False,
    on_spec: Callable[[LaunchSpec], object] | None = None,
) -> LaunchRecord:
    """The Triton launches of one training step of ``model`` on the device batch ``batch``: ``model.loss(batch,
    forward(batch))`` under autocast to ``autocast_dtype`` (``forward`` defaults to ``model``) and its gradients
    with respect to the trainable parameters, with every launch recorded, not run (its outputs stay
    uninitialised; nothing in the step reads them on the host).

    Leaves nothing behind: the random state is forked (the real step draws the same negatives and dropout), the
    gradients are returned by ``torch.autograd.grad`` and dropped (no ``.grad`` is touched) and the buffers are
    restored. ``cast_dtype``: the dtype of the step's :class:`~foundation.model.precision.CastOnce` copies, whose
    copy kernel (:func:`kernels.multi_copy`: the parameters into their copies, the copies' gradients back) is
    recorded on one-element stand-ins, the parameters it copies being known only after the first step's forward.
    ``master_adamw``: the step's optimizer is a :class:`~foundation.model.precision.MasterAdamW`, whose kernels'
    variants are recorded the same way (:func:`launch_master_adamw`, with the row kernels of the model's sparse
    tables); torch's AdamW launches no Triton kernel.
    ``on_spec``: called with each spec as it is first launched
    (:func:`kernels.precompile.record_launches`).
    """
    forward = forward or model
    device = batch.candidate.device
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [(b, b.clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), record_launches(on_spec) as record:
            with autocast(device, autocast_dtype):
                loss = model.loss(batch, forward(batch))["loss"]
            torch.autograd.grad(loss, params, allow_unused=True)
            if cast_dtype is not None:
                launch_cast_copies(device, cast_dtype)
            if master_adamw:
                launch_master_adamw(device, cast_dtype, tables=list(sparse_tables(model)))
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return record


def launch_cast_copies(device: torch.device, dtype: torch.dtype) -> None:
    """The copy launches of a :class:`~foundation.model.precision.CastOnce` step to ``dtype`` on ``device`` (float32
    into ``dtype``, and back), on one-element stand-ins: what Triton specialises the kernel on (dtypes, 16-byte
    aligned addresses) is what the parameters and their copies give."""
    full = torch.empty(1, device=device)
    low = torch.empty(1, dtype=dtype, device=device)
    multi_copy([low], [full])
    multi_copy([full], [low])


def launch_master_adamw(device: torch.device, cast_dtype: torch.dtype | None,
                        tables: Sequence[torch.Tensor] = ()) -> None:
    """The launches of a :class:`~foundation.model.precision.MasterAdamW` step on ``[2, 2]`` stand-ins: float32
    gradients of parameters without a copy and, with ``cast_dtype`` copies, float32 (the first step's, before the
    copies exist in the forward) and ``cast_dtype`` gradients (the held ones) into those copies; each with a
    gradient laid out as its parameter and with a transposed one (a launch of its own). Per width of the sparse
    ``tables[R, D]`` (their rows' deferred steps: :meth:`~foundation.model.precision.MasterAdamW.defer_rows`) the
    row kernels on ``[2, D]`` stand-ins: the catch-up, the gradient's row sums and the rows' update."""

    def two(dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(2, 2, dtype=dtype, device=device)

    variants = [(torch.float32, None)]
    if cast_dtype is not None:
        variants += [(torch.float32, cast_dtype), (cast_dtype, cast_dtype)]
    for grad_dtype, copy_dtype in variants:
        for grad in (two(grad_dtype), two(grad_dtype).t()):
            multi_adamw([two()], [grad], [two()], [two()], copies=[two(copy_dtype) if copy_dtype else None],
                        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=1)
    for dtype, width in {(t.dtype, t.shape[1]) for t in tables}:
        param, exp_avg, exp_avg_sq = (torch.zeros(2, width, device=device) for _ in range(3))
        rows = torch.arange(2, device=device)
        DeferredRows(param, exp_avg, exp_avg_sq, step=0, betas=(0.9, 0.999), eps=1e-8, capacity=2).catch_up(rows)
        row_adamw(param, exp_avg, exp_avg_sq, rows, torch.zeros(2, width, dtype=dtype, device=device), lr=1e-3,
                  betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=1)


@dataclass
class StepPrecompile:
    """A first step's precompile (:func:`start_precompile_step`): recorded, its compiles under way in ``job`` (None
    where it was skipped: ``result`` then holds the report). Run the step inside :meth:`gate`, then :meth:`finish`."""

    result: dict
    job: CompileJob | None = None
    pool: KernelCompilePool | None = None
    owned: bool = False
    key: str | None = None
    log: Callable[[str], None] = print

    def gate(self) -> contextlib.AbstractContextManager:
        """Inside, each Triton launch of a kernel still compiling waits for that kernel only
        (:func:`kernels.precompile.launches_wait_for`); the rest of the step runs meanwhile."""
        return launches_wait_for(self.job) if self.job is not None else contextlib.nullcontext()

    def finish(self) -> dict:
        """Wait for the compiles left, log the summary, write the step's manifest where every spec compiled, close a
        pool made here; returns the report (:func:`precompile_step`). Idempotent."""
        if self.job is None or "compiled" in self.result:  # skipped, or finished
            return self.result
        try:
            report = self.job.report()
        finally:
            if self.owned:
                self.pool.close(wait=False)
        conclude(report, key=self.key, log=self.log)
        waited = sum(self.job.waited.values())
        self.result.update(
            compiled=report.compiled, failed=report.failed, compile_s=report.seconds, workers=report.workers,
            skipped=report.skipped, slowest=[list(s) for s in report.slowest], entries=report.entries,
            waited_s=waited, waited_for=[[name, round(t, 3)] for name, t in self.job.waited.most_common(SLOWEST_REPORTED)],
        )
        return self.result


def start_precompile_step(
    model: nn.Module,
    batch: JaggedBatch,
    *,
    autocast_dtype: torch.dtype | None,
    forward: Callable[[JaggedBatch], object] | None = None,
    cast_dtype: torch.dtype | None = None,
    master_adamw: bool = False,
    pool: KernelCompilePool | None = None,
    workers: int | None = None,
    key: str | None = None,
    log: Callable[[str], None] = print,
) -> StepPrecompile:
    """Record the step's launches on ``batch`` (:func:`record_step`; ``cast_dtype`` and ``master_adamw`` as there),
    each spec sent to ``pool``'s workers (made here, of ``workers`` processes, when not given) as the recording
    meets it, and return while they compile: the step then runs inside :meth:`StepPrecompile.gate`, its early
    launches overlapping the compiles of its late ones, and :meth:`StepPrecompile.finish` waits for the rest and
    reports.

    With ``key`` (:func:`step_key`): skipped, with one logged line, when the step's manifest says the cache holds
    its kernels (:func:`kernels.precompile.cached_step`, which also settles this process's kernel keys, so the
    step's launches find the entries under the keys an earlier pool's workers compiled them: call this before the
    step's first launch); otherwise a precompile that compiles every spec writes that manifest for the next start.

    A logged no-op where nothing compiles (Triton's interpreter, no CUDA). Never raises: a kernel that fails to
    compile, a pool that cannot start, or a step that fails to record (the real step will then meet the same error),
    costs one logged line, and the kernels compile at their launches, as without this.
    """
    reason = skip_reason(["step"])
    cached = False
    if not reason and key is not None:
        reason = cached_step(key, log=log)
        cached = bool(reason)
    owned = pool is None
    start = time.perf_counter()
    # A pool given starts on each spec as the recording meets it; one made here starts after the recording, which
    # costs no processes when the recording fails.
    job = pool.start() if not reason and not owned else None
    if not reason:
        try:
            record = record_step(model, batch, autocast_dtype=autocast_dtype, forward=forward, cast_dtype=cast_dtype,
                                 master_adamw=master_adamw, on_spec=job.add if job is not None else None)
            if batch.candidate.is_cuda:
                torch.cuda.synchronize(batch.candidate.device)
            record_s = time.perf_counter() - start
            reason = "" if record.specs else "no Triton launches recorded"
        except Exception as err:
            reason = f"recording the step failed: {type(err).__name__}: {str(err).strip()[:200]}"
    if not reason and job is None:
        try:
            pool = KernelCompilePool(workers, device=batch.candidate.device.index or 0)
            job = pool.start(record.specs)
        except Exception as err:
            reason = f"no pool: {type(err).__name__}: {str(err).strip()[:200]}"
    if reason and job is not None:
        job.report()
        if owned:
            pool.close(wait=False)
    if reason:
        log(f"kernel precompile: skipped ({reason})")
        return StepPrecompile({"specs": 0, "launches": 0, "record_s": 0.0, "compiled": 0, "failed": [],
                               "compile_s": 0.0, "workers": 0, "skipped": reason, "cached": cached, "slowest": [],
                               "waited_s": 0.0, "waited_for": []})
    result = {"specs": len(record.specs), "launches": sum(record.launches.values()), "record_s": record_s,
              "skipped": "", "cached": False}
    return StepPrecompile(result, job=job, pool=pool, owned=owned, key=key, log=log)


def precompile_step(model: nn.Module, batch: JaggedBatch, **options) -> dict:
    """:func:`start_precompile_step` (``options``: its keyword arguments), then wait for every compile before
    returning (no step overlaps them). Returns ``{"specs", "launches", "record_s", "compiled", "failed",
    "compile_s", "workers", "skipped", "cached", "slowest", "waited_s", "waited_for"}`` (``compile_s``: from the
    first spec recorded, so it overlaps ``record_s``; ``cached``: skipped on the manifest; ``slowest``:
    :attr:`kernels.precompile.PrecompileReport.slowest`; ``waited_*``: what launches inside the gate waited for)."""
    return start_precompile_step(model, batch, **options).finish()
