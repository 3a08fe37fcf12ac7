"""Serving latency of a student value model: p50/p95/p99 per serving form and candidate count, one CPU thread.

Each request is a full :meth:`value_models.serving.Scorer.score` call (validation, embedding-store
lookups, feature gathering, the forward pass and the sigmoid), after ``--warmup`` requests. Forms
(:data:`value_models.serving.FORMS`): plain eager (autograd recording), ``inference_mode``, TorchScript
(scripted + frozen) and ``torch.compile`` (dynamic shapes). Each form is first checked against eager on
real requests of every size; the fastest that passes (by p99 at ``--target-candidates``) is the one to serve.

Wall-clock percentiles are what a caller sees; on a shared machine they include time the thread spent
descheduled, so the table also gives percentiles of the thread's CPU time (``cpu_p99_ms``), the cost on
one dedicated thread.

Run it as ``gem bench-serving`` or ``python -m experiments.bench_serving`` (same arguments).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from value_models.serving import (
    FORMS,
    LatencyBudget,
    Scorer,
    ServingConfig,
    build_form,
    check_equivalence,
    example_inputs,
    load_student,
    measure_latency,
)

TARGET_P99_MS = LatencyBudget().p99_ms


def run_bench(
    ckpt: str | Path,
    store: str | Path,
    *,
    candidates: tuple[int, ...] = (64, 256, 1024),
    forms: tuple[str, ...] = FORMS,
    iters: int = 500,
    warmup: int = 100,
    target_candidates: int = 256,
) -> dict:
    """The latency table (module doc): ``{"rows": [...], "serve": form, "equivalence": {...}, "meets_target"}``."""
    torch.set_num_threads(1)
    cfg = ServingConfig(
        budget=LatencyBudget(max_candidates=max(candidates), p99_ms=TARGET_P99_MS), follow_latest=False
    )
    scorer = Scorer(load_student(ckpt), store, cfg)
    examples = [example_inputs(scorer, n, seed=s) for s, n in enumerate((1, *candidates))]
    eager = build_form(scorer.module, "eager", examples[0])
    rows, equivalence = [], {}
    for form in forms:
        t0 = time.perf_counter()
        try:
            scorer.set_form(form)
            equivalence[form] = {
                "max_abs_diff": check_equivalence(scorer.runner, eager, examples),
                "passed": True,
            }
        except Exception as exc:  # a form that fails to build or to match is reported, not served
            equivalence[form] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        equivalence[form]["build_s"] = time.perf_counter() - t0
        for n in candidates:
            rows.append({"form": form, **measure_latency(scorer, n, iters=iters, warmup=warmup)})
            print(json.dumps(rows[-1]), flush=True)
    at_target = [r for r in rows if r["candidates"] == target_candidates]
    serve = min(at_target, key=lambda r: r["p99_ms"])["form"] if at_target else None
    best = min((r["p99_ms"] for r in at_target), default=float("inf"))
    return {
        "checkpoint": str(ckpt),
        "store": str(store),
        "store_version": scorer.version,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "equivalence": equivalence,
        "serve": serve,
        "target": {"candidates": target_candidates, "p99_ms": TARGET_P99_MS},
        "meets_target": best <= TARGET_P99_MS,
    }


def format_table(result: dict) -> str:
    """A markdown table of the rows, the served form marked."""
    lines = [
        "| form | candidates | p50 ms | p95 ms | p99 ms | CPU p50 ms | CPU p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        mark = " (served)" if r["form"] == result["serve"] else ""
        lines.append(
            f"| {r['form']}{mark} | {r['candidates']} | {r['p50_ms']:.3f} | {r['p95_ms']:.3f} | {r['p99_ms']:.3f} "
            f"| {r['cpu_p50_ms']:.3f} | {r['cpu_p99_ms']:.3f} |"
        )
    return "\n".join(lines)
