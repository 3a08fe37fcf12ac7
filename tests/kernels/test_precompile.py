"""Recording a step's Triton launches and compiling them ahead (:mod:`kernels.precompile`, :mod:`gem.precompile`).

The step tests run a tiny teacher with every kernel on Triton, in the interpreter (``conftest.py``). The cache test
compiles for a real CUDA target in a subprocess without the interpreter, with Triton's bundled ``ptxas``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import triton
from triton.runtime import interpreter

import gem.precompile
from gem.precompile import precompile_step, record_step, start_precompile_step
from kernels.precompile import (
    CompileJob,
    KernelCompilePool,
    LaunchSpec,
    Pointer,
    compiled_line,
    kernel_modules,
    launch_spec,
    launches_wait_for,
    precompile,
    record_launches,
    recording,
    summary_line,
)
from tests.teacher_batches import CTR_SCHEMA, make_batch, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def on_triton(monkeypatch):
    monkeypatch.setenv("GEM_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("GEM_GLUE_BACKEND", "triton")


def tiny_teacher():
    from foundation.model.teacher import build_teacher

    torch.manual_seed(0)
    return build_teacher(tiny_config(generative=True), CTR_SCHEMA)


@contextlib.contextmanager
def counting_launches():
    """Every interpreted launch runs as usual; yields the specs of the launches, in order."""
    seen: list[LaunchSpec] = []
    original = interpreter.InterpretedFunction.run

    def run(kernel, *args, grid, warmup, **kwargs):
        if not warmup:
            seen.append(launch_spec(kernel, args, kwargs))
        return original(kernel, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    try:
        yield seen
    finally:
        interpreter.InterpretedFunction.run = original


def real_step(model, batch):
    loss = model.loss(batch, model(batch))["loss"]
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.slow
def test_recorded_launches_are_those_of_a_real_step_and_leave_no_trace(on_triton):
    """The record (launches skipped, outputs uninitialised) lists the kernels, specialisations and launch counts
    a real interpreted step runs; after it, the real step's loss and gradients equal those of a model that was
    never recorded (dropout and sampled negatives included: the random state is untouched)."""
    batch = make_batch(CTR_SCHEMA, [0, 1, 6, 3, 9])
    model = tiny_teacher()
    record = record_step(model, batch, autocast_dtype=None)
    assert all(p.grad is None for p in model.parameters())
    with counting_launches() as seen:
        loss, grads = real_step(model, batch)
    assert record.specs == list(dict.fromkeys(seen))
    assert record.launches == Counter(spec.name for spec in seen)
    names = {spec.name for spec in record.specs}
    assert {"_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "_ln_fwd_kernel", "_ln_bwd_kernel"} <= names
    assert {"_modulate_fwd_kernel", "_modulate_bwd_kernel"} <= names

    fresh_loss, fresh_grads = real_step(tiny_teacher(), batch)
    assert torch.equal(loss, fresh_loss)
    for name, grad in fresh_grads.items():
        assert (grad is None) == (grads[name] is None), name
        if grad is not None:
            assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, None], ids=["bf16", "float32"])
def test_the_record_of_a_padded_batch_holds_every_launch_of_the_bucketed_step(on_triton, dtype):
    """What ``bench_teacher --bucketed`` precompiles (:func:`record_step` on the first padded batch) is what its
    first step launches (:class:`gem.loop.StaticStep`: lookups apart, the dense step on static buffers)."""
    from foundation.model.padding import StaticShapes, pad_batch
    from gem.loop import GraphConfig, StaticStep

    model = tiny_teacher()
    batch = pad_batch(make_batch(CTR_SCHEMA, [0, 1, 5, 9, 3, 2]), StaticShapes(tokens=48, rows=(8, 16), max_len=12))
    record = record_step(model, batch, autocast_dtype=dtype)
    step = StaticStep(model, torch.optim.AdamW(model.parameters()), autocast_dtype=dtype, config=GraphConfig())
    with record_launches() as real:
        step(batch)
    assert record.specs == real.specs and record.launches == real.launches


def test_the_step_of_a_second_bucket_launches_what_the_first_buckets_record_compiled(on_triton):
    """``bench_teacher --bucketed 64,72`` precompiles the first batch's step (64 rows); a later batch that needs 72
    rows (every row adds its CLS and candidate tokens, so the sequence arch's token count changes by more than the
    rows) must launch no kernel specialised otherwise, or it compiles in the middle of training."""
    from foundation.model.padding import StaticShapes, pad_batch

    model = tiny_teacher()
    shapes = StaticShapes(tokens=48, rows=(64, 72), max_len=12)
    first = pad_batch(make_batch(CTR_SCHEMA, [0, 1, 5, 9, 3, 2]), shapes)
    second = pad_batch(make_batch(CTR_SCHEMA, [0] * 60 + [9, 8]), shapes)
    assert (first.batch_size, second.batch_size) == (64, 72)
    specs = [set(record_step(model, batch, autocast_dtype=None).specs) for batch in (first, second)]
    assert "_time_tiles_kernel" in {s.name for s in specs[0]}
    assert specs[1] == specs[0], sorted(s.name for s in specs[1] ^ specs[0])


def test_the_record_holds_the_cast_once_copies_of_the_first_steps(on_triton):
    """With ``cast_dtype`` the record also holds the copy kernel of a step that casts once (``bench_teacher`` and
    ``gem train`` by default): the first step's refresh of the copies and, from the second step on, the gradients'
    conversion, for parameters that only the first step's forward finds."""
    from foundation.model.padding import StaticShapes, pad_batch
    from foundation.model.precision import CastOnce
    from gem.loop import GraphConfig, StaticStep

    model = tiny_teacher()
    batch = pad_batch(make_batch(CTR_SCHEMA, [0, 1, 5, 9, 3, 2]), StaticShapes(tokens=48, rows=(8, 16), max_len=12))
    plain = record_step(model, batch, autocast_dtype=torch.bfloat16)
    record = record_step(model, batch, autocast_dtype=torch.bfloat16, cast_dtype=torch.bfloat16)
    cast = CastOnce(model)
    step = StaticStep(model, torch.optim.AdamW(model.parameters()), autocast_dtype=torch.bfloat16,
                      config=GraphConfig(), cast_once=cast)
    with record_launches() as real:
        step(batch)
        step(batch)
    assert cast.names
    copies = [s for s in record.specs if s not in plain.specs]
    assert len(copies) == 2 and {s.name for s in copies} == {"_multi_copy_kernel"}
    assert set(record.specs) == set(real.specs)


