"""The main job: the whole mission on the embedded default, in minutes on a CPU (``gem quickstart``).

One run of a :class:`~gem.flavors.MissionRecipe` (default ``debug``), every stage an MLflow child run of one
``quickstart`` parent run:

1. **data**: the synthetic ads world (generated once, then reused);
2. **baseline**: the DLRM trained on the ``train`` window, scored on ``test``;
3. **teacher**: the GEM teacher, same data, scored on ``test``;
4. **students**: teacher outputs, then students on the later ``valid`` window, alone and with each transfer
   method, over several seeds, scored on ``test``, with transfer ratios (:mod:`gem.report`);
5. **export**: the teacher's user and item embeddings as a store version with its FAISS index;
6. **package**: the transfer-stack student registered as an MLflow model, after its latency budget is checked;
7. **request**: the registered model loaded back and one request scored.

It prints one table and writes ``OUT/report.json`` (``baseline``, ``teacher``, ``student_alone`` and
``student_distilled``, each ``{"click_ne", "conversion_ne"}``; ``transfer_ratio`` ``{"click", "conversion"}``,
null where the teacher has no gain to transfer; ``serving_p99_ms``; and the details). Stages that finished
are recorded in ``OUT/quickstart.json`` and reused by a rerun, which continues the same parent run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import mlflow

from foundation.config import apply_overrides
from foundation.data.io import atomic_write_text, sha256_file
from foundation.data.schema import TASKS
from gem.config import ExperimentConfig
from gem.evaluate import evaluate
from gem.flavors import MissionRecipe, get_flavor, mission_recipe
from gem.pipeline import ensure_world
from gem.report import BASELINE, ReportConfig, report_json, run_transfer_report
from gem.tracking import ensure_experiment, finish_parent_run, nest_under, start_parent_run
from gem.train import tracking_uri, train

STATE_FILE = "quickstart.json"
REPORT_FILE = "report.json"
MODEL_NAME = "gem-quickstart-student"
STAGES = ("data", "baseline", "teacher", "students", "export", "package", "request")


def stage_header(index: int, text: str) -> None:
    print(f"\n[{index}/{len(STAGES)}] {text}", flush=True)


def flavor_config(name: str, overrides: tuple[str, ...], data_path: str, out_dir: Path, seed: int) -> ExperimentConfig:
    cfg = apply_overrides(get_flavor(name), list(overrides))
    cfg.data.path = data_path
    cfg.train.out_dir = str(out_dir / "runs")
    cfg.train.seed = cfg.data.seed = seed
    cfg.name = f"{cfg.name}-s{seed}"
    return cfg


def test_metrics(ckpt: str) -> dict[str, float]:
    """NE and AUC per task on the test split."""
    metrics = evaluate(ckpt, "test")["metrics"]
    return {f"{task}_{m}": metrics[f"{task}/{m}"] for task in TASKS for m in ("ne", "auc") if f"{task}/{m}" in metrics}


def reusable(entry: dict | None) -> bool:
    """A recorded training stage whose checkpoint is still the one it recorded."""
    return bool(entry) and Path(entry["checkpoint"]).is_file() and sha256_file(entry["checkpoint"]) == entry["checkpoint_sha256"]


def train_and_score(cfg: ExperimentConfig, run_name: str, parent: str | None) -> dict[str, Any]:
    """Train (or continue) ``cfg`` under ``parent`` and score it on the test split."""
    result = train(cfg, parent_run_id=parent, run_name=run_name)
    return {
        "run_id": result["run_id"],
        "checkpoint": str(Path(result["checkpoint"]).resolve()),
        "checkpoint_sha256": result["checkpoint_sha256"],
        "metrics": test_metrics(result["checkpoint"]),
    }


def report_config(recipe: MissionRecipe, teacher: dict, data_path: str, out_dir: Path, seed: int, seeds: int) -> ReportConfig:
    return ReportConfig(
        teacher_ckpt=teacher["checkpoint"],
        out_dir=str(out_dir / "transfer"),
        data_path=data_path,
        flavor=recipe.student,
        methods=recipe.methods,
        seeds=seeds,
        first_seed=seed,
        student_split=recipe.student_split,
        overrides=recipe.student_overrides,
        teacher_run_id=teacher["run_id"] or "",
    )


def train_models(
    recipe: MissionRecipe, out_dir: Path, *, seed: int = 0, seeds: int | None = None, state: dict | None = None,
    parent: str | None = None, seconds: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Stages 1-4 (data, baseline, teacher, students) at training seed ``seed`` (students: ``seeds`` seeds from
    ``seed``). ``state`` (updated in place) holds stages finished before, which are reused; ``seconds`` gets
    each stage's wall time in this call. Returns the state."""
    state = {} if state is None else state
    seconds = {} if seconds is None else seconds
    clock = time.perf_counter()
    stage_header(1, f"data: synthetic world {recipe.preset!r} at {recipe.dataset}")
    data_path, generated = ensure_world(recipe.preset, recipe.dataset, recipe.synth_overrides, progress=True)
    state["data"] = {"path": data_path, "generated": generated}
    seconds["data"], clock = time.perf_counter() - clock, time.perf_counter()
    for index, (key, flavor, overrides, title) in enumerate(
        [("baseline", recipe.baseline, recipe.baseline_overrides, "DLRM baseline"),
         ("teacher", recipe.teacher, recipe.teacher_overrides, "GEM teacher")],
        start=2,
    ):
        stage_header(index, f"{key}: {title} ({flavor})")
        if not reusable(state.get(key)):
            cfg = flavor_config(flavor, overrides, data_path, out_dir, seed)
            state[key] = train_and_score(cfg, f"{key}: {title} {flavor} (seed {seed})", parent)
            save_state(out_dir, state)
        seconds[key], clock = time.perf_counter() - clock, time.perf_counter()
    stage_header(4, f"students: {recipe.student} alone, {', '.join(recipe.methods)} on {recipe.student_split!r}")
    cfg = report_config(recipe, state["teacher"], data_path, out_dir, seed, seeds or recipe.seeds)
    request = json.loads(json.dumps(dataclasses.asdict(cfg)))
    recorded = state.get("students")
    if recorded and recorded["request"] == request and Path(recorded["report"]).is_file():
        path = Path(recorded["report"])
    else:
        path = run_transfer_report(cfg, parent_run_id=parent)
    state["students"] = {"report": str(path), "request": request, **summarize_students(json.loads(path.read_text()), recipe)}
    save_state(out_dir, state)
    seconds["students"] = time.perf_counter() - clock
    return state


