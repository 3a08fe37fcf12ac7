"""Where a window of profiled training steps leaves the GPU idle, and what the host was doing meanwhile.

:func:`experiments.kernel_groups.kernel_breakdown` says how much kernel time a step takes by group; this says how
the rest of the step's wall time is lost. From one ``torch.profiler`` trace of steps run as training runs them
(each enqueued before the previous one is waited for), the device's activity (kernels, copies, fills: one stream
assumed) is merged into busy intervals, and each gap between them is charged to

- ``host``: the innermost host op that spans the whole gap (what the GPU waited for, e.g. a lookup that syncs,
  the batch's preparation, ``aten::item``), and
- ``launch``: the runtime call that launched the activity after the gap (``cudaGraphLaunch``,
  ``cudaLaunchKernel``, ``cudaMemcpyAsync``) and the innermost host op around that call.

Times are microseconds on the profiler's clock; the summary is per step, in milliseconds.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """An interval of activity: ``[start, end)`` microseconds, a name and (device activity and the runtime calls
    that launch it) the profiler's correlation id, -1 where there is none."""

    start: float
    end: float
    name: str
    correlation: int = -1


def busy_intervals(device: list[Span]) -> list[tuple[float, float, Span, Span]]:
    """Device spans merged where they overlap or touch: ``(start, end, first span, last-ending span)``."""
    merged: list[list] = []
    for span in sorted(device, key=lambda s: (s.start, s.end)):
        if merged and span.start <= merged[-1][1]:
            if span.end > merged[-1][1]:
                merged[-1][1], merged[-1][3] = span.end, span
        else:
            merged.append([span.start, span.end, span, span])
    return [tuple(m) for m in merged]


def innermost_covering(host: list[Span], queries: list[tuple[float, float]]) -> list[Span | None]:
    """For each ``(start, end)`` query, the shortest host span containing it, or None. One sweep over the spans
    by start time: the spans open at a time are those of its call stacks (one per thread), few."""
    spans = sorted(host, key=lambda s: s.start)
    found: list[Span | None] = [None] * len(queries)
    open_spans: list[Span] = []
    i = 0
    for q in sorted(range(len(queries)), key=lambda k: queries[k][0]):
        start, end = queries[q]
        while i < len(spans) and spans[i].start <= start:
            open_spans.append(spans[i])
            i += 1
        open_spans = [span for span in open_spans if span.end >= start]
        covering = [span for span in open_spans if span.end >= end]
        found[q] = min(covering, key=lambda s: s.end - s.start, default=None)
    return found


def idle_gaps(device: list[Span], host: list[Span], runtime: list[Span], min_gap_us: float = 2.0) -> list[dict]:
    """The gaps of at least ``min_gap_us`` between busy intervals, each with the device activity before and after
    it and what the host was doing (module docstring). ``runtime``: the host's runtime calls (launches, copies,
    syncs), matched to device activity by correlation id."""
    launches = {span.correlation: span for span in runtime if span.correlation >= 0}
    busy = busy_intervals(device)
    pairs = [(prev, nxt) for prev, nxt in itertools.pairwise(busy) if nxt[0] - prev[1] >= min_gap_us]
    launched = [launches.get(nxt[2].correlation) for _, nxt in pairs]
    during = innermost_covering(host, [(prev[1], nxt[0]) for prev, nxt in pairs])
    found = [launch for launch in launched if launch is not None]
    outers = dict(zip(map(id, found), innermost_covering(host, [(s.start, s.end) for s in found]), strict=True))
    around = [outers.get(id(launch)) for launch in launched]
    return [
        {
            "start_us": prev[1], "us": nxt[0] - prev[1], "before": prev[3].name, "after": nxt[2].name,
            "host": host_op.name if host_op is not None else None,
            "launch": launch.name if launch is not None else None,
            "launched_in": outer.name if outer is not None else None,
        }
        for (prev, nxt), launch, host_op, outer in zip(pairs, launched, during, around, strict=True)
    ]