def test_the_record_holds_the_master_adamw_launches_of_the_first_steps(on_triton):
    """With ``master_adamw`` the record also holds the optimizer's kernel in the variants a step with
    :class:`MasterAdamW` keeping the copies launches: float32 gradients without copies, the first step's float32
    gradients into the copies, and the held bf16 gradients into them from the second step on, each with gradients
    laid out as their parameters and transposed ones."""
    from foundation.model.padding import StaticShapes, pad_batch
    from foundation.model.precision import CastOnce, MasterAdamW
    from gem.loop import GraphConfig, StaticStep

    model = tiny_teacher()
    batch = pad_batch(make_batch(CTR_SCHEMA, [0, 1, 5, 9, 3, 2]), StaticShapes(tokens=48, rows=(8, 16), max_len=12))
    plain = record_step(model, batch, autocast_dtype=torch.bfloat16, cast_dtype=torch.bfloat16)
    record = record_step(model, batch, autocast_dtype=torch.bfloat16, cast_dtype=torch.bfloat16, master_adamw=True)
    cast = CastOnce(model)
    optimizer = MasterAdamW(model.parameters())
    optimizer.keep_copies(cast)
    step = StaticStep(model, optimizer, autocast_dtype=torch.bfloat16, config=GraphConfig(), cast_once=cast)
    with record_launches() as real:
        step(batch)
        step(batch)
    added = [s for s in record.specs if s not in plain.specs]
    assert len(added) == 6 and {s.name for s in added} == {"_adamw_kernel"}
    # The gradients' conversion is recorded too (a clipping step still converts them), but not launched here.
    # Whether a transposed gradient of each kind occurs depends on the model: recorded either way.
    assert set(real.specs) <= set(record.specs)
    assert all(dict(s.kwargs)["STRIDED"] for s in set(added) - set(real.specs))


