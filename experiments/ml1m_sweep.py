"""Many ML-1M runs at once on one GPU machine: prepare the datasets once, run :mod:`experiments.ml1m_hstu`
processes concurrently, each within a time budget, and summarise every run and every group of seeds.

Usage (from the repository root; ``--raw`` holds ``sequences.tsv`` and ``ratings-users-0001-2999.dat.gz``)::

    python -m experiments.ml1m_sweep run --raw .mldata --out /tmp/sweep --plan calibration --seeds 0,1,2
    python -m experiments.ml1m_sweep run --raw .mldata --out /tmp/sweep --plan timebias --plan suspects
    python -m experiments.ml1m_sweep run --raw .mldata --out /tmp/sweep --plan reference --parallel 21
    python -m experiments.ml1m_sweep run --raw ... --runs my_runs.json          # runs of your own
    python -m experiments.ml1m_sweep merge /tmp/sweep/summary.json docs/results/ml1m.json

Datasets (``data`` of a run), converted with the HSTU protocol into ``<out>/datasets/<name>``:

- ``sequences``: ``sequences.tsv``, all 6,040 users, event positions as timestamps;
- ``ratings``: ``ratings-users-0001-2999.dat.gz`` (users 1-2999, real timestamps) with
  ``ties="sequence"``: events that share a timestamp follow ``sequences.tsv``, so order and
  leave-one-out targets are those of ``sequences.tsv`` and only the timestamps differ;
- ``sequences-one-shard``: ``sequences.tsv`` in one shard of one row group. ``sequences`` has two shards
  (4,096 + 1,944 users); with ``--shuffle-window 1`` (every run before 2026-12-01's reference sweep) an
  epoch shuffles the two and the users inside each, so every batch but one holds users of one shard, and
  only this dataset gives every epoch one permutation of all users (the reference's sampler). The
  sweep's runs now shuffle all row groups together (``experiments.ml1m_hstu --shuffle-window 0``, the
  default since that sweep), which makes the two datasets train alike.

Plans (``--plan``, repeatable; each run once per ``--seeds`` seed):

- ``calibration``: ``sasrec``, ``ml1m_hstu``, ``ml1m_hstu_large`` on ``sequences``;
- ``timebias`` / ``timebias-large``: ``ml1m_hstu`` / ``ml1m_hstu_large`` on ``ratings``, target-time
  bias (the default) against ``query_time=event`` (the old bias);
- ``suspects``: ``ml1m_hstu`` on ``sequences``, one switch at a time: ``attention_norm=211`` (the
  reference's fixed N) and ``attention_norm=row``, the exact sigmoid (``GEM_KERNELS_FAST_SIGMOID=0``),
  ``negative_pool=used``. Their baseline is ``calibration``'s ``ml1m_hstu`` at the same seeds (add
  ``--plan calibration`` to run it in the same sweep). Test at the best valid epoch needs no run of
  its own: every run reports it.
- ``reference``: ``ml1m_hstu`` with the reference HSTU's behaviour one difference at a time
  (``docs/ml1m_reference_diff.md``): the default and each of :data:`REFERENCE_SWITCHES` on ``sequences``,
  the default on ``sequences-one-shard``, and every difference at once (:data:`ALL_REFERENCE` on
  ``sequences-one-shard``): 7 groups, 21 runs at 3 seeds;
- ``reference-large``: ``ml1m_hstu_large``: the default and ``rel_bias=shared`` (which only matters with
  several heads) on ``sequences``, :data:`ALL_REFERENCE` on ``sequences-one-shard``: 9 runs at 3 seeds.
- ``position-window``: ``ml1m_hstu_large`` and ``ml1m_hstu`` on ``ratings``, the full position table against
  ``position_window=32`` (exact distances up to 31, one bucket for the farther ones).
- ``realtime``: real against positional time, paired: ``ml1m_hstu`` and ``ml1m_hstu_large`` on ``ratings`` and on
  ``sequences``; run with ``--users 2999`` so that both arms hold the same users, sequences and targets (only the
  times differ). ``realtime-more``: its controls, ``sasrec`` on both arms (it reads no time) and
  ``ml1m_hstu_large`` on ``ratings`` without the time bias (``time_buckets=0``).

``--runs FILE`` adds runs from a JSON list of ``{"flavor", "seed", "data", "overrides": [...],
"env": {...}}`` (``data``, ``overrides`` and ``env`` optional).

Every run is a process with ``OMP_NUM_THREADS=1`` (the runs are host-bound: one core each) and
``GEM_KERNELS_AUTOTUNE=0`` unless ``--env`` says otherwise (concurrent runs would each autotune every
new batch shape against each other's load). At most ``--parallel`` run at once, the slowest flavors
first; a run is killed ``--grace`` seconds after its ``--time-budget`` (the script itself stops at the
budget after a last evaluation). Its output goes to ``<out>/runs/<name>/log.txt``.

``<out>/summary.json`` (rewritten as runs finish) holds ``rows``, one per (flavor, data, variant)
over its seeds in the format of ``docs/results/ml1m.json`` (``flavor``, ``data``, ``seeds``,
``hr@10_mean``, ``hr@10_std``, ``ndcg@10_mean``, ``command``, ``date``: test metrics of the last
epoch, plus ``variant``, ``ndcg@10_std``, ``epochs`` and ``best_valid``, the test at the epoch with the
best valid NDCG@10), and ``runs``, one per run. A short table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.ml1m_hstu import TARGETS
from foundation.data.converters import STATS_FILE, convert
from foundation.data.io import atomic_path, atomic_write_text
from foundation.data.schema import SCHEMA_FILE

SEQUENCES = "sequences.tsv"
RATINGS = "ratings-users-0001-2999.dat.gz"
ONE_SHARD = "sequences-one-shard"
DATASETS = {"sequences": SEQUENCES, "ratings": f"{RATINGS} (ties=sequence)", ONE_SHARD: f"{SEQUENCES} (one shard)"}
# Users in the one shard of ONE_SHARD: also the converter's Parquet row group (write_table's 8,192 rows).
ONE_SHARD_ROWS = 8192
# The slowest flavors start first so that the sweep ends with the short runs filling the gaps.
FLAVOR_COST = {"ml1m_hstu_large": 3, "sasrec": 1, "ml1m_hstu": 1}
DEFAULT_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GEM_KERNELS_AUTOTUNE": "0"}
METRICS = ("hr10", "ndcg10", "hr50", "hr200", "ndcg200", "mrr")
SELECT = "ndcg10"


@dataclass(frozen=True)
class RunSpec:
    """One training process: a flavor on a dataset with overrides and environment, at one seed."""

    flavor: str
    seed: int
    data: str = "sequences"
    overrides: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def variant(self) -> str:
        parts = [*self.overrides, *(f"{k}={v}" for k, v in self.env)]
        return " ".join(parts) or "default"

    @property
    def name(self) -> str:
        tag = "_".join(p.replace("=", "-") for p in self.variant.split()) if self.overrides or self.env else "default"
        return f"{self.flavor}.{self.data}.{tag}.s{self.seed}"

    @classmethod
    def from_dict(cls, d: dict, where: str) -> RunSpec:
        unknown = set(d) - {"flavor", "seed", "data", "overrides", "env"}
        if unknown or "flavor" not in d or "seed" not in d:
            raise ValueError(f"{where}: a run needs flavor and seed (optional data, overrides, env); got {sorted(d)}")
        return cls(
            flavor=str(d["flavor"]),
            seed=int(d["seed"]),
            data=str(d.get("data", "sequences")),
            overrides=tuple(str(o) for o in d.get("overrides", ())),
            env=tuple(sorted((str(k), str(v)) for k, v in d.get("env", {}).items())),
        )


# The reference HSTU's behaviour where ours differs, one switch each (docs/ml1m_reference_diff.md).
REFERENCE_SWITCHES = ("block_norm=plain", "block_init=reference", "uvqk_bias=false", "embedding_init=reference")
# Every difference a switch reaches at once: those four, bias tables shared by the heads (a no-op with one
# head), the reference's normaliser 1/211 and its exact sigmoid; its runs read ONE_SHARD (the reference's
# shuffle of all users).
ALL_REFERENCE = (
    (*REFERENCE_SWITCHES, "rel_bias=shared", "attention_norm=211"),
    {"GEM_KERNELS_FAST_SIGMOID": "0"},
)


def _variants(flavor: str, data: str, variants: list[tuple[tuple[str, ...], dict]], seeds: list[int]) -> list[RunSpec]:
    return [
        RunSpec(flavor, seed, data, overrides, tuple(sorted(env.items())))
        for overrides, env in variants
        for seed in seeds
    ]


def plan_runs(plan: str, seeds: list[int]) -> list[RunSpec]:
    """The runs of a named plan (module docstring)."""
    if plan == "calibration":
        return [RunSpec(flavor, seed) for flavor in ("sasrec", "ml1m_hstu", "ml1m_hstu_large") for seed in seeds]
    if plan in ("timebias", "timebias-large"):
        flavor = "ml1m_hstu_large" if plan == "timebias-large" else "ml1m_hstu"
        return _variants(flavor, "ratings", [((), {}), (("query_time=event",), {})], seeds)
    if plan == "suspects":
        switches = [
            (("attention_norm=211",), {}),
            (("attention_norm=row",), {}),
            ((), {"GEM_KERNELS_FAST_SIGMOID": "0"}),
            (("negative_pool=used",), {}),
        ]
        return _variants("ml1m_hstu", "sequences", switches, seeds)
    if plan == "reference":
        switches = [((), {}), *(((switch,), {}) for switch in REFERENCE_SWITCHES)]
        return _variants("ml1m_hstu", "sequences", switches, seeds) + _variants(
            "ml1m_hstu", ONE_SHARD, [((), {}), ALL_REFERENCE], seeds
        )
    if plan == "reference-large":
        return _variants("ml1m_hstu_large", "sequences", [((), {}), (("rel_bias=shared",), {})], seeds) + _variants(
            "ml1m_hstu_large", ONE_SHARD, [ALL_REFERENCE], seeds
        )
    if plan == "realtime":
        return [RunSpec(flavor, seed, data) for flavor in ("ml1m_hstu_large", "ml1m_hstu")
                for data in ("ratings", "sequences") for seed in seeds]
    if plan == "realtime-more":
        return [RunSpec("sasrec", seed, data) for data in ("ratings", "sequences") for seed in seeds] + _variants(
            "ml1m_hstu_large", "ratings", [(("time_buckets=0",), {})], seeds
        )
    if plan == "position-window":
        window = [((), {}), (("position_window=32",), {})]
        return _variants("ml1m_hstu_large", "ratings", window, seeds) + _variants("ml1m_hstu", "ratings", window, seeds)
    raise ValueError(f"unknown plan {plan!r}; choose one of {PLANS}")


PLANS = ("calibration", "timebias", "timebias-large", "suspects", "reference", "reference-large", "realtime",
         "realtime-more", "position-window")


def load_runs(path: Path) -> list[RunSpec]:
    try:
        items = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON list of runs")
    return [RunSpec.from_dict(item, f"{path}: run {i}") for i, item in enumerate(items)]


def check_runs(runs: list[RunSpec]) -> None:
    """Unknown flavors or datasets, or two runs with one name, fail before anything starts."""
    for run in runs:
        if run.flavor not in TARGETS:
            raise ValueError(f"run {run.name}: unknown flavor {run.flavor!r}; choose one of {sorted(TARGETS)}")
        if run.data not in DATASETS:
            raise ValueError(f"run {run.name}: unknown data {run.data!r}; choose one of {sorted(DATASETS)}")
    names = [run.name for run in runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"runs listed twice: {duplicates}")


# -- datasets -----------------------------------------------------------------------------------------


def first_users(raw: Path, out: Path, users: int) -> Path:
    """Copies of ``raw``'s two files restricted to the first ``users`` users of ``sequences.tsv`` (dry runs)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(raw / SEQUENCES) as f:
        lines = [line for _, line in zip(range(users), f, strict=False)]
    atomic_write_text(out / SEQUENCES, "".join(lines))
    keep = {line.split("\t", 1)[0] for line in lines}
    if (raw / RATINGS).is_file():
        with gzip.open(raw / RATINGS, "rt") as f:
            kept = [line for line in f if line.split("::", 1)[0] in keep]
        with atomic_path(out / RATINGS) as tmp:
            tmp.write_bytes(gzip.compress("".join(kept).encode()))
    return out


