"""The embedded default end to end: data -> teacher -> teacher outputs -> students -> transfer report.

``gem pipeline --preset debug --out outputs/pipeline-debug`` runs, on one CPU machine:

1. **data**: the synthetic ads world ``preset`` at ``data_path`` (default ``data/synth-<preset>``);
2. **teacher**: the preset's GEM teacher flavor (:data:`gem.flavors.PRESET_FLAVORS`), trained under ``OUT/runs``, or
   an existing checkpoint (``teacher_ckpt``, e.g. one trained on a GPU, with its MLflow ``teacher_run_id``);
3. **report**: :func:`gem.report.run_transfer_report` (teacher outputs, every transfer method's
   students over ``seeds`` seeds, NE/AUC/TR) under ``OUT/report``.

By default the students train on ``valid``, the window after the teacher's ``train`` (staleness: the
world drifts, so the teacher's labels are stale there; see :mod:`gem.report`).

Resume: a rerun skips every stage whose output exists and verifies, and finishes the others.

- data: a dataset is complete once its ``schema.json`` exists (the generator writes it last); an existing
  synthetic dataset must record the requested generator config in ``synth.json``, else it is an error
  (the pipeline never overwrites a dataset).
- teacher: a finished teacher is recorded in ``OUT/pipeline.json`` with its checkpoint's sha256 and reused
  while the file still matches; an interrupted one resumes from its ``last.ckpt``.
- report: skipped when ``OUT/report/transfer_report.json`` was written for the same teacher checkpoint and
  the same report request (methods, seeds, split, student flavor and overrides, sharing policy), as recorded
  in ``OUT/pipeline.json``; otherwise the report reuses finished teacher-output shards and students.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import mlflow

from foundation.checkpoint import checkpoint_run_id
from foundation.config import apply_overrides
from foundation.data.io import atomic_write_text, sha256_file
from foundation.data.schema import SCHEMA_FILE
from foundation.data.synthetic import STATS_FILE, generate_world
from gem.flavors import PRESET_FLAVORS, STUDENT_METHODS, SYNTH_PRESETS, get_flavor, synth_preset
from gem.module import load_module
from gem.report import REPORT_JSON, ReportConfig, run_transfer_report
from gem.tracking import ensure_experiment, finish_parent_run, start_parent_run
from gem.train import tracking_uri, train

STATE_FILE = "pipeline.json"


class PipelineError(ValueError):
    """A stage's existing output cannot be reused (e.g. a dataset generated with another config)."""


@dataclass
class PipelineConfig:
    """What :func:`run_pipeline` runs; empty fields take the preset's defaults.

    ``synth_overrides`` are ``field=value`` overrides of the generator preset; ``teacher_overrides`` and
    ``student_overrides`` apply to the teacher and student flavors (e.g. ``train.max_steps=50``).
    """

    out_dir: str
    preset: str = "debug"
    data_path: str = ""
    synth_overrides: tuple[str, ...] = ()
    teacher_ckpt: str = ""
    teacher_run_id: str = ""
    teacher_flavor: str = ""
    teacher_overrides: tuple[str, ...] = ()
    student_flavor: str = ""
    student_overrides: tuple[str, ...] = ()
    methods: tuple[str, ...] = tuple(STUDENT_METHODS)
    seeds: int = 2
    student_split: str = "valid"
    rows_per_shard: int = 65536
    share_policy: str = "freeze"
    share_lr_scale: float = 0.1

    def __post_init__(self) -> None:
        if self.preset not in SYNTH_PRESETS:
            raise PipelineError(f"unknown synth preset {self.preset!r}; known: {sorted(SYNTH_PRESETS)}")
        teacher, student = PRESET_FLAVORS.get(self.preset, ("", ""))
        self.teacher_flavor = self.teacher_flavor or teacher
        self.student_flavor = self.student_flavor or student
        if not self.student_flavor or not (self.teacher_flavor or self.teacher_ckpt):
            raise PipelineError(f"preset {self.preset!r} has no default flavors; set teacher_flavor and student_flavor")
        self.data_path = self.data_path or f"data/synth-{self.preset}"


def load_state(out_dir: Path) -> dict:
    path = out_dir / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def save_state(out_dir: Path, state: dict) -> None:
    atomic_write_text(out_dir / STATE_FILE, json.dumps(state, indent=2, sort_keys=True))


def ensure_data(cfg: PipelineConfig) -> tuple[str, bool]:
    """``(dataset path, generated now)`` of the pipeline's world (:func:`ensure_world`)."""
    return ensure_world(cfg.preset, cfg.data_path, cfg.synth_overrides)


def ensure_world(preset: str, data_path: str, synth_overrides: tuple[str, ...] = (), *, progress: bool = False) -> tuple[str, bool]:
    """``(dataset path, generated now)``: the synthetic world ``preset`` (with ``field=value`` overrides) is
    generated at ``data_path`` unless a finished one with the same generator config is there; one generated
    with another config is an error (a dataset is never overwritten)."""
    path = Path(data_path)
    synth = apply_overrides(synth_preset(preset), list(synth_overrides))
    wanted = json.loads(json.dumps(dataclasses.asdict(synth)))
    if (path / SCHEMA_FILE).is_file():
        stats_file = path / STATS_FILE
        if stats_file.is_file():
            recorded = json.loads(stats_file.read_text())["config"]
            diff = sorted(k for k in wanted if recorded.get(k) != wanted[k])
            if diff:
                raise PipelineError(
                    f"{path} holds a synthetic world generated with another config (differs in {diff}); "
                    "point data_path elsewhere or remove it"
                )
        return str(path.resolve()), False
    generate_world(synth, path, progress=progress)
    return str(path.resolve()), True


