"""Which form of the training step a run takes: the resolved ``train.cast_once``, ``train.bucket_rows``,
``train.cuda_graphs`` and ``train.precompile_kernels`` switches (:class:`gem.config.TrainConfig`).

All four are for one device (a process pool compiling kernels for each of many ranks would oversubscribe the
host): a parallel strategy reduces the gradients in its own backward hooks (which
:class:`~gem.loop.StaticStep`'s ``torch.autograd.grad`` does not fire), splits batches by rows (which a padded
batch does not survive) and keeps its own mixed precision, so under ``parallel.enabled`` they are off, said
in one line. The static step also needs a model whose lookups run apart (``look_up``, the GEM teacher) and a
precision without a gradient scaler (``16-mixed`` scales the loss, which its gradients never see).
``model.teacher.sparse_tables`` (the tables' rows stepped apart, :class:`~foundation.model.precision.MasterAdamW`)
is for one device too: under ``parallel.enabled`` the tables get dense gradients again, also said in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foundation.config import ConfigError
from foundation.model.padding import StaticShapes, static_shapes
from gem.config import ExperimentConfig
from gem.loop import GraphConfig

# Lightning precisions whose autocast dtype is bfloat16.
BF16_AUTOCAST = ("bf16-mixed", "bf16")
# Lightning precisions that scale the loss with a GradScaler.
SCALED = ("16-mixed", "16")


@dataclass(frozen=True)
class StepOptions:
    """The resolved switches.

    Attributes:
        autocast_dtype: the dtype Lightning's precision autocasts to (None: no autocast).
        cast_once: parameters cast once per step (:class:`~foundation.model.precision.CastOnce`).
        shapes: the static shapes training batches are padded to, or None (plain batches, the plain step).
        graphs: how :class:`~gem.loop.StaticStep` runs the dense part (with ``shapes`` only).
        precompile_kernels: compile the first step's Triton kernels in parallel before it runs
            (:class:`gem.train.PrecompileKernels`; a logged no-op off CUDA).
        sparse_tables: the teacher's tables give sparse row gradients (``model.teacher.sparse_tables``), which
            MasterAdamW steps and :func:`~foundation.model.precision.clip_grad_norm` clips.
    """

    autocast_dtype: torch.dtype | None
    cast_once: bool
    shapes: StaticShapes | None
    graphs: GraphConfig
    precompile_kernels: bool = False
    sparse_tables: bool = False


def step_options(cfg: ExperimentConfig, has_lookups: bool) -> tuple[StepOptions, list[str]]:
    """The run's :class:`StepOptions` and one line for each switch asked for and turned off (module doc).

    ``has_lookups``: the model runs its lookups apart (``look_up``). A combination that cannot mean anything
    (graphs without buckets, buckets without a token budget, buckets on a model without lookups) raises
    :class:`~foundation.config.ConfigError` naming the field.
    """
    train, notes = cfg.train, []
    precision = str(train.precision)
    autocast_dtype = torch.bfloat16 if precision in BF16_AUTOCAST else torch.float16 if precision in SCALED else None
    if train.cuda_graphs and not train.bucket_rows:
        raise ConfigError("train.cuda_graphs replays static shapes: set train.bucket_rows too (e.g. (64,128))")
    shapes = None
    if train.bucket_rows:
        if not has_lookups:
            raise ConfigError(
                f"train.bucket_rows: model.arch={cfg.model.arch!r} has no static-shape step (the GEM teacher has)"
            )
        if not cfg.data.token_budget:
            raise ConfigError("train.bucket_rows pads batches to data.token_budget tokens: set data.token_budget")
        try:
            shapes = static_shapes(cfg.data.token_budget, cfg.data.max_len, tuple(train.bucket_rows))
        except ValueError as err:
            raise ConfigError(f"train.bucket_rows={tuple(train.bucket_rows)}: {err}") from None
    if train.graph_warmup < 0:
        raise ConfigError(f"train.graph_warmup={train.graph_warmup} must be 0 or more")
    sparse_tables = cfg.model.arch == "teacher" and cfg.model.teacher.sparse_tables
    if sparse_tables and cfg.parallel.enabled:
        notes.append("model.teacher.sparse_tables off: parallel.enabled shards the tables (one device only); they get dense gradients")
        sparse_tables = False
    cast_once = train.cast_once and autocast_dtype == torch.bfloat16
    precompile = train.precompile_kernels
    if cfg.parallel.enabled:
        asked = [name for name, on in (("cast_once", cast_once), ("bucket_rows", shapes), ("cuda_graphs", train.cuda_graphs)) if on]
        if asked:
            notes.append(f"train.{', train.'.join(asked)} off: parallel.enabled (single-device switches); the plain step runs")
        cast_once, shapes, precompile = False, None, False
    elif shapes is not None and precision in SCALED:
        notes.append(f"train.bucket_rows off: train.precision={precision} scales the loss, which the static step does not; the plain step runs")
        shapes = None
    graphs = GraphConfig(cuda_graphs=bool(train.cuda_graphs and shapes is not None), warmup_steps=train.graph_warmup)
    return StepOptions(autocast_dtype, cast_once, shapes, graphs, precompile, sparse_tables), notes