def prepare_dataset(name: str, raw: Path, out: Path) -> Path:
    """``<out>/datasets/<name>``, converted once from the raw files (module docstring)."""
    target = out / "datasets" / name
    source = raw / (RATINGS if name == "ratings" else SEQUENCES)
    if (target / SCHEMA_FILE).is_file():
        converted_from = json.loads((target / STATS_FILE).read_text())["source"]
        if converted_from != str(source):
            raise ValueError(f"{target} was converted from {converted_from}, not {source}: use another --out")
        return target
    if name == "ratings":
        convert(
            "movielens-dat", raw / RATINGS, target, protocol="hstu", ties="sequence", ties_reference=raw / SEQUENCES
        )
    elif name == ONE_SHARD:
        with open(source) as f:
            users = sum(1 for line in f if line.strip())
        if users > ONE_SHARD_ROWS:
            raise ValueError(f"{source}: {users} users do not fit the one shard of {ONE_SHARD} ({ONE_SHARD_ROWS} rows)")
        convert("seq-tsv", source, target, protocol="hstu", rows_per_shard=ONE_SHARD_ROWS)
    else:
        convert("seq-tsv", source, target, protocol="hstu")
    return target


# -- running ------------------------------------------------------------------------------------------


@dataclass
class Launched:
    spec: RunSpec
    out: Path
    command: list[str]
    process: subprocess.Popen
    started: float


