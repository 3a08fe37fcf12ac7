"""The one training step, its throughput accounting, and the plain epoch loop built on them.

:func:`train_step` is a step of every trainer in the project: the Lightning harness
(:class:`gem.module.RecModule`, with Lightning's backward and gradient clipping) and :func:`train_epoch`
(plain PyTorch, for GPU sweeps and benchmarks on machines without MLflow). :class:`Throughput` gives both
their tokens/s, TFLOP/s and MFU. Neither imports MLflow or Lightning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from foundation.data.batch import JaggedBatch
from foundation.model.flops import peak_flops, throughput_metrics
from foundation.model.padding import PaddedBatch, StaticShapes, bucket_stand_in
from foundation.model.precision import CastOnce, MasterAdamW, clip_grad_norm


def autocast(device: torch.device, dtype: torch.dtype | None, *, cache: bool = True) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``'s type (``cache``: autocast's cache of cast parameters), or
    nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)


def train_step(
    model: nn.Module,
    batch: JaggedBatch,
    optimizer: torch.optim.Optimizer,
    *,
    grad_clip: float = 0.0,
    autocast_dtype: torch.dtype | None = None,
    loss_weight: float = 1.0,
    forward: Callable[[JaggedBatch], object] | None = None,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    clip: Callable[[float], object] | None = None,
    cast_once: CastOnce | None = None,
) -> dict[str, torch.Tensor]:
    """One optimiser step on a device batch; returns ``model.loss``'s terms (``"loss"`` is the total).

    ``model.loss(batch, forward(batch))`` under autocast to ``autocast_dtype``, then ``backward`` of
    ``loss * loss_weight`` (a rank's share of a global mean), gradients clipped to norm ``grad_clip`` when it
    is positive (``clip(grad_clip)``, default: over ``model.parameters()``), then ``optimizer.step()``.
    ``forward`` defaults to ``model``; a trainer passes its own to feed extra inputs (teacher outputs).
    ``cast_once`` (a :class:`~foundation.model.precision.CastOnce` of ``model``, kept across steps, with the
    default ``forward``) casts the parameters autocast would cast at every use once per step instead.
    """
    if cast_once is not None and forward is not None:
        raise ValueError("train_step: cast_once runs the model's own forward; pass one or the other")
    forward = forward or model
    with autocast(batch.candidate.device, autocast_dtype):
        if cast_once is None:
            losses = model.loss(batch, forward(batch))
        else:
            losses = cast_once.run(lambda model_forward: model.loss(batch, model_forward(batch)))
    optimizer.zero_grad(set_to_none=True)
    backward(losses["loss"] * loss_weight if loss_weight != 1.0 else losses["loss"])
    if cast_once is not None:
        cast_once.collect_grads()
    if grad_clip > 0:
        if clip is None:
            clip_grad_norm(model.parameters(), grad_clip)
        else:
            clip(grad_clip)
    optimizer.step()
    return losses


class Throughput:
    """Tokens and FLOPs counted over a span of steps, as tokens/s, TFLOP/s and MFU.

    FLOPs come from the model's ``flops(batch, training=True)`` counter (valid tokens only) when it has one;
    count each batch on its host copy, where reading offsets needs no device sync. MFU needs a GPU whose
    peak at ``precision`` (a Lightning precision string) is known.
    """

    def __init__(self, model: nn.Module, device: torch.device, precision: str) -> None:
        self.model = model
        self.device = device
        self.counts_flops = hasattr(model, "flops")
        self.peak = peak_flops(torch.cuda.get_device_name(device), precision) if device.type == "cuda" else None
        self.reset()

    def reset(self) -> None:
        """Forget the counts and start the clock."""
        self.tokens, self.flops = 0, 0.0
        self.start_clock()

    def start_clock(self) -> None:
        self.started = time.perf_counter()

    def count(self, batch: JaggedBatch) -> None:
        """Add a batch's history tokens (a padded batch's real ones) and FLOPs."""
        self.tokens += batch.real_tokens if isinstance(batch, PaddedBatch) else batch.num_tokens
        if self.counts_flops:
            self.flops += self.model.flops(batch, training=True)

    def metrics(self) -> dict[str, float]:
        """``tokens_per_s`` (and ``tflops_per_s``, ``mfu`` where known) since the clock started; syncs the GPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        perf = throughput_metrics(self.flops, self.tokens, time.perf_counter() - self.started, self.peak)
        return perf if self.counts_flops else {"tokens_per_s": perf["tokens_per_s"]}


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[JaggedBatch],
    *,
    grad_clip: float = 0.0,
    autocast_dtype: torch.dtype | None = None,
    max_steps: int = -1,
    deadline: float | None = None,
    cast_once: bool = False,
    static_step: StaticStep | None = None,
    prepare: StaticShapes | None = None,
) -> dict:
    """One pass of :func:`train_step` over ``batches`` (at most ``max_steps`` when >= 0, and none begun after
    the ``time.perf_counter()`` value ``deadline``).

    Returns the mean loss, the step, padded-step (``static_step``'s) and row counts, the model FLOPs trained
    (``flops``, the sum of ``model.flops(batch)`` over the steps; 0 for a model without a counter) and
    :class:`Throughput`'s figures over the pass (MFU at bf16 peak with ``autocast_dtype=torch.bfloat16``, else
    fp32). ``cast_once`` runs :func:`train_step` with a :class:`~foundation.model.precision.CastOnce` of the model
    (autocast only).
    ``static_step`` (made with the same optimizer, clip and autocast) takes the padded batches
    (:class:`~foundation.model.padding.PaddedBatches`), :func:`train_step` the others; with ``prepare`` (the
    batches' shapes) every bucket is warmed up and captured after the pass's first padded step
    (:meth:`StaticStep.prepare`; a later pass finds them ready).
    """
    device = next(model.parameters()).device
    once = CastOnce(model, autocast_dtype) if cast_once and autocast_dtype is not None else None
    meter = Throughput(model, device, "bf16-mixed" if autocast_dtype == torch.bfloat16 else "32-true")
    total_loss, steps, rows, padded, prepared = torch.zeros((), device=device), 0, 0, 0, False
    for batch in batches:
        if steps == max_steps or (deadline is not None and time.perf_counter() > deadline):
            break
        meter.count(batch)
        if static_step is not None and isinstance(batch, PaddedBatch):
            losses = static_step(batch)  # from the host batch into its bucket's buffers
            padded += 1
            if prepare is not None and not prepared:
                static_step.prepare(batch, prepare)
                prepared = True
        else:
            losses = train_step(
                model, batch.to(device, non_blocking=True), optimizer, grad_clip=grad_clip,
                autocast_dtype=autocast_dtype, cast_once=once,
            )
        total_loss += losses["loss"].detach()  # summed on the device: no per-step sync
        steps += 1
        rows += batch.real_rows if isinstance(batch, PaddedBatch) else batch.batch_size
    return {
        "loss": float(total_loss) / max(steps, 1), "steps": steps, "padded_steps": padded, "rows": rows,
        "flops": meter.flops, **meter.metrics(),
    }


