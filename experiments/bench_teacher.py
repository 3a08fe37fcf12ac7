"""Training throughput of a GEM teacher flavor on one GPU: tokens/s, TFLOP/s, MFU, memory, start-up.

Usage::

    python -m experiments.bench_teacher --flavor large --token-budget 16384 --steps 40 \\
        --data /tmp/world --json /tmp/large_triton.json
    python -m experiments.bench_teacher --flavor large --backend pytorch --max-history 512 \\
        --token-budget 16384 --steps 20 --data /tmp/world --json /tmp/large_pytorch.json
    python -m experiments.bench_teacher --flavor debug --steps 3 --rows 2000 --examples 4000   # CPU smoke test

A synthetic ``large`` world (histories up to ``--world-max-history`` = 4096 events, scaled down to
``--examples`` impressions) is generated into ``--data`` (reused when it already holds a dataset)
or a temporary directory. The flavor is built and initialised on the device (``--no-init-on-device``: on the
CPU, then moved) and trained for ``--steps`` AdamW
steps under bf16 autocast on token-budgeted batches of the train split (pinned host memory,
non-blocking copies), stopping early at ``--time-limit`` seconds of training after the first step. Set
``TRITON_CACHE_AUTOTUNING=1`` to reuse the kernels' autotuning across runs.

Reported (stdout and ``--json``): time to the first finished step from process start and from
the start of the model build; steady-state tokens/s, TFLOP/s and MFU over the steps after
``--warmup`` (each step timed end to end, data wait included; model FLOPs from ``model.flops`` on
the host batch, valid tokens only; peak from :func:`foundation.model.flops.peak_flops`); peak GPU
memory (``torch.cuda.max_memory_allocated``); the loss of the first and last steps. ``--profile N``
then runs ``N`` more steps under ``torch.profiler`` and prints (and stores) the operators and kernels
that took the most device time, and the kernel time per step by group (generative loss, attention,
embeddings, optimizer, GEMM, elementwise/norm, other: :mod:`experiments.kernel_groups`) with the share
of the step the GPU sat idle.

``--timeline N`` profiles ``N`` more steps the way ``--overlap-steps`` runs them and reports the GPU's idle time
between its kernels per step, by the host op it waited in and by the launch that ended it, with the longest gaps
(:mod:`experiments.device_timeline`).

``--sync-check`` (CUDA) runs one more step under ``torch.cuda.set_sync_debug_mode`` and lists where it
made the host wait for the GPU. Each step waits for the GPU before the next starts, unless ``--overlap-steps``:
after the first step a step's loss is read (the host waits for that step only: :class:`LossReadback`) once the next
step is enqueued, so the host's part of a step (the FLOP count, the batch's copy, the lookups, the launches) runs
while the GPU finishes the one before,
as in a training loop that logs a step's loss late; a step's time is then the time between two such reads.

``--compare-losses REF.json`` prints the largest per-step loss difference against another run's
``--json`` over the steps both ran (same seed and data: the same batches, which it checks), e.g. the
fused glue kernels against ``--glue-backend pytorch``. ``--record docs/results/teacher_mfu.json`` appends
the headline figures (MFU, tokens/s, median step, first step after the build, the command, date and
device) to that file as one row.

``--bucketed ROWS`` pads every batch (in the DataLoader's workers) to ``--token-budget`` tokens and the
smallest of the comma-separated row counts that holds it (:mod:`foundation.model.padding`: the loss and
gradients do not change) and trains those through :class:`gem.loop.StaticStep`, one set of static buffers
per bucket; ``--cuda-graphs`` then captures each bucket's dense forward and backward into a CUDA graph
after ``--graph-warmup`` eager steps and replays it (a failed capture prints one line and runs eagerly).
With graphs, every bucket's warm-up steps and capture run right after the first step, before the timed steps,
on stand-ins made from the first batch (``prepare_buckets``: their seconds and buckets; ``--no-prepare-buckets``
leaves each to its first batch, inside the timed steps).
Throughput counts the real rows and tokens only. ``--no-cast-once`` restores autocast's cast of every
parameter at every use (:class:`foundation.model.precision.CastOnce` casts once per step, same values; in the
static step, inside its graph). ``--optimizer master`` (default) steps with
:class:`foundation.model.precision.MasterAdamW`, which in the static step reads the copies' bf16 gradients and
writes the copies itself; ``--optimizer adamw`` with torch's fused AdamW (float32 gradients, copies refreshed by the
forward).

``--count-ops N`` (after the timed steps; ``--steps 0`` for none) counts the ATen operators and Triton
launches of ``N`` eager steps by phase, kind and source line, then times the host of ``N`` more
(:mod:`experiments.op_count`); with ``--cpu-widths`` the flavor keeps its structure at CPU-sized widths,
a proxy for the GPU step's host work. Trailing ``field=value`` arguments override the teacher config (e.g.
``dropout=0.0``). CPU proxy of the ``large`` step (the Triton kernels counted, not interpreted)::

    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 python -m experiments.bench_teacher --flavor large --cpu-widths \
        --steps 0 --count-ops 3 --rows 256 --examples 3000 --items 2000 --workers 0 --token-budget 512 \
        --max-history 64 --data /tmp/world-small --backend triton --glue-backend triton

``--precompile`` (default on CUDA) records the first batch's Triton launches before its step and compiles them in
``--precompile-workers`` processes started as the script starts, before it imports torch (:mod:`gem.compile_workers`,
:mod:`gem.precompile`, :mod:`kernels.precompile`), so a machine with an empty Triton cache does not compile them one
after another inside the first step. Each kernel goes to the workers as the recording meets it, and the first step
runs while they compile, each launch waiting for its own kernel only; ``precompile_s`` (the recording) is part
of the first step's time (``first_step_parts``: the build, the first batch's wait, the recording, the step itself,
its waits included, and the rest, adding up to the time from the build's start; ``precompile.compile_s``: the
compiles, from the first spec recorded; ``precompile.waited_s``/``waited_for``: what the step's launches waited
for; ``precompile.slowest``: the specs that took longest). After the first step
one line (and ``first_step_compiled`` in the JSON) names the Triton kernels it still compiled itself (new entries
in Triton's cache: what the precompile missed); so does the first step of each later bucket (``later_buckets`` in
the trace's ``static``: a kernel specialised on the new shapes compiles there, in the middle of training). A
precompile that compiled every kernel leaves a manifest in the cache, keyed by what decides the step's kernels
(:func:`precompile_key`); a later run of the same step on that cache records nothing and starts no compile process
(one line: ``kernel precompile: skipped (cache holds ...)``).
Fresh-machine measurement (an empty cache each run)::

    TRITON_CACHE_DIR=$(mktemp -d) python -m experiments.bench_teacher --flavor large --data /tmp/world \
        --max-history 512 --token-budget 16384 --steps 10 --no-precompile --json /tmp/cold_jit.json
    TRITON_CACHE_DIR=$(mktemp -d) python -m experiments.bench_teacher --flavor large --data /tmp/world \
        --max-history 512 --token-budget 16384 --steps 10 --precompile --json /tmp/cold_precompiled.json

``--backend pytorch`` runs every attention of the model on the padded PyTorch reference (through
the kernel switch ``backend``); it materialises ``[B, H, N, N]`` score tensors, so pair it with a
short ``--max-history`` and a small budget. On CUDA out-of-memory the run retries at half the
token budget (``--oom-retries`` times) and records every failed budget; the model then keeps
the steps it took before (its first reported loss is not a fresh model's). Results are in
``docs/benchmarks.md`` ("GEM teacher").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

_T0 = time.perf_counter()


def process_age_s() -> float:
    """Seconds since this process started (``/proc``), or since this module loaded where unavailable."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _T0


