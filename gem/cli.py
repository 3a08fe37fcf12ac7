"""The ``gem`` command line: data, training, evaluation, teacher outputs, transfer reports and the quickstart.

Every subcommand validates its arguments before doing work and reports problems as one line
(``gem: error: ...``, exit code 2) instead of a traceback.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from pathlib import Path

from foundation.config import ConfigError, apply_overrides

EXIT_USAGE = 2
MAX_ERROR_CHARS = 500
# transfer.sharing.POLICIES, spelled out so that building the parser imports no torch.
POLICY_CHOICES = ("freeze", "finetune", "finetune_lower_lr")


class CLIError(Exception):
    """A user-facing error: bad argument, missing file, unknown flavor."""


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        from foundation.data.io import atomic_write_text

        atomic_write_text(Path(path), json.dumps(payload, indent=2, sort_keys=True))
        print(f"wrote {path}")


def cmd_data_synth(args: argparse.Namespace) -> None:
    from foundation.data.synthetic import generate_world
    from gem.flavors import SYNTH_PRESETS, synth_preset

    if args.preset not in SYNTH_PRESETS:
        raise CLIError(f"unknown synth preset {args.preset!r}; known: {sorted(SYNTH_PRESETS)}")
    cfg = apply_overrides(synth_preset(args.preset), args.overrides)
    if args.seed is not None:
        cfg.seed = args.seed
    stats = generate_world(cfg, args.out, progress=True)
    print(json.dumps(stats, indent=2, default=str))
    _write_json(args.json, stats)


def cmd_data_convert(args: argparse.Namespace) -> None:
    from foundation.data.converters import convert

    if not Path(args.input).is_file():
        raise CLIError(f"input file not found: {args.input}")
    stats = convert(args.format, args.input, args.out, policy=args.policy)
    print(json.dumps(stats, indent=2, default=str))
    _write_json(args.json, stats)


def cmd_data_checksum(args: argparse.Namespace) -> None:
    from foundation.data.io import adopt_shards

    if not Path(args.dataset, "schema.json").is_file():
        raise CLIError(f"dataset {args.dataset!r} not found (no schema.json)")
    print(json.dumps(adopt_shards(args.dataset)))


def load_flavor(name: str, overrides: list[str]):
    from gem.flavors import get_flavor

    return apply_overrides(get_flavor(name), overrides)


def cmd_train(args: argparse.Namespace) -> None:
    cfg = load_flavor(args.flavor, args.overrides)
    if args.print_config:
        print(cfg.to_json())
        return
    if not Path(cfg.data.path, "schema.json").is_file():
        raise CLIError(
            f"dataset {cfg.data.path!r} not found; create it with `gem data synth --preset debug|default|large "
            f"--out {cfg.data.path}` or `gem data convert ...`, or point data.path=... at a dataset"
        )
    from gem.compile_workers import start_compile_workers, worker_plan

    # Before the harness's imports and set-up, which their own start-up then overlaps (gem.compile_workers).
    precompile = cfg.train.precompile_kernels and not cfg.parallel.enabled and cfg.train.devices == 1
    workers = start_compile_workers(*worker_plan(precompile, cfg.train.accelerator))
    from gem.train import train

    result = train(cfg, resume=not args.no_resume, compile_workers=workers)
    print(json.dumps(result, indent=2, sort_keys=True))
    _write_json(args.json, result)


def cmd_eval(args: argparse.Namespace) -> None:
    from gem.evaluate import evaluate

    if not Path(args.ckpt).is_file():
        raise CLIError(f"checkpoint not found: {args.ckpt}")
    result = evaluate(args.ckpt, args.split, data_path=args.data)
    print(json.dumps(result, indent=2, sort_keys=True))
    _write_json(args.json, result)


def cmd_teacher_outputs(args: argparse.Namespace) -> None:
    from gem.module import load_teacher
    from gem.train import tracking_uri
    from transfer.teacher_outputs import write_teacher_outputs

    if not Path(args.ckpt).is_file():
        raise CLIError(f"checkpoint not found: {args.ckpt}")
    teacher = load_teacher(args.ckpt, purpose="`gem teacher-outputs`")
    stats = write_teacher_outputs(
        teacher, args.data or teacher.config["data"]["path"], args.split, args.out, rows_per_shard=args.rows_per_shard, tracking_uri=tracking_uri()
    )
    print(json.dumps({k: v for k, v in stats.items() if k != "manifest"}, indent=2, default=str))
    _write_json(args.json, stats)


def cmd_transfer_report(args: argparse.Namespace) -> None:
    from gem.report import ReportConfig, run_transfer_report

    if not Path(args.ckpt).is_file():
        raise CLIError(f"checkpoint not found: {args.ckpt}")
    if args.data and not Path(args.data, "schema.json").is_file():
        raise CLIError(f"dataset {args.data!r} not found (no schema.json)")
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    try:
        cfg = ReportConfig(
            teacher_ckpt=args.ckpt,
            out_dir=args.out,
            data_path=args.data or "",
            flavor=args.flavor,
            seeds=args.seeds,
            student_split=args.student_split,
            rows_per_shard=args.rows_per_shard,
            overrides=tuple(args.overrides),
            teacher_run_id=args.teacher_run_id or "",
            share_policy=args.share_policy,
            share_lr_scale=args.share_lr_scale,
            **({"methods": methods} if methods else {}),
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    print(run_transfer_report(cfg))


def cmd_pipeline(args: argparse.Namespace) -> None:
    from gem.pipeline import PipelineConfig, PipelineError, run_pipeline
    from transfer.sharing import SharingError
    from transfer.teacher_outputs import TeacherOutputsError

    if args.teacher_ckpt and not Path(args.teacher_ckpt).is_file():
        raise CLIError(f"checkpoint not found: {args.teacher_ckpt}")
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    try:
        cfg = PipelineConfig(
            out_dir=args.out,
            preset=args.preset,
            data_path=args.data or "",
            teacher_ckpt=args.teacher_ckpt or "",
            teacher_run_id=args.teacher_run_id or "",
            teacher_flavor=args.teacher_flavor or "",
            student_flavor=args.student_flavor or "",
            seeds=args.seeds,
            student_split=args.student_split,
            synth_overrides=tuple(args.synth),
            teacher_overrides=tuple(args.teacher),
            student_overrides=tuple(args.student),
            share_policy=args.share_policy,
            **({"methods": methods} if methods else {}),
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    try:
        path = run_pipeline(cfg)
    except (PipelineError, SharingError, TeacherOutputsError) as exc:
        raise CLIError(str(exc)) from exc
    print(path)


def cmd_export(args: argparse.Namespace) -> None:
    from gem.module import load_teacher
    from gem.train import tracking_uri
    from transfer.export import export_embeddings
    from transfer.store import StoreError

    if not Path(args.ckpt).is_file():
        raise CLIError(f"checkpoint not found: {args.ckpt}")
    teacher = load_teacher(args.ckpt, purpose="`gem export` (it publishes a teacher's user/item vectors)")
    try:
        report = export_embeddings(
            teacher,
            args.data or teacher.config["data"]["path"],
            args.store,
            splits=tuple(s.strip() for s in args.splits.split(",") if s.strip()),
            since=args.since,
            retention=args.retention,
            tracking_uri=tracking_uri(),
            index_factory=args.index_factory,
            build_retrieval_index=not args.no_index,
        )
    except StoreError as exc:
        raise CLIError(str(exc)) from exc
    print(json.dumps({k: v for k, v in report.items() if k != "manifest"}, indent=2, default=str))
    _write_json(args.json, report)


def cmd_retrieve(args: argparse.Namespace) -> None:
    from transfer.store import StoreError, open_store

    try:
        store = open_store(args.store, args.version)
        vector, found = store.lookup_users([args.user_id])
        if not found[0]:
            raise CLIError(f"user {args.user_id} is not in {store.path}")
        index = store.index()
    except StoreError as exc:
        raise CLIError(str(exc)) from exc
    ids, scores = index.search(vector, args.k)
    keep = ids[0] >= 0
    result = {"user_id": args.user_id, "version": store.version, "factory": index.meta.factory,
              "items": ids[0][keep].tolist(), "scores": scores[0][keep].tolist()}
    print(json.dumps(result, indent=2))
    _write_json(args.json, result)


def add_bench_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``gem bench-serving`` and ``python -m experiments.bench_serving`` (one declaration)."""
    parser.add_argument("--ckpt", required=True, help="student checkpoint (gem train --flavor student-*)")
    parser.add_argument("--store", required=True, help="embedding store root (gem export)")
    parser.add_argument("--candidates", default="64,256,1024")
    parser.add_argument("--forms", default="", help="comma-separated serving forms (default: all)")
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--json", help="write the table as JSON here")


