"""Kernel time of profiled training steps, grouped by what the step spends it on.

Groups: ``generative_loss``, ``attention`` and ``embeddings`` (the teacher's named profiler ranges,
:mod:`foundation.model.profiling`), ``optimizer`` (torch's ``Optimizer.step`` range), then by kernel
name: ``gemm``, ``elementwise_norm``, and ``other`` (copies, memsets, anything unnamed here).

A kernel belongs to the innermost range around the CPU op that launched it. Backward kernels run
outside the forward's ranges; they belong to the range in which the forward op that created their
autograd node ran: the profiler gives both the same sequence number. On CPU there are no kernels:
each op's self time stands in for them (indicative only: the host is the device there).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from foundation.model.profiling import ATTENTION, EMBEDDINGS, GENERATIVE

GROUPS = ("generative_loss", "attention", "embeddings", "optimizer", "gemm", "elementwise_norm", "other")
REGION_GROUPS = {GENERATIVE: "generative_loss", ATTENTION: "attention", EMBEDDINGS: "embeddings"}
BACKWARD_PREFIX = "autograd::engine::evaluate_function:"
OPTIMIZER_PREFIX = "Optimizer."
# The optimizer's own kernels by name (a Triton launch inside ``Optimizer.step`` is linked to no host op).
OPTIMIZER_NAMES = re.compile(r"^_adamw_kernel|^_multi_copy_kernel|multi_tensor_apply|fused_adam", re.I)
# The jagged attention kernels by name, for launches the profiler links to no range of ours.
ATTENTION_NAMES = re.compile(r"^_fwd_kernel|^_bwd_(dq|dkdv|delta)_kernel|attention|flash|fmha", re.I)
GEMM_NAMES = re.compile(r"gemm|cutlass|nvjet|xmma|cublas|wgmma|^aten::(mm|addmm|bmm|baddbmm|addbmm|_scaled_mm)$", re.I)
ELEMENTWISE_NAMES = re.compile(
    r"elementwise|vectorized|reduce|norm|softmax|index|gather|scatter|cat|copy_kernel|fill|where|silu|"
    r"dropout|modulate|_ln_|^aten::",
    re.I,
)


def ancestors(event):
    """The event, then its enclosing CPU ops, innermost first."""
    while event is not None:
        yield event
        event = event.cpu_parent


def region_sequence_numbers(events) -> dict[str, set[int]]:
    """Region -> sequence numbers of the forward ops that ran inside it (their autograd nodes' numbers)."""
    numbers: dict[str, set[int]] = {region: set() for region in REGION_GROUPS}
    for event in events:
        if event.sequence_nr < 0 or event.name.startswith(BACKWARD_PREFIX):
            continue
        for outer in ancestors(event.cpu_parent):
            if outer.name in numbers:
                numbers[outer.name].add(event.sequence_nr)
                break
    return numbers


def context_group(event, numbers: dict[str, set[int]]) -> str | None:
    """The group the event's enclosing ranges (or its backward node's forward range) give it, if any."""
    for outer in ancestors(event):
        if outer.name.startswith(OPTIMIZER_PREFIX):
            return "optimizer"
        if outer.name in REGION_GROUPS:
            return REGION_GROUPS[outer.name]
        if outer.name.startswith(BACKWARD_PREFIX):
            for region, seen in numbers.items():
                if outer.sequence_nr in seen:
                    return REGION_GROUPS[region]
            return None
    return None


def name_group(name: str) -> str:
    if OPTIMIZER_NAMES.search(name):
        return "optimizer"
    if ATTENTION_NAMES.search(name):
        return "attention"
    if GEMM_NAMES.search(name):
        return "gemm"
    if ELEMENTWISE_NAMES.search(name):
        return "elementwise_norm"
    return "other"


def timed_items(event, on_device: bool) -> list[tuple[str, float]]:
    """``(name, microseconds)`` of the kernels an op launched (device), or of its own host time (CPU)."""
    if on_device:
        return [(kernel.name, kernel.duration) for kernel in event.kernels]
    return [(event.name, event.self_cpu_time_total)] if event.self_cpu_time_total > 0 else []


def kernel_breakdown(events, *, on_device: bool, steps: int, wall_s: float, top: int = 15) -> dict:
    """Per-step milliseconds by group, their shares, the busiest kernels, and the share of the wall time
    with no kernel running (device only; one stream assumed)."""
    numbers = region_sequence_numbers(events)
    by_group: dict[str, float] = defaultdict(float)
    by_kernel: dict[tuple[str, str], float] = defaultdict(float)
    launches: dict[tuple[str, str], int] = defaultdict(int)
    for event in events:
        items = timed_items(event, on_device)
        if not items:
            continue
        context = context_group(event, numbers)
        for name, us in items:
            group = context or name_group(name)
            by_group[group] += us
            by_kernel[(name, group)] += us
            launches[(name, group)] += 1
    total_us = sum(by_group.values())
    per_step = max(steps, 1) * 1e3
    busiest = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]
    result = {
        "time_kind": "device kernels" if on_device else "host op self time (CPU: indicative only)",
        "steps": steps,
        "wall_ms_per_step": wall_s * 1e3 / max(steps, 1),
        "kernel_ms_per_step": total_us / per_step,
        "groups_ms_per_step": {g: by_group.get(g, 0.0) / per_step for g in GROUPS},
        "groups_share": {g: by_group.get(g, 0.0) / total_us if total_us else 0.0 for g in GROUPS},
        "top_kernels": [
            {"name": n[:160], "group": g, "ms_per_step": us / per_step, "launches_per_step": launches[n, g] / max(steps, 1)}
            for (n, g), us in busiest
        ],
    }
    if on_device:
        result["device_idle_share"] = max(0.0, 1.0 - total_us / 1e6 / wall_s) if wall_s > 0 else None
    return result