def save_state(out_dir: Path, state: dict) -> None:
    """Record the finished stages (``OUT/quickstart.json``), so a rerun after a kill resumes after them."""
    atomic_write_text(out_dir / STATE_FILE, json.dumps(state, indent=2, sort_keys=True))


def _mean(stats: dict, task: str) -> float | None:
    value = (stats.get(task) or {}).get("mean")
    return value if _defined(value) else None


def _std_where_defined(stats: dict, task: str) -> float | None:
    return stats[task]["std"] if _mean(stats, task) is not None else None


def summarize_students(report: dict, recipe: MissionRecipe) -> dict[str, Any]:
    """Per method NE/AUC (mean, std), TR where the teacher has a gain, and checkpoints; which method is the
    distilled student of the report and which is packaged (the last)."""
    methods = {}
    for name in (BASELINE, *recipe.methods):
        m = report["methods"][name]
        methods[name] = {
            "ne": {t: m["ne"][t] for t in TASKS if t in m["ne"]},
            "auc": {t: m["auc"][t] for t in TASKS if t in m["auc"]},
            "tr": {t: m["tr"][t] for t in TASKS if t in m["tr"] and name != BASELINE},
            "runs": m["runs"],
            "checkpoints": m["checkpoints"],
        }
    return {"methods": methods, "teacher_gain": {t: report["teacher_gain"][t] for t in TASKS},
            "distilled": recipe.distilled, "packaged": recipe.methods[-1]}


def export_store(state: dict, out_dir: Path, parent: str) -> dict:
    """Stage 5: the teacher's embeddings as a store version under ``OUT/store`` (reused while it verifies)."""
    from gem.module import load_trained
    from transfer.export import export_embeddings
    from transfer.store import StoreError, open_store

    recorded = state.get("export")
    if recorded and recorded.get("teacher_sha256") == state["teacher"]["checkpoint_sha256"]:
        try:
            open_store(recorded["store"], recorded["version"])
            return recorded
        except StoreError:
            pass
    teacher = load_trained(state["teacher"]["checkpoint"])
    report = export_embeddings(teacher, state["data"]["path"], out_dir / "store", tracking_uri=tracking_uri(), progress=True)
    nest_under(parent, [report.get("run_id")])
    return {"store": str((out_dir / "store").resolve()), "version": report["version"], "run_id": report.get("run_id"),
            "users": report["users"], "items": report["items"], "teacher_sha256": state["teacher"]["checkpoint_sha256"]}