@dataclass
class GraphConfig:
    """How :class:`StaticStep` runs the dense part of a step (the ``--cuda-graphs`` switch of the GPU benchmarks).

    Attributes:
        cuda_graphs: capture each bucket's dense forward and backward into a CUDA graph and replay it (CUDA
            only); False runs the same step eagerly on the same static buffers.
        warmup_steps: eager steps per bucket before its capture (they compile and tune the kernels, which a
            capture cannot).
    """

    cuda_graphs: bool = False
    warmup_steps: int = 2


@dataclass
class _Slot:
    """One bucket's static buffers: the batch's tensors, the lookups (leaves: made at the first step), the
    captured graph and its outputs."""

    batch: JaggedBatch
    lookups: object = None
    leaves: list[torch.Tensor] | None = None
    steps: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple | None = None


class StaticStep:
    """One optimiser step on static-shape batches (:func:`foundation.model.padding.pad_batch`), the dense part
    replayable from a CUDA graph.

    The model is split as :class:`~foundation.model.teacher.GEMTeacher` is: ``model.look_up(batch)`` (the
    torchrec tables, whose lookups may sync the host and are not captured) runs eagerly; the dense rest,
    ``model.loss(batch, model(batch, lookups))`` and its backward into the dense parameters and the lookups,
    runs on one set of static buffers per bucket (batch shapes): eagerly for ``warmup_steps``, then, with
    ``config.cuda_graphs``, captured once and replayed. The lookups' gradients then flow into the tables
    eagerly, the dense gradients are handed to ``optimizer``, which steps after the gradients are clipped to
    norm ``grad_clip`` when it is positive (``clip(grad_clip)``, default: over the model's parameters), as in
    :func:`train_step`. ``cast_once`` (a :class:`~foundation.model.precision.CastOnce` of ``model``, under autocast)
    refreshes the low-precision copies of the parameters autocast would cast at every use inside the graph, in one
    multi-tensor copy, and converts their gradients back after it in another (same values), where autocast would
    launch two casts per parameter; with an optimizer that keeps the copies
    (:meth:`~foundation.model.precision.MasterAdamW.keep_copies`) neither: the optimizer reads the bf16 gradients
    and writes the copies. If a capture fails, one line goes to ``log`` and every later step runs eagerly.
    A call returns ``model.loss``'s terms (device scalars; ``"loss"`` is the total). The random numbers are drawn in
    the eager step's order (negatives in the lookups, then dropout), so without a graph it trains exactly as
    :func:`train_step` on the same batches.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        autocast_dtype: torch.dtype | None,
        config: GraphConfig,
        log: Callable[[str], None] = print,
        grad_clip: float = 0.0,
        clip: Callable[[float], object] | None = None,
        cast_once: CastOnce | None = None,
    ) -> None:
        self.model, self.optimizer, self.autocast_dtype = model, optimizer, autocast_dtype
        self.cast_once = cast_once
        self.config, self.log = config, log
        self.grad_clip, self.clip = grad_clip, clip
        self.device = next(model.parameters()).device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.slots: dict[tuple, _Slot] = {}
        self.graphs_off = not config.cuda_graphs
        if config.cuda_graphs and self.device.type != "cuda":
            self.graphs_off = True
            log(f"cuda graphs off: the model is on {self.device.type}; eager steps")
        self.pool = self.side_stream = None

    @property
    def graphs(self) -> int:
        """Buckets replaying a captured graph."""
        return sum(slot.graph is not None for slot in self.slots.values())

    def __call__(self, batch: JaggedBatch) -> dict[str, torch.Tensor]:
        slot, produced = self.load(batch)
        discovered = self.cast_once is not None and self.cast_once.discovered
        losses, grads = self.run_dense(slot)
        if self.cast_once is not None and not discovered and self.cast_once.discovered:
            params = self.cast_once.params
            copied = sum(p.numel() for p in params) / 1e6
            self.log(f"cast once: {len(params)} parameters ({copied:.1f}M values) get {self.cast_once.dtype} copies")
        if self.cast_once is not None:
            # After the graph, not in it: its gradients' addresses are fixed only once it is captured, and the
            # one-launch copy needs them before (kernels/triton/multi_copy.py).
            n = len(self.params)
            # An optimizer that keeps the copies (MasterAdamW) reads their gradients as they are, unless clipping
            # needs every gradient in the parameters' .grad.
            hold = self.cast_once.kept_by_optimizer and self.grad_clip <= 0
            convert = self.cast_once.hold_grads if hold else self.cast_once.float_grads
            grads = (*convert(self.params, list(grads[:n])), *grads[n:])
        self.optimizer.zero_grad(set_to_none=True)
        differentiable = [t for t in produced if t.requires_grad]
        pairs = [(t, g) for t, g in zip(differentiable, grads[len(self.params):], strict=True) if g is not None]
        if pairs:  # into the tables, eagerly
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        for p, g in zip(self.params, grads, strict=False):
            if g is not None:
                p.grad = in_layout_of(p, g) if p.grad is None else p.grad + g
        if self.grad_clip > 0:
            if self.clip is None:
                clip_grad_norm(self.model.parameters(), self.grad_clip)
            else:
                self.clip(self.grad_clip)
        self.optimizer.step()
        slot.steps += 1
        return {name: value.clone() for name, value in losses.items()}  # a replay overwrites the outputs

    def load(self, batch: JaggedBatch) -> tuple[_Slot, list[torch.Tensor]]:
        """The batch copied into its bucket's buffers and its lookups run (eagerly) into the slot's leaves; returns
        the slot and the lookups' own tensors (whose graph leads back into the tables)."""
        slot = self.slot_for(batch)
        _copy_tensors(slot.batch, batch)
        slot.batch.sparse = batch.sparse.to(self.device, non_blocking=True)
        lookups = self.model.look_up(slot.batch)
        produced = _lookup_tensors(lookups)
        if slot.leaves is None:
            slot.leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in produced]
            slot.lookups = _rebuild_lookups(lookups, slot.leaves)
        with torch.no_grad():
            for leaf, value in zip(slot.leaves, produced, strict=True):
                leaf.copy_(value)
        return slot, produced

    def prepare(self, batch: JaggedBatch, shapes: StaticShapes) -> list[int]:
        """Run every bucket's warm-up steps and, with CUDA graphs, its capture now, each on a stand-in of the
        bucket made from ``batch`` (:func:`~foundation.model.padding.bucket_stand_in`), so that no later step
        pays them: a bucket's first batches otherwise run eagerly and capture in the middle of training (where
        data-parallel ranks would all wait for the one that does).

        The stand-ins' dense passes only warm up: their gradients are dropped, no parameter, gradient or
        optimizer state changes, and the random-number generators are restored after them, so training goes on
        exactly as it would without this call. Returns the buckets warmed up (one whose stand-in cannot be made
        is left to its first batch)."""
        prepared = []
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            for rows in shapes.rows:
                stand_in = bucket_stand_in(batch, shapes, rows)
                if stand_in is None:
                    continue
                slot, _ = self.load(stand_in)
                while slot.steps < self.config.warmup_steps:
                    self.run_dense(slot)
                    slot.steps += 1
                if not self.graphs_off and slot.graph is None:
                    self.run_dense(slot)  # the capture (or, where it fails, the switch to eager steps)
                prepared.append(rows)
        return prepared

    def slot_for(self, batch: JaggedBatch) -> _Slot:
        """The bucket's slot, with static copies of the batch's tensors on the device (made on first use)."""
        key = tuple((tuple(t.shape), t.dtype) for t in _batch_tensors(batch))
        if key not in self.slots:
            self.slots[key] = _Slot(_static_copy(batch, self.device))
        return self.slots[key]

    def run_dense(self, slot: _Slot) -> tuple[dict[str, torch.Tensor], tuple]:
        """The dense forward and backward on the slot's buffers: replayed, captured then replayed, or eager."""
        if slot.graph is not None:
            slot.graph.replay()
            return slot.outputs
        use_graph = not self.graphs_off
        if use_graph and slot.steps >= self.config.warmup_steps:
            try:
                self.capture(slot)
                slot.graph.replay()
                return slot.outputs
            except Exception as err:  # whatever stopped the capture: run eagerly from now on
                self.graphs_off = True
                slot.graph = slot.outputs = None
                # What the kernels derived from these buffers during the capture was never computed.
                for t in _batch_tensors(slot.batch):
                    torch.autograd.graph.increment_version(t)
                reason = str(err).splitlines()[0][:200] if str(err) else ""
                self.log(f"cuda graphs off: capture failed ({type(err).__name__}: {reason}); eager from now on")
        if use_graph:  # warm-up steps run on a side stream, as a capture does
            self.side_stream = self.side_stream or torch.cuda.Stream(self.device)
            self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side_stream):
                outputs = self.dense(slot)
            torch.cuda.current_stream(self.device).wait_stream(self.side_stream)
            return outputs
        return self.dense(slot)

    def capture(self, slot: _Slot) -> None:
        torch.cuda.synchronize(self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the DataLoader's pin-memory thread keeps making CUDA calls (pinned allocations, event
        # queries) while this thread captures; only this thread's unsafe calls may break the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = self.dense(slot)
        slot.graph, slot.outputs = graph, outputs

    def dense(self, slot: _Slot) -> tuple[dict[str, torch.Tensor], tuple]:
        """``(loss terms, gradients of the parameters then of the lookup leaves)``; None where unused.

        Autocast's cache is off: under an enclosing autocast (a Lightning step's) a cast cached before a capture
        would be read by the graph after its memory is freed.
        """
        cast = self.cast_once
        targets = cast.grad_targets(self.params) if cast is not None else self.params
        with autocast(self.device, self.autocast_dtype, cache=False):
            if cast is None:
                losses = self.model.loss(slot.batch, self.model(slot.batch, slot.lookups))
            else:
                losses = cast.run(lambda forward: self.model.loss(slot.batch, forward(slot.batch, slot.lookups)))
        leaves = [leaf for leaf in slot.leaves if leaf.requires_grad]
        grads = torch.autograd.grad(losses["loss"], [*targets, *leaves], allow_unused=True)
        return {name: value.detach() for name, value in losses.items()}, grads


def build_static_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    autocast_dtype: torch.dtype | None,
    config: GraphConfig,
    cast_once: bool,
    grad_clip: float = 0.0,
    log: Callable[[str], None] = print,
) -> StaticStep:
    """A :class:`StaticStep` of ``model`` for a script's own loop; with ``cast_once`` (under autocast only) a
    :class:`~foundation.model.precision.CastOnce` of its parameters, whose copies a
    :class:`~foundation.model.precision.MasterAdamW` ``optimizer`` keeps."""
    cast = CastOnce(model, autocast_dtype) if cast_once and autocast_dtype is not None else None
    if cast is not None and isinstance(optimizer, MasterAdamW):
        optimizer.keep_copies(cast)
    return StaticStep(model, optimizer, autocast_dtype=autocast_dtype, config=config, log=log, grad_clip=grad_clip,
                      cast_once=cast)


