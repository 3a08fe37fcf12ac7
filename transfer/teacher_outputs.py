"""The teacher-output service: run a trained teacher once over a split and store what students learn from.

ExFM's "data augmentation service": instead of running the expensive teacher inside every student's
training loop, its predictions are computed once and joined to the events by ``example_id``.

Layout of an output directory::

    manifest.json          teacher run id, checkpoint sha256, output schema, row counts, checksums
    part-00000.parquet     rows [0, R) of the split in eval order
    part-00001.parquet     rows [R, 2R) ...

One row per example: ``example_id``, ``user_id``, ``item_id``, ``domain``, per task ``{task}_logit``
and ``{task}_prob`` (the soft label), and ``user_repr`` / ``item_repr`` as fixed-size float32 lists.

Resume: shard ``k`` always covers rows ``[k*R, (k+1)*R)`` of the split's eval order (source shards in
name order, row groups in order, rows in order: the order of a non-training ``EventStream``), and is
batched the same way on every run, so recomputing it gives the same rows. Each shard is written
atomically, then the manifest (rewritten atomically after every shard) records its checksum. A
restarted run skips the shards whose file still matches its recorded checksum and recomputes the
rest, so an interrupted run ends with no duplicated and no missing rows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn
from tqdm.auto import tqdm

from foundation.checkpoint import TrainedModel, checkpoint_run_id
from foundation.data.batch import JaggedBatch
from foundation.data.io import atomic_write_text, iter_valid_row_groups, list_shards, sha256_file, write_table
from foundation.data.pipeline import RowBlock, build_batch, table_to_block
from foundation.data.schema import SCHEMA_FILE, EventSchema
from foundation.model.outputs import ModelOutput
from transfer.lineage import log_lineage_run

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
ID_COLUMNS = ("example_id", "user_id", "item_id", "domain")


class TeacherOutputsError(ValueError):
    """Teacher outputs that cannot be used as asked: wrong teacher, wrong schema, corrupt or incomplete."""


@dataclass(frozen=True)
class OutputSchema:
    """What a teacher-output table holds: the tasks it has soft labels for and the representation dims.

    A dim of ``None`` means the teacher has no such representation and the column is absent.
    """

    tasks: tuple[str, ...]
    user_repr_dim: int | None
    item_repr_dim: int | None

    def arrow_schema(self) -> pa.Schema:
        fields = [
            pa.field("example_id", pa.int64(), nullable=False),
            pa.field("user_id", pa.int64(), nullable=False),
            pa.field("item_id", pa.int64(), nullable=False),
            pa.field("domain", pa.int32(), nullable=False),
        ]
        for task in self.tasks:
            fields += [
                pa.field(f"{task}_logit", pa.float32(), nullable=False),
                pa.field(f"{task}_prob", pa.float32(), nullable=False),
            ]
        for name, dim in (("user_repr", self.user_repr_dim), ("item_repr", self.item_repr_dim)):
            if dim is not None:
                fields.append(pa.field(name, pa.list_(pa.float32(), dim), nullable=False))
        return pa.schema(fields)

    def to_dict(self) -> dict:
        return {**asdict(self), "tasks": list(self.tasks)}

    @classmethod
    def from_dict(cls, d: dict) -> OutputSchema:
        return cls(tasks=tuple(d["tasks"]), user_repr_dim=d["user_repr_dim"], item_repr_dim=d["item_repr_dim"])


@dataclass(frozen=True)
class ShardPlan:
    """Output shard ``index`` covers eval-order rows ``[start, stop)``.

    ``pieces`` are ``(source file, row group, first row, end row)`` with rows local to the row group.
    """

    index: int
    start: int
    stop: int
    pieces: tuple[tuple[Path, int, int, int], ...]

    @property
    def file_name(self) -> str:
        return f"part-{self.index:05d}.parquet"


def plan_shards(dataset_dir: str | Path, split: str, rows_per_shard: int) -> list[ShardPlan]:
    """Cut the split's eval order into consecutive ranges of ``rows_per_shard`` rows (the last may be short)."""
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be positive, got {rows_per_shard}")
    units = []
    for path in list_shards(dataset_dir, split):
        meta = pq.ParquetFile(path).metadata
        units += [(path, rg, meta.row_group(rg).num_rows) for rg in range(meta.num_row_groups)]
    plans, pieces, start, filled = [], [], 0, 0
    for path, rg, n in units:
        lo = 0
        while lo < n:
            take = min(n - lo, rows_per_shard - filled)
            pieces.append((path, rg, lo, lo + take))
            lo, filled = lo + take, filled + take
            if filled == rows_per_shard:
                plans.append(ShardPlan(len(plans), start, start + filled, tuple(pieces)))
                pieces, start, filled = [], start + filled, 0
    if filled:
        plans.append(ShardPlan(len(plans), start, start + filled, tuple(pieces)))
    return plans


