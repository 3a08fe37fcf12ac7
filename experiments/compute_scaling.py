"""Compute scaling of the GEM teacher against the DLRM on a large synthetic world: several sizes of each, a
few seeds each, test click NE against the training FLOPs each run spent (issue 16, item 5).

Usage (GPU machine, two calls of one plan, each a shard of its runs; the world is regenerated in each call
unless ``--world`` already holds it)::

    python -m experiments.compute_scaling run --plan trained --world /tmp/scale-world --out /tmp/scale2 \\
        --shard 0/2 --call-budget 565 --grace 120 --bundle $OUT
    python -m experiments.compute_scaling run --plan trained --world /tmp/scale-world --out /tmp/scale2 \\
        --shard 1/2 --call-budget 565 --grace 120 --bundle $OUT

then, on a machine with matplotlib, from the two bundles::

    python -m experiments.compute_scaling combine summary-0of2.json summary-1of2.json --out summary.json
    python -m experiments.compute_scaling merge summary.json docs/results/teacher_vs_dlrm.json
    python -m experiments.compute_scaling plot summary.json docs/teacher_vs_dlrm_scaling_trained.png
    python -m experiments.compute_scaling plan --plan trained --world /tmp/scale-world   # runs, FLOPs, time estimate

``--preset sequential`` (on ``run`` and ``plan``) generates the plan's world from that synthetic preset at the
plan's sizes instead (the order-rewarding world of docs/benchmarks.md); its rows' ``data`` label says so.

The CPU dry run is the same commands with ``--plan dry --device cpu`` (a world of 3k rows, two sizes of
each model and a probe, four steps per run, the ``trained`` plan's recipe and runner).

**Plans** (:data:`PLANS`), all on the ``default`` world's ground truth with 2M impressions (80 per user) and
stored histories of up to 1,024 events; teacher sizes of the ``small`` recipe (``w32`` is ``teacher-small``
itself) widened and deepened to ~40x its FLOPs per example, DLRM sizes of the ``default`` flavor (``d32`` is it)
widened; seeds 0, 1, 2. Every run reads 1,024 history events, trains ``steps`` steps of ``batch_rows`` rows (one
pass over that many distinct rows, a fraction of the train split: no row is seen twice, so neither family
memorises; ``data-passes`` alone reads the whole split twice), then scores the valid and the test split once.

- ``scaling``, the first sweep (2026-12-01): 1,200 steps of 256 rows at the flavors' constant rates, float32,
  through :mod:`experiments.teacher_vs_baseline` (``--epochs`` > 1 repeats that on fresh rows and reports the
  test metrics of the best valid epoch).
- ``trained``, the second: the same 307,200 rows as 600 steps of 512, through :mod:`experiments.scaling_run`:
  warm-up + cosine to a tenth of a per-size peak rate (:func:`width_scaled_lr`), bf16 autocast, loader
  processes, wider row shuffling, teacher dropout 0, a fourth DLRM size, and probes (seed 0 only: the rate at
  x0.5 and x2 at both ends of each family's ladder, dropout back on at ``w128-l3``). docs/benchmarks.md says why.
- ``recent``, the third (session 14, ``--preset sequential``): ``trained`` with both families' rates doubled and the
  teacher's last 8 events as summary tokens (``model.teacher.num_recent=8``), 5 seeds of ``w256-l4``, ``d512`` and
  ``d2048`` (``Plan.duel``).
- ``recent-data``: its best teacher per FLOP (``w128-l3``) and two DLRM sizes on twice the rows, 2 seeds.
- ``data2x``: the third sweep's recipe on twice the rows, ladders ``w16``-``w128`` and ``d32``-``d2048``, 5 seeds of
  ``w128-l3``, ``d128`` and ``d2048``; three calls (``--shard I/3``).
- ``data2x-seeds``: seeds 3 and 4 of ``data2x``'s three smaller teachers (their seeds spread .01-.025 in click NE,
  ten times the larger sizes'), and ``data2x``'s two runs that its third call cut by time, again (``Plan.reruns``);
  :func:`combine` joins it to ``data2x``.
- ``data2x-w128``: why ``w128-l3`` trails ``w64-l2`` on ``data2x``: ``w128`` at ``w64``'s depth (``w128-l2``, a size
  of the curve) and ``w128-l3`` at ``w64``'s peak rate (a probe, x1.41), 3 seeds each.
- ``data4x``: the next test of why ``w128`` trails ``w64`` at 614k rows (short of data, as ``w256`` was at 307k?):
  ``w32``, ``w64``, ``w128-l3`` and the DLRM's ``d128`` and ``d2048`` on four times ``recent``'s rows (2,400 steps,
  1.2M of the 1.6M train rows, one pass), 3 seeds; three calls.
- ``data-passes``: ``data4x``'s sizes, seeds and recipe on the WHOLE train split read twice (``--passes 2`` of
  :mod:`experiments.scaling_run`, each pass reshuffled): 6,254 steps of 512 = 2 x ceil(1,600,557 / 512), 3.2M rows
  per run, half of them read a second time. Its steps are computed for that split (``Plan.split_rows``): a world
  with another train split is refused. The teacher keeps dropout 0 (the one-pass recipe), so its second pass may
  memorise; the curve's train loss is held out in the first pass only. Six calls (``--shard I/6``, 2-3 runs each:
  a run alone is estimated at 360-420 s, so the world must already be on the machine, e.g. from a ``plan`` call).
- ``data-fresh``: ``data-passes``' sizes, seeds, schedule and (within 1%) steps on a world of twice the impressions
  (4M, 160 per user), read once: as many rows and FLOPs per run as two passes over the 2M world, every row distinct.
  The second pass moved every teacher size but not the top of the ladder (``w128-l3`` fit the repeated rows better
  without a test gain), so this asks whether distinct rows reopen it. 6,200 steps of 512 stay inside one pass of any
  regeneration's train split (80.0% of the rows). The world takes about twice the 2M world's ~160 s (262 s measured).
  It did (session 21, seeds 0-1 of ``w64-l2``, ``w128-l3``, ``d128``), so the plan also holds ``data2x``'s
  ``w16-l2`` and ``d512``: the whole figure on one world.

**Runs.** Each is a runner process (``OMP_NUM_THREADS=1``, ``GEM_KERNELS_AUTOTUNE=0``: concurrent runs must not
autotune against each other's load), ``--parallel`` (else the plan's ``parallel``, else all of a shard) at once,
longest first. A run stops training after its budget (then scores and writes its result) and is killed
``--grace`` seconds later. The budget is ``--time-budget``, cut so that the run ends by ``--call-budget`` seconds
after the command began: on a machine lent for 10 minutes a slow world generation shortens the training, not
the results; under a schedule a cut run still ends annealed (its progress counts time). Each records the model
FLOPs it trained (the sum of ``model.flops(batch)`` over its steps), so a run cut by its budget still lands at
its true place on the x-axis. Output: ``<out>/runs/<name>/{log.txt,result.json}`` and ``<out>/summary.json``;
with ``--bundle DIR`` also ``DIR/summary-IofN.json`` (rewritten as each run ends) and, at the end,
``DIR/runs-IofN.tar.gz`` (logs and results).

**Shards.** ``--shard I/N`` takes the I-th of N groups of runs balanced by estimated time (longest first, each
to the group with the lowest load per weight; weights from ``--weights``, else the plan's ``shard_weights``),
a deterministic split of the same plan; ``--done SUMMARY..`` first leaves out the runs those summaries hold
trained to their schedule's end, so the rest of a half-run plan can be split over fewer calls. The estimate
(:func:`estimated_seconds`, :class:`CostModel`) is each run's seconds alone and its GPU seconds; a shard takes the
larger of its GPU seconds and its seconds over the overlap.

**Summary rows** (one per model and size over its seeds, the format of ``docs/results/teacher_vs_dlrm.json``):
``model``, ``size``, ``seeds``, ``parameters``, ``flops_per_example`` (training FLOPs per row),
``train_flops`` (mean over seeds, up to the end of the best valid epoch), ``click_ne_mean`` / ``_std``,
``click_auc_mean``, ``per_domain`` (click NE mean and std by domain name), ``train_rows``, ``data``,
``command``, ``date``, ``device`` (what the runs trained on; absent from summaries made before it was
recorded); ``recalibrated_click_ne_mean`` (Platt per domain on valid); under a schedule also
``lr`` (peak), ``probe`` (what a probe changes, empty for a size of the curve) and ``stopped_by`` per seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from foundation.config import apply_overrides
from foundation.data.io import atomic_path, atomic_write_text, list_shards
from foundation.data.schema import SCHEMA_FILE, EventSchema
from foundation.data.synthetic import STATS_FILE, SynthConfig, generate_world
from foundation.model.baseline import dlrm_flops
from foundation.model.flops import teacher_flops
from gem.flavors import SYNTH_PRESETS, get_flavor, synth_preset

RUN_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GEM_KERNELS_AUTOTUNE": "0"}
FAMILIES = ("teacher", "dlrm")


@dataclass(frozen=True)
class CostModel:
    """GPU time of a run, for the shards and the plan's estimate (:func:`estimated_seconds`).

    A step takes ``overhead_s[family]`` of host time (launches, Python) plus ``step FLOPs / effective_flops``,
    and never less than its rows take to load (``loader_rows_per_s`` per loader process, ``loaders`` of them;
    0: not modelled). The GPU is busy for the FLOPs part only. Runs sharing the GPU overlap their host time
    ``overlap`` ways and serialise their GPU time: a shard takes ``max(sum of GPU seconds, sum of run seconds /
    overlap)``.
    """

    overhead_s: tuple[tuple[str, float], ...]
    effective_flops: float
    overlap: float
    loader_rows_per_s: float = 0.0
    loaders: int = 1
    eval_batch_rows: int = 1024

    def overhead(self, family: str) -> float:
        return dict(self.overhead_s)[family]


# The first sweep's model, from docs/benchmarks.md: the `small` teacher's 1,024-event step alone on an H200 took
# 28.2 ms for 82k tokens (~27 GFLOP: launch-bound); float32/TF32 matmuls of these models taken at 30 TFLOP/s; the
# DLRM's step a few dozen small kernels (10 ms). Five runs at once gave 1.25x the throughput of one (session 4).
FIRST_SWEEP_COST = CostModel(overhead_s=(("teacher", 0.028), ("dlrm", 0.010)), effective_flops=30e12, overlap=1.25)
# The second sweep's model (bf16, 512-row steps, 2 loader processes per run): the GPU rate from what the first
# sweep's GPU-bound runs got together, scaled for bf16; the host time of a step and the loader's rows/s per process
# as measured. The derivation is in docs/benchmarks.md ("Second sweep", "Time estimate").
SECOND_SWEEP_COST = CostModel(
    overhead_s=(("teacher", 0.040), ("dlrm", 0.015)), effective_flops=25e12, overlap=6.0, loader_rows_per_s=5000.0,
    loaders=2,
)


@dataclass(frozen=True)
class Size:
    """One model size: a flavor of :mod:`gem.flavors`, the dotted overrides that size it, its peak learning rate
    (None: the flavor's ``train.lr``) and, for a probe (a check run on the probe seeds only), what it changes."""

    family: str
    name: str
    flavor: str
    overrides: tuple[str, ...]
    lr: float | None = None
    probe: str = ""


@dataclass(frozen=True)
class Schedule:
    """Every run's learning-rate schedule (:class:`gem.schedule.WarmupCosine`): linear warm-up over
    ``warmup_frac`` of the steps, then a cosine to ``final_frac`` of the peak at the end of the run."""

    warmup_frac: float = 0.05
    final_frac: float = 0.1

    def warmup_steps(self, steps: int) -> int:
        return min(max(1, round(self.warmup_frac * steps)), steps - 1) if self.warmup_frac > 0 else 0


@dataclass(frozen=True)
class Plan:
    """A world, the sizes trained on it, the seeds, and each run's data budget and recipe.

    ``schedule`` None runs :mod:`experiments.teacher_vs_baseline` at the flavor's constant learning rate (the
    first sweep); otherwise :mod:`experiments.scaling_run` under that schedule at each size's ``lr``.
    ``probes`` run on ``probe_seeds`` only. ``parallel``: runs at once by default; ``shard_weights``: the share
    of the plan each of ``len(shard_weights)`` calls takes by default. The sizes named in ``duel`` (``<family>-<size>``)
    also run on ``duel_seeds``: more seeds where two families' best sizes are compared. ``reruns`` names runs
    (``<family>-<size>.s<seed>``) of another plan on the same world that its call cut by time, run again here (the
    sizes among ``sizes``); :func:`combine` keeps the complete one. ``passes`` (under a schedule): passes over
    the train split each run may make (``--passes`` of :mod:`experiments.scaling_run`); 1 reads no row twice.
    ``split_rows`` (0: none): the train split's rows that ``steps`` was computed for (``passes`` whole passes),
    checked against the world by :func:`check_rows`.
    """

    name: str
    world: SynthConfig
    sizes: tuple[Size, ...]
    seeds: tuple[int, ...]
    steps: int
    batch_rows: int
    history: int
    label: str
    cost: CostModel = FIRST_SWEEP_COST
    schedule: Schedule | None = None
    probes: tuple[Size, ...] = ()
    probe_seeds: tuple[int, ...] = (0,)
    parallel: int = 0
    shard_weights: tuple[float, ...] = ()
    duel: tuple[str, ...] = ()
    duel_seeds: tuple[int, ...] = ()
    reruns: tuple[str, ...] = ()
    passes: int = 1
    split_rows: int = 0

    @property
    def train_rows(self) -> int:
        """Rows each run trains on (every one read once when ``passes`` is 1)."""
        return self.steps * self.batch_rows


@dataclass(frozen=True)
class Run:
    size: Size
    seed: int

    @property
    def size_key(self) -> str:
        return f"{self.size.family}-{self.size.name}"

    @property
    def name(self) -> str:
        return f"{self.size_key}.s{self.seed}"


def batch_overrides(history: int, batch_rows: int) -> tuple[str, ...]:
    """Every run reads ``history`` events and trains on ``batch_rows`` rows per step (no token cap below that)."""
    return (f"data.max_len={history}", f"data.batch_size={batch_rows}", f"data.token_budget={batch_rows * history}")


def teacher_size(width: int, layers: int, heads: int, history: int, batch_rows: int, *, lr: float | None = None,
                 extra: tuple[str, ...] = ()) -> Size:
    """The ``small`` recipe at ``width`` (d_model, item and expert widths) with ``layers`` HSTU blocks of ``heads``."""
    t = "model.teacher."
    return Size(
        "teacher",
        f"w{width}-l{layers}",
        "teacher-small",
        (
            f"{t}d_model={width}", f"{t}item_dim={width}", f"{t}num_layers={layers}", f"{t}num_heads={heads}",
            f"{t}attn_dim={width // heads}", f"{t}value_dim={width // heads}", f"{t}expert_hidden={2 * width}",
            f"{t}expert_dim={width}", f"{t}wukong_hidden={2 * width}", f"{t}repr_dim={width}",
            f"{t}max_len={history}", *batch_overrides(history, batch_rows), *extra,
        ),
        lr,
    )


def dlrm_size(width: int, history: int, batch_rows: int, *, lr: float | None = None,
              extra: tuple[str, ...] = ()) -> Size:
    """The ``default`` DLRM at embedding width ``width``: bottom MLP (2w, w), top MLP (8w, 4w)."""
    d = "model.dlrm."
    return Size(
        "dlrm",
        f"d{width}",
        "default",
        (
            f"{d}embedding_dim={width}", f"{d}bottom_mlp={2 * width},{width}",
            f"{d}top_mlp={8 * width},{4 * width}", *batch_overrides(history, batch_rows), *extra,
        ),
        lr,
    )


def width_scaled_lr(base_lr: float, base_width: int, width: int) -> float:
    """``base_lr`` at ``base_width``, scaled by ``sqrt(base_width / width)``: Adam's best rate falls with width
    (as ``1/width`` for hidden matrices under muP); the square root is a middle course that the plan's learning-rate
    probes check at the largest size of each family."""
    return base_lr * math.sqrt(base_width / width)


def lr_probes(size: Size, factors: tuple[float, ...]) -> tuple[Size, ...]:
    """``size`` at ``factor x`` its peak learning rate, one probe per factor (named ``<size>@lr<factor>x``)."""
    return tuple(
        dataclasses.replace(size, name=f"{size.name}@lr{f:g}x", lr=size.lr * f, probe=f"lr x{f:g}") for f in factors
    )


def override_probe(size: Size, tag: str, overrides: tuple[str, ...]) -> Size:
    """``size`` with ``overrides`` appended (a later override wins), named ``<size>@<tag>``."""
    return dataclasses.replace(size, name=f"{size.name}@{tag}", overrides=size.overrides + overrides,
                               probe=" ".join(overrides))


def scaling_plan() -> Plan:
    """The first sweep (2026-12-01): 1,200 steps of 256 rows, the flavors' constant rates, float32."""
    history, rows = 1024, 256
    return Plan(
        name="scaling",
        # Blocks of 1,024 users: 25 blocks keep 16 generating processes busy with ~1 GB each.
        world=synth_preset("default", num_examples=2_000_000, max_history=history, users_per_block=1024),
        sizes=(
            teacher_size(32, 2, 2, history, rows),
            teacher_size(64, 2, 2, history, rows),
            teacher_size(128, 3, 4, history, rows),
            teacher_size(256, 4, 4, history, rows),
            dlrm_size(32, history, rows),
            dlrm_size(128, history, rows),
            dlrm_size(512, history, rows),
        ),
        seeds=(0, 1, 2),
        steps=1200,
        batch_rows=rows,
        history=history,
        label="synthetic default, 2M impressions, 1,024-event histories",
    )


# What every run of the second sweep changes from the flavor: bf16 autocast; two loader processes with pinned
# batches (the first sweep loaded in the training process, ~3k rows/s); rows shuffled across 8 row groups
# (65k rows, ~800 users) instead of one (8k rows, ~100 users, so 16 consecutive 512-row batches came from the
# same users).
TRAINED_RECIPE = ("train.precision=bf16-mixed", "data.num_workers=2", "data.pin_memory=true", "data.shuffle_window=8")
# One pass reads no row twice, so the recipe's dropout (tuned where the models memorised within two epochs) only
# slows learning; the probe `w128-l3@dropout0.1` puts it back (at the second largest teacher: a quarter of the
# largest's GPU time).
ONE_PASS_TEACHER = ("model.teacher.dropout=0.0",)


# (width, layers, heads) of the teacher sizes and the DLRM widths of the second and third sweeps.
TEACHER_LADDER = ((32, 2, 2), (64, 2, 2), (128, 3, 4), (256, 4, 4))
DLRM_LADDER = (32, 128, 512, 2048)


def trained_plan() -> Plan:
    """The second sweep: each size trained properly for one pass over 393k rows (module docstring)."""
    history, rows = 1024, 512
    teacher = [
        teacher_size(w, layers, heads, history, rows, lr=width_scaled_lr(2e-3, 32, w),
                     extra=TRAINED_RECIPE + ONE_PASS_TEACHER)
        for w, layers, heads in TEACHER_LADDER
    ]
    dlrm = [dlrm_size(w, history, rows, lr=width_scaled_lr(4e-3, 32, w), extra=TRAINED_RECIPE) for w in DLRM_LADDER]
    return Plan(
        name="trained",
        world=scaling_plan().world,
        sizes=(*teacher, *dlrm),
        seeds=(0, 1, 2),
        steps=600,
        batch_rows=rows,
        history=history,
        label="synthetic default, 2M impressions, 1,024-event histories; 307k rows, warm-up + cosine, bf16",
        cost=SECOND_SWEEP_COST,
        schedule=Schedule(warmup_frac=0.05, final_frac=0.1),
        probes=(
            # The width-scaled rates checked at both ends of each family's ladder.
            *lr_probes(teacher[0], (0.5, 2.0)),
            *lr_probes(teacher[-1], (0.5, 2.0)),
            override_probe(teacher[-2], "dropout0.1", ("model.teacher.dropout=0.1",)),
            # The last 8 events as summary tokens that the final interaction compares with the candidate: on the
            # sequential world the trained candidate token otherwise reads the history as a bag.
            *(override_probe(t, "recent8", ("model.teacher.num_recent=8",)) for t in (teacher[0], teacher[-2])),
            *lr_probes(dlrm[2], (0.5, 2.0)),
            *lr_probes(dlrm[-1], (0.5, 2.0)),
        ),
        parallel=6,
        shard_weights=(3.0, 5.0),
    )


# The third sweep's changes, both from the second sweep's probes and diagnosis on the sequential world: every
# rate doubled (the x2 probes beat the curve at both ends of both families' ladders), and the teacher's last 8
# events as summary tokens (its candidate token read the history as a bag).
RECENT_TEACHER = ("model.teacher.num_recent=8",)


def recent_teacher_size(width: int, layers: int, heads: int) -> Size:
    """A teacher size of the third sweep's recipe (1,024 events, 512-row steps)."""
    return teacher_size(width, layers, heads, 1024, 512, lr=width_scaled_lr(4e-3, 32, width),
                        extra=TRAINED_RECIPE + ONE_PASS_TEACHER + RECENT_TEACHER)


def recent_plan() -> Plan:
    """The third sweep: the ``trained`` plan with the changes above, and 5 seeds of the largest sizes (the
    teacher's and the DLRM's two best) for the 2-standard-error comparison."""
    trained = trained_plan()
    teacher = [recent_teacher_size(*ladder) for ladder in TEACHER_LADDER]
    dlrm = [dlrm_size(w, trained.history, trained.batch_rows, lr=width_scaled_lr(8e-3, 32, w), extra=TRAINED_RECIPE)
            for w in DLRM_LADDER]
    return dataclasses.replace(
        trained,
        name="recent",
        sizes=(*teacher, *dlrm),
        label=f"{trained.label}; rates x2, teacher with 8 recent-event tokens",
        probes=(*lr_probes(teacher[-1], (2.0,)), *lr_probes(dlrm[-1], (2.0,))),
        duel=("teacher-w256-l4", "dlrm-d512", "dlrm-d2048"),
        duel_seeds=(3, 4),
        shard_weights=(2.0, 3.0),
    )


def recent_data_plan() -> Plan:
    """The third sweep's best teacher per FLOP and two DLRM sizes on twice the rows (1,200 steps, 614,400 rows, still
    one pass): does either family gain more from data than the other? Seeds 0 and 1."""
    recent = recent_plan()
    keep = ("teacher-w128-l3", "dlrm-d128", "dlrm-d2048")
    return dataclasses.replace(
        recent,
        name="recent-data",
        sizes=tuple(s for s in recent.sizes if f"{s.family}-{s.name}" in keep),
        seeds=(0, 1),
        steps=2 * recent.steps,
        label=recent.label.replace("307k rows", "614k rows"),
        probes=(),
        duel=(),
        duel_seeds=(),
        shard_weights=(1.0,),
    )


def data2x_plan() -> Plan:
    """The third sweep's recipe on twice the rows (1,200 steps of 512, one pass), where ``recent-data`` put the
    teacher ahead: teacher ladder ``w16``-``w128`` (~23x FLOPs per example; ``w256`` would double the GPU time),
    the four DLRM sizes, 3 seeds each, and 5 seeds of ``w128`` against the DLRM's two best sizes."""
    recent = recent_plan()
    teacher = (recent_teacher_size(16, 2, 2), *(s for s in recent.sizes if s.family == "teacher" and s.name != "w256-l4"))
    return dataclasses.replace(
        recent,
        name="data2x",
        sizes=(*teacher, *(s for s in recent.sizes if s.family == "dlrm")),
        steps=2 * recent.steps,
        label=recent.label.replace("307k rows", "614k rows"),
        probes=(),
        duel=("teacher-w128-l3", "dlrm-d128", "dlrm-d2048"),
        duel_seeds=(3, 4),
        shard_weights=(1.0, 2.0, 2.0),
    )


def data2x_seeds_plan() -> Plan:
    """Seeds 3 and 4 of ``data2x``'s teachers below ``w128`` and its two runs cut by time, again: the ladder on 5
    seeds, every run on its 614,400 rows."""
    data2x = data2x_plan()
    return dataclasses.replace(
        data2x,
        name="data2x-seeds",
        sizes=tuple(s for s in data2x.sizes if s.family == "teacher" and s.name != "w128-l3"),
        seeds=(3, 4),
        duel=(),
        duel_seeds=(),
        reruns=("teacher-w32-l2.s2", "teacher-w64-l2.s1"),
        shard_weights=(1.0,),
    )


def data2x_w128_plan() -> Plan:
    """Depth or rate: ``w128-l2`` (4 heads of 32, as ``w128-l3``) and ``w128-l3`` at ``w64-l2``'s peak rate, on
    ``data2x``'s rows, seeds 0-2."""
    data2x = data2x_plan()
    deep = next(s for s in data2x.sizes if s.family == "teacher" and s.name == "w128-l3")
    return dataclasses.replace(
        data2x,
        name="data2x-w128",
        sizes=(recent_teacher_size(128, 2, 4),),
        probes=lr_probes(deep, (1.41,)),
        probe_seeds=(0, 1, 2),
        duel=(),
        duel_seeds=(),
        shard_weights=(1.0,),
    )


def data4x_plan() -> Plan:
    """``data2x``'s recipe on twice its rows: does the teacher's curve keep falling past ``w64`` once ``w128`` has the
    data? Three teacher sizes and the DLRM's two ends, seeds 0-2."""
    data2x = data2x_plan()
    keep = ("teacher-w32-l2", "teacher-w64-l2", "teacher-w128-l3", "dlrm-d128", "dlrm-d2048")
    return dataclasses.replace(
        data2x,
        name="data4x",
        sizes=tuple(s for s in data2x.sizes if f"{s.family}-{s.name}" in keep),
        steps=2 * data2x.steps,
        label=data2x.label.replace("614k rows", "1229k rows"),
        duel=(),
        duel_seeds=(),
        shard_weights=(1.0, 1.0, 1.0),
    )


# The train rows of the plans' 2M-impression world (the `default` and the `sequential` preset alike: 1,600,557 /
# 199,730 / 199,713 train / valid / test rows in every regeneration, docs/benchmarks.md).
WORLD_TRAIN_ROWS = 1_600_557


def data_passes_plan() -> Plan:
    """``data4x``'s sizes and recipe on the whole train split, twice: 2 x ceil(train rows / 512) steps of 512 rows
    over two passes (``--passes 2``, each reshuffled), the schedule over all of them. Seeds 0-2; six calls of 2-3
    runs (``data4x``'s calls of 5 runs took about twice their estimate; here a run alone is estimated at 360-420 s)."""
    data4x = data4x_plan()
    passes = 2
    steps = passes * math.ceil(WORLD_TRAIN_ROWS / data4x.batch_rows)
    return dataclasses.replace(
        data4x,
        name="data-passes",
        steps=steps,
        passes=passes,
        split_rows=WORLD_TRAIN_ROWS,
        label=data4x.label.replace("1229k rows", f"{passes} passes over the {WORLD_TRAIN_ROWS / 1000:.0f}k train rows"),
        shard_weights=(1.0,) * 6,
    )


def data_fresh_plan() -> Plan:
    """``data-passes`` on twice the impressions per user, one pass of 6,200 steps (module doc), plus ``data2x``'s
    ``w16-l2`` and ``d512``: four teacher sizes over ~20x FLOPs per example and three DLRM sizes on one world, the
    figure the issue asks for. Five calls of three runs by default (runs here are loader-bound: three at once took
    about as long as one)."""
    passes = data_passes_plan()
    world = dataclasses.replace(passes.world, num_examples=2 * passes.world.num_examples)
    keep = {f"{s.family}-{s.name}" for s in passes.sizes} | {"teacher-w16-l2", "dlrm-d512"}
    steps = 6_200
    return dataclasses.replace(
        passes,
        name="data-fresh",
        world=world,
        sizes=tuple(s for s in data2x_plan().sizes if f"{s.family}-{s.name}" in keep),
        steps=steps,
        # Three runs at once each took about their time alone (16 cores, two loaders per run); more is unmeasured.
        cost=dataclasses.replace(passes.cost, overlap=3.0),
        shard_weights=(1.0,) * 5,
        passes=1,
        split_rows=0,
        label=re.sub(r"2M impressions, (.*?); 2 passes over the \d+k train rows",
                     rf"{world.num_examples / 1e6:.0f}M impressions, \1; one pass over "
                     rf"{steps * passes.batch_rows / 1e6:.1f}M of its train rows", passes.label),
    )


def dry_plan() -> Plan:
    """The ``trained`` plan's path and recipe at CPU sizes: a 3k-row world, two sizes of each model, a probe, four
    steps."""
    history, rows = 32, 64
    teacher = [teacher_size(w, layers, 2, history, rows, lr=width_scaled_lr(2e-3, 16, w),
                            extra=TRAINED_RECIPE + ONE_PASS_TEACHER) for w, layers in ((16, 1), (32, 2))]
    return Plan(
        name="dry",
        world=synth_preset("debug", num_users=300, num_examples=3_000, max_history=history, users_per_block=100),
        sizes=(
            *teacher,
            dlrm_size(8, history, rows, lr=4e-3, extra=TRAINED_RECIPE),
            dlrm_size(32, history, rows, lr=2e-3, extra=TRAINED_RECIPE),
        ),
        seeds=(0,),
        steps=4,
        batch_rows=rows,
        history=history,
        label="synthetic debug, 3k impressions (dry run)",
        cost=SECOND_SWEEP_COST,
        schedule=Schedule(warmup_frac=0.5, final_frac=0.1),
        probes=(*lr_probes(teacher[-1], (2.0,)), override_probe(teacher[0], "recent8", ("model.teacher.num_recent=8",))),
        parallel=2,
        shard_weights=(1.0, 2.0),
    )


PLANS: dict[str, Callable[[], Plan]] = {"scaling": scaling_plan, "trained": trained_plan, "recent": recent_plan,
                                        "recent-data": recent_data_plan, "data2x": data2x_plan,
                                        "data2x-seeds": data2x_seeds_plan, "data2x-w128": data2x_w128_plan,
                                        "data4x": data4x_plan, "data-passes": data_passes_plan,
                                        "data-fresh": data_fresh_plan, "dry": dry_plan}


def build_plan(name: str, preset: str | None = None) -> Plan:
    """``PLANS[name]``, its world taken from the synthetic ``preset`` (None: the plan's own) at the plan's sizes."""
    plan = PLANS[name]()
    if preset is None:
        return plan
    w = plan.world
    world = synth_preset(preset, num_examples=w.num_examples, max_history=w.max_history,
                         users_per_block=w.users_per_block)
    label, named = re.subn(r"^synthetic \w+", f"synthetic {preset}", plan.label)
    if not named:
        raise ValueError(f"plan {name!r}: its label {plan.label!r} does not start with 'synthetic <preset>'")
    return dataclasses.replace(plan, world=world, label=label)


def plan_runs(plan: Plan) -> list[Run]:
    """The sizes on every seed, the duel's sizes on the duel seeds, the reruns, then the probes on the probe seeds."""
    runs = [Run(size, seed) for size in plan.sizes for seed in plan.seeds]
    unknown = set(plan.duel) - {r.size_key for r in runs}
    if unknown:
        raise ValueError(f"plan {plan.name}: duel names sizes it does not have: {sorted(unknown)}")
    runs += [Run(size, seed) for size in plan.sizes for seed in plan.duel_seeds if Run(size, seed).size_key in plan.duel]
    sizes = {f"{size.family}-{size.name}": size for size in plan.sizes}
    for name in plan.reruns:
        key, _, seed = name.rpartition(".s")
        if key not in sizes or not seed.isdigit():
            raise ValueError(f"plan {plan.name}: rerun {name!r} is not <family>-<size>.s<seed> of one of its sizes")
        runs.append(Run(sizes[key], int(seed)))
    return runs + [Run(size, seed) for size in plan.probes for seed in plan.probe_seeds]


# -- the world ------------------------------------------------------------------------------------


def prepare(plan: Plan, world_dir: Path, workers: int) -> Path:
    """``world_dir`` holding the plan's world: reused when its ``synth.json`` has the same config, else generated."""
    wanted = json.loads(json.dumps(dataclasses.asdict(plan.world)))
    if (world_dir / SCHEMA_FILE).is_file():
        found = json.loads((world_dir / STATS_FILE).read_text())["config"]
        if found != wanted:
            changed = sorted(k for k in wanted if found.get(k) != wanted[k])
            raise ValueError(f"{world_dir} holds another world (differs in {changed}): use another --world")
        print(f"world {world_dir}: reused", flush=True)
        return world_dir
    start = time.perf_counter()
    stats = generate_world(plan.world, world_dir, progress=False, workers=workers)
    print(f"world {world_dir}: {stats['rows']} rows in {time.perf_counter() - start:.0f} s", flush=True)
    return world_dir


def world_facts(world_dir: Path) -> dict:
    """Rows per split, history length percentiles and the oracle's test metrics, from ``synth.json``."""
    stats = json.loads((world_dir / STATS_FILE).read_text())["stats"]
    return {"rows": stats["rows"], "history_len": stats["history_len"], "oracle_test": stats["oracle_test"]}


def sample_offsets(world_dir: Path, history: int, rows: int = 4096) -> torch.Tensor:
    """``offsets[rows+1]`` of train rows drawn at random (seed 0) from the first shard, histories cut to ``history``."""
    table = pq.read_table(list_shards(world_dir, "train")[0], columns=["history_item_ids"])
    lengths = np.minimum(table.column("history_item_ids").combine_chunks().value_lengths().to_numpy(), history)
    picked = np.random.default_rng(0).choice(lengths, rows)
    return torch.from_numpy(np.concatenate([[0], np.cumsum(picked)]))


def flops_per_example(size: Size, schema: EventSchema, offsets: torch.Tensor) -> float:
    """Training-step FLOPs per row of ``size`` on rows with history ``offsets``."""
    cfg = apply_overrides(get_flavor(size.flavor), list(size.overrides))
    rows = offsets.numel() - 1
    if cfg.model.arch == "teacher":
        return teacher_flops(cfg.model.teacher, schema, offsets) / rows
    return dlrm_flops(cfg.model.dlrm, schema, rows) / rows


def estimated_seconds(plan: Plan, family: str, per_example: float, eval_rows: int) -> dict[str, float]:
    """``{"seconds", "gpu_seconds"}`` of one run alone (:class:`CostModel`): its steps, then one forward pass (a
    third of a training step's FLOPs) over valid and test."""
    cost = plan.cost
    overhead, rate = cost.overhead(family), cost.effective_flops
    loader = cost.loader_rows_per_s * cost.loaders

    def span(steps: float, rows_per_step: float, flops_per_step: float) -> float:
        compute = steps * (overhead + flops_per_step / rate)
        return max(compute, steps * rows_per_step / loader) if loader else compute

    eval_steps = eval_rows / cost.eval_batch_rows
    train_flops, eval_flops = plan.train_rows * per_example, eval_rows * per_example / 3
    return {
        "seconds": span(plan.steps, plan.batch_rows, plan.batch_rows * per_example)
        + span(eval_steps, cost.eval_batch_rows, eval_flops / eval_steps),
        "gpu_seconds": (train_flops + eval_flops) / rate,
    }


def estimate(plan: Plan, world_dir: Path) -> dict[str, dict]:
    """Per size and probe: training FLOPs per example and the estimated seconds of one run."""
    schema = EventSchema.load(world_dir)
    offsets = sample_offsets(world_dir, plan.history)
    rows = world_facts(world_dir)["rows"]
    out = {}
    for size in (*plan.sizes, *plan.probes):
        per_example = flops_per_example(size, schema, offsets)
        out[Run(size, 0).size_key] = {
            "flops_per_example": per_example,
            **estimated_seconds(plan, size.family, per_example, rows["valid"] + rows["test"]),
        }
    return out


def check_rows(plan: Plan, world_dir: Path) -> None:
    """Refuse a plan whose runs would read train rows twice (one pass: more rows than the world's train split) or
    run out of them (``passes`` passes: more steps than ``passes`` times a pass's batches), and one whose steps
    were computed for another train split (``split_rows``)."""
    have = world_facts(world_dir)["rows"]["train"]
    if plan.split_rows and have != plan.split_rows:
        raise ValueError(f"plan {plan.name}: its {plan.steps} steps are {plan.passes} passes over {plan.split_rows} "
                         f"train rows, {world_dir} has {have} train rows")
    most = have if plan.passes == 1 else plan.passes * math.ceil(have / plan.batch_rows) * plan.batch_rows
    if plan.train_rows > most:
        passes = f" (at most {plan.passes} passes)" if plan.passes > 1 else ""
        raise ValueError(f"plan {plan.name}: each run trains {plan.train_rows} rows, {world_dir} has {have} train "
                         f"rows{passes}")


def parse_shard(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or not 0 <= int(index) < int(count):
        raise ValueError(f"--shard {text!r}: expected I/N with 0 <= I < N")
    return int(index), int(count)


def shard_weights(plan: Plan, text: str | None, count: int) -> tuple[float, ...]:
    """``--weights A,B,..`` (one positive number per shard), else the plan's ``shard_weights`` when it has
    ``count`` of them, else equal shares."""
    if text is None:
        return plan.shard_weights if len(plan.shard_weights) == count else (1.0,) * count
    try:
        weights = tuple(float(w) for w in text.split(","))
    except ValueError:
        weights = ()
    if len(weights) != count or not all(w > 0 for w in weights):
        raise ValueError(f"--weights {text!r}: expected {count} positive numbers, one per shard")
    return weights


def run_cost(costs: dict[str, dict], run: Run, overlap: float) -> float:
    """A run's share of a shard's time: its GPU seconds or its seconds over the overlap, the larger."""
    c = costs[run.size_key]
    return max(c.get("gpu_seconds", 0.0), c["seconds"] / overlap)


def shard_runs(runs: list[Run], costs: dict[str, dict], index: int, count: int,
               weights: tuple[float, ...] | None = None, overlap: float = 1.0) -> list[Run]:
    """The ``index``-th of ``count`` groups of ``runs``, balanced by :func:`run_cost` in proportion to ``weights``
    (longest first, each run to the group with the lowest load per weight after it; ties by name, so every call
    splits the same way)."""
    weights = weights or (1.0,) * count
    loads = [0.0] * count
    groups: list[list[Run]] = [[] for _ in range(count)]
    for run in sorted(runs, key=lambda r: (-run_cost(costs, r, overlap), r.name)):
        cost = run_cost(costs, run, overlap)
        target = min(range(count), key=lambda g: ((loads[g] + cost) / weights[g], g))
        groups[target].append(run)
        loads[target] += cost
    return groups[index]


def shard_seconds(runs: list[Run], costs: dict[str, dict], overlap: float) -> float:
    """Estimated seconds of ``runs`` sharing one GPU: their GPU seconds in a row, or their seconds overlapped
    ``overlap`` ways, the larger."""
    gpu = sum(costs[r.size_key].get("gpu_seconds", 0.0) for r in runs)
    return max(gpu, sum(costs[r.size_key]["seconds"] for r in runs) / overlap)


def done_runs(paths: list[Path], plan: Plan, world: dict) -> set[str]:
    """Names of the plan's runs that trained their whole schedule in these summaries (``--done``), on this world
    and data budget; a later call shards only the rest. A summary of another plan, world or data is refused."""
    names = {r.name for r in plan_runs(plan)}
    done: set[str] = set()
    for path in paths:
        try:
            summary = json.loads(path.read_text())
            if not isinstance(summary, dict) or not {"plan", "data", "world", "runs"} <= summary.keys():
                raise ValueError("no plan, data, world or runs")
        except ValueError as exc:
            raise ValueError(f"--done {path}: not a summary of compute_scaling ({exc})") from None
        if plan.name not in summary["plan"].split(" + ") or summary["data"] != plan.label:
            raise ValueError(f"--done {path}: a summary of plan {summary['plan']!r} ({summary['data']}), "
                             f"not of {plan.name!r}")
        if json.dumps(summary["world"], sort_keys=True) != json.dumps(world, sort_keys=True):
            raise ValueError(f"--done {path}: a summary of another world than {world}")
        done |= {r.get("name") for r in summary["runs"] if r.get("status") == "ok" and r.get("stopped_by") != "time"}
    return done & names


# -- running ----------------------------------------------------------------------------------------


def run_command(run: Run, world_dir: Path, result: Path, plan: Plan, budget: float,
                args: argparse.Namespace) -> list[str]:
    """The run's process: :mod:`experiments.scaling_run` under the plan's schedule, or (no schedule, the first
    sweep) :mod:`experiments.teacher_vs_baseline` at the flavor's constant rate."""
    common = ["--data", str(world_dir), "--flavor", run.size.flavor, "--seed", str(run.seed),
              "--time-budget", f"{budget:.0f}", "--json", str(result)]
    if plan.schedule is None:
        if plan.passes != 1:
            raise ValueError(f"plan {plan.name}: passes={plan.passes} needs a schedule (experiments.scaling_run)")
        command = [sys.executable, "-m", "experiments.teacher_vs_baseline", *common, "--epochs", str(args.epochs),
                   "--max-steps", str(plan.steps)]
    else:
        command = [sys.executable, "-m", "experiments.scaling_run", *common, "--steps", str(plan.steps),
                   "--warmup-steps", str(plan.schedule.warmup_steps(plan.steps)),
                   "--final-lr-frac", f"{plan.schedule.final_frac:g}"]
        if plan.passes != 1:
            command += ["--passes", str(plan.passes)]
        if run.size.lr is not None:
            command += ["--lr", repr(run.size.lr)]
    if args.device:
        command += ["--device", args.device]
    return command + list(run.size.overrides) + list(args.override)


@dataclass
class Process:
    run: Run
    out: Path
    command: list[str]
    popen: subprocess.Popen
    started: float
    budget: float
    kill_at: float | None


def run_budget(args: argparse.Namespace, call_started: float) -> float:
    """Training seconds of a run starting now (0: none): ``--time-budget``, cut so that with ``--grace`` for
    its start and evaluation it ends ``--call-budget`` seconds after the call began (at least one second)."""
    budget = args.time_budget
    if args.call_budget > 0:
        left = max(call_started + args.call_budget - time.monotonic() - args.grace, 1.0)
        budget = min(budget, left) if budget > 0 else left
    return budget


def start(run: Run, world_dir: Path, plan: Plan, args: argparse.Namespace, call_started: float) -> Process:
    out = Path(args.out) / "runs" / run.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").unlink(missing_ok=True)  # a stale result must not pass for this run's
    budget = run_budget(args, call_started)
    command = run_command(run, world_dir, out / "result.json", plan, budget, args)
    with open(out / "log.txt", "w") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **RUN_ENV})
    now = time.monotonic()
    return Process(run, out, command, popen, now, budget, now + budget + args.grace if budget > 0 else None)


