"""Transfer report: how much of a teacher's gain each transfer method carries into a student.

``gem transfer-report --ckpt TEACHER.ckpt --out DIR`` runs, in order:

1. teacher outputs for the students' train, validation and test splits, under ``DIR/teacher_outputs/<split>``
   (:func:`transfer.teacher_outputs.write_teacher_outputs`; finished shards are reused on a rerun);
2. one student per method (:data:`gem.flavors.STUDENT_METHODS`) and seed, trained through the
   harness (:func:`gem.train.train`) with ``transfer.teacher_outputs`` pointing at those outputs
   and, for :data:`gem.flavors.SHARING_METHODS`, ``transfer.share_from`` at the teacher checkpoint;
   ``alone`` gets none: it is the no-transfer baseline;
3. NE and AUC per task, overall and per domain, on the test split, for the teacher and every student;
4. per method and seed, the transfer ratio of each NE (DESIGN.md), against ``alone`` of the same seed::

       TR = (NE_alone − NE_method) / (NE_alone − NE_teacher)

   then mean and spread (sample std; 0 for one seed) over seeds. TR is only defined where the teacher
   beats the student alone (a gain to transfer): a seed without that gain gets NaN, and a key with any
   such seed has no TR (``null`` in the JSON, "—" in the table, no bar in the plot).

Finished students are recorded in ``DIR/students.json`` (config digest, checkpoint sha256, test metrics); a
rerun reuses every student whose config and checkpoint still match and trains the rest, and finished
teacher-output shards are reused, so an interrupted report resumes. The results go to
``DIR/transfer_report.json``, ``transfer_report.md`` and ``transfer_report.png``, which
are also MLflow artifacts of a ``transfer_report`` run tagged with the teacher's run id and checkpoint.

Staleness (ExFM's setting, a teacher trained on an earlier window than its students): train the teacher
on ``train`` and pass ``student_split="valid"`` (``--student-split valid``): the students then train on
the later window ``valid``, with teacher outputs computed for it, validate and test on ``test``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from foundation.config import apply_overrides
from foundation.data.io import atomic_write_text, sha256_file
from foundation.data.schema import TASKS
from gem.config import ExperimentConfig
from gem.evaluate import evaluate
from gem.flavors import (
    SHARING_METHODS,
    STUDENT_METHODS,
    get_flavor,
    repr_overrides,
    sharing_overrides,
)
from gem.module import load_module, load_trained
from gem.run_dir import holds_run, identity_differences, saved_config
from gem.tracking import nest_under
from gem.train import run_dir, tracking_uri, train
from transfer.lineage import log_lineage_run
from transfer.sharing import POLICIES
from transfer.teacher_outputs import OutputSchema, write_teacher_outputs

BASELINE = "alone"
REPORT_JSON = "transfer_report.json"
REPORT_MD = "transfer_report.md"
REPORT_PNG = "transfer_report.png"
LEDGER_FILE = "students.json"
# The test-set metrics the report keeps: ``{task}/ne``, ``{task}/auc`` and their ``/d{k}`` per domain.
_METRIC_KEY = re.compile(rf"^(?:{'|'.join(TASKS)})/(ne|auc)(?:/d\d+)?$")


@dataclass
class ReportConfig:
    """What :func:`run_transfer_report` compares.

    ``data_path`` defaults to the teacher's dataset; ``flavor`` is a student flavor and ``overrides``
    apply to it (e.g. ``train.max_steps=50``); ``methods`` are keys of ``STUDENT_METHODS`` (``alone``,
    the baseline, is always run); students train with seeds ``first_seed .. first_seed + seeds - 1``;
    ``student_split`` is the split the students train on.
    ``teacher_run_id`` names the teacher's MLflow run when it is not recorded beside the checkpoint (a
    teacher trained elsewhere); ``share_policy`` / ``share_lr_scale`` configure the sharing methods. Their
    default, ``freeze``: fine-tuning the teacher's tables at the full learning rate overfits a student trained
    on a short later window, and frozen tables transferred as much as the 0.1x learning rate from a DLRM
    teacher and more from the GEM teacher (``docs/benchmarks.md``, "Knowledge transfer").
    """

    teacher_ckpt: str
    out_dir: str
    data_path: str = ""
    flavor: str = "student-debug"
    methods: tuple[str, ...] = tuple(STUDENT_METHODS)
    seeds: int = 2
    first_seed: int = 0
    student_split: str = "train"
    rows_per_shard: int = 65536
    overrides: tuple[str, ...] = ()
    teacher_run_id: str = ""
    share_policy: str = "freeze"
    share_lr_scale: float = 0.1

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in STUDENT_METHODS]
        if unknown:
            raise ValueError(f"unknown transfer methods {unknown}; known: {sorted(STUDENT_METHODS)}")
        if self.seeds < 1:
            raise ValueError(f"seeds must be at least 1, got {self.seeds}")
        if self.share_policy not in POLICIES:
            raise ValueError(f"unknown sharing policy {self.share_policy!r}; choose one of {POLICIES}")
        self.methods = (BASELINE, *(m for m in self.methods if m != BASELINE))
        baseline_flavor(self.flavor, self.overrides)


def baseline_flavor(flavor: str, overrides: tuple[str, ...]) -> ExperimentConfig:
    """The student flavor with ``overrides``; it is the ``alone`` baseline, so no transfer may be on."""
    cfg = apply_overrides(get_flavor(flavor), list(overrides))
    student = cfg.model.student
    transfer = cfg.transfer.teacher_outputs or cfg.transfer.share_from
    if cfg.model.arch != "student" or student.distill != "none" or student.teacher_repr or transfer:
        raise ValueError(f"flavor {flavor!r} must be a student with no transfer on (e.g. student-debug)")
    return cfg


def student_base(cfg: ReportConfig, data_path: str) -> ExperimentConfig:
    """The student flavor with the report's overrides, on ``data_path``, training on ``student_split``.

    Validation uses the flavor's eval split, or the test split when the students train on that one.
    """
    base = baseline_flavor(cfg.flavor, cfg.overrides)
    base.data.path = data_path
    base.train.out_dir = str(Path(cfg.out_dir) / "students")
    if cfg.student_split == base.data.eval_split:
        base.data.eval_split = base.data.test_split
    base.data.train_split = cfg.student_split
    return base


def student_splits(base: ExperimentConfig) -> tuple[str, ...]:
    """The splits a student reads: train, validation and test, each once."""
    return tuple(dict.fromkeys((base.data.train_split, base.data.eval_split, base.data.test_split)))


def write_split_outputs(
    cfg: ReportConfig, data_path: str, splits: tuple[str, ...], uri: str
) -> tuple[dict[str, str], dict, list[str]]:
    """Teacher outputs of every split under ``out_dir/teacher_outputs/<split>``: ``(split -> dir, a manifest,
    their MLflow run ids)``.

    All splits come from the same checkpoint, so any one manifest gives the teacher and the output schema.
    """
    dirs, manifest, run_ids = {}, {}, []
    teacher = load_trained(cfg.teacher_ckpt)
    for split in splits:
        out = Path(cfg.out_dir) / "teacher_outputs" / split
        stats = write_teacher_outputs(
            teacher, data_path, split, out, rows_per_shard=cfg.rows_per_shard, progress=True,
            tracking_uri=uri, run_id=cfg.teacher_run_id or None,
        )
        dirs[split], manifest = str(out), stats["manifest"]
        run_ids.append(stats["run_id"])
    return dirs, manifest, run_ids


def student_config(
    base: ExperimentConfig, method: str, seed: int, dirs: dict[str, str], manifest: dict, share: tuple[str, ...] = ()
) -> ExperimentConfig:
    """``base`` with ``method`` on, seeded; every method but ``alone`` reads the teacher outputs ``dirs``
    (so its run carries the teacher's lineage) and the sharing methods also apply the ``share`` overrides."""
    cfg = apply_overrides(copy.deepcopy(base), list(STUDENT_METHODS[method]))
    if cfg.model.student.teacher_repr:
        schema = OutputSchema.from_dict(manifest["schema"])
        apply_overrides(cfg, list(repr_overrides(schema.user_repr_dim or 0, schema.item_repr_dim or 0)))
    if method in SHARING_METHODS:
        apply_overrides(cfg, list(share))
    cfg.name = f"{base.name}-{method}-{base.data.train_split}-s{seed}"
    cfg.train.seed = cfg.data.seed = seed
    if method != BASELINE:
        cfg.transfer.teacher_outputs = dict(dirs)
        cfg.transfer.checkpoint_sha256 = manifest["teacher"]["checkpoint_sha256"]
    return cfg


def config_digest(cfg: ExperimentConfig) -> str:
    """sha256 of the resolved config: a ledger entry is reused only for the very same student."""
    return hashlib.sha256(cfg.to_json().encode()).hexdigest()


def load_ledger(out_dir: Path) -> dict[str, dict]:
    """Finished students of earlier runs of this report, by run name (empty when there are none)."""
    path = out_dir / LEDGER_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def reusable_student(ledger: dict[str, dict], cfg: ExperimentConfig) -> dict | None:
    """The ledger entry of ``cfg`` if it was trained with this config and its checkpoint is unchanged."""
    entry = ledger.get(cfg.name)
    if entry is None or entry["config_sha256"] != config_digest(cfg):
        return None
    ckpt = Path(entry["checkpoint"])
    return entry if ckpt.is_file() and sha256_file(ckpt) == entry["checkpoint_sha256"] else None


def split_metrics(ckpt: str, split: str, data_path: str | None = None) -> dict[str, float]:
    """NE and AUC per task, overall and per domain, of a checkpoint on ``split``."""
    metrics = evaluate(ckpt, split, data_path=data_path)["metrics"]
    return {k: v for k, v in metrics.items() if _METRIC_KEY.match(k)}


def transfer_ratios(method: dict[str, float], alone: dict[str, float], teacher: dict[str, float]) -> dict[str, float]:
    """TR per NE key (``click/ne`` -> ``click``, ``click/ne/d0`` -> ``click/d0``); NaN where the teacher does not
    beat the student alone (no gain, so no share of one)."""
    out = {}
    for key, ne in method.items():
        task, metric, *domain = key.split("/")
        if metric != "ne" or key not in teacher:
            continue
        gain = alone[key] - teacher[key]
        out["/".join([task, *domain])] = (alone[key] - ne) / gain if gain > 0 else float("nan")
    return out


def spread(values: list[float]) -> dict[str, float]:
    """``{"mean", "std"}`` over seeds; the sample std, 0 for a single seed."""
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0}