def test_the_record_holds_the_row_kernels_of_deferred_sparse_tables(on_triton):
    """A teacher with ``sparse_tables`` stepped by :class:`MasterAdamW` with deferred rows launches the catch-up,
    the gradients' row sums and the rows' update; the record holds each in the variants the real steps launch
    (the tables' width decides their blocks), and the real steps launch nothing the record lacks."""
    from foundation.model.padding import StaticShapes, pad_batch
    from foundation.model.precision import CastOnce, MasterAdamW
    from foundation.model.teacher import build_teacher
    from gem.loop import GraphConfig, StaticStep

    torch.manual_seed(0)
    model = build_teacher(tiny_config(generative=True, sparse_tables=True), CTR_SCHEMA)
    batch = pad_batch(make_batch(CTR_SCHEMA, [0, 1, 5, 9, 3, 2]), StaticShapes(tokens=48, rows=(8, 16), max_len=12))
    plain = record_step(model, batch, autocast_dtype=torch.bfloat16, cast_dtype=torch.bfloat16)
    record = record_step(model, batch, autocast_dtype=torch.bfloat16, cast_dtype=torch.bfloat16, master_adamw=True)
    cast = CastOnce(model)
    optimizer = MasterAdamW(model.parameters())
    assert optimizer.defer_rows(model)
    optimizer.keep_copies(cast)
    step = StaticStep(model, optimizer, autocast_dtype=torch.bfloat16, config=GraphConfig(), cast_once=cast)
    with record_launches() as real:
        step(batch)
        step(batch)
    rows = {"_catch_up_kernel", "_row_sums_kernel", "_row_adamw_kernel"}
    assert rows <= {s.name for s in real.specs}
    assert {s for s in real.specs if s.name in rows} <= set(record.specs)
    assert not {s for s in plain.specs if s.name in rows - {"_catch_up_kernel"}}
    assert set(real.specs) <= set(record.specs)


class WaitingJob:
    """Stands in for a :class:`CompileJob` whose every spec is still compiling: notes what each launch waits for."""

    def __init__(self) -> None:
        self.waited: list[LaunchSpec] = []

    def pending(self) -> bool:
        return True

    def wait_for(self, spec: LaunchSpec) -> None:
        self.waited.append(spec)


def test_a_gated_step_waits_for_each_kernel_it_launches_and_computes_the_same(on_triton):
    """Inside :func:`launches_wait_for` every launch of a real step first waits for its own spec, the one the
    recording sent to the workers (the record's, in first-launch order), then runs: loss and gradients equal the
    ungated step's."""
    batch = make_batch(CTR_SCHEMA, [0, 1, 6, 3, 9])
    sent: list[LaunchSpec] = []
    record = record_step(tiny_teacher(), batch, autocast_dtype=None, on_spec=sent.append)
    assert sent == record.specs
    job = WaitingJob()
    with launches_wait_for(job):
        loss, grads = real_step(tiny_teacher(), batch)
    assert list(dict.fromkeys(job.waited)) == record.specs
    assert len(job.waited) == sum(record.launches.values())
    plain_loss, plain_grads = real_step(tiny_teacher(), batch)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(grads[n], g) for n, g in plain_grads.items() if g is not None)