def run_command(spec: RunSpec, dataset: Path, out: Path, args: argparse.Namespace) -> list[str]:
    command = [
        sys.executable, "-m", "experiments.ml1m_hstu", "--data", str(dataset), "--flavor", spec.flavor,
        "--seed", str(spec.seed), "--out", str(out), "--epochs", str(args.epochs),
        "--eval-every", str(args.eval_every), "--time-budget", str(args.time_budget),
    ]
    if args.max_steps >= 0:
        command += ["--max-steps", str(args.max_steps)]
    if args.batch_size:
        command += ["--batch-size", str(args.batch_size)]
    if args.device:
        command += ["--device", args.device]
    return command + list(spec.overrides)


def run_environment(spec: RunSpec, extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **DEFAULT_ENV, **extra, **dict(spec.env)}


def launch(spec: RunSpec, dataset: Path, args: argparse.Namespace, extra_env: dict[str, str]) -> Launched:
    out = Path(args.out) / "runs" / spec.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").unlink(missing_ok=True)  # a stale result must not pass for this run's
    command = run_command(spec, dataset, out, args)
    # The child writes its own copy of the descriptor, after the command line.
    with open(out / "log.txt", "w") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        env = run_environment(spec, extra_env)
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path.cwd())
    return Launched(spec, out, command, process, time.monotonic())