def run_processes(runs: list[Run], launch: Callable[[Run], Process], parallel: int, poll: float,
                  on_finish: Callable[[Process, bool], None]) -> None:
    """Start ``runs`` in order, ``parallel`` at a time; a process still alive at its ``kill_at`` is killed."""
    waiting, alive = list(runs), []
    while waiting or alive:
        while waiting and len(alive) < parallel:
            alive.append(launch(waiting.pop(0)))
        time.sleep(poll)
        for proc in list(alive):
            overdue = proc.kill_at is not None and time.monotonic() > proc.kill_at
            if proc.popen.poll() is None and overdue:
                proc.popen.kill()
            if proc.popen.poll() is None and not overdue:
                continue
            proc.popen.wait()
            alive.remove(proc)
            on_finish(proc, overdue)


# -- summaries --------------------------------------------------------------------------------------


def run_row(proc: Process, killed: bool, domains: list[str]) -> dict:
    """One run: what it was, how it ended, and (from its ``result.json``) FLOPs, parameters and test metrics."""
    size = proc.run.size
    row = {
        "name": proc.run.name,
        "model": size.family,
        "size": size.name,
        "seed": proc.run.seed,
        "probe": size.probe,
        "command": shlex.join(proc.command),
        "rc": proc.popen.returncode,
        "status": "killed" if killed else ("ok" if proc.popen.returncode == 0 else "failed"),
        "seconds": round(time.monotonic() - proc.started, 1),
        "time_budget": round(proc.budget, 1),
        "log": str(proc.out / "log.txt"),
    }
    path = proc.out / "result.json"
    if not path.is_file():
        if row["status"] == "ok":
            row["status"] = "no result"
        return row
    result = json.loads(path.read_text())
    test = result["test"]
    row.update(
        parameters=result["parameters"],
        train_rows=result["train_rows"],
        train_flops=result["train_flops"],
        train_flops_at_best=result["train_flops_at_best"],
        flops_per_example=result["flops_per_example"],
        best_epoch=result["best_epoch"],
        epochs=len(result["history"]),
        tokens_per_s=[round(h["tokens_per_s"]) for h in result["history"]],
        test={k: test[k] for k in ("click/ne", "click/auc", "click/oracle_ne", "conversion/ne") if k in test},
        # A domain without a click in the test split has no NE (NaN): None, and its row leaves the domain out.
        per_domain={name: _finite(test.get(f"click/ne/d{d}")) for d, name in enumerate(domains)},
        recalibrated_click_ne=result.get("test_recalibrated", {}).get("click/ne"),
        valid_click_ne=result["history"][result["best_epoch"]]["valid"].get("click/ne"),
        train_loss=[h["loss"] for h in result["history"]],
    )
    if "schedule" in result:  # experiments.scaling_run: the peak rate, why it stopped, the train-loss curve
        row.update(lr=result["schedule"]["lr"], stopped_by=result["stopped_by"],
                   passes_started=result.get("passes_started", 1),
                   curve=[{k: c[k] for k in ("end_step", "loss", "lr")} for c in result["curve"]])
    return row