from gem.compile_workers import start_compile_workers, worker_plan_from_argv  # noqa: E402  (standard library only)

# Run as a script, the kernel compile workers start before this process imports torch, so that their own imports
# overlap ours (gem.compile_workers); compile_pool adopts them, or closes them when the cache holds the step.
EARLY_WORKERS = start_compile_workers(*worker_plan_from_argv(sys.argv[1:])) if __name__ == "__main__" else []

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from experiments.device_timeline import format_timeline, profiler_spans, summarize_timeline  # noqa: E402
from experiments.kernel_groups import (  # noqa: E402
    device_kernel_us,
    kernel_breakdown,
    unattributed_kernels,
    with_unattributed,
)
from experiments.op_count import count_steps, format_counts  # noqa: E402
from foundation.config import apply_overrides  # noqa: E402
from foundation.data.io import atomic_write_text  # noqa: E402
from foundation.data.pipeline import DataConfig, EventStream, build_dataloader  # noqa: E402
from foundation.data.schema import SCHEMA_FILE, EventSchema  # noqa: E402
from foundation.data.synthetic import generate_world  # noqa: E402
from foundation.model.flops import peak_flops, throughput_metrics  # noqa: E402
from foundation.model.padding import PaddedBatch, PaddedBatches, static_shapes  # noqa: E402
from foundation.model.precision import CastOnce, MasterAdamW  # noqa: E402
from foundation.model.teacher import build_teacher  # noqa: E402
from gem.flavors import TEACHER_FLAVORS, synth_preset, teacher_flavor  # noqa: E402
from gem.loop import GraphConfig, StaticStep, build_static_step  # noqa: E402
from gem.precompile import start_precompile_step, step_key, warm_cache  # noqa: E402
from kernels.precompile import (  # noqa: E402
    KernelCompilePool,
    cache_entries,
    compiled_line,
    compiled_since,
    skip_reason,
    stop_workers,
)
from kernels.settings import KernelSettings, apply_kernel_settings  # noqa: E402
from kernels.triton import jagged_attention as triton_attention  # noqa: E402
from kernels.triton.configs import TUNED_PATH, write_tuned  # noqa: E402

PRECISIONS = {"bf16": "bf16-mixed", "fp32": "32-true"}


