"""MLflow packaging of a value model: a models-from-code ``mlflow.pyfunc`` bundling the student, its store
and its budget, loaded without unpickling anything.

:func:`register_value_model` checks the model before it is registered: every serving form in ``forms``
must match eager within tolerance, the fastest one is chosen, and its p99 at the budget's candidate count
on one CPU thread must be within the budget, else :class:`value_models.serving.BudgetError` refuses it.
The packaged model holds:

- the model code, ``value_model_code.py`` (:mod:`gem.value_model_code`), which MLflow runs to build the
  :class:`GemValueModel` (models from code: no ``python_model.pkl``);
- ``student/``: the student's tensors as ``student.safetensors`` and its run config and schema as
  ``student.json`` (:func:`value_models.serving.save_student_files`); their sha256 are recorded in
  ``serving.json`` and checked before they are read;
- ``store``: a copy of the one store version when its files total at most ``bundle_store_max_bytes``,
  otherwise nothing (the model then points at the store directory and version named in ``serving.json``);
  the store's manifest checksums are verified when it is opened. Its arrays load with
  ``allow_pickle=False``, its index with FAISS;
- ``serving.json``: the budget, staleness limits, chosen form, the student files' sha256 and the store
  pointer (path, version, teacher checkpoint sha256), so lineage runs from the served model back to the teacher.

Whoever can write the artifact store can still change the code file, as with any installed code; what
no longer happens is a pickle, which would run code while the weights are merely being read.

REST requests (``mlflow models serve``): ``{"dataframe_records": [{"user_id": 3, "candidate_ids": [1, 2],
"domain": 0}]}``, optional fields ``dense`` and ``now`` (:data:`value_models.serving.CONTEXT_FIELDS`), or the
same fields as one object under ``"inputs"``. Each answer is ``{"version", "scores": {task: [N]},
"fallbacks", "stale_store"}``. A bad request (a wrong type, a ragged list, an id past int64, a body nested
deeper than :data:`gem.rest_guard.MAX_DEPTH`, invalid JSON) gets ``MlflowException(INVALID_PARAMETER_VALUE)``,
HTTP 400, with one line naming the request and field: the model checks each body before MLflow parses it
(:mod:`gem.rest_guard`) and again in ``predict``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import mlflow
import numpy as np
import safetensors
import torch
from mlflow.exceptions import MlflowException

from foundation.data.io import atomic_write_text, sha256_file
from foundation.messages import shown
from gem.rest_guard import install_request_guard
from transfer.store import LATEST_FILE, open_store, version_name
from value_models.serving import (
    CONTEXT_FIELDS,
    LatencyBudget,
    Scorer,
    ScoringError,
    ServingConfig,
    build_form,
    check_budget,
    check_equivalence,
    example_inputs,
    load_student,
    load_student_files,
    measure_latency,
    save_student_files,
)

REQUEST_FIELDS = ("user_id", "candidate_ids", *CONTEXT_FIELDS)
BUNDLE_STORE_MAX_BYTES = 64 << 20
SERVING_FILE = "serving.json"
MODEL_CODE = Path(__file__).with_name("value_model_code.py")


def _absent(value) -> bool:
    """A cell pandas filled for a field this record did not send."""
    return value is None or (isinstance(value, float) and np.isnan(value))


def requests_from_input(model_input) -> list[dict]:
    """Scoring requests from what the MLflow scoring server parsed: a DataFrame, a dict or a list of dicts."""
    if hasattr(model_input, "to_dict") and hasattr(model_input, "columns"):
        records = model_input.to_dict(orient="records")
    elif isinstance(model_input, dict):
        records = [{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in model_input.items()}]
    elif isinstance(model_input, list) and all(isinstance(r, dict) for r in model_input):
        records = model_input
    else:
        raise ScoringError(
            f"expected request records with fields {list(REQUEST_FIELDS)}, got {type(model_input).__name__}"
        )
    out = []
    for i, record in enumerate(records):
        fields = {k: v for k, v in record.items() if not _absent(v)}
        if unknown := sorted(set(fields) - set(REQUEST_FIELDS)):
            raise ScoringError(f"request {i}: unknown fields {shown(unknown)}; allowed: {list(REQUEST_FIELDS)}")
        if missing := [k for k in ("user_id", "candidate_ids", "domain") if k not in fields]:
            raise ScoringError(f"request {i}: missing fields {missing}")
        out.append(fields)
    return out


def records_of_payload(payload) -> list | None:
    """The request records of a parsed REST body (``dataframe_records``, ``dataframe_split``, ``inputs`` or
    ``instances``); None for a body in no format this model reads (MLflow's parser then answers)."""
    if not isinstance(payload, dict):
        return None
    if isinstance(records := payload.get("dataframe_records"), list):
        return records
    split = payload.get("dataframe_split")
    if isinstance(split, dict) and isinstance(split.get("columns"), list) and isinstance(split.get("data"), list):
        return [dict(zip(split["columns"], row, strict=False)) if isinstance(row, list) else row for row in split["data"]]
    for key in ("inputs", "instances"):
        if isinstance(value := payload.get(key), dict):
            return [value]
        if isinstance(value, list):
            return value
    return None


class GemValueModel(mlflow.pyfunc.PythonModel):
    """The pyfunc: loads a :class:`Scorer` from the artifacts (no pickle), checks and scores request records."""

    def load_context(self, context) -> None:
        spec = json.loads(Path(context.artifacts[SERVING_FILE]).read_text())
        bundled = "store" in context.artifacts
        cfg = ServingConfig(
            budget=LatencyBudget(**spec["budget"]),
            max_store_age_s=spec["max_store_age_s"],
            max_user_age=spec["max_user_age"],
            form=spec["form"],
            follow_latest=spec["store"]["follow_latest"] and not bundled,
        )
        # The budget is per request on one thread; the server's concurrency comes from its workers.
        torch.set_num_threads(1)
        store = context.artifacts["store"] if bundled else spec["store"]["path"]
        version = None if cfg.follow_latest else spec["store"]["version"]
        student = load_student_files(
            context.artifacts["student"],
            weights_sha256=spec["student"]["weights_sha256"],
            config_sha256=spec["student"]["config_sha256"],
        )
        self.scorer = Scorer(student, store, cfg, version=version, model_name=spec["name"])
        install_request_guard(self.check_payload)

    def check_payload(self, payload) -> None:
        """Validate a parsed REST body's requests before MLflow converts them (:mod:`gem.rest_guard`);
        raises :class:`ScoringError` naming the request and field."""
        records = records_of_payload(payload)
        if records is None:
            return
        for i, req in enumerate(requests_from_input(records)):
            try:
                self.scorer.validate(req["user_id"], req["candidate_ids"], {k: req[k] for k in CONTEXT_FIELDS if k in req})
            except ScoringError as exc:
                raise ScoringError(f"request {i}: {exc}") from None

    def predict(self, context, model_input, params=None) -> list[dict]:
        try:
            requests = requests_from_input(model_input)
            results = []
            for i, req in enumerate(requests):
                ctx = {k: req[k] for k in CONTEXT_FIELDS if k in req}
                try:
                    results.append(self.scorer.score(req["user_id"], req["candidate_ids"], ctx).to_json())
                except ScoringError as exc:
                    raise ScoringError(f"request {i}: {exc}") from exc
            return results
        except ScoringError as exc:
            raise MlflowException.invalid_parameter_value(str(exc)) from exc


def choose_form(scorer: Scorer, forms: tuple[str, ...], *, iters: int = 200) -> dict:
    """Serve the fastest of ``forms`` (p99 at the budget size, one thread) that matches eager; returns the table."""
    examples = [
        example_inputs(scorer, n, seed=s) for s, n in enumerate((1, 7, scorer.cfg.budget.max_candidates))
    ]
    eager = build_form(scorer.module, "eager", examples[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    table = {}
    try:
        for form in forms:
            scorer.set_form(form)
            diff = check_equivalence(scorer.runner, eager, examples)
            table[form] = {
                **measure_latency(scorer, scorer.cfg.budget.max_candidates, iters=iters),
                "max_abs_diff": diff,
            }
    finally:
        torch.set_num_threads(threads)
    best = min(table, key=lambda f: table[f]["p99_ms"])
    scorer.set_form(best)
    return {"form": best, "forms": table}


def _bundle_store(store_root: Path, version: int, out: Path) -> Path:
    """A store directory holding only ``version`` (copied) and a ``LATEST`` naming it."""
    shutil.copytree(store_root / version_name(version), out / version_name(version))
    atomic_write_text(out / LATEST_FILE, version_name(version) + "\n")
    return out


def register_value_model(
    student_ckpt: str | Path,
    store_root: str | Path,
    name: str,
    *,
    alias: str = "champion",
    cfg: ServingConfig | None = None,
    forms: tuple[str, ...] = ("inference_mode", "torchscript"),
    tracking_uri: str | None = None,
    experiment: str = "gem",
    bundle_store_max_bytes: int = BUNDLE_STORE_MAX_BYTES,
) -> dict:
    """Check, package and register a value model as ``models:/{name}@{alias}`` (module doc).

    Raises :class:`BudgetError` when the fastest equivalent form is over the budget. Returns
    ``{"name", "version", "alias", "model_uri", "run_id", "form", "latency", "store_version", "bundled"}``.
    """
    cfg = cfg or ServingConfig()
    store_root = Path(store_root)
    scorer = Scorer(load_student(student_ckpt), store_root, cfg, model_name=name)
    choice = choose_form(scorer, forms)
    latency = check_budget(scorer)
    store = open_store(store_root, scorer.version, verify=False)
    store_bytes = sum(entry["bytes"] for entry in store.manifest["files"].values())
    bundled = store_bytes <= bundle_store_max_bytes
    spec = {
        "name": name,
        "budget": asdict(cfg.budget),
        "max_store_age_s": cfg.max_store_age_s,
        "max_user_age": cfg.max_user_age,
        "form": choice["form"],
        "store": {
            "path": str(store_root.resolve()),
            "version": scorer.version,
            "bundled": bundled,
            "follow_latest": cfg.follow_latest,
            "teacher_checkpoint_sha256": store.manifest["teacher"]["checkpoint_sha256"],
        },
    }
    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(experiment)
    with tempfile.TemporaryDirectory() as tmp, mlflow.start_run(run_name=f"package-{name}") as run:
        spec["student"] = save_student_files(student_ckpt, Path(tmp) / "student")
        artifacts = {
            "student": str(Path(tmp) / "student"),
            SERVING_FILE: str(atomic_write_text(Path(tmp) / SERVING_FILE, json.dumps(spec, indent=2))),
        }
        if bundled:
            artifacts["store"] = str(_bundle_store(store_root, scorer.version, Path(tmp) / "store"))
        mlflow.set_tags(
            {
                "gem.stage": "package",
                "gem.export_version": str(scorer.version),
                "gem.student_sha256": sha256_file(student_ckpt),
                "gem.student_weights_sha256": spec["student"]["weights_sha256"],
                "gem.checkpoint_sha256": spec["store"]["teacher_checkpoint_sha256"],
                "gem.teacher_run_id": store.manifest["teacher"]["mlflow_run_id"] or "",
            }
        )
        mlflow.log_params(
            {
                "form": choice["form"],
                "max_candidates": cfg.budget.max_candidates,
                "p99_budget_ms": cfg.budget.p99_ms,
                "store_bundled": bundled,
            }
        )
        mlflow.log_metrics({"p50_ms": latency["p50_ms"], "p99_ms": latency["p99_ms"]})
        mlflow.log_dict(choice, "forms.json")
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=str(MODEL_CODE),
            artifacts=artifacts,
            registered_model_name=name,
            pip_requirements=[
                f"torch=={torch.__version__.split('+')[0]}",
                f"mlflow=={mlflow.__version__}",
                f"safetensors=={safetensors.__version__}",
            ],
        )
    client = mlflow.MlflowClient()
    version = info.registered_model_version
    client.set_registered_model_alias(name, alias, version)
    return {
        "name": name,
        "version": int(version),
        "alias": alias,
        "model_uri": f"models:/{name}@{alias}",
        "run_id": run.info.run_id,
        "form": choice["form"],
        "latency": latency,
        "store_version": scorer.version,
        "bundled": bundled,
        "forms": choice["forms"],
    }