def run_all(runs: list[RunSpec], datasets: dict[str, Path], args: argparse.Namespace, extra_env: dict[str, str],
            on_finish) -> None:
    """Run every spec, at most ``args.parallel`` at once, killing any that outlives its budget plus grace."""
    pending = sorted(runs, key=lambda r: -FLAVOR_COST.get(r.flavor, 1))
    running: list[Launched] = []
    limit = args.time_budget + args.grace if args.time_budget > 0 else None
    while pending or running:
        while pending and len(running) < args.parallel:
            spec = pending.pop(0)
            running.append(launch(spec, datasets[spec.data], args, extra_env))
        time.sleep(args.poll)
        for job in list(running):
            killed = False
            if job.process.poll() is None and limit is not None and time.monotonic() - job.started > limit:
                job.process.kill()
                killed = True
            if job.process.poll() is None and not killed:
                continue
            job.process.wait()
            running.remove(job)
            on_finish(job, killed, time.monotonic() - job.started)


# -- summaries ----------------------------------------------------------------------------------------


def run_row(job: Launched, killed: bool, seconds: float, data_label: str) -> dict:
    """One run's row: what it was, how it ended, and its metrics (from its ``results.json``, if any)."""
    spec = job.spec
    row = {
        "name": spec.name,
        "flavor": spec.flavor,
        "data": data_label,
        "variant": spec.variant,
        "seed": spec.seed,
        "command": shlex.join(job.command),
        "env": dict(spec.env),
        "rc": job.process.returncode,
        "status": "killed" if killed else ("ok" if job.process.returncode == 0 else "failed"),
        "seconds": round(seconds, 1),
        "log": str(job.out / "log.txt"),
    }
    results_path = job.out / "results.json"
    if results_path.is_file():
        results = json.loads(results_path.read_text())
        row["epochs"] = results["epochs_run"]
        row["test"] = {k: results["final_test"][k] for k in METRICS if k in results["final_test"]}
        row["best_valid"] = {
            name: {"epoch": best["epoch"], "test": {k: best["test"][k] for k in METRICS if k in best["test"]}}
            for name, best in results.get("best_valid", {}).items()
        }
    elif row["status"] == "ok":
        row["status"] = "no results"
    return row


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def group_rows(run_rows: list[dict], command: str, date: str) -> list[dict]:
    """One row per (flavor, data, variant) over the seeds whose run produced test metrics.

    Runs name their metrics as MLflow does (``hr10``); the rows keep the published results file's keys
    (``hr@10_mean``: ``docs/results/ml1m.json``, whose schema readers of the results rely on).
    """
    groups: dict[tuple, list[dict]] = {}
    for row in run_rows:
        if "test" in row:
            groups.setdefault((row["flavor"], row["data"], row["variant"]), []).append(row)
    out = []
    for (flavor, data, variant), rows in groups.items():
        rows = sorted(rows, key=lambda r: r["seed"])
        hr, hr_std = _mean_std([r["test"]["hr10"] for r in rows])
        ndcg, ndcg_std = _mean_std([r["test"]["ndcg10"] for r in rows])
        group = {
            "flavor": flavor,
            "data": data,
            "seeds": [r["seed"] for r in rows],
            "hr@10_mean": round(hr, 4),
            "hr@10_std": round(hr_std, 4),
            "ndcg@10_mean": round(ndcg, 4),
            "command": command,
            "date": date,
            "variant": variant,
            "ndcg@10_std": round(ndcg_std, 4),
            "epochs": [r["epochs"] for r in rows],
        }
        selected = [r["best_valid"][SELECT] for r in rows if SELECT in r.get("best_valid", {})]
        if len(selected) == len(rows):
            best_hr, best_hr_std = _mean_std([s["test"]["hr10"] for s in selected])
            group["best_valid"] = {
                "select": f"valid {SELECT}",
                "epochs": [s["epoch"] for s in selected],
                "hr@10_mean": round(best_hr, 4),
                "hr@10_std": round(best_hr_std, 4),
                "ndcg@10_mean": round(statistics.fmean(s["test"]["ndcg10"] for s in selected), 4),
            }
        out.append(group)
    return sorted(out, key=lambda g: (g["data"], g["flavor"], g["variant"] != "default", g["variant"]))


