"""The GPU's idle gaps in a profiled window and what the host was doing in them (experiments/device_timeline.py)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from experiments.device_timeline import (
    Span,
    busy_intervals,
    format_timeline,
    idle_gaps,
    innermost_covering,
    profiler_spans,
    summarize_timeline,
)

# Two steps on one stream: a kernel, a gap while the host looks up, two kernels back to back (one launched by
# a graph launch), a long gap while the host waits in `aten::item`, a copy, and a sub-threshold gap.
DEVICE = [
    Span(0, 10, "k_embed", 1),
    Span(30, 40, "k_graph_a", 2),
    Span(38, 50, "k_graph_b", 2),
    Span(100, 110, "Memcpy HtoD", 3),
    Span(111, 120, "k_tail", 4),
]
HOST = [
    Span(0, 200, "train_step"),
    Span(12, 29, "look_up"),
    Span(5, 31, "static_step"),
    Span(45, 101, "aten::item"),
    Span(97, 99.5, "aten::copy_"),
]
RUNTIME = [
    Span(1, 2, "cudaLaunchKernel", 1),
    Span(29, 30, "cudaGraphLaunch", 2),
    Span(98, 99, "cudaMemcpyAsync", 3),
    Span(110, 110.5, "cudaLaunchKernel", 4),
]


def test_busy_intervals_merge_overlapping_and_touching_activity():
    merged = busy_intervals([*DEVICE, Span(50, 55, "k_touching", 5)])
    assert [(start, end) for start, end, _, _ in merged] == [(0, 10), (30, 55), (100, 110), (111, 120)]
    assert merged[1][2].name == "k_graph_a" and merged[1][3].name == "k_touching"


def test_innermost_covering_picks_the_shortest_span_holding_the_whole_query():
    found = innermost_covering(HOST, [(50, 100), (10, 30), (13, 20), (98, 99), (150, 250)])
    assert [s.name if s else None for s in found] == ["aten::item", "static_step", "look_up", "aten::copy_", None]


def test_idle_gaps_name_what_the_device_waited_for():
    gaps = idle_gaps(DEVICE, HOST, RUNTIME, min_gap_us=2.0)
    assert [(g["start_us"], g["us"]) for g in gaps] == [(10, 20), (50, 50)]  # the 1 us gap is below the threshold
    first, second = gaps
    assert (first["before"], first["after"], first["host"]) == ("k_embed", "k_graph_a", "static_step")
    assert (first["launch"], first["launched_in"]) == ("cudaGraphLaunch", "static_step")
    assert (second["before"], second["after"], second["host"]) == ("k_graph_b", "Memcpy HtoD", "aten::item")
    assert (second["launch"], second["launched_in"]) == ("cudaMemcpyAsync", "aten::copy_")


def test_summary_is_per_step_and_ranks_the_idle_time():
    summary = summarize_timeline(DEVICE, HOST, RUNTIME, steps=2, top=5, min_gap_us=0.5)
    assert summary["window_ms_per_step"] == pytest.approx(0.060)
    assert summary["busy_ms_per_step"] == pytest.approx(0.0245)  # 10 + 20 + 10 + 9 us over 2 steps
    assert summary["idle_ms_per_step"] == pytest.approx(0.0355)
    assert summary["busy_share"] == pytest.approx(49 / 120)
    assert list(summary["idle_by_host"]) == ["aten::item", "static_step", "train_step"]
    assert summary["idle_by_host"]["aten::item"] == pytest.approx(0.025)  # 50 us over 2 steps
    assert list(summary["idle_by_launch"]) == [
        "cudaMemcpyAsync in aten::copy_", "cudaGraphLaunch in static_step", "cudaLaunchKernel in train_step"
    ]
    assert [g["us"] for g in summary["longest_gaps"]] == [50, 20, 1]
    text = format_timeline(summary)
    assert "idle 0.04 in 1.5 gaps/step" in text and "'aten::item'" in text


def test_a_cpu_profile_has_host_ops_and_no_device_activity():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        a = torch.randn(64, 64)
        (a @ a).sum()
    device, host, runtime = profiler_spans(prof)
    assert device == [] and runtime == [] and any(s.name == "aten::mm" for s in host)
    assert all(s.end >= s.start >= 0 for s in host)
    summary = summarize_timeline(device, host, runtime, steps=1)
    assert summary == {"steps": 1, "device_activity": False}
    assert format_timeline(summary) == "timeline: no device activity (a CPU run)"