def _batch_tensors(batch: JaggedBatch) -> list[torch.Tensor]:
    """The batch's tensors in a fixed order (fields, then dict keys sorted), the sparse features left out."""
    out = []
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, dict):
            out.extend(value[k] for k in sorted(value))
    return out


def _static_copy(batch: JaggedBatch, device: torch.device) -> JaggedBatch:
    """A copy of the batch's tensors on ``device`` (never the batch's own tensors, which the caller keeps)."""
    copies = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            copies[f.name] = value.to(device, copy=True)
        elif isinstance(value, dict):
            copies[f.name] = {k: t.to(device, copy=True) for k, t in value.items()}
    return dataclasses.replace(batch, **copies)


def _copy_tensors(static: JaggedBatch, batch: JaggedBatch) -> None:
    for target, source in zip(_batch_tensors(static), _batch_tensors(batch), strict=True):
        target.copy_(source, non_blocking=True)


def _lookup_tensors(lookups) -> list[torch.Tensor]:
    return [getattr(lookups, f.name) for f in dataclasses.fields(lookups) if getattr(lookups, f.name) is not None]


def _rebuild_lookups(lookups, leaves: list[torch.Tensor]):
    values = iter(leaves)
    return dataclasses.replace(
        lookups, **{f.name: next(values) for f in dataclasses.fields(lookups) if getattr(lookups, f.name) is not None}
    )


def in_layout_of(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``param``'s strides, as autograd's own accumulation into ``.grad`` gives it: a gradient that
    reaches a parameter through a transpose arrives transposed, and torch's fused AdamW reads a gradient as if it
    were laid out like its parameter (a transposed one steps the wrong entries)."""
    return grad if grad.stride() == param.stride() else torch.empty_like(param).copy_(grad)