def _finite(value: float | None) -> float | None:
    return value if value is not None and np.isfinite(value) else None


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def group_rows(runs: list[dict], data: str, command: str, date: str, device: str | None = None) -> list[dict]:
    """One row per (model, size) over the seeds whose run wrote a result (the module docstring's format);
    ``device``: the machine's accelerator, as the summary recorded it (summaries before it was recorded: None)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in runs:
        if "test" in row:
            groups.setdefault((row["model"], row["size"]), []).append(row)
    out = []
    for (model, size), rows in groups.items():
        rows = sorted(rows, key=lambda r: r["seed"])
        ne, ne_std = _mean_std([r["test"]["click/ne"] for r in rows])
        recalibrated = [r["recalibrated_click_ne"] for r in rows if r.get("recalibrated_click_ne") is not None]
        domains = {
            name: _mean_std([r["per_domain"][name] for r in rows])
            for name in rows[0]["per_domain"]
            if all(r["per_domain"].get(name) is not None for r in rows)
        }
        out.append({
            "model": model,
            "size": size,
            "seeds": [r["seed"] for r in rows],
            "parameters": rows[0]["parameters"],
            "flops_per_example": statistics.fmean(r["flops_per_example"] for r in rows),
            "train_flops": statistics.fmean(r["train_flops_at_best"] for r in rows),
            "click_ne_mean": round(ne, 5),
            "click_ne_std": round(ne_std, 5),
            "click_auc_mean": round(statistics.fmean(r["test"]["click/auc"] for r in rows), 5),
            "per_domain": {k: {"click_ne_mean": round(m, 5), "click_ne_std": round(s, 5)} for k, (m, s) in domains.items()},
            "train_rows": [r["train_rows"] for r in rows],
            "data": data,
            "command": command,
            "date": date,
            "device": device,
        })
        if len(recalibrated) == len(rows):
            out[-1]["recalibrated_click_ne_mean"] = round(statistics.fmean(recalibrated), 5)
        if "lr" in rows[0]:
            out[-1].update(lr=rows[0]["lr"], probe=rows[0].get("probe", ""),
                           stopped_by=[r["stopped_by"] for r in rows])
    return sorted(out, key=lambda g: (FAMILIES.index(g["model"]), bool(g.get("probe")), g["flops_per_example"],
                                      g["size"]))


def write_summary(summary: dict, path: Path) -> None:
    summary["rows"] = group_rows(summary["runs"], summary["data"], summary["command"], summary["date"],
                                 summary.get("device"))
    atomic_write_text(path, json.dumps(summary, indent=2) + "\n")


def format_table(summary: dict) -> str:
    lines = [f"{'model':<8} {'size':<20} {'n':>2} {'GFLOP/example':>13} {'train FLOPs':>11} {'click NE ± std':>16}"
             f" {'recal.':>6} {'lr':>8}  stopped by"]
    for g in summary["rows"]:
        recalibrated = g.get("recalibrated_click_ne_mean")
        lines.append(
            f"{g['model']:<8} {g['size']:<20} {len(g['seeds']):>2} {g['flops_per_example'] / 1e9:>13.4f} "
            f"{g['train_flops']:>11.3e} {g['click_ne_mean']:>9.4f}±{g['click_ne_std']:.4f}"
            f" {recalibrated if recalibrated is not None else float('nan'):>6.4f} {g.get('lr', float('nan')):>8.2e}"
            f"  {' '.join(g.get('stopped_by', []))}"
        )
    lines += [f"run {r['name']}: {r['status']} (rc {r['rc']}), log {r['log']}" for r in summary["runs"] if r["status"] != "ok"]
    if summary.get("missing"):
        lines.append(f"runs of the plan in no summary: {' '.join(summary['missing'])}")
    return "\n".join(lines)


def bundle(summary_path: Path, out: Path, target: Path, tag: str) -> None:
    """``target/summary-<tag>.json`` and ``target/runs-<tag>.tar.gz`` (every run's log and result)."""
    target.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target / f"summary-{tag}.json", summary_path.read_text())
    with atomic_path(target / f"runs-{tag}.tar.gz") as tmp, tarfile.open(tmp, "w:gz") as tar:
        tar.add(out / "runs", arcname=f"runs-{tag}")