def test_a_launch_waits_for_its_compile_only_until_the_deadline(tmp_path, monkeypatch):
    """A spec whose worker never answers holds its launch until the job's deadline, not forever; a spec never sent
    does not wait; one added after the report is ignored."""
    (tmp_path / "hangs_on_import.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = LaunchSpec("kernels.triton.layer_norm:_ln_fwd_kernel", (), (), ())
    other = LaunchSpec("kernels.triton.layer_norm:_ln_bwd_kernel", (), (), ())
    with KernelCompilePool(1, modules=["hangs_on_import"]) as pool:
        job = pool.start(timeout_s=2.0)
        job.add(spec)
        assert job.pending()
        start = time.perf_counter()
        job.wait_for(other)
        # Well under the 2 s deadline (a loaded CI machine may be slow to return, but not by a deadline).
        assert time.perf_counter() - start < 1.5
        job.wait_for(spec)
        assert 1.5 < time.perf_counter() - start < 60
        report = job.report()
    assert report.compiled == 0 and report.failed and not job.pending()
    job.add(other)
    assert other not in job.done and job.report() is report


def test_specs_added_while_the_job_runs_compile_and_are_waited_for(monkeypatch):
    """Specs join a running job as a recording meets them; :meth:`CompileJob.wait_for` returns once each is done and
    the report counts every one (the workers set up on the compile-only driver: this checks the job, not Triton)."""
    from kernels import layer_norm

    with record_launches() as record:
        layer_norm(torch.randn(3, 8), torch.ones(8), torch.zeros(8), 1e-5, backend="triton")
    unknown = LaunchSpec("kernels.triton.layer_norm:no_such_kernel", (), (), ())
    with KernelCompilePool(2, modules=[*kernel_modules(), "tests.kernels.compile_only_driver"]) as pool:
        job = pool.start()
        assert isinstance(job, CompileJob) and not job.pending()
        for spec in [*record.specs, unknown]:
            job.add(spec)
        for spec in [*record.specs, unknown]:
            job.wait_for(spec)
            assert job.done[spec].is_set()
        assert not job.pending()
        report = job.report()
    assert (report.specs, report.compiled) == (2, 1) and report.failed[0].startswith("no_such_kernel: ")


def test_the_first_step_overlaps_the_compiles_of_its_kernels(on_triton, monkeypatch):
    """:func:`start_precompile_step` returns once the step is recorded, its specs already with the workers; the step
    runs inside the gate and :meth:`~gem.precompile.StepPrecompile.finish` reports every spec (here compiled on the
    compile-only driver in the interpreter: the flow, not Triton)."""
    monkeypatch.setattr(gem.precompile, "skip_reason", lambda specs: "")
    batch = make_batch(CTR_SCHEMA, [0, 1, 6, 3, 9])
    model = tiny_teacher()
    lines: list[str] = []
    with KernelCompilePool(2, modules=[*kernel_modules(), "tests.kernels.compile_only_driver"]) as pool:
        started = start_precompile_step(model, batch, autocast_dtype=None, pool=pool, log=lines.append)
        specs = record_step(tiny_teacher(), batch, autocast_dtype=None).specs
        assert list(started.job.done) == specs and started.result["specs"] == len(specs)
        with started.gate():
            real_step(model, batch)
        result = started.finish()
    assert result["compiled"] == len(specs) and result["failed"] == [] and result["waited_s"] >= 0
    assert started.finish() is result and lines == [summary_line(started.job.report())]


def test_the_harness_runs_the_first_step_inside_the_gate_and_reports_after_it(on_triton, monkeypatch):
    """:class:`gem.train.PrecompileKernels` with a pool: at the first batch the step is recorded and the gate
    entered; the step runs gated; after it the gate is left, the report holds every spec and the workers end."""
    import functools
    from types import SimpleNamespace

    import gem.train
    from gem.loop import GraphConfig
    from gem.step_options import StepOptions

    monkeypatch.setattr(gem.train, "skip_reason", lambda specs: "")
    monkeypatch.setattr(gem.precompile, "skip_reason", lambda specs: "")
    monkeypatch.setattr(gem.train, "KernelCompilePool", functools.partial(
        KernelCompilePool, 2, modules=[*kernel_modules(), "tests.kernels.compile_only_driver"]))
    model = tiny_teacher()
    options = StepOptions(autocast_dtype=None, cast_once=False, shapes=None, graphs=GraphConfig(),
                          precompile_kernels=True)
    module = SimpleNamespace(model=model, step_options=options, device=torch.device("cpu"),
                             cfg=SimpleNamespace(data=SimpleNamespace(train_split="train")),
                             forward_batch=lambda batch, split: model(batch))
    batch = make_batch(CTR_SCHEMA, [0, 1, 6, 3, 9])
    callback = gem.train.PrecompileKernels()
    callback.on_fit_start(None, module)
    pool = callback.pool
    callback.on_train_batch_start(None, module, batch, 0)
    assert interpreter.InterpretedFunction.run.__name__ == "gated_run"
    real_step(model, batch)
    callback.on_train_batch_end(None, module, None, batch, 0)
    assert interpreter.InterpretedFunction.run.__name__ != "gated_run"
    report = callback.report
    assert report["specs"] > 0 and report["compiled"] == report["specs"] and report["first_step_compiled"] == []
    assert callback.pool is None
    pool.close()
    assert all(process.poll() is not None for process in pool.processes)


def test_records_are_deterministic(on_triton):
    batch = make_batch(CTR_SCHEMA, [4, 0, 7])
    first = record_step(tiny_teacher(), batch, autocast_dtype=None)
    second = record_step(tiny_teacher(), batch, autocast_dtype=None)
    assert first.specs == second.specs and first.launches == second.launches
    assert [(s.args, s.kwargs) for s in first.specs] == [(s.args, s.kwargs) for s in second.specs]
    assert len(first.specs) < sum(first.launches.values())  # equal launches are one spec


def test_specs_key_what_triton_specialises_on():
    from kernels import layer_norm

    def specs(rows: int, n: int, *, view_offset: int = 0, dtype=torch.float32):
        x = torch.randn(rows * n + view_offset, dtype=dtype)[view_offset:].view(rows, n)
        with record_launches() as record:
            layer_norm(x, torch.ones(n), torch.zeros(n), 1e-5, backend="triton")
        return record.specs

    (base,) = specs(6, 24)
    assert specs(10, 24) == [base]  # row count: a grid size, not specialised
    assert specs(6, 32) != [base]  # N: BLOCK_N and the stride's divisibility by 16
    assert specs(6, 24, dtype=torch.float16) != [base]
    (shifted,) = specs(6, 24, view_offset=1)  # x 4 bytes past a 16-byte boundary
    assert shifted != base and shifted.args[0] == Pointer(torch.float32, 4)
    assert not recording()


def test_batches_of_another_bucket_launch_the_same_specialisations():
    """A padded batch of another bucket has a few more rows and so a few more tokens (each row's own tokens): the
    kernels whose arguments follow those counts must not specialise on them, or the first batch of each bucket
    compiles kernels in the middle of training. Here 48 tokens in 3 rows against 56 in 5 (divisible by 16 or not)
    and 48 in 4 (the modulation's chunk table then holds an odd number of chunks before its row starts)."""
    from kernels import jagged_attention
    from kernels.glue import jagged_silu_modulate

    def specs(lengths: list[int]) -> set:
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        tokens, heads = int(offsets[-1]), 2
        q, k, v = (torch.randn(tokens, heads, 16, requires_grad=True) for _ in range(3))
        tables = torch.randn(heads, 8, requires_grad=True), torch.randn(heads, 8, requires_grad=True)
        h = torch.randn(tokens, 8, requires_grad=True)
        scale, shift = (torch.randn(len(lengths), 8, requires_grad=True) for _ in range(2))
        rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        with record_launches() as record:
            out = jagged_attention(q, k, v, offsets, 32, activation="silu", causal=True, pos_bias=tables[0],
                                   time_bias=tables[1], timestamps=torch.arange(tokens) * 37, backend="triton")
            out.sum().backward()
            jagged_silu_modulate(h, scale, shift, rows, backend="triton").sum().backward()
        return set(record.specs)

    first = specs([16, 16, 16])
    assert {s.name for s in first} >= {"_time_tiles_kernel", "_modulate_fwd_kernel", "_modulate_bwd_kernel"}
    for lengths in ([16, 16, 8, 8, 8], [12, 12, 12, 12]):
        other = specs(lengths)
        assert other == first, (lengths, sorted(s.name for s in other ^ first))


def test_an_autotuned_launch_records_every_config_and_remembers_no_pick(monkeypatch):
    """Without a checked-in config a launch would autotune: the record holds each config the autotuner would
    compile, and neither the picks nor the autotuner's cache change (the real launch still tunes)."""
    import kernels.triton.jagged_attention as attention
    from kernels import jagged_attention
    from kernels.triton.configs import FWD_CONFIGS, configs_for

    launch = attention._launch

    def as_on_cuda(tuned, plain, cpu_blocks, block_key, grid_rows, batch_heads, args, kwargs, on_cuda, work=None):
        launch(tuned, plain, cpu_blocks, block_key, grid_rows, batch_heads, args, kwargs, True, work)

    monkeypatch.setattr(attention, "_launch", as_on_cuda)
    monkeypatch.setattr(attention, "checked_in_pick", lambda device, entry: None)
    monkeypatch.setattr(attention, "_PICKS", {})
    q, k, v = (torch.randn(9, 2, 16) for _ in range(3))
    offsets = torch.tensor([0, 4, 9])
    tuned, cache = dict(attention.TUNED), dict(attention._fwd_tuned.cache)
    with record_launches() as record:
        jagged_attention(q, k, v, offsets, 5, activation="silu", backend="triton")
    expected = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                for c in configs_for(FWD_CONFIGS, {"HAS_PB": False, "HAS_TB": False}, q.dtype)]
    got = [tuple(dict(s.kwargs)[name] for name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))
           for s in record.specs]
    assert got == expected and all(s.name == "_fwd_kernel" for s in record.specs)
    assert (attention._PICKS, attention.TUNED, attention._fwd_tuned.cache) == ({}, tuned, cache)

    chosen = triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2)
    monkeypatch.setattr(attention, "checked_in_pick", lambda device, entry: chosen)
    with record_launches() as record:
        jagged_attention(q, k, v, offsets, 5, activation="relu", backend="triton")
    (options,) = [dict(s.kwargs) for s in record.specs if s.name == "_fwd_kernel"]
    assert (options["BLOCK_M"], options["BLOCK_N"], options["num_warps"], options["num_stages"]) == (64, 32, 4, 2)