def teacher_gain(alone: list[dict[str, float]], teacher: dict[str, float]) -> dict[str, dict[str, float]]:
    """ΔNE_teacher = NE_alone − NE_teacher per NE key, over seeds; TR reads as a share only where it is > 0."""
    gains: dict[str, dict[str, float]] = {}
    for key, ne in teacher.items():
        task, metric, *domain = key.split("/")
        if metric == "ne":
            values = [a[key] - ne for a in alone]
            gains["/".join([task, *domain])] = {**spread(values), "per_seed": values}
    return gains


def summarize_method(per_seed: list[dict[str, float]], alone: list[dict[str, float]], teacher: dict[str, float]) -> dict:
    """``{"ne": {key: spread}, "auc": {...}, "tr": {key: spread + per_seed}}`` of one method's seeds."""
    ratios = [transfer_ratios(m, a, teacher) for m, a in zip(per_seed, alone, strict=True)]
    summary: dict[str, dict] = {"ne": {}, "auc": {}, "tr": {}}
    for key in per_seed[0]:
        task, metric, *domain = key.split("/")
        summary[metric]["/".join([task, *domain])] = spread([m[key] for m in per_seed])
    for key in ratios[0]:
        values = [r[key] for r in ratios]
        summary["tr"][key] = {**spread(values), "per_seed": values}
    return summary