class BlockReader:
    """Reads row groups as ``RowBlock`` s, keeping the last one: consecutive output shards often share one."""

    def __init__(self, schema: EventSchema) -> None:
        self.schema = schema
        self.key: tuple[Path, int] | None = None
        self.block: RowBlock | None = None

    def get(self, path: Path, rg: int) -> RowBlock:
        if self.key != (path, rg):
            # policy "error": a dropped row would shift every later shard's range, breaking resume.
            ((_, table),) = iter_valid_row_groups(path, self.schema, policy="error", row_groups=[rg])
            self.key, self.block = (path, rg), table_to_block(table, self.schema)
        return self.block


def iter_shard_batches(
    plan: ShardPlan, reader: BlockReader, batch_size: int, max_len: int
) -> Iterator[JaggedBatch]:
    """The shard's rows in order as batches of at most ``batch_size`` rows (histories cut to ``max_len``)."""
    pending: list[tuple[RowBlock, np.ndarray]] = []
    size = 0
    for path, rg, lo, hi in plan.pieces:
        block = reader.get(path, rg)
        while lo < hi:
            take = min(hi - lo, batch_size - size)
            pending.append((block, np.arange(lo, lo + take)))
            lo, size = lo + take, size + take
            if size == batch_size:
                yield build_batch(pending, reader.schema, max_len, None)
                pending, size = [], 0
    if pending:
        yield build_batch(pending, reader.schema, max_len, None)


def outputs_to_table(batch: JaggedBatch, out: ModelOutput, schema: OutputSchema) -> pa.Table:
    """One batch's ``ModelOutput`` (logits ``[B]`` per task, reprs ``[B, d]``) as rows of ``schema``."""
    cols: dict[str, pa.Array] = {
        "example_id": pa.array(batch.example_id.cpu().numpy(), pa.int64()),
        "user_id": pa.array(batch.user_id.cpu().numpy(), pa.int64()),
        "item_id": pa.array(batch.candidate.cpu().numpy(), pa.int64()),
        "domain": pa.array(batch.domain.cpu().numpy().astype(np.int32), pa.int32()),
    }
    for task in schema.tasks:
        logit = out.logits[task].detach().float()
        cols[f"{task}_logit"] = pa.array(logit.cpu().numpy(), pa.float32())
        cols[f"{task}_prob"] = pa.array(torch.sigmoid(logit).cpu().numpy(), pa.float32())
    for name, dim in (("user_repr", schema.user_repr_dim), ("item_repr", schema.item_repr_dim)):
        if dim is not None:
            flat = getattr(out, name).detach().float().cpu().numpy().reshape(-1)
            cols[name] = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), dim)
    return pa.Table.from_pydict(cols, schema=schema.arrow_schema())


def infer_output_schema(out: ModelOutput) -> OutputSchema:
    """The schema of a model's outputs, from one ``ModelOutput``."""
    dims = {n: None if getattr(out, n) is None else int(getattr(out, n).shape[1]) for n in ("user_repr", "item_repr")}
    return OutputSchema(tasks=tuple(sorted(out.logits)), user_repr_dim=dims["user_repr"], item_repr_dim=dims["item_repr"])


def _identity(manifest: dict) -> dict:
    """The manifest fields that must agree for a restarted run to reuse finished shards."""
    return {
        "checkpoint_sha256": manifest["teacher"]["checkpoint_sha256"],
        "dataset": manifest["source"]["dataset"],
        "split": manifest["source"]["split"],
        "source_schema_sha256": manifest["source"]["schema_sha256"],
        "rows_per_shard": manifest["rows_per_shard"],
        "batch_size": manifest["batch_size"],
        "max_len": manifest["max_len"],
    }


