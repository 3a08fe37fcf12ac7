"""MLflow runs of the transfer stages, with the lineage tags that lead back to the teacher.

Every stage that consumes a teacher checkpoint (teacher outputs, embedding export, transfer report) is
one MLflow run tagged ``gem.stage``, ``gem.teacher_run_id`` (empty when the teacher was trained outside
MLflow) and ``gem.checkpoint_sha256``. Student training runs carry the same two teacher tags
(:func:`gem.train.transfer_lineage`), so a served value model can be followed back to its data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path


def lineage_tags(stage: str, teacher: dict, **extra: str) -> dict[str, str]:
    """``gem.stage``, ``gem.teacher_run_id``, ``gem.checkpoint_sha256`` and ``gem.<key>`` per extra tag.

    ``teacher`` is a manifest's ``teacher`` entry (``mlflow_run_id``, ``checkpoint_sha256``).
    """
    tags = {
        "gem.stage": stage,
        "gem.teacher_run_id": teacher.get("mlflow_run_id") or "",
        "gem.checkpoint_sha256": teacher["checkpoint_sha256"],
    }
    tags.update({f"gem.{key}": str(value) for key, value in extra.items()})
    return tags


def log_lineage_run(
    *,
    stage: str,
    run_name: str,
    teacher: dict,
    tracking_uri: str,
    experiment: str = "gem",
    tags: dict[str, str] | None = None,
    params: dict | None = None,
    metrics: dict[str, float] | None = None,
    documents: dict[str, dict] | None = None,
    artifacts: Iterable[str | Path] = (),
) -> str:
    """Record one finished stage as an MLflow run and return its id.

    ``tags`` are extra ``gem.<key>`` lineage tags (e.g. ``export_version``); ``documents`` maps an artifact
    file name to a JSON document (a manifest); ``artifacts`` are files logged as they are. Non-finite
    metrics are left out (MLflow would store them, but they are no measurement).
    """
    # Imported here: the transfer stages also run on machines without MLflow when not tracked.
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=run_name) as run:
        mlflow.set_tags(lineage_tags(stage, teacher, **(tags or {})))
        if params:
            mlflow.log_params(params)
        finite = {k: float(v) for k, v in (metrics or {}).items() if v is not None and math.isfinite(v)}
        if finite:
            mlflow.log_metrics(finite)
        for name, document in (documents or {}).items():
            mlflow.log_dict(document, name)
        for path in artifacts:
            mlflow.log_artifact(str(path))
        return run.info.run_id