def unattributed_kernels(device_us: dict[str, float], breakdown: dict, *, steps: int, min_ms: float = 0.05) -> list[dict]:
    """Kernels the device ran for longer than the breakdown (:func:`kernel_breakdown`) credits them: those the
    profiler linked to no host op, so no group holds them. ``device_us``: kernel name -> microseconds over the
    profiled steps, from the device's own records (:func:`device_kernel_us`); ``breakdown``'s ``top_kernels`` must
    list every kernel (``top`` at least their number). Per step, names cut as the breakdown cuts them."""
    credited: dict[str, float] = defaultdict(float)
    for kernel in breakdown["top_kernels"]:
        credited[kernel["name"]] += kernel["ms_per_step"]
    per_step = max(steps, 1) * 1e3
    missing = []
    for name, us in device_us.items():
        ms = us / per_step - credited.get(name[:160], 0.0)
        if ms >= min_ms:
            missing.append({"name": name[:160], "ms_per_step": ms})
    return sorted(missing, key=lambda k: -k["ms_per_step"])


def with_unattributed(breakdown: dict, missing: list[dict]) -> dict[str, float]:
    """``breakdown``'s per-step milliseconds by group with the kernels no group holds (:func:`unattributed_kernels`)
    added to the group their names give: the groups then add up to the device's own kernel time."""
    groups = dict(breakdown["groups_ms_per_step"])
    for kernel in missing:
        groups[name_group(kernel["name"])] += kernel["ms_per_step"]
    return groups


def device_kernel_us(prof) -> dict[str, float]:
    """Kernel name -> microseconds of every device activity (kernels, copies, memsets) a finished
    ``torch.profiler.profile`` recorded; the device-side spans of ``record_function`` ranges are not kernels."""
    from torch.autograd import DeviceType

    totals: dict[str, float] = defaultdict(float)
    for event in prof.profiler.kineto_results.events():
        if event.device_type() == DeviceType.CUDA and not event.is_user_annotation():
            totals[event.name()] += (event.end_ns() - event.start_ns()) / 1e3
    return dict(totals)


def profile_calls(fn: Callable[[], object], calls: int, on_device: bool) -> dict:
    """:func:`kernel_breakdown` of ``calls`` calls of ``fn`` under the profiler (its per-step figures are per call);
    the caller warms ``fn`` up first."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_device else [])
    if on_device:
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if on_device:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return kernel_breakdown(prof.events(), on_device=on_device, steps=calls, wall_s=wall)