def run_device(requested: str | None) -> str:
    """What the runs train on, by name: the GPU the trainer picks by default, or the ``--device`` asked for."""
    if (requested or "cuda").startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(requested or "cuda"))
    return requested or "cpu"


def sweep(args: argparse.Namespace) -> dict:
    call_started = time.monotonic()
    plan = build_plan(args.plan, args.preset)
    index, count = parse_shard(args.shard)
    weights = shard_weights(plan, args.weights, count)
    if plan.schedule is not None and args.epochs != 1:
        raise ValueError(f"plan {plan.name}: one pass per run (its schedule's length); --epochs is the first sweep's")
    out, world_dir = Path(args.out), Path(args.world)
    prepare(plan, world_dir, args.workers)
    check_rows(plan, world_dir)
    costs = estimate(plan, world_dir)
    done = done_runs([Path(p) for p in args.done], plan, world_facts(world_dir))
    todo = [r for r in plan_runs(plan) if r.name not in done]
    runs = shard_runs(todo, costs, index, count, weights, plan.cost.overlap)
    schema = EventSchema.load(world_dir)
    summary = {
        "plan": plan.name,
        "shard": args.shard,
        "data": plan.label,
        "world": world_facts(world_dir),
        "estimate": costs,
        "shard_weights": list(weights),
        "command": shlex.join(["python", "-m", "experiments.compute_scaling", *args.argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "device": run_device(args.device),
        "env": RUN_ENV,
        "rows": [],
        "runs": [],
    }
    summary_path, tag = out / "summary.json", f"{index}of{count}"
    out.mkdir(parents=True, exist_ok=True)
    if args.bundle:
        Path(args.bundle).mkdir(parents=True, exist_ok=True)
    seconds = shard_seconds(runs, costs, plan.cost.overlap)
    print(f"shard {args.shard}: {len(runs)} runs, ~{seconds:.0f} s of GPU (estimate)"
          + (f"; {len(done)} runs done before (--done)" if done else ""), flush=True)

    def on_finish(proc: Process, killed: bool) -> None:
        row = run_row(proc, killed, schema.domain_names)
        summary["runs"].append(row)
        write_summary(summary, summary_path)
        if args.bundle:  # the headline figures leave the machine even if the call is cut short
            atomic_write_text(Path(args.bundle) / f"summary-{tag}.json", summary_path.read_text())
        ne = row.get("test", {}).get("click/ne", float("nan"))
        print(f"[{len(summary['runs'])}/{len(runs)}] {row['name']}: {row['status']} in {row['seconds']} s, "
              f"{row.get('train_rows', 0)} rows, {row.get('train_flops', 0):.3e} FLOPs, click NE {ne:.4f}", flush=True)

    launch = functools.partial(start, world_dir=world_dir, plan=plan, args=args, call_started=call_started)
    run_processes(runs, launch, args.parallel or plan.parallel or len(runs), args.poll, on_finish)
    write_summary(summary, summary_path)
    if args.bundle:
        bundle(summary_path, out, Path(args.bundle), tag)
    print(format_table(summary), flush=True)
    return summary


def combine(paths: list[Path], target: Path) -> dict:
    """One summary from the summaries of a plan's shards, and of plans that add runs on the same world and data
    (``data2x-seeds`` to ``data2x``): their runs together, rows recomputed. A run in two summaries is kept where it
    trained to its schedule's end and the other copy was cut by time (a rerun); any other repeat is refused."""
    parts = [json.loads(p.read_text()) for p in paths]
    worlds = {json.dumps(p.get("world"), sort_keys=True) for p in parts}
    if len({p["data"] for p in parts}) != 1 or len(worlds) != 1:
        raise ValueError(f"{[str(p) for p in paths]}: summaries of different worlds or data budgets")
    runs: dict[str, dict] = {}
    for run in (r for p in parts for r in p["runs"]):
        kept = runs.setdefault(run["name"], run)
        if kept is run:
            continue
        cut = [r.get("stopped_by") == "time" for r in (kept, run)]
        if cut.count(True) != 1:
            raise ValueError(f"run {run['name']} in more than one summary (a rerun replaces only a run cut by time)")
        runs[run["name"]] = run if cut[0] else kept
    plans = list(dict.fromkeys(name for p in parts for name in p["plan"].split(" + ")))
    summary = {**parts[0], "plan": " + ".join(plans), "shard": [p["shard"] for p in parts], "runs": list(runs.values())}
    summary["command"] = " && ".join(dict.fromkeys(p["command"] for p in parts))
    devices = [p["device"] for p in parts if p.get("device")]
    summary["device"] = " + ".join(dict.fromkeys(devices)) if devices else None
    summary["missing"] = sorted({r.name for name in plans for r in plan_runs(PLANS[name]())} - set(runs))
    write_summary(summary, target)
    return summary


def merge(summary_path: Path, results_path: Path) -> dict:
    """A summary's rows into a results file: a row replaces the one with its model, size and data."""
    rows = json.loads(summary_path.read_text())["rows"]
    current = json.loads(results_path.read_text()) if results_path.is_file() else {"rows": []}
    fresh = {(r["model"], r["size"], r["data"]) for r in rows}
    current["rows"] = [r for r in current["rows"] if (r["model"], r["size"], r["data"]) not in fresh] + rows
    atomic_write_text(results_path, json.dumps(current, indent=2) + "\n")
    return current


def rows_label(summary: dict) -> str:
    """The rows each run of ``summary`` trained on, as ``"307k rows"``."""
    rows = {r["train_rows"] for r in summary["runs"] if "test" in r}
    return " / ".join(f"{n / 1000:.0f}k rows" for n in sorted(rows))


def plot(summary_path: Path, png: Path, also: tuple[Path, ...] = ()) -> None:
    """Test click NE against training FLOPs (log x): per model family its seeds (dots) and their mean ± std;
    each summary in ``also`` (the same world, another data budget) as dashed curves beside them."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [json.loads(p.read_text()) for p in (summary_path, *also)]
    worlds = {json.dumps(s.get("world", {}).get("oracle_test"), sort_keys=True) for s in summaries}
    if len(worlds) > 1:
        raise ValueError(f"{[str(p) for p in (summary_path, *also)]}: summaries of different worlds")
    summary = summaries[0]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for index, part in enumerate(summaries):
        style, rows_text = ("-", "--", ":")[index % 3], rows_label(part)
        for family, color in zip(FAMILIES, ("tab:blue", "tab:orange"), strict=True):
            rows = [g for g in part["rows"] if g["model"] == family and not g.get("probe")]
            probes = [g for g in part["rows"] if g["model"] == family and g.get("probe")]
            if not rows:
                continue
            runs = [r for r in part["runs"] if r["model"] == family and "test" in r and not r.get("probe")]
            # A run cut by its time budget (until its rerun lands) is drawn hollow: its seed sits in the mean.
            for cut in (False, True):
                chosen = [r for r in runs if (r.get("stopped_by") == "time") == cut]
                ax.scatter([r["train_flops_at_best"] for r in chosen], [r["test"]["click/ne"] for r in chosen],
                           color=color, alpha=0.35 if not cut else 0.8, s=14 if not cut else 22,
                           facecolors="none" if cut else color)
            ax.errorbar([g["train_flops"] for g in rows], [g["click_ne_mean"] for g in rows],
                        yerr=[g["click_ne_std"] for g in rows], color=color, marker="o", capsize=3,
                        linestyle=style, label=f"{family}, {rows_text}" if also else family)
            # Probes (one seed, one change each) beside the curve, not on it.
            ax.scatter([g["train_flops"] for g in probes], [g["click_ne_mean"] for g in probes], color=color,
                       marker="x", s=24)
            for g in (*rows, *probes):
                ax.annotate(g["size"], (g["train_flops"], g["click_ne_mean"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=color)
    oracle = summary.get("world", {}).get("oracle_test", {}).get("click", {}).get("ne")
    if oracle is not None:
        low, high = ax.get_ylim()
        if oracle >= low - (high - low):
            ax.axhline(oracle, color="grey", linestyle="--", linewidth=1, label="oracle (true probabilities)")
        else:  # a line that far below would squash the curves into a band: its value goes in the legend instead
            ax.plot([], [], color="grey", linestyle="--", linewidth=1, label=f"oracle (true probabilities): {oracle:.4f}")
    if any(r.get("stopped_by") == "time" and "test" in r and not r.get("probe") for p in summaries for r in p["runs"]):
        ax.scatter([], [], facecolors="none", edgecolors="grey", s=22, label="seed cut by its time budget")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("training FLOPs (model FLOPs of the steps trained, to the best valid epoch)")
    ax.set_ylabel("test click NE (lower is better)")
    ax.set_title(textwrap.fill(f"Teacher vs DLRM: {summary['data']}", 90), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(png) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def print_plan(args: argparse.Namespace) -> None:
    plan = build_plan(args.plan, args.preset)
    world_dir = prepare(plan, Path(args.world), args.workers)
    check_rows(plan, world_dir)
    costs = estimate(plan, world_dir)
    done = done_runs([Path(p) for p in args.done], plan, world_facts(world_dir))
    runs = [r for r in plan_runs(plan) if r.name not in done]
    if done:
        print(f"done before (--done): {' '.join(sorted(done))}")
    count = args.shards or len(plan.shard_weights) or 2
    weights = shard_weights(plan, args.weights, count)
    for name, c in costs.items():
        print(f"{name:<24} {c['flops_per_example'] / 1e9:9.4f} GFLOP/example  {c['seconds']:7.1f} s per run alone, "
              f"{c['gpu_seconds']:7.1f} s of it on the GPU")
    for index in range(count):
        shard = shard_runs(runs, costs, index, count, weights, plan.cost.overlap)
        names = " ".join(r.name for r in shard)
        seconds = shard_seconds(shard, costs, plan.cost.overlap)
        print(f"shard {index}/{count} (weight {weights[index]:g}): {len(shard)} runs, ~{seconds:.0f} s of GPU: {names}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="action", required=True)
    run = commands.add_parser("run", help="prepare the world, run a shard of the plan, write summary.json")
    plan = commands.add_parser("plan", help="prepare the world, print each size's FLOPs and the shards' time estimate")
    for sub in (run, plan):
        sub.add_argument("--plan", default="scaling", choices=sorted(PLANS))
        sub.add_argument("--preset", default=None, choices=sorted(SYNTH_PRESETS),
                         help="generate the plan's world from this synthetic preset at the plan's sizes "
                              "(default: the plan's own world)")
        sub.add_argument("--world", required=True, help="the world's directory (generated unless it holds it)")
        sub.add_argument("--workers", type=int, default=max(1, min(16, os.cpu_count() or 1)),
                         help="processes generating the world")
    plan.add_argument("--shards", type=int, default=0, help="calls to split the plan over (0: the plan's)")
    for sub in (run, plan):
        sub.add_argument("--done", nargs="+", default=[], metavar="SUMMARY",
                         help="leave out the runs these summaries of the plan hold trained to the end, then shard the rest")
        sub.add_argument("--weights", default=None,
                         help="A,B,..: each shard's share of the plan (default: the plan's, else equal)")
    run.add_argument("--out", required=True, help="runs/<name>/ and summary.json go here")
    run.add_argument("--shard", default="0/1", help="I/N: the I-th of N balanced groups of the plan's runs")
    run.add_argument("--epochs", type=int, default=1)
    run.add_argument("--time-budget", type=float, default=0.0, help="seconds of training per run (0: none)")
    run.add_argument("--call-budget", type=float, default=0.0,
                     help="seconds from this command's start by which every run must end (0: none)")
    run.add_argument("--grace", type=float, default=120.0,
                     help="seconds past a run's training budget (for its start and evaluation) before it is killed")
    run.add_argument("--parallel", type=int, default=0, help="runs at once (0: the plan's, else all of the shard)")
    run.add_argument("--device", default=None)
    run.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                     help="a dotted override for every run, after the plan's (e.g. train.precision=32-true); repeatable")
    run.add_argument("--bundle", help="also copy the summary and a tarball of the runs here")
    run.add_argument("--poll", type=float, default=1.0, help=argparse.SUPPRESS)
    comb = commands.add_parser("combine", help="one summary from the shards' summaries")
    comb.add_argument("summaries", nargs="+")
    comb.add_argument("--out", required=True)
    merge_parser = commands.add_parser("merge", help="merge a summary's rows into a results file")
    merge_parser.add_argument("summary")
    merge_parser.add_argument("results")
    plot_parser = commands.add_parser("plot", help="test click NE against training FLOPs, as a PNG")
    plot_parser.add_argument("summary")
    plot_parser.add_argument("png")
    plot_parser.add_argument("--also", action="append", default=[], metavar="SUMMARY",
                             help="another summary of the same world (another data budget), drawn dashed")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        if args.action == "run":
            summary = sweep(args)
            return 0 if summary["runs"] and all(r["status"] == "ok" for r in summary["runs"]) else 1
        if args.action == "plan":
            print_plan(args)
        elif args.action == "combine":
            summary = combine([Path(p) for p in args.summaries], Path(args.out))
            print(format_table(summary))
        elif args.action == "merge":
            print(f"{args.results}: {len(merge(Path(args.summary), Path(args.results))['rows'])} rows")
        else:
            plot(Path(args.summary), Path(args.png), tuple(Path(p) for p in args.also))
            print(f"{args.png}: written")
    except (ValueError, FileNotFoundError) as exc:
        print(f"compute_scaling: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