def _reusable_shards(out_dir: Path, fresh: dict) -> dict[int, dict]:
    """Finished shards of an earlier run of the same job whose files still verify, by index."""
    path = out_dir / MANIFEST_FILE
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    before, now = _identity(old), _identity(fresh)
    diff = [f"{k}: existing {before[k]!r}, requested {now[k]!r}" for k in now if before.get(k) != now[k]]
    if diff:
        raise TeacherOutputsError(f"{out_dir} holds outputs of a different job ({'; '.join(diff)}); use a new out_dir")
    return {
        s["index"]: s
        for s in old["shards"]
        if (out_dir / s["file"]).is_file() and sha256_file(out_dir / s["file"]) == s["sha256"]
    }


def _remove_stale_temps(out_dir: Path) -> None:
    # A kill during an atomic write leaves its hidden temp file behind; nothing else writes them here.
    for tmp in out_dir.glob(".part-*.tmp"):
        tmp.unlink(missing_ok=True)
    for tmp in out_dir.glob(f".{MANIFEST_FILE}.*.tmp"):
        tmp.unlink(missing_ok=True)


def build_manifest(
    teacher: TrainedModel,
    dataset_dir: Path,
    split: str,
    plans: list[ShardPlan],
    rows_per_shard: int,
    batch_size: int,
    run_id: str | None = None,
) -> dict:
    """The manifest of a job before any shard is done (``complete`` false, no shards, schema unknown).

    ``run_id`` is the teacher's MLflow run; by default the one recorded beside its ``checkpoints/``.
    """
    return {
        "format_version": FORMAT_VERSION,
        "complete": False,
        "teacher": {
            "checkpoint": str(teacher.path.resolve()),
            "checkpoint_sha256": sha256_file(teacher.path),
            "mlflow_run_id": run_id or checkpoint_run_id(teacher.path),
            "arch": teacher.arch,
            "flavor": teacher.flavor,
        },
        "source": {
            "dataset": str(dataset_dir),
            "split": split,
            "rows": plans[-1].stop,
            "schema_sha256": sha256_file(dataset_dir / SCHEMA_FILE),
        },
        "rows_per_shard": rows_per_shard,
        "batch_size": batch_size,
        "max_len": teacher.max_len,
        "num_shards": len(plans),
        "schema": None,
        "rows": 0,
        "shards": [],
    }


def compute_shard(
    model: nn.Module, plan: ShardPlan, reader: BlockReader, batch_size: int, max_len: int, device: str
) -> tuple[pa.Table, OutputSchema]:
    """Run ``model`` over one shard's rows; returns the rows and their schema."""
    tables, schema = [], None
    for batch in iter_shard_batches(plan, reader, batch_size, max_len):
        out = model(batch.to(device))
        schema = schema or infer_output_schema(out)
        tables.append(outputs_to_table(batch, out, schema))
    return pa.concat_tables(tables), schema


def write_teacher_outputs(
    teacher: TrainedModel,
    dataset_dir: str | Path,
    split: str,
    out_dir: str | Path,
    *,
    rows_per_shard: int,
    batch_size: int | None = None,
    device: str | None = None,
    progress: bool = True,
    tracking_uri: str | None = None,
    run_id: str | None = None,
) -> dict:
    """Run ``teacher``'s model once over ``split`` and write its outputs (resumable; see module doc).

    ``batch_size`` and the history cap default to the teacher's training data config. With ``tracking_uri``,
    the job is recorded as an MLflow run (:func:`log_outputs_run`). ``run_id`` names the teacher's MLflow run
    when it is not recorded beside the checkpoint (e.g. a teacher trained on another machine). Returns
    ``{"out_dir", "rows", "num_shards", "shards_written", "shards_reused", "rows_computed", "seconds",
    "rows_per_s", "manifest"}``; ``rows_per_s`` counts only rows computed by this call.
    """
    dataset_dir, out_dir = Path(dataset_dir).resolve(), Path(out_dir)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    teacher.model.to(device)
    batch_size = batch_size or teacher.batch_size
    plans = plan_shards(dataset_dir, split, rows_per_shard)
    if not plans:
        raise ValueError(f"{dataset_dir}: split {split!r} has no rows")
    manifest = build_manifest(teacher, dataset_dir, split, plans, rows_per_shard, batch_size, run_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out_dir)
    done = _reusable_shards(out_dir, manifest)
    reader = BlockReader(EventSchema.load(dataset_dir))
    computed, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for plan in tqdm(plans, desc=f"teacher outputs {split}", unit="shard", disable=not progress):
            if plan.index in done:
                manifest["shards"].append(done[plan.index])
                continue
            table, schema = compute_shard(teacher.model, plan, reader, batch_size, teacher.max_len, device)
            path = write_table(table, out_dir / plan.file_name)
            computed += table.num_rows
            manifest["schema"] = schema.to_dict()
            manifest["shards"].append(
                {"index": plan.index, "file": plan.file_name, "start": plan.start, "stop": plan.stop,
                 "rows": table.num_rows, "sha256": sha256_file(path)}
            )
            _write_manifest(out_dir, manifest)
    seconds = time.perf_counter() - t0
    # When every shard was reused, the schema is that of the shard files.
    manifest["schema"] = manifest["schema"] or _schema_of_file(out_dir / plans[0].file_name).to_dict()
    manifest["complete"] = True
    manifest["rows"] = sum(s["rows"] for s in manifest["shards"])
    manifest["throughput_rows_per_s"] = computed / seconds if computed and seconds > 0 else None
    _write_manifest(out_dir, manifest)
    report = {
        "out_dir": str(out_dir),
        "rows": manifest["rows"],
        "num_shards": len(plans),
        "shards_written": len(plans) - len(done),
        "shards_reused": len(done),
        "rows_computed": computed,
        "seconds": seconds,
        "rows_per_s": manifest["throughput_rows_per_s"],
        "manifest": manifest,
    }
    if tracking_uri:
        report["run_id"] = log_outputs_run(report, tracking_uri)
    return report