def _cell(stat: dict[str, float]) -> str:
    if not np.isfinite(stat["mean"]):
        return "— (no teacher gain)"
    return f"{stat['mean']:.4f} ± {stat['std']:.4f}"


def format_markdown(report: dict) -> str:
    """A table per task: teacher and methods, with NE, AUC and TR (mean ± std over seeds), overall."""
    teacher = report["teacher"]["metrics"]
    lines = [f"# Transfer report ({len(report['seeds'])} seeds, test split `{report['test_split']}`)", ""]
    for task in TASKS:
        if f"{task}/ne" not in teacher:
            continue
        lines += [f"## {task}", "", "| model | NE | AUC | TR |", "| --- | --- | --- | --- |"]
        lines.append(f"| teacher | {teacher[f'{task}/ne']:.4f} | {teacher[f'{task}/auc']:.4f} | 1 |")
        for name, m in report["methods"].items():
            lines.append(f"| {name} | {_cell(m['ne'][task])} | {_cell(m['auc'][task])} | {_cell(m['tr'][task])} |")
        gain = report["teacher_gain"][task]
        lines += ["", f"Teacher gain ΔNE = NE_alone − NE_teacher: {_cell(gain)}" + _gain_note(gain["mean"]), ""]
    return "\n".join(lines)


