"""Host work of training steps: the ATen operators and Triton launches a step issues, and its host time.

A launch-bound GPU step costs the host a roughly fixed time per operator it dispatches, whatever the tensor
sizes, so counting operators on a CPU at small widths measures what the GPU step's host pays at full size
(the same structure dispatches the same operators). :class:`OpCounter` counts every operator that reaches
ATen (a :class:`~torch.utils._python_dispatch.TorchDispatchMode`, so autograd's backward operators too) by
phase (``forward``, ``backward``, ``optimizer``), by kind (:func:`op_kind`) and by the line of this
repository that dispatched it (for the backward of a built-in function, the autograd node and the forward line
that made it: :func:`autograd_site`): views, allocations and the dispatchers' CPU-only offset checks launch no
kernel on a GPU (:data:`NO_KERNEL`), every other kind launches about one. Triton kernels are not ATen operators; their launches are
counted by kernel name, and what Triton's CPU interpreter does inside a launch is left out of both the
operator counts and the host time (on a GPU a launch is asynchronous; on a CPU the interpreter *runs* it).
The interpreter takes minutes per kernel-heavy step and computes bf16 dots wrongly, so by default the
interpreted launches are counted and not run (``interpret=False``): the step dispatches the same operators
(none of its control flow reads a tensor value), on numbers that mean nothing.

Differences from a CUDA step worth knowing when reading CPU counts: CPU autocast casts a slightly different
operator list than CUDA's (e.g. CUDA also runs ``sum``/``exp``/``softmax`` in float32), and an operator that
syncs the host with the device on CUDA (``_local_scalar_dense``, ``nonzero``, ...) is listed as kind
``sync`` here: each one would stall a GPU step and break a CUDA graph capture.

Bytes (``bytes_by_site``, ``triton_bytes``): a model of the memory traffic of every launching operator and Triton
launch, counted on the tensors it is handed: each distinct input and output once (an expanded or strided view
counts the storage it spans, at most its elements), an indexing operator twice its output (it reads the rows it
gathers, not the table). Run at the GPU's widths (not ``--cpu-widths``), it ranks the step's memory-bound
passes by what they move; tokens scale every ``[T, d]`` figure linearly.

Matrix products (``gemm_flops_by_site``): each one's FLOPs (two per multiply-add) by operator, operand shapes and
site, the same way: which products a step's GEMM time is spent on, and at which shapes.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

PHASES = ("forward", "backward", "optimizer")
KINDS = (
    "sync", "copy_cast", "gemm", "index", "norm", "reduction", "fill", "optimizer", "elementwise", "alloc", "view",
    "cpu_check",
)
# Kinds that launch no kernel on a GPU: views, allocations, and checks the dispatchers run on CPU tensors only.
NO_KERNEL = ("alloc", "view", "cpu_check")
_COPY = {"_to_copy", "copy_", "clone", "_copy_from", "_copy_from_and_resize", "lift_fresh_copy", "contiguous"}
_GEMM = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "_scaled_mm", "addmv", "mv", "dot", "linear"}
_INDEX = {
    "index", "index_select", "index_add", "index_add_", "index_put", "index_put_", "_index_put_impl_", "gather",
    "scatter", "scatter_add", "scatter_add_", "embedding", "embedding_dense_backward", "embedding_bag",
    "_embedding_bag", "_embedding_bag_backward", "_embedding_bag_dense_backward", "searchsorted",
    "repeat_interleave", "index_fill_", "masked_fill", "masked_fill_", "take", "put_", "triu_indices",
    "_embedding_bag_forward_only", "segment_reduce", "_segment_reduce_backward",
}
_NORM = {"native_layer_norm", "native_layer_norm_backward", "layer_norm", "_fused_rms_norm", "linalg_vector_norm"}
_REDUCTION = {"sum", "mean", "amax", "amin", "max", "min", "logsumexp", "var_mean", "std", "var", "prod", "norm", "cumsum", "argsort", "sort"}
_ALLOC = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "lift_fresh", "promote_types"}
_FILL = {
    "zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "arange",
    "randint", "rand", "randn", "scalar_tensor", "fill_", "zero_",
}
# The attention dispatchers check offset values on CPU tensors only (kernels/checks.py): no CUDA step runs these.
CPU_ONLY_FILES = ("kernels/checks.py",)
REPOSITORY = str(Path(__file__).resolve().parents[1])
# A virtual environment may live inside the checkout (CI's does): its packages are not this repository's code.
INSTALLED = ("site-packages", "dist-packages")
# One frame of a traceback that anomaly mode stores in an autograd node's metadata.
_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')
# On a CUDA tensor these read a device value on the host (or size an output by one).
_SYNC = {"_local_scalar_dense", "item", "nonzero", "masked_select", "is_nonzero", "equal", "allclose", "unique", "_unique2", "unique_consecutive", "tolist"}


def op_kind(func) -> str:
    """The kind of an ATen operator overload (module doc); views never launch a kernel."""
    name = func.overloadpacket.__name__
    if name in _SYNC:
        return "sync"
    if getattr(func, "is_view", False) or name in ("detach", "alias", "_reshape_alias", "view", "_unsafe_view"):
        return "view"
    if name in _COPY:
        return "copy_cast"
    if name in _GEMM:
        return "gemm"
    if name in _INDEX:
        return "index"
    if name in _NORM:
        return "norm"
    if name in _REDUCTION:
        return "reduction"
    if name in _ALLOC:
        return "alloc"
    if name in _FILL:
        return "fill"
    if name.startswith(("_foreach_", "_fused_adam")):
        return "optimizer"
    return "elementwise"


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches reading or writing all of ``t``: its elements, or the storage a broadcast view spans."""
    elements = t.numel() * t.element_size()
    if not elements:
        return 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
    return min(elements, span * t.element_size())