def test_recording_is_not_reentrant_and_ends_on_error():
    with pytest.raises(RuntimeError, match="already active"), record_launches(), record_launches():
        pass
    with pytest.raises(ValueError, match="boom"), record_launches():
        raise ValueError("boom")
    assert not recording()


def test_the_pool_reports_failures_in_one_line():
    """An unknown kernel fails in its worker and is reported with the kernel's name; the others compile (the
    workers inherit the interpreter, whose ``warmup`` compiles nothing, and set up on the compile-only driver:
    this checks the pool, not Triton)."""
    from kernels import layer_norm

    with record_launches() as record:
        layer_norm(torch.randn(3, 8), torch.ones(8), torch.zeros(8), 1e-5, backend="triton")
    unknown = LaunchSpec("kernels.triton.layer_norm:no_such_kernel", (), (), ())
    with KernelCompilePool(2, modules=[*kernel_modules(), "tests.kernels.compile_only_driver"]) as pool:
        report = pool.compile([*record.specs, unknown])
    assert (report.specs, report.compiled, report.workers) == (2, 1, 2)
    # Both specs timed, slowest first, from when each was sent.
    assert sorted(name for name, _, _ in report.slowest) == ["_ln_fwd_kernel", "no_such_kernel"]
    assert report.slowest[0][2] >= report.slowest[1][2] > 0 and all(0 <= sent < 60 for _, sent, _ in report.slowest)
    assert report.failed == ["no_such_kernel: LookupError: kernels.triton.layer_norm:no_such_kernel is not a Triton kernel"]
    line = summary_line(report)
    assert "\n" not in line and "1/2 specs" in line and "1 failed, first no_such_kernel" in line