def _gain_note(gain: float) -> str:
    return "" if gain > 0 else " (the teacher does not beat the student alone: TR is not a share of a gain)"


def plot_ratios(report: dict, path: Path) -> None:
    """Bar chart of TR (mean, std error bars) per method, for the tasks where the teacher has a gain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in report["methods"] if m != BASELINE]
    tasks = [
        t for t in TASKS
        if t in report["methods"][BASELINE]["tr"] and all(np.isfinite(report["methods"][m]["tr"][t]["mean"]) for m in methods)
    ]
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(methods), 3.5))
    if not tasks:
        ax.text(0.5, 0.5, "no task where the teacher beats the student alone:\nno transfer ratio to show",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    width = 0.8 / max(len(tasks), 1)
    for i, task in enumerate(tasks):
        stats = [report["methods"][m]["tr"][task] for m in methods]
        x = np.arange(len(methods)) + i * width
        ax.bar(x, [s["mean"] for s in stats], width, yerr=[s["std"] for s in stats], label=task, capsize=3)
    ax.set_xticks(np.arange(len(methods)) + width * (len(tasks) - 1) / 2, methods)
    if tasks:
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_ylabel("transfer ratio (ΔNE student / ΔNE teacher)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train_students(
    cfg: ReportConfig, base: ExperimentConfig, dirs: dict[str, str], manifest: dict, parent_run_id: str | None = None
) -> dict[str, list[dict]]:
    """Method -> per seed ``{"run_id", "checkpoint", "metrics"}`` with test-split NE/AUC.

    Students already in the ledger (module doc) are reused; each newly trained one is added to it at once.
    A student directory the ledger does not vouch for (another config, or a run cut short) is started over.
    """
    out = Path(cfg.out_dir)
    ledger = load_ledger(out)
    share = sharing_overrides(str(Path(cfg.teacher_ckpt).resolve()), cfg.share_policy, cfg.share_lr_scale)
    runs: dict[str, list[dict]] = {m: [] for m in cfg.methods}
    jobs = [(seed, method) for seed in seeds_of(cfg) for method in cfg.methods]
    for seed, method in tqdm(jobs, desc="students", unit="student"):
        student = student_config(base, method, seed, dirs, manifest, share)
        entry = reusable_student(ledger, student)
        if entry is None:
            discard_run(student)
            trained = train(student, parent_run_id=parent_run_id)
            entry = {
                "config_sha256": config_digest(student),
                "run_id": trained["run_id"],
                "checkpoint": trained["checkpoint"],
                "checkpoint_sha256": trained["checkpoint_sha256"],
                "metrics": split_metrics(trained["checkpoint"], base.data.test_split),
            }
            ledger[student.name] = entry
            atomic_write_text(out / LEDGER_FILE, json.dumps(ledger, indent=2, sort_keys=True))
        runs[method].append({k: entry[k] for k in ("run_id", "checkpoint", "metrics")})
    return runs


def seeds_of(cfg: ReportConfig) -> list[int]:
    return list(range(cfg.first_seed, cfg.first_seed + cfg.seeds))


def discard_run(cfg: ExperimentConfig) -> None:
    """Remove a student's run directory that holds a run of another config (the report's own output)."""
    path = run_dir(cfg)
    if holds_run(path):
        saved = saved_config(path)
        if saved is None or identity_differences(saved, cfg.to_dict()):
            shutil.rmtree(path)


def build_report(cfg: ReportConfig, base: ExperimentConfig, manifest: dict, teacher: dict, runs: dict[str, list[dict]]) -> dict:
    """The JSON report: inputs by reference, the teacher's test metrics, per method NE/AUC/TR, runs and checkpoints."""
    alone = [r["metrics"] for r in runs[BASELINE]]
    return {
        "teacher": {
            "checkpoint": str(Path(cfg.teacher_ckpt).resolve()),
            "checkpoint_sha256": manifest["teacher"]["checkpoint_sha256"],
            "run_id": manifest["teacher"]["mlflow_run_id"],
            "metrics": teacher,
        },
        "dataset": base.data.path,
        "student_flavor": base.name,
        "student_split": base.data.train_split,
        "test_split": base.data.test_split,
        "seeds": seeds_of(cfg),
        "teacher_gain": teacher_gain(alone, teacher),
        "methods": {
            m: {
                **summarize_method([r["metrics"] for r in rs], alone, teacher),
                "runs": [r["run_id"] for r in rs],
                "checkpoints": [r["checkpoint"] for r in rs],
            }
            for m, rs in runs.items()
        },
    }