def package_student(state: dict, recipe: MissionRecipe, parent: str) -> dict:
    """Stage 6: the transfer-stack student (first seed) checked against its budget and registered."""
    from gem.packaging import register_value_model
    from value_models.serving import LatencyBudget, ServingConfig

    ckpt = state["students"]["methods"][recipe.methods[-1]]["checkpoints"][0]
    recorded = state.get("package")
    if recorded and recorded.get("student_sha256") == sha256_file(ckpt) and recorded.get("store_version") == state["export"]["version"]:
        return recorded
    cfg = ServingConfig(budget=LatencyBudget(recipe.max_candidates, recipe.p99_ms))
    result = register_value_model(ckpt, state["export"]["store"], MODEL_NAME, cfg=cfg, tracking_uri=tracking_uri())
    nest_under(parent, [result["run_id"]])
    return {"model_uri": result["model_uri"], "version": result["version"], "run_id": result["run_id"],
            "form": result["form"], "p99_ms": result["latency"]["p99_ms"], "p50_ms": result["latency"]["p50_ms"],
            "budget_p99_ms": recipe.p99_ms, "max_candidates": recipe.max_candidates,
            "store_version": state["export"]["version"], "student_checkpoint": ckpt, "student_sha256": sha256_file(ckpt)}


def score_one_request(state: dict) -> dict:
    """Stage 7: load the registered model as a server would and score one user against ten items."""
    import pandas as pd

    from transfer.store import open_store

    store = open_store(state["export"]["store"], state["export"]["version"])
    user = int(store.side("user", "ids")[0])
    candidates = [int(i) for i in store.side("item", "ids")[:10]]
    request = {"user_id": user, "candidate_ids": candidates, "domain": 0}
    model = mlflow.pyfunc.load_model(state["package"]["model_uri"])
    (answer,) = model.predict(pd.DataFrame([request]))
    scores = {task: [round(float(s), 4) for s in values] for task, values in answer["scores"].items()}
    return {"request": request, "scores": scores, "version": answer["version"], "fallbacks": answer["fallbacks"]}


def mission_report(state: dict, recipe_name: str, seconds: dict[str, float]) -> dict[str, Any]:
    """``report.json``: the keys the quickstart promises (module doc), then the details behind them."""
    students = state["students"]["methods"]
    distilled = state["students"]["distilled"]

    def pair(metrics: dict) -> dict[str, float | None]:
        return {f"{t}_ne": metrics.get(f"{t}_ne") if _defined(metrics.get(f"{t}_ne")) else None for t in TASKS}

    def student_pair(method: str) -> dict[str, float | None]:
        return {f"{t}_ne": _mean(students[method]["ne"], t) for t in TASKS}

    return {
        "baseline": pair(state["baseline"]["metrics"]),
        "teacher": pair(state["teacher"]["metrics"]),
        "student_alone": student_pair(BASELINE),
        "student_distilled": student_pair(distilled),
        "transfer_ratio": {t: _mean(students[distilled]["tr"], t) for t in TASKS},
        "serving_p99_ms": state["package"]["p99_ms"],
        "recipe": recipe_name,
        "distilled_method": distilled,
        "packaged_method": state["students"]["packaged"],
        "transfer_ratio_std": {t: _std_where_defined(students[distilled]["tr"], t) for t in TASKS},
        "teacher_gain": state["students"]["teacher_gain"],
        "students": students,
        "baseline_run": state["baseline"], "teacher_run": state["teacher"],
        "export": state["export"], "package": state["package"], "request": state["request"],
        "mlflow_parent_run_id": state.get("parent_run_id"),
        "seconds": seconds,
    }


def _ne_auc(metrics: dict[str, float]) -> list[str]:
    keys = ("click_ne", "conversion_ne", "click_auc", "conversion_auc")
    return [f"{metrics[k]:.4f}" if _defined(metrics.get(k)) else "—" for k in keys]


