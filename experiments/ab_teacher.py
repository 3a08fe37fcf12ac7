"""This tree against another copy of the repository on the teacher's training step: ``bench_teacher`` runs
alternated between the two, with the step times, MFU and loss differences side by side.

Usage::

    mkdir /tmp/base && git archive BASE_COMMIT | tar -x -C /tmp/base     # a copy of the tree to compare against
    python -m experiments.ab_teacher --base /tmp/base --lengths 512 4096 --pairs 2 --json ab.json -- dropout=0.0

Each run is ``python -m experiments.bench_teacher`` started in its tree (``PYTHONPATH`` that tree) with the same
arguments (:data:`BENCH_ARGS`, or ``--bench-args``), ``--max-history`` the length and ``--bucketed`` its row counts
(:data:`BUCKETS`), the overrides after ``--`` last; each tree compiles into a Triton cache of its own, so neither
reuses the other's kernels. Pair ``i`` runs the base first when ``i`` is even and this tree first when it is odd, so
that a drift of the clocks or the machine falls on both. Per length: every run's median step and MFU
(``steady_no_outliers_mfu``, as docs/benchmarks.md reports them), each tree's median over its runs and the change,
and the loss differences over the same batches: this tree against the base pair by pair, and each tree's later
runs against its first (the noise the first figure is read against). ``--budget`` skips the runs that would start
after that many seconds (a device call's limit); ``--record`` appends this tree's runs to a results table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.bench_teacher import compare_losses
from foundation.data.io import atomic_write_text

BENCH_ARGS = ("--flavor large --data /tmp/world --examples 80000 --workers 4 --cuda-graphs --overlap-steps "
              "--token-budget 16384 --steps 60 --time-limit 9")
# The row buckets the docs' runs pad each length's batches to.
BUCKETS = {512: "64,72", 4096: "64,128"}
REPO = Path(__file__).resolve().parents[1]


def run_order(pairs: int) -> list[tuple[int, str]]:
    """``(pair, tree)`` in the order they run: base first in even pairs, this tree first in odd ones."""
    order = []
    for pair in range(pairs):
        trees = ("base", "this") if pair % 2 == 0 else ("this", "base")
        order.extend((pair, tree) for tree in trees)
    return order


def bench_command(length: int, json_path: Path, bench_args: list[str], overrides: list[str],
                  extra: list[str]) -> list[str]:
    buckets = ["--bucketed", BUCKETS[length]] if length in BUCKETS else []
    return [sys.executable, "-m", "experiments.bench_teacher", *bench_args, "--max-history", str(length), *buckets,
            "--json", str(json_path), *extra, *overrides]


def run_one(tree: Path, command: list[str], cache: Path, timeout: float) -> tuple[int, str]:
    """Runs ``command`` in ``tree``; ``(return code, the output's tail)``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               TRITON_CACHE_DIR=str(cache))
    try:
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    return done.returncode, (done.stdout + done.stderr)[-2000:]


def summarize_length(runs: list[dict]) -> dict:
    """Each tree's median step over its runs, the change, and the loss differences (module doc)."""
    done = [r for r in runs if r.get("step_ms_median") is not None]
    by_tree = {t: [r for r in done if r["tree"] == t] for t in ("base", "this")}
    medians = {t: statistics.median(r["step_ms_median"] for r in rs) if rs else None for t, rs in by_tree.items()}
    change = (medians["this"] / medians["base"] - 1) if medians["base"] and medians["this"] else None
    against_base = []
    for run in by_tree["this"]:
        partner = next((r for r in by_tree["base"] if r["pair"] == run["pair"]), None)
        if partner is not None:
            against_base.append(_loss_diff(run, partner))
    noise = {t: [_loss_diff(r, rs[0]) for r in rs[1:]] for t, rs in by_tree.items()}
    return {"median_step_ms": medians, "change": change, "loss_vs_base": against_base, "loss_noise": noise}


def _loss_diff(run: dict, reference: dict) -> dict:
    trace = json.loads(Path(run["json"]).read_text())["trace"]
    diff = compare_losses(trace, reference["json"])
    return {k: diff[k] for k in ("steps", "same_batches", "mean_abs_diff", "max_abs_diff")}


def format_length(length: int, runs: list[dict], summary: dict) -> str:
    lines = [f"{length} events:"]
    for r in runs:
        if r.get("step_ms_median") is None:
            lines.append(f"  pair {r['pair']} {r['tree']:4s}: {r['status']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        lines.append(f"  pair {r['pair']} {r['tree']:4s}: median step {r['step_ms_median']:.2f} ms, MFU {mfu}, "
                     f"first step {r['first_step_after_build_s']:.1f} s after build")
    med = summary["median_step_ms"]
    if summary["change"] is not None:
        lines.append(f"  median of medians: base {med['base']:.2f} ms, this {med['this']:.2f} ms "
                     f"({100 * summary['change']:+.1f}%)")
    for name, diffs in (("this vs base", summary["loss_vs_base"]), ("base vs base", summary["loss_noise"]["base"]),
                        ("this vs this", summary["loss_noise"]["this"])):
        if diffs:
            text = ", ".join(f"{d['mean_abs_diff']:.3f} / {d['max_abs_diff']:.3f}" for d in diffs)
            lines.append(f"  losses {name} (mean / largest |diff|): {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, type=Path, help="the other copy of the repository")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096], help="--max-history of each run")
    parser.add_argument("--pairs", type=int, default=2, help="runs per tree and length")
    parser.add_argument("--bench-args", default=BENCH_ARGS, help="bench_teacher's arguments, as one string")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    parser.add_argument("--budget", type=float, default=None, help="start no run after this many seconds")
    parser.add_argument("--cache", type=Path, default=None, help="Triton caches go in DIR/base and DIR/this")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--record", default=None, help="append this tree's runs to this results table")
    parser.add_argument("--record-label", default=None)
    args = parser.parse_args(argv)
    base = args.base.resolve()
    if not (base / "experiments" / "bench_teacher.py").is_file():
        raise SystemExit(f"--base {base}: not a copy of the repository (no experiments/bench_teacher.py)")
    trees = {"base": base, "this": REPO}
    work = Path(tempfile.mkdtemp(prefix="ab_teacher_"))
    cache = args.cache or work / "triton"
    bench_args = shlex.split(args.bench_args)
    start = time.monotonic()
    result = {"base": str(base), "this": str(REPO), "bench_args": bench_args, "overrides": overrides, "lengths": {}}
    for length in args.lengths:
        runs = []
        for pair, tree in run_order(args.pairs):
            run = {"tree": tree, "pair": pair, "json": str(work / f"{tree}_{length}_{pair}.json")}
            runs.append(run)
            if args.budget is not None and time.monotonic() - start > args.budget:
                run["status"] = f"skipped: {time.monotonic() - start:.0f} s past the start"
                continue
            record = ["--record", args.record, *(["--record-label", args.record_label] if args.record_label else [])]
            extra = record if args.record and tree == "this" else []
            command = bench_command(length, Path(run["json"]), bench_args, overrides, extra)
            code, tail = run_one(trees[tree], command, cache / tree, args.timeout)
            if code != 0:
                run["status"] = f"failed ({code}): {tail.strip().splitlines()[-1] if tail.strip() else ''}"
                continue
            out = json.loads(Path(run["json"]).read_text())
            run.update(status="done", step_ms_median=out["step_ms_median"], mfu=out.get("steady_no_outliers_mfu"),
                       first_step_after_build_s=out["first_step_from_build_s"])
            print(f"{length} pair {pair} {tree}: {out['step_ms_median']:.2f} ms", flush=True)
        summary = summarize_length(runs)
        result["lengths"][str(length)] = {"runs": runs, **summary}
        print(format_length(length, runs, summary), flush=True)
        if args.json:
            atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