def traffic_bytes(kind: str, inputs, outputs) -> int:
    """Modelled bytes an operator moves (module doc): distinct tensors among ``inputs`` and ``outputs``."""
    outs = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)]
    if kind == "index":
        return 2 * sum(tensor_bytes(t) for t in outs)
    seen, total = set(), 0
    for t in [*tree_leaves(inputs), *outs]:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if key not in seen:
                seen.add(key)
                total += tensor_bytes(t)
    return total


def _kernel_args_bytes(args, kwargs) -> int:
    return traffic_bytes("elementwise", (args, kwargs), ())


class OpCounter(TorchDispatchMode):
    """Counts ``(phase, operator)`` for every ATen call while active; ``phase`` is set by :meth:`in_phase`.

    Operators dispatched inside a Triton launch (the CPU interpreter's own copies) are not counted: while
    ``paused`` is positive nothing is.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.ops: Counter[tuple[str, str]] = Counter()
        self.kinds: Counter[tuple[str, str]] = Counter()
        self.sites: Counter[tuple[str, str]] = Counter()
        self.site_bytes: Counter[tuple[str, str]] = Counter()
        self.site_flops: Counter[tuple[str, str]] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            name, site = func.overloadpacket.__name__, caller_in_project()
            kind = "cpu_check" if site.startswith(CPU_ONLY_FILES) else op_kind(func)
            self.ops[self.phase, name] += 1
            self.kinds[self.phase, kind] += 1
            if kind not in NO_KERNEL:
                self.sites[self.phase, f"{name} at {site}"] += 1
                self.site_bytes[self.phase, f"{kind} {name} at {site}"] += traffic_bytes(kind, (args, kwargs), out)
            if kind == "gemm":
                shapes = " @ ".join(str(list(a.shape)) for a in args if isinstance(a, torch.Tensor) and a.dim() > 1)
                self.site_flops[self.phase, f"{name} {shapes} at {site}"] += gemm_flops(name, args, out)
        return out


# Products whose first argument is the term they add to: their contracted operand comes second.
_ACCUMULATING = {"addmm", "baddbmm", "addbmm", "addmv"}


def gemm_flops(name: str, args: tuple, out) -> int:
    """FLOPs of a matrix product: two per multiply-add, ``2 x output elements x contracted length`` (``addbmm``
    also sums its batch, ``dot`` has one output)."""
    first = args[1] if name in _ACCUMULATING else args[0]
    if not isinstance(first, torch.Tensor) or not isinstance(out, torch.Tensor) or first.dim() == 0:
        return 0
    outputs = 1 if name == "dot" else out.numel() * (first.shape[0] if name == "addbmm" else 1)
    return 2 * outputs * first.shape[-1]


def caller_in_project() -> str:
    """``path:line`` of the innermost frame of this repository's code on the stack (``?``: none).

    An operator that autograd's engine runs for a built-in function's backward has no frame of ours below the
    ``.backward()`` call: it is named by its node and the forward line that made the node instead,
    ``AddmmBackward0 of path:line`` (:func:`autograd_site`).
    """
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if frame.f_code.co_name == "_engine_run_backward":
            return autograd_site()
        if _in_project(filename):
            return f"{filename[len(REPOSITORY) + 1:]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _in_project(filename: str) -> bool:
    return filename.startswith(REPOSITORY) and filename != __file__ and not any(p in filename for p in INSTALLED)


def autograd_site() -> str:
    """The autograd node running now and the innermost line of ours in its forward's traceback (recorded only
    under anomaly mode, which :func:`count_steps` turns on for the counted steps; ``?`` without it)."""
    node = torch._C._current_autograd_node()
    if node is None:
        return "?"
    where = "?"
    for entry in node.metadata.get("traceback_") or []:
        match = _FRAME.match(entry)
        if match and _in_project(match["file"]):
            where = f"{match['file'][len(REPOSITORY) + 1:]}:{match['line']}"
    return f"{node.name()} of {where}"


class LaunchTimer:
    """Triton launches by ``(phase, kernel)`` and the seconds spent inside them (the CPU interpreter's run).

    ``interpret=False`` counts the interpreter's launches without running them (module doc): their outputs
    stay uninitialised.
    """

    def __init__(self, *, interpret: bool = False) -> None:
        self.interpret = interpret
        self.phase = "forward"
        self.launches: Counter[tuple[str, str]] = Counter()
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.seconds: Counter[str] = Counter()
        self.counter: OpCounter | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Wrap the ``run`` of Triton's compiled and interpreted kernels with this timer while inside."""
        from triton.runtime import interpreter, jit

        originals = {cls: cls.run for cls in (jit.JITFunction, interpreter.InterpretedFunction)}
        timer = self

        def wrap(run: Callable, interpreted: bool) -> Callable:
            def timed_run(kernel, *args, **kwargs):
                if kwargs.get("warmup"):
                    return run(kernel, *args, **kwargs)
                timer.launches[timer.phase, kernel.__name__] += 1
                timer.bytes[timer.phase, kernel.__name__] += _kernel_args_bytes(args, kwargs)
                if interpreted and not timer.interpret:
                    return None
                if timer.counter is not None:
                    timer.counter.paused += 1
                start = time.perf_counter()
                try:
                    return run(kernel, *args, **kwargs)
                finally:
                    timer.seconds[timer.phase] += time.perf_counter() - start
                    if timer.counter is not None:
                        timer.counter.paused -= 1

            return timed_run

        for cls, run in originals.items():
            cls.run = wrap(run, cls is interpreter.InterpretedFunction)
        try:
            yield
        finally:
            for cls, run in originals.items():
                cls.run = run


class PhaseClock:
    """Host seconds by phase, with the time inside Triton launches (:class:`LaunchTimer`) kept apart."""

    def __init__(self, timer: LaunchTimer, counter: OpCounter | None = None) -> None:
        self.timer, self.counter = timer, counter
        self.seconds: Counter[str] = Counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.timer.phase = name
        if self.counter is not None:
            self.counter.phase = name
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


def count_steps(run_step: Callable, batches, steps: int, *, interpret: bool = False) -> dict:
    """Host work per step of ``run_step(phase, batch)``, which wraps its parts in ``with phase("forward")`` etc.

    One batch warms up (first calls build caches), the next ``steps`` run under :class:`OpCounter` (operator
    counts), the next ``steps`` without it (host time: the counter's Python callback per operator would
    dominate it). Returns per-step means:
    ``ops[phase]`` (every dispatched operator), ``launching_ops[phase]`` (all but the :data:`NO_KERNEL` kinds),
    ``kinds[phase][kind]``, ``top_ops[phase]`` (the 25 most frequent), ``top_sites[phase]`` (the 40 most
    frequent launching ``operator at path:line``), ``sync_sites``, ``triton_launches[phase][kernel]``,
    ``host_ms[phase]`` (wall time minus the time inside Triton launches). ``interpret``: see
    :class:`LaunchTimer`.
    """
    batches = iter(batches)
    timer, counter = LaunchTimer(interpret=interpret), OpCounter()
    with timer.installed():
        _run(run_step, PhaseClock(timer), batches, 1)
        timer.launches.clear()
        timer.bytes.clear()
        timer.counter = counter
        # Anomaly mode (without its NaN checks, which would add operators) keeps each autograd node's forward
        # traceback, by which the backward's operators are attributed (:func:`autograd_site`).
        with counter, warnings.catch_warnings(), torch.autograd.set_detect_anomaly(True, check_nan=False):
            warnings.simplefilter("ignore", UserWarning)
            counted = _run(run_step, PhaseClock(timer, counter), batches, steps)
        timer.counter = None
        launches, launch_bytes = Counter(timer.launches), Counter(timer.bytes)
        timer.seconds.clear()
        clock = PhaseClock(timer)
        timed = _run(run_step, clock, batches, steps)
    if not counted or not timed:
        raise ValueError(f"--count-ops needs {2 * steps + 1} batches after the timed steps; the data ran out")
    return summarize_counts(counter, launches, counted, clock.seconds, timer.seconds, timed, launch_bytes)


def _run(run_step, clock: PhaseClock, batches, steps: int) -> int:
    done = 0
    for batch in batches:
        run_step(clock.phase, batch)
        done += 1
        if done == steps:
            break
    return done


def summarize_counts(
    counter: OpCounter, launches: Counter, counted: int, wall: Counter, inside: Counter, timed: int,
    launch_bytes: Counter | None = None,
) -> dict:
    """Per-step means of what :func:`count_steps` gathered, by phase."""
    launch_bytes = launch_bytes or Counter()
    kinds = {p: {k: counter.kinds[p, k] / counted for k in KINDS if counter.kinds[p, k]} for p in PHASES}
    ops = {p: sum(kinds[p].values()) for p in PHASES}
    launching = {p: sum(n for k, n in kinds[p].items() if k not in NO_KERNEL) for p in PHASES}
    top = {
        p: dict(Counter({op: n / counted for (q, op), n in counter.ops.items() if q == p}).most_common(25))
        for p in PHASES
    }
    sites = {
        p: dict(Counter({site: n / counted for (q, site), n in counter.sites.items() if q == p}).most_common(40))
        for p in PHASES
    }
    syncs = {site: n for p in PHASES for site, n in sites[p].items() if site.split(" at ")[0] in _SYNC}
    triton = {p: {k: n / counted for (q, k), n in sorted(launches.items()) if q == p} for p in PHASES}
    host_ms = {p: (wall[p] - inside[p]) / timed * 1e3 for p in PHASES}
    site_bytes = {p: {s: n / counted for (q, s), n in counter.site_bytes.most_common() if q == p} for p in PHASES}
    triton_bytes = {p: {k: n / counted for (q, k), n in launch_bytes.most_common() if q == p} for p in PHASES}
    gemm_flops_by_site = {p: {s: n / counted for (q, s), n in counter.site_flops.most_common() if q == p}
                          for p in PHASES}
    return {
        "steps_counted": counted,
        "steps_timed": timed,
        "ops": ops,
        "ops_total": sum(ops.values()),
        "launching_ops": launching,
        "launching_ops_total": sum(launching.values()),
        "triton_launches_total": sum(sum(v.values()) for v in triton.values()),
        "kinds": kinds,
        "top_ops": top,
        "top_sites": sites,
        "triton_launches": triton,
        "host_ms": host_ms,
        "host_ms_total": sum(host_ms.values()),
        "sync_sites": syncs,
        "bytes_by_site": site_bytes,
        "triton_bytes": triton_bytes,
        "bytes_total": math.fsum(n for table in (*site_bytes.values(), *triton_bytes.values()) for n in table.values()),
        "gemm_flops_by_site": gemm_flops_by_site,
        "gemm_flops_total": math.fsum(n for table in gemm_flops_by_site.values() for n in table.values()),
    }


def largest(summary: dict, keys: tuple[str, ...], count: int) -> list[tuple[float, str, str]]:
    """The ``count`` largest entries of the summary's per-phase tables ``keys`` (e.g. the operator sites and Triton
    kernels that move the most bytes per step): ``(value, phase, name)``."""
    rows = [(n, phase, name) for key in keys for phase, table in summary[key].items() for name, n in table.items()]
    return sorted(rows, reverse=True)[:count]


def format_counts(summary: dict) -> str:
    """A short table: per phase, operators (launching), Triton launches, host ms, then the kinds."""
    lines = [f"{'phase':10s} {'ops':>8s} {'launching':>10s} {'triton':>7s} {'host ms':>8s}"]
    for p in PHASES:
        lines.append(
            f"{p:10s} {summary['ops'][p]:8.0f} {summary['launching_ops'][p]:10.0f}"
            f" {sum(summary['triton_launches'][p].values()):7.0f} {summary['host_ms'][p]:8.1f}"
        )
    lines.append(
        f"{'total':10s} {summary['ops_total']:8.0f} {summary['launching_ops_total']:10.0f}"
        f" {summary['triton_launches_total']:7.0f} {summary['host_ms_total']:8.1f}"
    )
    for p in PHASES:
        lines.append(f"{p} by kind: " + ", ".join(f"{k} {v:.0f}" for k, v in summary["kinds"][p].items()))
    if "bytes_total" in summary:
        lines.append(f"modelled bytes per step: {summary['bytes_total'] / 2**20:.1f} MiB; the largest:")
        movers = largest(summary, ("bytes_by_site", "triton_bytes"), 12)
        lines += [f"  {n / 2**20:10.1f} MiB  {phase:9s} {site}" for n, phase, site in movers]
    if summary.get("gemm_flops_total"):
        lines.append(f"matrix products per step: {summary['gemm_flops_total'] / 1e9:.1f} GFLOP; the largest:")
        lines += [f"  {n / 1e9:10.2f} GFLOP  {p:9s} {site}" for n, p, site in largest(summary, ("gemm_flops_by_site",), 12)]
    if summary["sync_sites"]:
        lines.append("would sync on CUDA: " + ", ".join(f"{s} x{n:.0f}" for s, n in summary["sync_sites"].items()))
    return "\n".join(lines)