def log_outputs_run(report: dict, tracking_uri: str, experiment: str = "gem") -> str:
    """Record a finished job as an MLflow run (:func:`transfer.lineage.log_lineage_run`): inputs by reference,
    row counts, throughput and the manifest."""
    manifest = report["manifest"]
    metrics = {k: report[k] for k in ("rows", "rows_computed", "shards_reused", "seconds", "rows_per_s")}
    return log_lineage_run(
        stage="teacher_outputs",
        run_name=f"teacher-outputs-{manifest['source']['split']}",
        teacher=manifest["teacher"],
        tracking_uri=tracking_uri,
        experiment=experiment,
        tags={"dataset": manifest["source"]["dataset"]},
        params={"split": manifest["source"]["split"], "rows_per_shard": manifest["rows_per_shard"],
                "batch_size": manifest["batch_size"], "out_dir": report["out_dir"]},
        metrics=metrics,
        documents={MANIFEST_FILE: manifest},
    )


def _write_manifest(out_dir: Path, manifest: dict) -> None:
    atomic_write_text(out_dir / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True))


def _schema_of_file(path: Path) -> OutputSchema:
    arrow = pq.read_schema(path)
    tasks = tuple(n.removesuffix("_logit") for n in arrow.names if n.endswith("_logit"))
    dims = {n: arrow.field(n).type.list_size if n in arrow.names else None for n in ("user_repr", "item_repr")}
    return OutputSchema(tasks=tasks, user_repr_dim=dims["user_repr"], item_repr_dim=dims["item_repr"])