def _defined(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _spread_cells(method: dict) -> list[str]:
    cells = []
    for metric, task in (("ne", "click"), ("ne", "conversion"), ("auc", "click"), ("auc", "conversion")):
        stat = method[metric].get(task) or {}
        defined = _mean(method[metric], task) is not None
        cells.append(f"{stat['mean']:.4f} ± {stat['std']:.4f}" if defined else "—")
    return cells


def _tr_cells(method: dict | None) -> list[str]:
    if method is None:
        return ["", ""]
    cells = []
    for task in TASKS:
        stat = method["tr"].get(task)
        cells.append(f"{stat['mean']:.2f} ± {stat['std']:.2f}" if _mean(method["tr"], task) is not None else "— (no teacher gain)")
    return cells


def format_table(report: dict) -> str:
    """The one table the quickstart prints: test NE/AUC per task per model, TR with spread, serving p99."""
    header = ["model", "click NE", "conversion NE", "click AUC", "conversion AUC", "click TR", "conversion TR"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines.append("| " + " | ".join(["DLRM baseline", *_ne_auc(report["baseline_run"]["metrics"]), "", ""]) + " |")
    lines.append("| " + " | ".join(["GEM teacher", *_ne_auc(report["teacher_run"]["metrics"]), "", ""]) + " |")
    for name, method in report["students"].items():
        label = "student alone" if name == BASELINE else f"student + {name}"
        tr = _tr_cells(None if name == BASELINE else method)
        lines.append("| " + " | ".join([label, *_spread_cells(method), *tr]) + " |")
    package = report["package"]
    lines.append("")
    lines.append(
        f"Students: mean ± std over {len(report['students'][BASELINE]['runs'])} seeds. TR = (NE_alone - NE_student) / "
        f"(NE_alone - NE_teacher), shown where the teacher beats the student alone at every seed. report.json's "
        f"student_distilled is student + {report['distilled_method']}. Serving the student + "
        f"{report['packaged_method']} ({package['form']}, "
        f"{package['max_candidates']} candidates, one CPU thread): p50 {package['p50_ms']:.2f} ms, "
        f"p99 {package['p99_ms']:.2f} ms (budget {package['budget_p99_ms']} ms); registered as {package['model_uri']}."
    )
    return "\n".join(lines)


def run_quickstart(
    recipe_name: str = "debug", out_dir: str | Path = "runs/quickstart", p99_ms: float | None = None
) -> dict[str, Any]:
    """Run (or resume) the mission (module doc); prints the table and returns the report. ``p99_ms`` replaces
    the recipe's latency budget for the packaged student."""
    recipe = mission_recipe(recipe_name)
    if p99_ms is not None:
        recipe = dataclasses.replace(recipe, p99_ms=p99_ms)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_FILE
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    if state.get("recipe") not in (None, recipe_name):
        raise ValueError(f"{out} holds a quickstart of recipe {state['recipe']!r}; pass another --out or remove {out}")
    state["recipe"] = recipe_name
    mlflow.set_tracking_uri(tracking_uri())
    experiment_id = ensure_experiment(get_flavor(recipe.student).train.experiment)
    state["parent_run_id"] = start_parent_run(
        experiment_id, f"quickstart ({recipe_name})", {"gem.stage": "quickstart", "gem.recipe": recipe_name},
        state.get("parent_run_id"),
    )
    save_state(out, state)
    parent, seconds, t0 = state["parent_run_id"], {}, time.perf_counter()
    try:
        train_models(recipe, out, state=state, parent=parent, seconds=seconds)
        clock = time.perf_counter()
        stage_header(5, "export: teacher embeddings -> embedding store + FAISS index")
        state["export"] = export_store(state, out, parent)
        save_state(out, state)
        seconds["export"], clock = time.perf_counter() - clock, time.perf_counter()
        stage_header(6, f"package: {recipe.methods[-1]} student, p99 budget {recipe.p99_ms} ms at {recipe.max_candidates} candidates")
        state["package"] = package_student(state, recipe, parent)
        save_state(out, state)
        seconds["package"], clock = time.perf_counter() - clock, time.perf_counter()
        stage_header(7, f"request: {state['package']['model_uri']} scores one user")
        state["request"] = score_one_request(state)
        save_state(out, state)
        seconds["request"] = time.perf_counter() - clock
    except BaseException:
        finish_parent_run(parent, "FAILED")
        raise
    seconds["total"] = time.perf_counter() - t0
    report = mission_report(state, recipe_name, seconds)
    atomic_write_text(out / REPORT_FILE, report_json(report))
    mlflow.MlflowClient().log_text(parent, format_table(report), "quickstart_table.md")
    mlflow.MlflowClient().log_artifact(parent, str(out / REPORT_FILE))
    for key in ("baseline", "teacher", "student_alone", "student_distilled"):
        for metric, value in report[key].items():
            if value is not None:
                mlflow.MlflowClient().log_metric(parent, f"{key}/{metric}", value)
    finish_parent_run(parent)
    print("\nTest split (the latest time window):\n" + format_table(report))
    print(f"\nOne request: user {state['request']['request']['user_id']} -> click "
          f"{state['request']['scores'].get('click')}\nWrote {out / REPORT_FILE}")
    return report