def bench_serving(args: argparse.Namespace) -> dict:
    """Run :func:`value_models.bench.run_bench` with :func:`add_bench_serving_arguments`' values, print its
    table, and write it as JSON with ``--json``; unknown forms raise ``ValueError``."""
    from value_models.bench import TARGET_P99_MS, format_table, run_bench
    from value_models.serving import FORMS

    forms = tuple(f.strip() for f in args.forms.split(",") if f.strip()) or FORMS
    if unknown := sorted(set(forms) - set(FORMS)):
        raise ValueError(f"unknown serving forms {unknown}; choose from {list(FORMS)}")
    result = run_bench(
        args.ckpt,
        args.store,
        candidates=tuple(int(c) for c in args.candidates.split(",")),
        forms=forms,
        iters=args.iters,
        warmup=args.warmup,
    )
    print(format_table(result))
    print(f"serve: {result['serve']}; p99 <= {TARGET_P99_MS} ms at 256 candidates: {result['meets_target']}")
    _write_json(args.json, result)
    return result


def cmd_bench_serving(args: argparse.Namespace) -> None:
    for path in (args.ckpt, args.store):
        if not Path(path).exists():
            raise CLIError(f"not found: {path}")
    try:
        bench_serving(args)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc


def cmd_package(args: argparse.Namespace) -> None:
    from gem.packaging import register_value_model
    from gem.train import tracking_uri
    from transfer.store import StoreError
    from value_models.serving import BudgetError, LatencyBudget, ServingConfig

    if not Path(args.ckpt).is_file():
        raise CLIError(f"checkpoint not found: {args.ckpt}")
    given = {"max_candidates": args.max_candidates, "p99_ms": args.p99_ms}
    budget = LatencyBudget(**{key: value for key, value in given.items() if value is not None})
    cfg = ServingConfig(budget=budget, max_store_age_s=args.max_store_age_s,
                        follow_latest=args.follow_latest)
    try:
        result = register_value_model(
            args.ckpt, args.store, args.name, alias=args.alias, cfg=cfg, tracking_uri=tracking_uri()
        )
    except (BudgetError, StoreError) as exc:
        raise CLIError(str(exc)) from exc
    print(json.dumps({k: v for k, v in result.items() if k != "forms"}, indent=2, default=str))
    _write_json(args.json, result)