def summarize_timeline(device: list[Span], host: list[Span], runtime: list[Span], *, steps: int, top: int = 10,
                       min_gap_us: float = 2.0) -> dict:
    """Per step: the window from the first device activity to the last, the time the device was busy in it and
    idle, the idle time by the host op it waited in (``idle_by_host``) and by what launched the next activity
    (``idle_by_launch``), and the ``top`` longest gaps."""
    if not device:
        return {"steps": steps, "device_activity": False}
    busy = busy_intervals(device)
    window = busy[-1][1] - busy[0][0]
    busy_us = sum(end - start for start, end, _, _ in busy)
    gaps = idle_gaps(device, host, runtime, min_gap_us)
    by_host: dict[str, float] = defaultdict(float)
    by_launch: dict[str, float] = defaultdict(float)
    for gap in gaps:
        by_host[gap["host"] or "(no host op)"] += gap["us"]
        by_launch[f"{gap['launch']} in {gap['launched_in']}"] += gap["us"]
    per_step = 1e3 * max(steps, 1)

    def ranked(table: dict[str, float]) -> dict[str, float]:
        return {name: us / per_step for name, us in sorted(table.items(), key=lambda kv: -kv[1])[:top]}

    origin = busy[0][0]
    return {
        "steps": steps,
        "device_activity": True,
        "window_ms_per_step": window / per_step,
        "busy_ms_per_step": busy_us / per_step,
        "idle_ms_per_step": (window - busy_us) / per_step,
        "busy_share": busy_us / window if window > 0 else 0.0,
        "gaps_per_step": len(gaps) / max(steps, 1),
        "idle_by_host": ranked(by_host),
        "idle_by_launch": ranked(by_launch),
        "longest_gaps": [
            {**gap, "start_us": gap["start_us"] - origin}
            for gap in sorted(gaps, key=lambda g: -g["us"])[:top]
        ],
    }


def profiler_spans(prof) -> tuple[list[Span], list[Span], list[Span]]:
    """``(device, host ops, runtime calls)`` of a finished ``torch.profiler.profile``, from its Kineto events.
    Runtime calls are the host events named ``cuda*`` (the CUDA runtime and driver); host ops the others."""
    from torch.autograd import DeviceType

    origin = prof.profiler.kineto_results.trace_start_ns()
    device, host, runtime = [], [], []
    for event in prof.profiler.kineto_results.events():
        span = Span((event.start_ns() - origin) / 1e3, (event.end_ns() - origin) / 1e3, event.name(),
                    event.correlation_id())
        if event.device_type() == DeviceType.CUDA:
            device.append(span)
        elif event.name().startswith("cuda"):
            runtime.append(span)
        else:
            host.append(span)
    return device, host, runtime


def format_timeline(summary: dict) -> str:
    if not summary.get("device_activity"):
        return "timeline: no device activity (a CPU run)"
    lines = [
        f"timeline over {summary['steps']} steps: window {summary['window_ms_per_step']:.2f} ms/step, device busy "
        f"{summary['busy_ms_per_step']:.2f} ({100 * summary['busy_share']:.1f}%), idle {summary['idle_ms_per_step']:.2f} "
        f"in {summary['gaps_per_step']:.1f} gaps/step",
        "  idle by the host op it waited in (ms/step): "
        + ", ".join(f"{name[:60]} {ms:.2f}" for name, ms in summary["idle_by_host"].items()),
        "  idle by the launch that ended it (ms/step): "
        + ", ".join(f"{name[:80]} {ms:.2f}" for name, ms in summary["idle_by_launch"].items()),
    ]
    for gap in summary["longest_gaps"]:
        lines.append(
            f"  gap {gap['us']:8.1f} us at {gap['start_us'] / 1e3:8.2f} ms: after {gap['before'][:40]!r}, before "
            f"{gap['after'][:40]!r}; host in {gap['host']!r}; launched by {gap['launch']!r} in {gap['launched_in']!r}"
        )
    return "\n".join(lines)