def prepare_world(args: argparse.Namespace, directory: Path) -> dict:
    """Generate the synthetic world into ``directory`` unless a dataset is already there."""
    if (directory / SCHEMA_FILE).is_file():
        return {"generated": False, "seconds": 0.0}
    cfg = synth_preset(
        "large",
        num_examples=args.examples,
        num_users=args.users or max(args.examples // 10, 64),
        **({"num_items": args.items} if args.items else {}),
        max_history=args.world_max_history,
        seed=args.seed,
    )
    start = time.perf_counter()
    stats = generate_world(cfg, directory, progress=False)
    return {
        "generated": True,
        "seconds": time.perf_counter() - start,
        "rows": stats["rows"],
        "history_len": stats["history_len"],
    }


def open_batches(data_dir: Path, data_cfg: DataConfig, args) -> Iterator:
    """The training batches of ``data_cfg``, padded to static shapes with ``args.bucketed``. Opening the iterator
    starts the loader's workers, which then prepare the first batches in the background."""
    stream = EventStream(data_dir, "train", data_cfg, training=True)
    shapes = static_shapes(data_cfg.token_budget, data_cfg.max_len, args.bucketed) if args.bucketed else None
    return iter(build_dataloader(PaddedBatches(stream, shapes) if shapes else stream, data_cfg))


def train(
    model, optimizer, data_dir: Path, data_cfg: DataConfig, args, device, marks: dict, pool=None, batches=None,
    key: str | None = None,
) -> dict:
    """``args.steps`` optimizer steps; per-step wall times (data wait included), FLOPs, tokens, losses. With
    ``args.precompile``, the first batch's kernels are compiled first (in ``pool`` when given), inside the
    first step's time, unless the manifest of the step ``key`` (:func:`precompile_key`) says the cache holds
    them. ``batches``: :func:`open_batches` of ``data_cfg`` opened earlier (e.g. before the model build, so that
    the first batch is ready when the model is), else opened here."""
    use_cuda = device.type == "cuda"
    times, flops, tokens, rows, max_lens, losses, padded = [], [], [], [], [], [], []
    buckets_seen: set[int] = set()
    later_buckets: list[dict] = []  # the first step of each bucket after the first step's, and its in-process compiles
    train_step = make_eager_step(model, optimizer, device, args.precision, cast_once=args.cast_once)
    shapes = static_shapes(data_cfg.token_budget, data_cfg.max_len, args.bucketed) if args.bucketed else None
    static_step = None
    if shapes is not None:
        graphs = GraphConfig(cuda_graphs=args.cuda_graphs, warmup_steps=args.graph_warmup)
        autocast_dtype = torch.bfloat16 if args.precision == "bf16" else None
        static_step = build_static_step(
            model, optimizer, autocast_dtype=autocast_dtype, config=graphs, cast_once=args.cast_once, log=log_line
        )

    def step(batch, sync: bool = True) -> torch.Tensor:
        # A padded batch is copied from pinned host memory into its bucket's buffers.
        loss = static_step(batch)["loss"] if isinstance(batch, PaddedBatch) else train_step(batch)
        if use_cuda and sync:
            torch.cuda.synchronize(device)
        return loss

    def finish(loss: LossReadback) -> float:
        """Reads a step's loss (waiting for that step) and records the step's time; returns the time it ended."""
        nonlocal last
        losses.append(loss.read())
        now = time.perf_counter()
        times.append(now - last)
        last = now
        i = len(times) - 1
        print(
            f"step {i + 1:4d}  {times[i] * 1e3:8.1f} ms  rows {rows[i]:5d}  tokens {tokens[i]:7d}"
            f"  max_len {max_lens[i]:5d}  loss {losses[i]:.4f}",
            flush=True,
        )
        return now

    batches = batches if batches is not None else open_batches(data_dir, data_cfg, args)
    start = last = time.perf_counter()
    pending = None  # with --overlap-steps: the loss of the step enqueued last, read once the next is enqueued
    for batch in batches:
        if len(rows) == args.steps:
            break
        if "first_step_parts" not in marks:
            marks["first_step_parts"] = {"batch_wait_s": time.perf_counter() - last}
        flops.append(model.flops(batch))  # on the host copy: no device sync; real rows of a padded batch
        real = batch.real_rows if isinstance(batch, PaddedBatch) else batch.batch_size
        tokens.append(int(batch.offsets[real]))
        rows.append(real)
        max_lens.append(int(batch.lengths[:real].max()) if real else 0)
        padded.append(isinstance(batch, PaddedBatch))
        started = None
        if args.precompile and "precompile" not in marks:
            started = start_precompile_step(
                model, batch.to(device), autocast_dtype=torch.bfloat16 if args.precision == "bf16" else None,
                cast_dtype=torch.bfloat16 if args.precision == "bf16" and args.cast_once else None,
                master_adamw=isinstance(optimizer, MasterAdamW), pool=pool, workers=args.precompile_workers or None,
                key=key, log=log_line,
            )
            marks["precompile"] = started.result
        first = "first_step_process_s" not in marks
        bucket = batch.batch_size if isinstance(batch, PaddedBatch) else None
        new_bucket = not first and bucket is not None and bucket not in buckets_seen
        buckets_seen.add(bucket)
        cached = cache_entries() if first or new_bucket else frozenset()
        step_start = time.perf_counter()
        overlap = args.overlap_steps and not first
        with started.gate() if started is not None else contextlib.nullcontext():
            loss = LossReadback(step(batch, sync=not overlap))
        if started is not None:
            marks["precompile"] = started.finish()
            cached |= frozenset(marks["precompile"].pop("entries", ()))  # the pool's, written during the step
            if pool is not None:
                pool.close(wait=False)
        if new_bucket:
            compiled = compiled_since(cached)
            later_buckets.append({"step": len(rows), "rows": bucket, "compiled": compiled})
            log_line(compiled_line(f"step {len(rows)}, the first of the {bucket}-row bucket", compiled))
        if overlap:
            now = finish(pending) if pending is not None else time.perf_counter()
            pending = loss
        else:
            now = finish(loss)
        if first:
            # The limit bounds the timed steps: a cold first step (compiling) must not use it up.
            start = now
            marks["first_step_process_s"] = process_age_s()
            marks["first_step_from_build_s"] = now - marks["build_start"]
            marks["first_step_compiled"] = compiled_since(cached)
            marks["first_step_autotuned"] = sorted(triton_attention.TUNED)
            # Where a cold first step goes: the build (from its start: the loader and compile pool start too),
            # waiting for the batch, the precompile, the step itself (its kernels' first launches, autotuning, a
            # graph's warm-up and capture, in-process compiles) and the rest (the batch's copy to the device,
            # the FLOP count, between the parts).
            parts = marks["first_step_parts"]
            parts.update(build_s=marks["build_s"], precompile_s=precompile_seconds(marks.get("precompile")),
                         step_s=now - step_start)
            parts["other_s"] = marks["first_step_from_build_s"] - sum(v or 0.0 for v in parts.values())
            log_line(compiled_line("first step", marks["first_step_compiled"]))
            if marks["first_step_autotuned"]:
                log_line(f"first step: {len(marks['first_step_autotuned'])} attention launches autotuned (no "
                         f"checked-in config: --write-tuned adds them), first {marks['first_step_autotuned'][0]}")
            if static_step is not None and args.cuda_graphs and args.prepare_buckets:
                marks["prepare_buckets"] = prepare_buckets(static_step, batch, shapes, device)
                start = last = time.perf_counter()
        if now - start > args.time_limit:
            print(f"time limit {args.time_limit} s reached after {len(rows)} steps", flush=True)
            break
    if pending is not None:
        finish(pending)
    trace = {"times": times, "flops": flops, "tokens": tokens, "rows": rows, "max_lens": max_lens, "losses": losses}
    if static_step is not None:
        trace["static"] = {
            "bucket_rows": list(shapes.rows),
            "padded_steps": sum(padded),
            "eager_steps": len(padded) - sum(padded),
            "buckets_used": len(buckets_seen - {None}),
            # Kernels compiled at a later bucket's first step are specialisations the first batch's precompile
            # did not foresee (a stall in the middle of training).
            "later_buckets": later_buckets,
            "graphs_captured": static_step.graphs,
            "cuda_graphs": args.cuda_graphs and not static_step.graphs_off,
            "padded": padded,
        }
    extra = next(batches, None) if args.sync_check and use_cuda else None
    if extra is not None:
        trace["sync_points"] = find_sync_points(step, extra)
    if args.profile:
        trace["profile"] = profile_steps(step, batches, args.profile, use_cuda, args.profile_top, args.profile_shapes)
    if args.timeline:
        trace["timeline"] = timeline_steps(step, batches, args.timeline, use_cuda, args.profile_top)
    if args.count_ops:
        counts = count_steps(
            lambda phase, batch: train_step(batch, phase), batches, args.count_ops, interpret=args.interpret_kernels
        )
        print(format_counts(counts), flush=True)
        trace["op_counts"] = counts
    return trace


class LossReadback:
    """A step's loss on its way to the host: copied into pinned memory right behind the step's kernels, with an
    event after the copy, so that :meth:`read` waits for that step only. ``float(loss)`` would queue its copy behind
    every step enqueued since, so that with ``--overlap-steps`` the host would wait for the step just enqueued too
    and the GPU would sit idle while the host prepared the next one."""

    def __init__(self, loss: torch.Tensor):
        loss = loss.detach()
        self.event = None
        if loss.is_cuda:
            self.value = torch.empty((), dtype=loss.dtype, pin_memory=True)
            self.value.copy_(loss, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.value = loss

    def read(self) -> float:
        if self.event is not None:
            self.event.synchronize()
        return float(self.value)


def log_line(line: str) -> None:
    print(line, flush=True)


def prepare_buckets(static_step: StaticStep, batch, shapes, device: torch.device) -> dict:
    """Every bucket's warm-up and capture on a stand-in made from the first batch (:meth:`StaticStep.prepare`),
    timed; the kernels it compiled in-process are named, as a later bucket's first step names them."""
    cached = cache_entries()
    started = time.perf_counter()
    buckets = static_step.prepare(batch, shapes)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    done = {"s": time.perf_counter() - started, "buckets": buckets, "compiled": compiled_since(cached)}
    log_line(compiled_line(f"buckets {buckets} prepared in {done['s']:.2f} s", done["compiled"]))
    return done


def make_eager_step(model, optimizer, device: torch.device, precision: str, *, cast_once: bool = True) -> Callable:
    """``step(batch, phase)``: one AdamW step on a host batch under bf16 autocast (``precision="bf16"``), its
    parts inside ``phase("forward")``, ``phase("backward")`` and ``phase("optimizer")`` (for
    :func:`experiments.op_count.count_steps`); returns the loss on the device, without a sync. ``cast_once``:
    the parameters autocast casts at every use are cast once per step (:class:`CastOnce`, same values)."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    once = CastOnce(model) if cast_once and precision == "bf16" else None

    def step(batch, phase: Callable[[str], contextlib.AbstractContextManager] = no_phase) -> torch.Tensor:
        with phase("forward"):
            batch = batch.to(device, non_blocking=True)
            with autocast:
                if once is None:
                    loss = model.loss(batch, model(batch))["loss"]
                else:
                    loss = once.run(lambda forward: model.loss(batch, forward(batch)))["loss"]
        with phase("backward"):
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if once is not None:
                once.collect_grads()
        with phase("optimizer"):
            optimizer.step()
        return loss

    return step


def no_phase(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def find_sync_points(step, batch) -> list[dict]:
    """One more step under CUDA's sync debug mode: where (file:line) it made the host wait for the GPU.

    Anything that reads a device value on the host (``.item()``, ``.tolist()``, ``bool(tensor)``,
    value-dependent shapes) is reported; places in this file are the step's own timing.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = Counter(
        "/".join(Path(w.filename).parts[-3:]) + f":{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    points = [{"where": k, "count": n} for k, n in where.most_common()]
    print(f"host syncs in one step: {sum(where.values())} at {len(points)} places: {json.dumps(points)}", flush=True)
    return points


def profile_steps(step, batches, num_steps: int, use_cuda: bool, top: int = 15, shapes: bool = False) -> dict:
    """``torch.profiler`` over the next ``num_steps`` steps: the operators and kernels that took the most
    device time (host time on CPU) as a table, the kernel time by group, and on the GPU the kernels the device ran
    that no group holds (linked to no host op); printed and kept in the JSON. ``shapes``: also the ``top`` busiest
    operators grouped by their inputs' shapes (which of a step's many small ``sum``s or ``copy_``s is which)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    steps = 0
    with profile(activities=activities, record_shapes=shapes) as prof:
        start = time.perf_counter()
        for _, batch in zip(range(num_steps), batches, strict=False):
            step(batch)
            steps += 1
        wall = time.perf_counter() - start
    sort_by = "self_cuda_time_total" if use_cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=20, max_name_column_width=60)
    print(table, flush=True)
    shape_table = None
    if shapes:
        shape_table = prof.key_averages(group_by_input_shape=True).table(
            sort_by=sort_by, row_limit=top, max_name_column_width=40, max_shapes_column_width=110
        )
        print(shape_table, flush=True)
    # Every kernel, to compare their credited time with the device's own records; the JSON keeps the top ones.
    every = kernel_breakdown(prof.events(), on_device=use_cuda, steps=steps, wall_s=wall, top=10**6)
    groups = {**every, "top_kernels": every["top_kernels"][:top]}
    print("kernel time per step by group (ms): " + json.dumps({k: round(v, 2) for k, v in groups["groups_ms_per_step"].items()}), flush=True)
    missing, groups_all = [], None
    if use_cuda:
        missing = unattributed_kernels(device_kernel_us(prof), every, steps=steps)
        print("kernels no group holds (ms/step): " + json.dumps([(k["name"][:80], round(k["ms_per_step"], 3)) for k in missing]), flush=True)
        groups_all = with_unattributed(every, missing)
        print("kernel time per step by group, those kernels added by name (ms): "
              + json.dumps({k: round(v, 2) for k, v in groups_all.items()}), flush=True)
    return {"table": table, "shape_table": shape_table, "groups": groups, "unattributed_kernels": missing,
            "groups_ms_per_step_all": groups_all}


def timeline_steps(step, batches, num_steps: int, use_cuda: bool, top: int = 15) -> dict:
    """``torch.profiler`` over the next ``num_steps`` steps run as ``--overlap-steps`` runs them (each enqueued
    before the previous one's loss is read): the GPU's idle time between its kernels and what the host was doing
    meanwhile (:mod:`experiments.device_timeline`), printed and kept in the JSON. The profiler's own host work
    (microseconds per op) makes host-bound gaps longer than they are unprofiled."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    steps, pending = 0, None
    with profile(activities=activities) as prof:
        for _, batch in zip(range(num_steps), batches, strict=False):
            loss = LossReadback(step(batch, sync=False))
            if pending is not None:
                pending.read()
            pending = loss
            steps += 1
        if pending is not None:
            pending.read()
    summary = summarize_timeline(*profiler_spans(prof), steps=steps, top=top)
    print(format_timeline(summary), flush=True)
    return summary


def summarize(trace: dict, warmup: int, peak: float | None) -> dict:
    """Steady-state throughput over the steps after ``warmup`` (after the first, if too few ran)."""
    n = len(trace["times"])
    skip = warmup if n > warmup else min(1, n - 1)
    sel = slice(max(skip, 0), n)
    seconds = sum(trace["times"][sel])
    steady = throughput_metrics(sum(trace["flops"][sel]), sum(trace["tokens"][sel]), seconds, peak)
    times = trace["times"][sel]
    median = statistics.median(times) if times else float("nan")
    # The same without outlier steps (> 2x the median: autotuning or compiling for a new shape).
    keep = [i for i in range(sel.start, n) if trace["times"][i] <= 2 * median]
    filtered = throughput_metrics(
        sum(trace["flops"][i] for i in keep),
        sum(trace["tokens"][i] for i in keep),
        sum(trace["times"][i] for i in keep),
        peak,
    )
    losses = trace["losses"]
    return {
        "steps_run": n,
        "steady_steps": len(times),
        "steady_seconds": seconds,
        **{f"steady_{k}": v for k, v in steady.items()},
        "outlier_steps": len(times) - len(keep),
        **{f"steady_no_outliers_{k}": v for k, v in filtered.items()},
        "step_ms_median": median * 1e3,
        "step_ms_min": min(times) * 1e3 if times else float("nan"),
        "step_ms_max": max(times) * 1e3 if times else float("nan"),
        "first_step_ms": trace["times"][0] * 1e3 if n else float("nan"),
        "mean_tokens_per_step": sum(trace["tokens"]) / max(n, 1),
        "mean_rows_per_step": sum(trace["rows"]) / max(n, 1),
        "mean_tflop_per_step": sum(trace["flops"]) / max(n, 1) / 1e12,
        "loss_first": losses[0] if losses else float("nan"),
        "loss_last": losses[-1] if losses else float("nan"),
        "loss_first3_mean": sum(losses[:3]) / max(len(losses[:3]), 1),
        "loss_last3_mean": sum(losses[-3:]) / max(len(losses[-3:]), 1),
        "losses_finite": all(math.isfinite(x) for x in losses),
    }


def compare_losses(trace: dict, reference_path: str) -> dict:
    """The largest per-step loss difference against another run's ``--json`` over the steps both ran."""
    reference = json.loads(Path(reference_path).read_text())["trace"]
    n = min(len(trace["losses"]), len(reference["losses"]))
    diffs = [abs(a - b) for a, b in zip(trace["losses"][:n], reference["losses"][:n], strict=True)]
    same = all(trace[k][:n] == reference[k][:n] for k in ("tokens", "rows", "max_lens"))
    worst = max(range(n), key=diffs.__getitem__) if n else None
    return {
        "reference": reference_path,
        "steps": n,
        "same_batches": same,
        "max_abs_diff": diffs[worst] if n else None,
        "at_step": worst + 1 if n else None,
        "max_rel_diff": max((d / max(abs(b), 1e-12) for d, b in zip(diffs, reference["losses"], strict=False)), default=None),
        "mean_abs_diff": sum(diffs) / n if n else None,
    }


def command_line(argv: list[str]) -> str:
    """How this run was started, with the environment variables that change what it measures."""
    env = [f"{k}={os.environ[k]}" for k in sorted(os.environ) if k.startswith("GEM_") or k == "TRITON_CACHE_AUTOTUNING"]
    return " ".join([*env, "python -m experiments.bench_teacher", *map(shlex.quote, argv)])


def record_row(path: Path, result: dict, command: str, label: str | None) -> dict:
    """Append this run's headline figures to ``path`` (``{"rows": [...]}``), atomically."""
    row = {
        "max_history": result["max_history"],
        "mfu": result.get("steady_mfu"),
        # The steady state without its outlier steps (a new bucket's capture, a compile), as the docs report it.
        "mfu_no_outliers": result.get("steady_no_outliers_mfu"),
        "outlier_steps": result["outlier_steps"],
        "tokens_per_s": result["steady_tokens_per_s"],
        "step_ms_median": result["step_ms_median"],
        "first_step_after_build_s": result["first_step_from_build_s"],
        "command": command,
        "date": datetime.date.today().isoformat(),
        "device": result["device_name"],
    }
    if result.get("precompile_s") is not None:
        row["precompile_s"] = result["precompile_s"]
    if label:
        row["label"] = label
    table = json.loads(path.read_text()) if path.is_file() else {"rows": []}
    if not isinstance(table.get("rows"), list):
        raise ValueError(f"{path}: expected an object with a 'rows' list")
    table["rows"].append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=2) + "\n")
    os.replace(tmp, path)
    return row


def run(args: argparse.Namespace) -> dict:
    apply_kernel_settings(KernelSettings(backend=args.backend, glue_backend=args.glue_backend))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    torch.set_float32_matmul_precision("high")
    with tempfile.TemporaryDirectory(prefix="bench_teacher_") as tmp:
        data_dir = Path(args.data) if args.data else Path(tmp) / "world"
        world = prepare_world(args, data_dir)
        print(f"world: {json.dumps(world)}", flush=True)
        schema = EventSchema.load(data_dir)
        cfg = teacher_config(args)
        max_history = args.max_history or cfg.max_len
        if max_history > cfg.max_len:
            raise ValueError(f"--max-history {max_history} exceeds the flavor's max_len {cfg.max_len}")
        marks: dict = {"build_start": time.perf_counter()}
        first_cfg = data_config(args, data_dir, max_history, args.token_budget)
        key = precompile_key(args, cfg, schema, first_cfg, device)
        # Before the build, so that the loader's first batches (and the compile workers' start-up, where they did
        # not start early) overlap it.
        pool = compile_pool(args, device, key, EARLY_WORKERS)
        first_batches = open_batches(data_dir, first_cfg, args)
        # Initialised where it trains: on the CPU, `large`'s initialisation alone took most of the build.
        with torch.device(device) if args.init_on_device else contextlib.nullcontext():
            model = build_teacher(cfg, schema)
        model = model.to(device)
        optimizer = build_optimizer(model, args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        marks["build_s"] = time.perf_counter() - marks["build_start"]
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        peak = peak_flops(device_name, PRECISIONS[args.precision]) if device.type == "cuda" else None
        budget, failed = args.token_budget, []
        while True:
            data_cfg = data_config(args, data_dir, max_history, budget)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            oom = False
            try:
                trace = train(model, optimizer, data_dir, data_cfg, args, device, marks, pool, first_batches, key)
            except torch.cuda.OutOfMemoryError as err:
                oom = True
                print(f"OOM at token budget {budget}: {str(err).splitlines()[0]}", flush=True)
            if not oom:
                break
            failed.append(budget)
            first_batches = None  # batches of the smaller budget are opened by the next attempt
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            if len(failed) > args.oom_retries or budget // 2 < max_history:
                raise SystemExit(f"out of memory at token budgets {failed}")
            budget //= 2
        result = {
            "flavor": args.flavor,
            "backend": args.backend,
            "resolved_backend": args.backend if args.backend != "auto" else ("triton" if device.type == "cuda" else "pytorch"),
            "glue_backend": args.glue_backend,
            "negatives": cfg.negatives,
            "precision": args.precision,
            "token_budget": budget,
            "oom_token_budgets": failed,
            "rows_cap": args.rows,
            "max_history": max_history,
            "device_name": device_name,
            "torch": torch.__version__,
            "triton": _triton_version(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "peak_flops": peak,
            "world": world,
            "build_s": marks["build_s"],
            "first_step_from_process_start_s": marks.get("first_step_process_s"),
            "first_step_from_build_s": marks.get("first_step_from_build_s"),
            "precompile": marks.get("precompile"),
            "first_step_compiled": marks.get("first_step_compiled"),
            "first_step_parts": marks.get("first_step_parts"),
            "first_step_autotuned": marks.get("first_step_autotuned"),
            "prepare_buckets": marks.get("prepare_buckets"),
            "precompile_s": precompile_seconds(marks.get("precompile")),
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            **summarize(trace, args.warmup, peak),
            "trace": trace,
            "args": vars(args),
        }
    return result


# Widths small enough for a CPU step at the `large` flavor's structure (layers, heads, tokens per row and
# block, experts, negatives unchanged): what --count-ops measures the host work of.
CPU_WIDTHS = {
    "d_model": 64, "item_dim": 32, "attn_dim": 16, "value_dim": 16, "pffn_hidden": 64, "pffn_summary_dim": 8,
    "wukong_rank": 4, "wukong_hidden": 64, "dcn_rank": 8, "expert_hidden": 64, "expert_dim": 32, "repr_dim": 32,
}


def build_optimizer(model, args: argparse.Namespace) -> torch.optim.Optimizer:
    """``--optimizer``: ``master`` (:class:`MasterAdamW`: one Triton launch per gradient dtype, the bucketed step's
    bf16 copies kept by it) or ``adamw`` (torch's fused AdamW: float32 gradients, the copies refreshed by the
    forward). No weight decay either way."""
    if args.optimizer == "master":
        optimizer = MasterAdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        optimizer.defer_rows(model)  # sparse_tables: the looked-up rows step, with AdamW's result
        return optimizer
    if model.cfg.sparse_tables:
        raise SystemExit("--optimizer adamw: torch's AdamW takes no sparse gradients; sparse_tables=True needs "
                         "--optimizer master")
    # Fused: a few multi-tensor kernels per step where the default for-each path launches several per tensor.
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)


def teacher_config(args: argparse.Namespace):
    """The flavor's config, at ``CPU_WIDTHS`` with ``--cpu-widths``, then with the ``field=value`` overrides."""
    cfg = teacher_flavor(args.flavor)
    if args.cpu_widths:
        cfg = cfg.replace(**CPU_WIDTHS)
    apply_overrides(cfg, args.overrides)
    cfg.check()
    return cfg


def data_config(args: argparse.Namespace, data_dir: Path, max_history: int, token_budget: int) -> DataConfig:
    return DataConfig(
        path=str(data_dir),
        max_len=max_history,
        batch_size=args.rows,
        token_budget=token_budget,
        num_workers=args.workers,
        seed=args.seed,
        pin_memory=True,
    )


def compile_pool(
    args: argparse.Namespace, device: torch.device, key: str | None, early: list | None = None
) -> KernelCompilePool | None:
    """With ``--precompile`` where kernels compile (CUDA, not the interpreter) and the cache does not hold the
    kernels of the step ``key`` already (:func:`gem.precompile.warm_cache`): the compile workers, ``early`` ones
    (started at the module's top: :data:`EARLY_WORKERS`) adopted, else started now. Unneeded early workers are
    told to exit."""
    if not args.precompile or device.type != "cuda" or skip_reason(["step"]) or warm_cache(key):
        stop_workers(early or (), wait=False)
        return None
    return KernelCompilePool(args.precompile_workers or None, device=device.index or 0, processes=early)


def precompile_key(
    args: argparse.Namespace, cfg, schema: EventSchema, data_cfg: DataConfig, device: torch.device
) -> str | None:
    """With ``--precompile``: the manifest key of the first step (:func:`gem.precompile.step_key`), from what
    decides its kernels and is known before the model is built: the teacher's config, the schema, the first
    batch (the data config, its path aside where the world is generated anew in a temporary directory, and the
    generator's arguments) and the step's switches."""
    if not args.precompile:
        return None
    data = dataclasses.replace(data_cfg, path=args.data or "generated")
    world = {k: getattr(args, k) for k in ("examples", "users", "items", "world_max_history")}
    identity = [
        repr(cfg), repr(schema), repr(data), repr(world),
        f"cast_once {args.cast_once}", f"bucketed {args.bucketed}", f"optimizer {args.optimizer}",
    ]
    return step_key(identity, autocast_dtype=torch.bfloat16 if args.precision == "bf16" else None, device=device)


def save_tuned(path: Path) -> None:
    """Adds this process's autotuned attention picks to the table at ``path`` (a copy of the checked-in one when
    absent), for this GPU and Triton version."""
    if not path.exists() and TUNED_PATH.exists():
        atomic_write_text(path, TUNED_PATH.read_text())
    write_tuned(triton_attention.TUNED, torch.device("cuda"), path)
    print(f"wrote {len(triton_attention.TUNED)} autotuned picks to {path}", flush=True)


def precompile_seconds(report: dict | None) -> float | None:
    """What the precompile held the first step back: its recording, which the compiles overlap, as they overlap the
    step, whose launches wait only for their own kernels (``waited_s``); None without ``--precompile``."""
    return report["record_s"] if report else None


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="large", choices=sorted(TEACHER_FLAVORS))
    parser.add_argument("--rows", type=int, default=4096, help="row cap per batch (the token budget binds first)")
    parser.add_argument("--max-history", type=int, default=0, help="history truncation (0: the flavor's max_len)")
    parser.add_argument(
        "--token-budget", type=int, default=16384,
        help="history tokens per batch (MFU and memory against it: docs/benchmarks.md)",
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the steady state")
    parser.add_argument("--time-limit", type=float, default=120.0, help="stop training this many seconds after the first step")
    parser.add_argument("--backend", default="auto", choices=("auto", "pytorch", "triton"))
    parser.add_argument(
        "--glue-backend", default="auto", choices=("auto", "pytorch", "triton"),
        help="the fused LayerNorm and row modulation (kernel switch glue_backend): pytorch = the unfused references",
    )
    parser.add_argument("--precision", default="bf16", choices=sorted(PRECISIONS))
    parser.add_argument(
        "--cast-once", action=argparse.BooleanOptionalAction, default=True,
        help="bf16 copies of the parameters autocast casts at every use, made once per step (same values)",
    )
    parser.add_argument(
        "--init-on-device", action=argparse.BooleanOptionalAction, default=True,
        help="build and initialise the model on --device (else on the CPU, then move it)",
    )
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--data", default=None, help="world dir: reused if it holds a dataset, else generated")
    parser.add_argument("--examples", type=int, default=80_000, help="impressions of a generated world")
    parser.add_argument("--users", type=int, default=0, help="users of a generated world (0: examples / 10)")
    parser.add_argument("--items", type=int, default=0, help="items of a generated world (0: the preset's 500,000)")
    parser.add_argument("--world-max-history", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--oom-retries", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--optimizer", default="master", choices=("master", "adamw"),
        help="master: MasterAdamW (bf16 gradients read and bf16 copies written in its pass); adamw: torch's fused",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--profile", type=int, default=0, help="after the timed steps, profile this many more (torch.profiler table)"
    )
    parser.add_argument(
        "--profile-top", type=int, default=15, help="with --profile, the busiest kernels kept; with --timeline, the gaps"
    )
    parser.add_argument(
        "--profile-shapes", action="store_true",
        help="with --profile, also print the --profile-top busiest operators grouped by input shape",
    )
    parser.add_argument(
        "--timeline", type=int, default=0, metavar="N",
        help="after the timed steps (and --profile), profile N more run overlapped and report where the GPU sat "
        "idle between its kernels and what the host was doing then",
    )
    parser.add_argument(
        "--overlap-steps", action="store_true",
        help="after the first step, read each step's loss only once the next step is enqueued, so that the host's "
        "work for a step (batch copy, lookups, launches) overlaps the GPU's previous one, as a training loop that "
        "does not wait for every step; a step's time is then between the reads",
    )
    parser.add_argument(
        "--sync-check", action="store_true", help="after the timed steps, list where one more step syncs with the host (CUDA)"
    )
    parser.add_argument("--compare-losses", default=None, metavar="REF.json", help="another run's --json to compare losses with")
    parser.add_argument(
        "--bucketed", default=None, metavar="ROWS",
        help="pad each batch to --token-budget tokens and the smallest of these row counts (e.g. 96,128,192) that "
        "holds it, and train those through gem.loop.StaticStep (static buffers per bucket)",
    )
    parser.add_argument(
        "--cuda-graphs", action="store_true",
        help="with --bucketed: capture each bucket's dense forward and backward into a CUDA graph and replay it",
    )
    parser.add_argument("--graph-warmup", type=int, default=1, help="eager steps per bucket before its capture")
    parser.add_argument(
        "--prepare-buckets", action=argparse.BooleanOptionalAction, default=True,
        help="with --cuda-graphs: after the first step, warm up and capture every bucket on a stand-in made from "
        "the first batch (gem.loop.StaticStep.prepare; reported as prepare_buckets, outside the timed steps), so "
        "that no bucket's first batch captures in the middle of training",
    )
    parser.add_argument(
        "--precompile", action=argparse.BooleanOptionalAction, default=None,
        help="before the first step, record its Triton launches and compile them in a process pool (default: on "
        "CUDA); reported as precompile_s, inside the first step's time",
    )
    parser.add_argument(
        "--precompile-workers", type=int, default=0, help="compile processes (0: min(16, CPU count))"
    )
    parser.add_argument(
        "--write-tuned", default=None, metavar="PATH",
        help="after the run, add the attention configs the autotuner picked to this copy of the checked-in table "
        f"(created from {TUNED_PATH.name} when absent; copy it over that file to check them in)",
    )
    parser.add_argument(
        "--count-ops", type=int, default=0, metavar="N",
        help="after the timed steps, count the ATen operators and Triton launches of N steps, then time the host of N more",
    )
    parser.add_argument(
        "--interpret-kernels", action="store_true",
        help="with --count-ops on CPU, run the Triton interpreter's launches (slow) instead of only counting them",
    )
    parser.add_argument(
        "--cpu-widths", action="store_true", help="the flavor's structure at CPU-sized widths (CPU_WIDTHS), e.g. for --count-ops"
    )
    parser.add_argument("overrides", nargs="*", help="teacher config fields, e.g. dropout=0.0 num_layers=4")
    parser.add_argument("--record", default=None, metavar="PATH", help="append the headline figures to this JSON table")
    parser.add_argument("--record-label", default=None, help="a label for the recorded row (e.g. 'after issue 15')")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.precompile is None:
        args.precompile = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if args.cuda_graphs and not args.bucketed:
        raise SystemExit("--cuda-graphs replays static shapes: pass --bucketed ROWS too")
    if args.compare_losses and not Path(args.compare_losses).is_file():
        raise SystemExit(f"--compare-losses: {args.compare_losses} does not exist")
    command = command_line(argv)
    result = run(args)
    if args.write_tuned and triton_attention.TUNED:
        save_tuned(Path(args.write_tuned))
    if args.compare_losses:
        result["loss_comparison"] = compare_losses(result["trace"], args.compare_losses)
    result["command"] = command
    if args.record:
        result["recorded_row"] = record_row(Path(args.record), result, result["command"], args.record_label)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    summary = {k: v for k, v in result.items() if k not in ("trace", "args", "world")}
    if "profile" in result["trace"]:
        summary["kernel_groups"] = result["trace"]["profile"]["groups"]
    if "sync_points" in result["trace"]:
        summary["sync_points"] = result["trace"]["sync_points"]
    if "static" in result["trace"]:
        summary["static"] = {k: v for k, v in result["trace"]["static"].items() if k != "padded"}
    print(json.dumps(summary, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