def log_report(report: dict, files: list[Path], uri: str, experiment: str) -> str:
    """An MLflow ``transfer_report`` run with the files as artifacts and TR means as metrics."""
    teacher = {"mlflow_run_id": report["teacher"]["run_id"], "checkpoint_sha256": report["teacher"]["checkpoint_sha256"]}
    metrics = {
        f"tr/{method}/{key}": stat["mean"]
        for method, summary in report["methods"].items()
        for key, stat in summary["tr"].items()
    }
    return log_lineage_run(
        stage="transfer_report",
        run_name="transfer-report",
        teacher=teacher,
        tracking_uri=uri,
        experiment=experiment,
        tags={"dataset": report["dataset"]},
        metrics=metrics,
        artifacts=files,
    )


def run_transfer_report(cfg: ReportConfig, *, parent_run_id: str | None = None) -> Path:
    """Run the whole comparison (module doc) and return the path of ``transfer_report.json``; with
    ``parent_run_id`` its MLflow runs (teacher outputs, students, the report) are filed under that run."""
    data_path = str(Path(cfg.data_path or load_module(cfg.teacher_ckpt).cfg.data.path).resolve())
    base = student_base(cfg, data_path)
    uri = tracking_uri(base)
    dirs, manifest, output_runs = write_split_outputs(cfg, data_path, student_splits(base), uri)
    if parent_run_id:
        nest_under(parent_run_id, output_runs)
    teacher = split_metrics(cfg.teacher_ckpt, base.data.test_split, data_path)
    report = build_report(cfg, base, manifest, teacher, train_students(cfg, base, dirs, manifest, parent_run_id))
    out = Path(cfg.out_dir)
    json_path, md_path, png_path = out / REPORT_JSON, out / REPORT_MD, out / REPORT_PNG
    atomic_write_text(md_path, format_markdown(report))
    plot_ratios(report, png_path)
    atomic_write_text(json_path, report_json(report))
    report["mlflow_run_id"] = log_report(report, [json_path, md_path, png_path], uri, base.train.experiment)
    if parent_run_id:
        nest_under(parent_run_id, [report["mlflow_run_id"]])
    atomic_write_text(json_path, report_json(report))
    return json_path


def report_json(report: dict) -> str:
    """Strict JSON: an undefined metric (nan, e.g. NE in a domain without positives) is written as ``null``."""

    def strict(value):
        if isinstance(value, dict):
            return {k: strict(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [strict(v) for v in value]
        if isinstance(value, float) and not np.isfinite(value):
            return None
        return value

    return json.dumps(strict(report), indent=2, sort_keys=True, allow_nan=False)