def test_a_worker_that_cannot_start_fails_every_spec_in_one_line():
    spec = LaunchSpec("kernels.triton.layer_norm:_ln_fwd_kernel", (), (), ())
    with KernelCompilePool(1, modules=["kernels.no_such_module"]) as pool:
        report = pool.compile([spec, spec])
    assert report.compiled == 0 and len(report.failed) == 2
    assert report.failed[0].startswith("_ln_fwd_kernel: worker set-up: ModuleNotFoundError")


def test_a_hung_worker_is_killed_at_the_deadline_and_its_specs_fail_in_one_line(tmp_path, monkeypatch):
    """A worker that never answers (its set-up hangs) costs ``timeout_s``, not the first step forever."""
    (tmp_path / "hangs_on_import.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = LaunchSpec("kernels.triton.layer_norm:_ln_fwd_kernel", (), (), ())
    start = time.perf_counter()
    with KernelCompilePool(1, modules=["hangs_on_import"]) as pool:
        report = pool.compile([spec, spec], timeout_s=2.0)
    assert time.perf_counter() - start < 60
    assert report.compiled == 0 and len(report.failed) == 2
    assert any("timed out after 2 s" in failure for failure in report.failed)


def test_closing_without_waiting_leaves_the_workers_exit_to_a_reaper(tmp_path, monkeypatch):
    """Before the first step the caller does not wait for the workers' interpreters to tear down (here each
    worker's exit handler sleeps 3 s); the reaper thread still sees every worker exit cleanly."""
    (tmp_path / "slow_exit.py").write_text("import atexit\nimport time\n\natexit.register(time.sleep, 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pool = KernelCompilePool(2, modules=[*kernel_modules(), "tests.kernels.compile_only_driver", "slow_exit"])
    spec = LaunchSpec("kernels.triton.layer_norm:no_such_kernel", (), (), ())
    assert pool.compile([spec]).failed  # answered: the worker that took it is set up and waiting
    start = time.perf_counter()
    pool.close(wait=False)
    returned = time.perf_counter() - start
    assert all(process.poll() is None for process in pool.processes)
    pool.reaper.join(60)
    reaped = time.perf_counter() - start
    assert [process.returncode for process in pool.processes] == [0, 0]
    # Returned before any worker's 3 s exit could have ended (a margin for a loaded machine), reaped after.
    assert returned < 2.5 and reaped >= 3.0


def test_nothing_compiles_in_the_interpreter(on_triton):
    lines: list[str] = []
    report = precompile([LaunchSpec("kernels.triton.layer_norm:_ln_fwd_kernel", (), (), ())], log=lines.append)
    assert report.compiled == 0 and report.skipped.startswith("Triton interpreter")
    result = precompile_step(tiny_teacher(), make_batch(CTR_SCHEMA, [2, 3]), autocast_dtype=None, log=lines.append)
    assert result["specs"] == 0 and result["skipped"] == report.skipped
    assert lines == [f"kernel precompile: skipped ({report.skipped})"] * 2


def _ptxas() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _without_interpreter(tmp_path) -> dict[str, str]:
    """The environment of a check that compiles for CUDA: no interpreter, its own cache, this repository first on
    the path, after ``GEM_CHECK_TRITON`` when set (a directory holding another Triton, e.g. the GPU machine's
    3.6 unpacked, to run the check against that version)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = os.pathsep.join(p for p in (os.environ.get("GEM_CHECK_TRITON"), str(REPO)) if p)
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=path, TRITON_DEFAULT_FP_FUSION="1")
    return env


def _run_check(module: str, *args: str, env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not _ptxas().is_file(), reason="this Triton bundles no ptxas: it cannot compile for CUDA here")
@pytest.mark.parametrize(("step", "specs"), [("layer_norm", 2), ("teacher", None)])
def test_the_pool_fills_the_cache_the_real_launches_read(tmp_path, step, specs):
    """For a CUDA target (sm_90, compiled without a GPU): the pool's artifacts land in ``TRITON_CACHE_DIR``, and
    the JIT's lookups for the real launches (real tensors, compile without launch) find every one of them: for a
    LayerNorm, and for a tiny teacher's bucketed step (:class:`gem.loop.StaticStep`, bf16 and float32), whose
    attention kernels share helpers (under Triton 3.6 their keys depended on which kernel a process hashed first:
    the real step compiled 8 of 46 again)."""
    result = _run_check("tests.kernels.precompile_cache_check", step, env=_without_interpreter(tmp_path))
    assert result["failed"] == [] and result["compiled"] == result["specs"] == result["cache_entries"]
    assert specs is None or result["specs"] == specs
    assert result["kernels_compiled_by_the_real_launches"] == []
    assert result["entries_added_by_the_real_launches"] == []
    assert result["entries_read_not_listed"] == [] and result["entries_listed"] == result["cache_entries"]
    assert result["manifest_written"]
    assert result["manifest_skip"].startswith(f"cache holds the {result['specs']} kernels of this step, manifest ")


@pytest.mark.slow
@pytest.mark.skipif(not _ptxas().is_file(), reason="this Triton bundles no ptxas: it cannot compile for CUDA here")
def test_a_warm_start_finds_the_kernels_an_earlier_pool_compiled(tmp_path):
    """A second start on the cache a pool filled (sm_90, compiled without a GPU) skips on the manifest, starts no
    pool, and its step compiles nothing, though it hashed the attention's kernels in another order than the
    workers did (under Triton 3.6 it compiled 12 of them again: nothing settled its keys without a pool)."""
    env = _without_interpreter(tmp_path)
    first = _run_check("tests.kernels.precompile_cache_check", "teacher", env=env)
    assert first["failed"] == [] and first["manifest_written"]
    second = _run_check("tests.kernels.precompile_cache_check", "teacher", "--warm", env=env)
    assert second["cached"] and second["skipped"].startswith(f"cache holds the {first['specs']} kernels of this step")
    assert second["cache_entries"] == first["cache_entries"]
    assert second["kernels_compiled_by_the_real_launches"] == []
    assert second["entries_added_by_the_real_launches"] == []


@pytest.mark.skipif(not _ptxas().is_file(), reason="this Triton bundles no ptxas: it cannot compile for CUDA here")
def test_the_kernels_a_step_compiles_itself_are_named(tmp_path):
    """What ``bench_teacher`` logs after its first step: the kernels it compiled in-process (new cache entries), by
    name; none once they are in the cache."""
    result = _run_check("tests.kernels.precompile_cache_check", "layer_norm", "--cold", env=_without_interpreter(tmp_path))
    assert result["compiled_since"] == sorted(result["kernels_compiled_by_the_real_launches"])
    assert result["compiled_since"] == ["_ln_bwd_kernel", "_ln_fwd_kernel"]
    line = compiled_line("first step", result["compiled_since"])
    assert line == "first step: 2 Triton kernels compiled in-process (cache misses): _ln_bwd_kernel, _ln_fwd_kernel"
    assert compiled_line("first step", []) == "first step: 0 Triton kernels compiled in-process (cache misses)"


def test_cache_keys_do_not_depend_on_what_a_process_hashed_first(tmp_path):
    """After :func:`settle_cache_keys`, every kernel's key is the same in a process that hashed the attention's
    backward kernels first as in one that hashed its forward first (a worker and the training process)."""
    env = _without_interpreter(tmp_path)
    backward_first = _run_check("tests.kernels.cache_key_check", "_bwd_dq_kernel", "_bwd_dkdv_kernel", env=env)
    forward_first = _run_check("tests.kernels.cache_key_check", "_fwd_kernel", env=env)
    assert len(forward_first) > 10 and backward_first == forward_first


def test_a_step_that_fails_to_record_costs_one_line(monkeypatch):
    """Where the pool would run, a step whose recording raises is skipped with one line; the caller goes on."""
    import gem.precompile

    class Broken(torch.nn.Module):
        def forward(self, batch):
            raise ValueError("no such feature: user_age")

        def loss(self, batch, output):
            return {"loss": output}

    monkeypatch.setattr(gem.precompile, "skip_reason", lambda specs: "")
    lines: list[str] = []
    result = precompile_step(Broken(), make_batch(CTR_SCHEMA, [2]), autocast_dtype=None, log=lines.append)
    assert result["specs"] == 0
    assert lines == ["kernel precompile: skipped (recording the step failed: ValueError: no such feature: user_age)"]
    assert not recording()


def test_the_harness_switch_is_on_for_one_device_and_adds_the_callback():
    from foundation.config import apply_overrides
    from gem.flavors import get_flavor
    from gem.step_options import step_options
    from gem.train import PrecompileKernels, build_trainer

    def resolved(*overrides: str):
        cfg = apply_overrides(get_flavor("teacher-large"), list(overrides))
        return cfg, step_options(cfg, has_lookups=True)[0].precompile_kernels

    cfg, on = resolved()
    assert on and any(isinstance(c, PrecompileKernels) for c in build_trainer(cfg, None, None).callbacks)
    cfg, off = resolved("train.precompile_kernels=false")
    assert not off and not any(isinstance(c, PrecompileKernels) for c in build_trainer(cfg, None, None).callbacks)
    assert not resolved("parallel.enabled=true")[1]


def test_the_pool_closes_promptly_while_a_forked_process_holds_its_pipes():
    """A DataLoader worker forked after the pool started holds copies of the pipes' write ends, so the workers
    never see the end of their input: closing must tell them to stop, not wait for that end."""
    with KernelCompilePool(2, modules=[*kernel_modules(), "tests.kernels.compile_only_driver"]) as pool:
        pool.compile([])
        holder = os.fork()
        if holder == 0:  # the forked child only keeps the inherited pipes open for a while
            time.sleep(60)
            os._exit(0)
        try:
            start = time.perf_counter()
            pool.close(timeout_s=20.0)
            elapsed = time.perf_counter() - start
            assert all(process.returncode == 0 for process in pool.processes)
        finally:
            os.kill(holder, signal.SIGKILL)
            os.waitpid(holder, 0)
    assert elapsed < 15.0