@dataclass
class TeacherOutputs:
    """Verified teacher outputs, sorted by ``example_id``; :meth:`take` joins them to a batch."""

    manifest: dict
    schema: OutputSchema
    table: pa.Table

    def __post_init__(self) -> None:
        self._ids = self.table.column("example_id").to_numpy()
        self._columns: dict[str, np.ndarray] = {}
        for name in self.table.column_names:
            col = self.table.column(name).combine_chunks()
            if pa.types.is_fixed_size_list(col.type):
                self._columns[name] = col.flatten().to_numpy().reshape(len(col), col.type.list_size)
            else:
                self._columns[name] = col.to_numpy()

    def __len__(self) -> int:
        return self.table.num_rows

    def rows_of(self, example_ids: np.ndarray | torch.Tensor) -> np.ndarray:
        """Row index of each id; an id without teacher outputs raises, naming a few of them."""
        ids = np.asarray(example_ids.cpu() if isinstance(example_ids, torch.Tensor) else example_ids, np.int64)
        rows = np.searchsorted(self._ids, ids)
        found = rows < len(self._ids)
        found[found] = self._ids[rows[found]] == ids[found]
        if not found.all():
            missing = ids[~found]
            raise TeacherOutputsError(
                f"{len(missing)} example ids have no teacher outputs (e.g. {missing[:5].tolist()}); "
                f"were the outputs written for split {self.manifest['source']['split']!r} of "
                f"{self.manifest['source']['dataset']}?"
            )
        return rows

    def take(self, example_ids: np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
        """Columns for ``example_ids[B]``: ``{task}_logit/_prob [B]``, ``user_repr/item_repr [B, d]``, ids ``[B]``."""
        rows = self.rows_of(example_ids)
        return {name: torch.from_numpy(col[rows]) for name, col in self._columns.items()}


def read_teacher_outputs(
    out_dir: str | Path,
    *,
    checkpoint: str | Path | None = None,
    checkpoint_sha256: str | None = None,
    expected_schema: OutputSchema | None = None,
) -> TeacherOutputs:
    """Verify and load an output directory written by :func:`write_teacher_outputs`.

    Checks that the run finished, every shard's checksum, schema and row count, that example ids are
    unique, and (when given) that the outputs come from ``checkpoint`` (or its sha256) and have
    ``expected_schema``. Each failure raises :class:`TeacherOutputsError` naming what is wrong.
    """
    out_dir = Path(out_dir)
    manifest = _load_manifest(out_dir)
    if checkpoint is not None:
        checkpoint_sha256 = sha256_file(checkpoint)
    recorded = manifest["teacher"]["checkpoint_sha256"]
    if checkpoint_sha256 is not None and checkpoint_sha256 != recorded:
        raise TeacherOutputsError(
            f"{out_dir}: outputs were written by teacher checkpoint sha256 {recorded[:12]}… "
            f"({manifest['teacher']['checkpoint']}), not the requested {checkpoint_sha256[:12]}…"
            + (f" ({checkpoint})" if checkpoint is not None else "")
        )
    schema = OutputSchema.from_dict(manifest["schema"])
    if expected_schema is not None and expected_schema != schema:
        diff = [
            f"{k}: outputs have {getattr(schema, k)!r}, expected {getattr(expected_schema, k)!r}"
            for k in ("tasks", "user_repr_dim", "item_repr_dim")
            if getattr(schema, k) != getattr(expected_schema, k)
        ]
        raise TeacherOutputsError(f"{out_dir}: output schema mismatch: {'; '.join(diff)}")
    tables = [_read_verified_shard(out_dir, s, schema) for s in sorted(manifest["shards"], key=lambda s: s["index"])]
    table = pa.concat_tables(tables) if tables else schema.arrow_schema().empty_table()
    if table.num_rows != manifest["source"]["rows"]:
        raise TeacherOutputsError(
            f"{out_dir}: {table.num_rows} rows in shards, but the split has {manifest['source']['rows']}"
        )
    table = table.sort_by("example_id")
    ids = table.column("example_id").to_numpy()
    dup = ids[1:][ids[1:] == ids[:-1]]
    if len(dup):
        raise TeacherOutputsError(f"{out_dir}: duplicated example ids {np.unique(dup)[:5].tolist()}")
    return TeacherOutputs(manifest=manifest, schema=schema, table=table)


def _load_manifest(out_dir: Path) -> dict:
    path = out_dir / MANIFEST_FILE
    if not path.is_file():
        raise TeacherOutputsError(f"{out_dir}: no {MANIFEST_FILE}; not a teacher-output directory")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TeacherOutputsError(f"{path}: unreadable manifest: {exc}") from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise TeacherOutputsError(f"{path}: format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    if not manifest.get("complete"):
        done = len(manifest.get("shards", []))
        raise TeacherOutputsError(
            f"{out_dir}: incomplete ({done} of {manifest.get('num_shards')} shards); rerun write_teacher_outputs to finish"
        )
    return manifest


def _read_verified_shard(out_dir: Path, entry: dict, schema: OutputSchema) -> pa.Table:
    path = out_dir / entry["file"]
    if not path.is_file():
        raise TeacherOutputsError(f"{path}: shard listed in the manifest is missing")
    actual = sha256_file(path)
    if actual != entry["sha256"]:
        raise TeacherOutputsError(
            f"{path}: checksum mismatch (manifest {entry['sha256'][:12]}…, file {actual[:12]}…): corrupt or modified"
        )
    table = pq.read_table(path)
    if not table.schema.equals(schema.arrow_schema()):
        raise TeacherOutputsError(f"{path}: columns {table.schema} do not match the manifest schema")
    if table.num_rows != entry["rows"]:
        raise TeacherOutputsError(f"{path}: {table.num_rows} rows, manifest says {entry['rows']}")
    return table