def format_table(summary: dict) -> str:
    """The group rows as a fixed-width table (the variant last, whole), then every run that did not end well."""
    header = f"{'flavor':<16} {'data':<26} {'n':>2} {'HR@10 ± std':>15} {'NDCG@10':>8} {'HR@10 best-valid':>16}  variant"
    lines = [header]
    for g in summary["rows"]:
        best = g.get("best_valid", {}).get("hr@10_mean")
        lines.append(
            f"{g['flavor']:<16} {g['data'][:26]:<26} {len(g['seeds']):>2} "
            f"{g['hr@10_mean']:>8.4f}±{g['hr@10_std']:.4f} {g['ndcg@10_mean']:>8.4f} "
            f"{'' if best is None else format(best, '.4f'):>16}  {g['variant']}"
        )
    bad = [r for r in summary["runs"] if r["status"] != "ok"]
    for r in bad:
        lines.append(f"run {r['name']}: {r['status']} (rc {r['rc']}), log {r['log']}")
    ok = len(summary["runs"]) - len(bad)
    lines.append(f"{ok}/{len(summary['runs'])} runs ok; summary {summary['path']}")
    return "\n".join(lines)


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env {item!r}: expected NAME=VALUE")
        env[key] = value
    return env


def sweep(args: argparse.Namespace) -> dict:
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    runs = [run for plan in args.plan for run in plan_runs(plan, seeds)]
    if args.runs:
        runs += load_runs(Path(args.runs))
    runs = list(dict.fromkeys(runs))  # plans share runs (the default ml1m_hstu): each runs once
    if not runs:
        raise ValueError("nothing to run: give --plan and/or --runs")
    check_runs(runs)
    extra_env = parse_env(args.env)
    out = Path(args.out)
    raw = Path(args.raw)
    if args.users:
        raw = first_users(raw, out / "raw", args.users)
    labels = {name: label + (f" (first {args.users} users)" if args.users else "") for name, label in DATASETS.items()}
    datasets = {name: prepare_dataset(name, raw, out) for name in sorted({r.data for r in runs})}
    if args.prepare_only:
        print("\n".join(f"{name}: {path}" for name, path in datasets.items()), flush=True)
        return {"runs": []}
    summary = {
        "path": str(out / "summary.json"),
        "command": shlex.join(["python", "-m", "experiments.ml1m_sweep", *args.argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "env": {**DEFAULT_ENV, **extra_env},
        "rows": [],
        "runs": [],
    }

    def on_finish(job: Launched, killed: bool, seconds: float) -> None:
        row = run_row(job, killed, seconds, labels[job.spec.data])
        summary["runs"].append(row)
        summary["rows"] = group_rows(summary["runs"], summary["command"], summary["date"])
        atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
        test = row.get("test", {})
        print(f"[{len(summary['runs'])}/{len(runs)}] {row['name']}: {row['status']} in {row['seconds']} s, "
              f"{row.get('epochs', 0)} epochs, HR@10 {test.get('hr10', float('nan')):.4f}", flush=True)

    run_all(runs, datasets, args, extra_env, on_finish)
    print(format_table(summary), flush=True)
    return summary


# -- merging into docs/results/ml1m.json --------------------------------------------------------------


def merge(summary_path: Path, results_path: Path) -> dict:
    """Rows of a sweep summary into a results file: a row replaces the one with its flavor, data and variant."""
    rows = json.loads(summary_path.read_text())["rows"]
    current = json.loads(results_path.read_text()) if results_path.is_file() else {"rows": []}

    def key(row: dict) -> tuple:
        return row["flavor"], row["data"], row.get("variant", "default")

    fresh = {key(r) for r in rows}
    current["rows"] = [r for r in current["rows"] if key(r) not in fresh] + rows
    atomic_write_text(results_path, json.dumps(current, indent=2) + "\n")
    return current


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="action", required=True)
    run = commands.add_parser("run", help="run a sweep")
    run.add_argument("--raw", required=True, help=f"directory with {SEQUENCES} and {RATINGS}")
    run.add_argument("--out", required=True, help="datasets, runs/<name>/ and summary.json go here")
    run.add_argument("--plan", action="append", default=[], choices=PLANS)
    run.add_argument("--runs", help="JSON list of extra runs")
    run.add_argument("--seeds", default="0,1,2")
    run.add_argument("--parallel", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    run.add_argument("--epochs", type=int, default=100)
    run.add_argument("--eval-every", type=int, default=5)
    run.add_argument("--time-budget", type=float, default=0.0, help="seconds per run (0: none)")
    run.add_argument("--grace", type=float, default=90.0, help="seconds past the budget before a run is killed")
    run.add_argument("--max-steps", type=int, default=-1, help="steps per epoch (dry runs)")
    run.add_argument("--batch-size", type=int, default=0, help="0: the script's default (128)")
    run.add_argument("--device", default=None)
    run.add_argument("--users", type=int, default=0, help="only the first N users of the raw files (dry runs)")
    run.add_argument("--env", action="append", default=[], help="NAME=VALUE for every run (repeatable)")
    run.add_argument("--prepare-only", action="store_true", help="convert the datasets the runs need, then stop")
    run.add_argument("--poll", type=float, default=1.0, help=argparse.SUPPRESS)
    merge_parser = commands.add_parser("merge", help="merge a summary's rows into a results file")
    merge_parser.add_argument("summary")
    merge_parser.add_argument("results")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.action == "merge":
        merged = merge(Path(args.summary), Path(args.results))
        print(f"{args.results}: {len(merged['rows'])} rows")
        return 0
    if args.parallel < 1:
        raise SystemExit("--parallel must be at least 1")
    try:
        summary = sweep(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"ml1m_sweep: {exc}", file=sys.stderr)
        return 2
    return 0 if all(r["status"] == "ok" for r in summary["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