def cmd_quickstart(args: argparse.Namespace) -> None:
    from gem.pipeline import PipelineError
    from gem.quickstart import run_quickstart
    from transfer.store import StoreError
    from value_models.serving import BudgetError

    try:
        report = run_quickstart(args.recipe, args.out, p99_ms=args.p99_ms)
    except (BudgetError, StoreError, PipelineError) as exc:
        raise CLIError(str(exc)) from exc
    _write_json(args.json, report)


def flavor_listing() -> str:
    """One line per flavor of :mod:`gem.flavors`: its model, dataset directory and epochs."""
    from gem.flavors import FLAVORS, get_flavor

    lines = ["flavors (gem/flavors.py):"]
    for name in FLAVORS:
        cfg = get_flavor(name)
        lines.append(f"  {name:<28} {cfg.model.arch:<8} {cfg.data.path:<22} {cfg.train.max_epochs} epochs")
    return "\n".join(lines)


class FlavorHelp(argparse.Action):
    """``gem train --help``: the usual help, then the flavors (the registry is read only now: it loads torch)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.print_help()
        print("\n" + flavor_listing())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="create or convert datasets").add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="generate the synthetic ads world")
    synth.add_argument("--preset", default="default")
    synth.add_argument("--out", required=True)
    synth.add_argument("--seed", type=int)
    synth.add_argument("--json")
    synth.add_argument("overrides", nargs="*", help="field=value overrides of the synth config")
    synth.set_defaults(fn=cmd_data_synth)

    conv = data.add_parser("convert", help="convert public sequence data to the event schema")
    conv.add_argument("--format", required=True, choices=["movielens-dat", "movielens-csv", "sasrec", "seq-tsv"])
    conv.add_argument("--input", required=True)
    conv.add_argument("--out", required=True)
    conv.add_argument("--policy", default="error", choices=["error", "quarantine"])
    conv.add_argument("--json")
    conv.set_defaults(fn=cmd_data_convert)

    checksum = data.add_parser(
        "checksum", help="give shards written by another tool their .sha256 (after reading every page)"
    )
    checksum.add_argument("dataset")
    checksum.set_defaults(fn=cmd_data_checksum)

    tr = sub.add_parser(
        "train", add_help=False, help="train a model flavor (resumes from the run's last checkpoint)",
        description="Train a flavor into runs/<name>/ (train.out_dir). A rerun of the same command resumes it; "
        "a run of another config there is refused (pass name=... for a separate run).",
    )
    tr.add_argument("-h", "--help", action=FlavorHelp, help="show this help and the flavors, then exit")
    tr.add_argument("--flavor", default="debug", help="a named config (listed below)")
    tr.add_argument("--no-resume", action="store_true", help="refuse to continue an existing run in the run directory")
    tr.add_argument("--print-config", action="store_true", help="print the resolved config (flavor + overrides) and exit")
    tr.add_argument("--json")
    tr.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. train.max_epochs=3")
    tr.set_defaults(fn=cmd_train)

    ev = sub.add_parser("eval", help="evaluate a checkpoint on a split")
    ev.add_argument("--ckpt", required=True)
    ev.add_argument("--split", default="test")
    ev.add_argument("--data", help="dataset directory (default: the one the checkpoint was trained on)")
    ev.add_argument("--json")
    ev.set_defaults(fn=cmd_eval)

    to = sub.add_parser("teacher-outputs", help="run a teacher checkpoint once over a split (resumable)")
    to.add_argument("--ckpt", required=True)
    to.add_argument("--split", default="train")
    to.add_argument("--data", help="dataset directory (default: the one the checkpoint was trained on)")
    to.add_argument("--out", required=True)
    to.add_argument("--rows-per-shard", type=int, default=65536)
    to.add_argument("--json")
    to.set_defaults(fn=cmd_teacher_outputs)

    rep = sub.add_parser(
        "transfer-report", help="teacher outputs -> students per transfer method -> NE/AUC/TR report (prints its path)"
    )
    rep.add_argument("--ckpt", required=True, help="teacher checkpoint")
    rep.add_argument("--data", help="dataset directory (default: the one the teacher was trained on)")
    rep.add_argument("--out", required=True, help="directory for teacher outputs, student runs and the report")
    rep.add_argument("--flavor", default="student-debug", help="student flavor")
    rep.add_argument("--methods", default="", help="comma-separated transfer methods (default: all)")
    rep.add_argument("--seeds", type=int, default=2)
    rep.add_argument("--student-split", default="train", help="split the students train on (e.g. valid: a later window)")
    rep.add_argument("--rows-per-shard", type=int, default=65536)
    rep.add_argument("--teacher-run-id", help="the teacher's MLflow run (default: recorded beside its checkpoints/)")
    rep.add_argument("--share-policy", default="freeze", choices=POLICY_CHOICES)
    rep.add_argument("--share-lr-scale", type=float, default=0.1)
    rep.add_argument("overrides", nargs="*", help="overrides of the student flavor, e.g. train.max_steps=100")
    rep.set_defaults(fn=cmd_transfer_report)

    pipe = sub.add_parser(
        "pipeline", help="data -> teacher -> teacher outputs -> students -> report (resumable; prints its path)"
    )
    pipe.add_argument("--preset", default="debug", help="synthetic world preset (debug, default)")
    pipe.add_argument("--out", required=True, help="directory for the teacher run, outputs, students and the report")
    pipe.add_argument("--data", help="dataset directory (default: data/synth-<preset>, generated if missing)")
    pipe.add_argument("--teacher-ckpt", help="an existing teacher checkpoint (skips teacher training)")
    pipe.add_argument("--teacher-run-id", help="its MLflow run (default: recorded beside its checkpoints/)")
    pipe.add_argument("--teacher-flavor", help="teacher flavor to train (default: the preset's GEM teacher)")
    pipe.add_argument("--student-flavor", help="student flavor (default: the preset's)")
    pipe.add_argument("--methods", default="", help="comma-separated transfer methods (default: all)")
    pipe.add_argument("--seeds", type=int, default=2)
    pipe.add_argument("--student-split", default="valid", help="split the students train on (default: later window)")
    pipe.add_argument("--share-policy", default="freeze", choices=POLICY_CHOICES)
    pipe.add_argument("--synth", nargs="*", default=[], help="generator overrides, e.g. num_examples=20000")
    pipe.add_argument("--teacher", nargs="*", default=[], help="teacher flavor overrides, e.g. train.max_steps=200")
    pipe.add_argument("--student", nargs="*", default=[], help="student flavor overrides, e.g. train.max_epochs=3")
    pipe.set_defaults(fn=cmd_pipeline)

    ex = sub.add_parser("export", help="publish a version of the user/item embedding store (+ FAISS index)")
    ex.add_argument("--ckpt", required=True)
    ex.add_argument("--data", help="dataset directory (default: the one the checkpoint was trained on)")
    ex.add_argument("--store", required=True, help="store root (holds v000001/, ..., LATEST)")
    ex.add_argument("--splits", default="train,valid,test")
    ex.add_argument("--since", type=int, help="incremental refresh from this version")
    ex.add_argument("--retention", type=int, help="keep the newest K versions (LATEST always kept)")
    ex.add_argument("--index-factory", help="FAISS factory string (default: chosen by corpus size)")
    ex.add_argument("--no-index", action="store_true")
    ex.add_argument("--json")
    ex.set_defaults(fn=cmd_export)

    ret = sub.add_parser("retrieve", help="top-K items for a user from the store's FAISS index")
    ret.add_argument("user_id", type=int)
    ret.add_argument("--store", required=True)
    ret.add_argument("--k", type=int, default=10)
    ret.add_argument("--version", type=int, help="store version (default: LATEST)")
    ret.add_argument("--json")
    ret.set_defaults(fn=cmd_retrieve)

    bs = sub.add_parser("bench-serving", help="value-model latency per serving form at 64/256/1024 candidates")
    add_bench_serving_arguments(bs)
    bs.set_defaults(fn=cmd_bench_serving)

    pk = sub.add_parser("package", help="check a student's latency budget; register it as an MLflow pyfunc + alias")
    pk.add_argument("--ckpt", required=True, help="student checkpoint")
    pk.add_argument("--store", required=True, help="embedding store root (its LATEST version is packaged)")
    pk.add_argument("--name", required=True, help="registered model name")
    pk.add_argument("--alias", default="champion")
    pk.add_argument("--max-candidates", type=int, help="candidates per request (default: LatencyBudget's, 256)")
    pk.add_argument("--p99-ms", type=float,
                    help="p99 budget on one CPU thread at --max-candidates (default: LatencyBudget's, 2.0 ms)")
    pk.add_argument("--max-store-age-s", type=float, help="flag responses from an older store version as stale")
    pk.add_argument("--follow-latest", action="store_true", help="an unbundled store: follow its LATEST")
    pk.add_argument("--json")
    pk.set_defaults(fn=cmd_package)

    qs = sub.add_parser(
        "quickstart", help="the mission: world -> DLRM and GEM teacher -> students -> export -> packaged model -> a request",
        description="Train the DLRM baseline and the GEM teacher, distil students, export embeddings, package the "
        "student under its latency budget and score one request; print the comparison and write OUT/report.json. "
        "A rerun reuses the finished stages.",
    )
    qs.add_argument("--recipe", default="debug", help="gem/flavors.py MISSION_RECIPES: debug (make quickstart), tiny")
    qs.add_argument("--out", default="runs/quickstart", help="where its runs, store and report.json go")
    qs.add_argument("--p99-ms", type=float, help="the packaged student's p99 budget (default: the recipe's, 20 ms)")
    qs.add_argument("--json", help="also write the report here")
    qs.set_defaults(fn=cmd_quickstart)
    return parser


def fail(message: str) -> int:
    """Print ``message`` as one ``gem: error:`` line of at most :data:`MAX_ERROR_CHARS` characters."""
    from foundation.messages import clip

    print(f"gem: error: {clip(' '.join(message.split()), MAX_ERROR_CHARS)}", file=sys.stderr)
    return EXIT_USAGE


def describe_os_error(exc: OSError) -> str:
    """``file: reason`` for an error of the machine (a full disk, a permission); the errno name when known."""
    reason = f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})" if exc.strerror else str(exc)
    return f"{exc.filename}: {reason}" if exc.filename else reason


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imported after parsing: `gem --help` stays fast (these load pyarrow).
    from foundation.data.io import CorruptFileError
    from foundation.data.schema import SchemaError
    from foundation.data.validate import DataValidationError
    from gem.errors import ModelRoleError, ResumeError, TrainingError
    from gem.logs import configure_logging
    from transfer.store import StoreError

    configure_logging()
    try:
        args.fn(args)
    except (
        CLIError, ConfigError, DataValidationError, CorruptFileError, SchemaError, StoreError, TrainingError,
        ResumeError, ModelRoleError, FileNotFoundError,
    ) as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(describe_os_error(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
