"""Run by ``test_precompile.py`` in a process without Triton's interpreter: record a step's launches, compile them
in a :class:`~kernels.precompile.KernelCompilePool` for an sm_90 target (:mod:`tests.kernels.compile_only_driver`),
then run the same step for real with each launch stopped after the JIT's cache lookup and compile. Prints one JSON
line: the pool's report, the cache entries it made, and the entries the real launches added (none when they found
the pool's) with the kernels that added them; the entries the real launches read that the pool's report does not
list (what a manifest written from it would miss), and whether that manifest, written, then makes the step skip.

``python -m tests.kernels.precompile_cache_check layer_norm``: a fused LayerNorm's forward and backward.
``--cold`` after either: the pool compiles nothing (the real launches compile every kernel).
``... teacher``: a tiny teacher's bucketed training step (every kernel on Triton), recorded as
:func:`gem.precompile.precompile_step` records it and run as ``bench_teacher --bucketed`` runs it
(:class:`gem.loop.StaticStep` on a padded batch), under bf16 autocast, then in float32.
``teacher --warm``, in a fresh process on the cache that ``teacher`` filled: no pool; the step takes the warm path
(:func:`gem.precompile.precompile_step` skips on the manifest) after hashing the attention's backward kernels first,
then runs as above. Prints the skip and what the real launches compiled.
"""

from __future__ import annotations

import json
import sys

import torch
from triton.runtime import jit

import tests.kernels.compile_only_driver  # noqa: F401  (the active driver: compile for sm_90, launch nothing)
from kernels import layer_norm
from kernels.precompile import (
    KernelCompilePool,
    _entries_used,
    cache_entries,
    cached_step,
    compiled_since,
    kernel_modules,
    record_launches,
    step_key,
    write_manifest,
)


def layer_norm_step() -> None:
    x = torch.randn(6, 24, requires_grad=True)
    layer_norm(x, torch.ones(24), torch.zeros(24), 1e-5, backend="triton").sum().backward()


def layer_norm_steps():
    """``(record, run)``: the launches of the LayerNorm step, and the step."""
    with record_launches() as record:
        layer_norm_step()
    return record.specs, layer_norm_step


TEACHER_DTYPES = (torch.bfloat16, None)


def teacher_model_and_batch():
    """A tiny teacher with every kernel on Triton, and a padded batch of it."""
    from foundation.model.padding import StaticShapes, pad_batch
    from foundation.model.teacher import build_teacher
    from kernels.settings import KernelSettings, apply_kernel_settings
    from tests.teacher_batches import CTR_SCHEMA, make_batch, tiny_config

    apply_kernel_settings(KernelSettings(backend="triton", glue_backend="triton"))
    torch.manual_seed(0)
    model = build_teacher(tiny_config(generative=True, in_batch_negatives=True), CTR_SCHEMA).train()
    batch = pad_batch(make_batch(CTR_SCHEMA, [0, 1, 5, 9, 3, 2]), StaticShapes(tokens=48, rows=(8, 16), max_len=12))
    return model, batch


def teacher_run(model, batch) -> None:
    """Both real :class:`~gem.loop.StaticStep` steps of ``model`` on ``batch``, at bf16 and float32."""
    from gem.loop import GraphConfig, StaticStep

    for dtype in TEACHER_DTYPES:
        optimizer = torch.optim.AdamW(model.parameters())
        StaticStep(model, optimizer, autocast_dtype=dtype, config=GraphConfig())(batch)


def teacher_steps():
    """``(record, run)``: the launches :func:`~gem.precompile.record_step` records for a tiny teacher's padded
    batch at bf16 and float32, and a function that runs both real steps (:func:`teacher_run`)."""
    from gem.precompile import record_step

    model, batch = teacher_model_and_batch()
    specs = list(dict.fromkeys(s for d in TEACHER_DTYPES for s in record_step(model, batch, autocast_dtype=d).specs))
    return specs, lambda: teacher_run(model, batch)


def teacher_warm():
    """``--warm``: the teacher's step as a start on a warm cache takes it: its kernels hashed in another order
    than a worker's (the attention's backward first), then :func:`gem.precompile.precompile_step` with the key of
    the manifest ``teacher`` wrote, which skips. Returns its result and the step (:func:`teacher_run`)."""
    import gem.precompile
    import kernels.triton.jagged_attention as attention

    # The compile-only driver stands in for CUDA, which the precompile's own check looks for.
    gem.precompile.skip_reason = lambda specs: ""
    model, batch = teacher_model_and_batch()
    for name in ("_bwd_dq_kernel", "_bwd_dkdv_kernel"):
        getattr(attention, name).cache_key  # noqa: B018
    key = step_key(["teacher"])  # after the kernel switches are set, as in ``teacher``
    result = gem.precompile.precompile_step(model, batch, autocast_dtype=TEACHER_DTYPES[0], key=key, log=print)
    return result, lambda: teacher_run(model, batch)


def compile_only(run_step) -> tuple[list[str], set[str]]:
    """Run ``run_step`` with each launch stopped after the JIT's cache lookup and compile: the kernels whose
    launches added a cache entry, in order, and the cache entries the launches read."""
    run = jit.JITFunction.run
    missed: list[str] = []

    def lookup(kernel, *args, grid, warmup, **kwargs):
        before = cache_entries()
        compiled = run(kernel, *args, grid=grid, warmup=True, **kwargs)
        if cache_entries() - before:
            missed.append(kernel.fn.__name__)
        return compiled

    jit.JITFunction.run = lookup
    try:
        with _entries_used() as read:
            run_step()
    finally:
        jit.JITFunction.run = run
    return missed, read


def warm(step: str) -> None:
    """``teacher --warm``: no pool; the step's start on the cache that an earlier run of it filled."""
    result, run_step = {"teacher": teacher_warm}[step]()
    made = cache_entries()
    missed, _ = compile_only(run_step)
    print(json.dumps({
        "skipped": result["skipped"], "cached": result["cached"], "cache_entries": len(made),
        "entries_added_by_the_real_launches": sorted(cache_entries() - made), "kernels_compiled_by_the_real_launches": missed,
    }))


def main(step: str, cold: bool) -> None:
    specs, run_step = {"layer_norm": layer_norm_steps, "teacher": teacher_steps}[step]()
    with KernelCompilePool(2, modules=[*kernel_modules(), "tests.kernels.compile_only_driver"]) as pool:
        report = pool.compile([] if cold else specs)
    made = cache_entries()
    key = step_key([step])
    manifest = write_manifest(key, report, log=lambda line: None)
    missed, read = compile_only(run_step)
    print(json.dumps({
        "entries_listed": len(report.entries), "entries_read_not_listed": sorted(read - set(report.entries)),
        "manifest_written": manifest is not None, "manifest_skip": cached_step(key, log=print),
        "specs": report.specs, "compiled": report.compiled, "failed": report.failed, "cache_entries": len(made),
        "entries_added_by_the_real_launches": sorted(cache_entries() - made), "kernels_compiled_by_the_real_launches": missed,
        "compiled_since": compiled_since(made),
    }))


if __name__ == "__main__":
    if "--warm" in sys.argv[2:]:
        warm(sys.argv[1])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "layer_norm", "--cold" in sys.argv[2:])