def ensure_teacher(cfg: PipelineConfig, data_path: str, out_dir: Path, state: dict, parent_run_id: str | None = None) -> dict:
    """The teacher checkpoint: the given one, the recorded finished one, or one trained (resumed) now."""
    if cfg.teacher_ckpt:
        ckpt = Path(cfg.teacher_ckpt)
        if not ckpt.is_file():
            raise FileNotFoundError(f"{ckpt}: teacher checkpoint not found")
        load_module(ckpt)  # a gem training checkpoint, readable, with its config: fail here, not in a later stage
        run_id = cfg.teacher_run_id or checkpoint_run_id(ckpt) or ""
        sha = sha256_file(ckpt)
        return {"checkpoint": str(ckpt.resolve()), "checkpoint_sha256": sha, "run_id": run_id, "trained": False}
    recorded = state.get("teacher")
    if recorded and recorded.get("flavor") == cfg.teacher_flavor and _unchanged(recorded):
        return {**recorded, "trained": False}
    teacher_cfg = apply_overrides(get_flavor(cfg.teacher_flavor), list(cfg.teacher_overrides))
    teacher_cfg.data.path = data_path
    teacher_cfg.train.out_dir = str(out_dir / "runs")
    result = train(teacher_cfg, resume=True, parent_run_id=parent_run_id, run_name=f"teacher {cfg.teacher_flavor}")
    return {
        "flavor": cfg.teacher_flavor,
        "checkpoint": str(Path(result["checkpoint"]).resolve()),
        "checkpoint_sha256": result["checkpoint_sha256"],
        "run_id": result["run_id"],
        "trained": True,
    }


def _unchanged(recorded: dict) -> bool:
    path = Path(recorded["checkpoint"])
    return path.is_file() and sha256_file(path) == recorded["checkpoint_sha256"]


def report_is_current(path: Path, request: dict, state: dict, teacher: dict) -> bool:
    """Whether ``path`` is a finished report (logged to MLflow) of exactly this ``request`` and teacher checkpoint."""
    if not path.is_file() or state.get("report_request") != request:
        return False
    report = json.loads(path.read_text())
    return report["teacher"]["checkpoint_sha256"] == teacher["checkpoint_sha256"] and "mlflow_run_id" in report


def run_pipeline(cfg: PipelineConfig) -> Path:
    """Run (or resume) every stage (module doc) and return the path of ``transfer_report.json``."""
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = load_state(out_dir)
    data_path, generated = ensure_data(cfg)
    state["data"] = {"path": data_path}
    parent = open_parent_run(cfg, state)
    save_state(out_dir, state)
    try:
        path = run_stages(cfg, out_dir, state, data_path, generated, parent)
    except BaseException:
        finish_parent_run(parent, "FAILED")
        raise
    finish_parent_run(parent)
    return path


def open_parent_run(cfg: PipelineConfig, state: dict) -> str:
    """The pipeline's MLflow run (recorded in the state, so a resumed pipeline continues it); stages nest under it."""
    # The stages' store and experiment (the student overrides may set them): the parent must be where they are.
    student = apply_overrides(get_flavor(cfg.student_flavor), list(cfg.student_overrides))
    mlflow.set_tracking_uri(tracking_uri(student))
    experiment_id = ensure_experiment(student.train.experiment)
    tags = {"gem.stage": "pipeline", "gem.preset": cfg.preset, "gem.out_dir": str(Path(cfg.out_dir).resolve())}
    state["mlflow_parent_run_id"] = start_parent_run(
        experiment_id, f"pipeline {cfg.preset}", tags, state.get("mlflow_parent_run_id")
    )
    return state["mlflow_parent_run_id"]


def run_stages(cfg: PipelineConfig, out_dir: Path, state: dict, data_path: str, generated: bool, parent: str) -> Path:
    """The teacher and report stages of :func:`run_pipeline`, recorded in ``state`` as they finish."""
    teacher = ensure_teacher(cfg, data_path, out_dir, state, parent)
    state["teacher"] = {k: v for k, v in teacher.items() if k != "trained"}
    save_state(out_dir, state)
    report_cfg = ReportConfig(
        teacher_ckpt=teacher["checkpoint"],
        out_dir=str(out_dir / "report"),
        data_path=data_path,
        flavor=cfg.student_flavor,
        methods=cfg.methods,
        seeds=cfg.seeds,
        student_split=cfg.student_split,
        rows_per_shard=cfg.rows_per_shard,
        overrides=cfg.student_overrides,
        teacher_run_id=teacher["run_id"],
        share_policy=cfg.share_policy,
        share_lr_scale=cfg.share_lr_scale,
    )
    request = json.loads(json.dumps(dataclasses.asdict(report_cfg)))
    path = Path(report_cfg.out_dir) / REPORT_JSON
    reused = report_is_current(path, request, state, teacher)
    if not reused:
        state.pop("report_request", None)
        save_state(out_dir, state)
        path = run_transfer_report(report_cfg, parent_run_id=parent)
    state["report_request"] = request
    state["stages"] = {"data": "generated" if generated else "reused",
                       "teacher": "trained" if teacher["trained"] else "reused",
                       "report": "reused" if reused else "written"}
    state["report"] = str(path.resolve())
    save_state(out_dir, state)
    return path
