"""Parameter sharing: start a student's embedding tables (and optionally towers) from a teacher checkpoint.

Tables are matched by feature: a student keeps its tables in an ``nn.ModuleDict`` (``student.tables``
by default) of ``nn.Embedding`` / ``nn.EmbeddingBag``. Every architecture names a categorical feature's
table ``t_<feature>`` (e.g. ``t_age_bucket``), but the item-id table's name differs: ``t_item_id`` in the
DLRM and the student, ``t_item`` in the GEM teacher. The caller passes that map (``model.arch`` -> item
table, ``gem.registry.ITEM_TABLES``); :func:`default_table_map` translates through the feature, so a
student shares from either teacher arch without configuration; :attr:`SharingConfig.tables`
(``transfer.share_tables``) overrides it. Where the embedding dims differ,
the student's table becomes the teacher's table followed by a learned projection
(:class:`ProjectedTable`). A policy then says what training may do to the teacher's parameters:

- ``freeze``: they stay as the teacher left them (projections still learn);
- ``finetune``: they train like the rest of the student;
- ``finetune_lower_lr``: they train at ``lr_scale`` times the student's learning rate.

All checkpoint reading goes through :func:`read_teacher_checkpoint`, so a reader for sharded (DCP)
checkpoints only has to be added there.

In training, :class:`gem.module.RecModule` applies sharing when ``transfer.share_from`` is set
(:func:`share_from_checkpoint`) and records each shared table's teacher dim in ``transfer.shared_dims``;
loading the trained student rebuilds that layout from the record alone (:func:`restore_shared_layout`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundation.checkpoint import read_training_checkpoint
from foundation.data.io import sha256_file

POLICIES = ("freeze", "finetune", "finetune_lower_lr")
# torchrec keeps a collection's tables at ``<collection>.embedding_bags.<table>.weight`` (pooled) or
# ``<collection>.embeddings.<table>.weight`` (sequence); both are embedding tables to a student.
_TABLE_KEY = re.compile(r"(?:^|\.)(?:embedding_bags|embeddings)\.([^.]+)\.weight$")
ITEM_FEATURE = "item_id"


class SharingError(ValueError):
    """A teacher parameter a student asked for is missing or has the wrong shape; the message names it."""


@dataclass
class TeacherCheckpoint:
    """A teacher checkpoint as sharing sees it: its parameters by model-relative name, its ``model.arch``
    (None for a bare state dict) and its sha256."""

    path: Path
    sha256: str
    arch: str | None
    state: dict[str, torch.Tensor]


def read_teacher_checkpoint(path: str | Path) -> TeacherCheckpoint:
    """Read a teacher checkpoint (``weights_only=True``, no pickle code); the one reader of teacher parameters.

    Accepts a ``gem train`` checkpoint (:mod:`foundation.checkpoint`, whose config names the arch) or a
    bare state dict.
    """
    ckpt = read_training_checkpoint(path, allow_bare=True)
    return TeacherCheckpoint(path=ckpt.path, sha256=sha256_file(path), arch=ckpt.arch, state=ckpt.state)


def feature_of_table(table: str, arch: str, item_tables: Mapping[str, str]) -> str:
    """The feature a table of ``arch`` embeds: ``item_id`` for its item table, else the name after ``t_``."""
    return ITEM_FEATURE if table == _item_table(arch, item_tables) else table.removeprefix("t_")


def table_of_feature(feature: str, arch: str, item_tables: Mapping[str, str]) -> str:
    """The name ``arch`` gives the table of ``feature``."""
    return _item_table(arch, item_tables) if feature == ITEM_FEATURE else f"t_{feature}"


def _item_table(arch: str, item_tables: Mapping[str, str]) -> str:
    if arch not in item_tables:
        raise SharingError(
            f"no table-name map for model.arch {arch!r} (known: {sorted(item_tables)}); "
            "map tables explicitly with transfer.share_tables"
        )
    return item_tables[arch]


def default_table_map(
    student_tables: Iterable[str], student_arch: str, teacher_arch: str | None, item_tables: Mapping[str, str]
) -> dict[str, str]:
    """Student table -> the teacher table of the same feature, e.g. ``{"t_item_id": "t_item"}`` from a GEM teacher.

    ``item_tables`` maps each ``model.arch`` to the name of its item-id table (every other table is
    ``t_<feature>`` in all of them).
    """
    if teacher_arch is None:
        raise SharingError("the teacher checkpoint does not name its model.arch; map tables with transfer.share_tables")
    return {
        name: table_of_feature(feature_of_table(name, student_arch, item_tables), teacher_arch, item_tables)
        for name in student_tables
    }


def teacher_tables(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Table name -> ``weight[num_embeddings, dim]`` for every torchrec table in ``state``."""
    tables: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = _TABLE_KEY.search(key)
        if match is None:
            continue
        name = match.group(1)
        if name in tables:
            raise SharingError(f"teacher table name {name!r} appears twice ({key}); map tables explicitly")
        tables[name] = value
    return tables


@dataclass
class SharingConfig:
    """What to take from the teacher and how the student may train it.

    ``tables``: student table -> teacher table; empty means every student table, by its own name.
    ``towers``: student submodule path -> teacher parameter prefix (copied name for name, same shapes).
    ``project``: where embedding dims differ, add a learned projection (otherwise it is an error).
    """

    tables: dict[str, str] = field(default_factory=dict)
    towers: dict[str, str] = field(default_factory=dict)
    policy: str = "finetune"
    lr_scale: float = 0.1
    project: bool = True
    tables_attr: str = "tables"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown sharing policy {self.policy!r}; choose one of {POLICIES}")
        if not 0 < self.lr_scale <= 1:
            raise ValueError(f"sharing.lr_scale must be in (0, 1], got {self.lr_scale}")


class ProjectedTable(nn.Module):
    """A teacher table of dim ``d_t`` followed by a learned ``Linear(d_t, d_s, bias=False)``.

    ``forward`` takes what the wrapped ``nn.Embedding`` / ``nn.EmbeddingBag`` takes and returns
    ``[..., d_s]``, so it replaces the student's table in place.
    """

    def __init__(self, table: nn.Embedding | nn.EmbeddingBag, out_dim: int, *, init_from_table: bool = True) -> None:
        super().__init__()
        self.table = table
        self.proj = nn.Linear(table.embedding_dim, out_dim, bias=False)
        if init_from_table:
            with torch.no_grad():
                self.proj.weight.copy_(init_projection(table.weight, out_dim))

    @property
    def embedding_dim(self) -> int:
        return self.proj.out_features

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.proj(self.table(input))


class ProjectedBag(ProjectedTable):
    """:class:`ProjectedTable` over an ``nn.EmbeddingBag``: takes its ``(input, offsets)``; both forms script
    with TorchScript (a serving form), which a variadic ``forward`` would not."""

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(self.table(input, offsets))


def projected_table(table: nn.Embedding | nn.EmbeddingBag, out_dim: int, *, init_from_table: bool = True) -> ProjectedTable:
    """``table`` followed by a projection to ``out_dim``, taking what ``table`` takes."""
    kind = ProjectedBag if isinstance(table, nn.EmbeddingBag) else ProjectedTable
    return kind(table, out_dim, init_from_table=init_from_table)


def init_projection(weight: torch.Tensor, out_dim: int) -> torch.Tensor:
    """``[out_dim, d_t]`` start for the projection: the table's top right-singular directions.

    Projecting on the principal directions keeps as much of the teacher's geometry as ``out_dim``
    dims can, so the student starts from the teacher's knowledge rather than a random mix of it;
    when ``out_dim > d_t`` the extra output dims start at zero.
    """
    _, _, vh = torch.linalg.svd(weight.detach().float(), full_matrices=False)
    out = weight.new_zeros(out_dim, weight.shape[1])
    k = min(out_dim, vh.shape[0])
    out[:k] = vh[:k]
    return out


def _table_like(student: nn.Module, weight: torch.Tensor) -> nn.Embedding | nn.EmbeddingBag:
    """A table of the student's kind (and pooling mode) holding a copy of ``weight``."""
    if isinstance(student, nn.EmbeddingBag):
        return nn.EmbeddingBag.from_pretrained(weight.clone(), freeze=False, mode=student.mode)
    return nn.Embedding.from_pretrained(weight.clone(), freeze=False, padding_idx=student.padding_idx)


@dataclass
class SharingResult:
    """What :func:`apply_sharing` did.

    ``shared``: parameters now holding teacher values (trained as the policy says); ``new``: the
    projections it added; ``report``: per student table/tower, where it came from and its shapes.
    """

    policy: str
    lr_scale: float
    shared: list[nn.Parameter]
    new: list[nn.Parameter]
    report: dict[str, dict]

    @property
    def table_dims(self) -> dict[str, int]:
        """Student table -> the teacher dim it was built from (what :func:`restore_shared_layout` needs)."""
        return {name: r["teacher_shape"][1] for name, r in self.report.items() if "teacher_shape" in r}


def apply_sharing(student: nn.Module, teacher_state: dict[str, torch.Tensor], cfg: SharingConfig) -> SharingResult:
    """Copy teacher tables (and towers) into ``student`` in place, projecting where dims differ.

    Raises :class:`SharingError` naming the table or parameter when it is missing in the teacher or
    its shape does not fit. Call before building the optimizer (see :func:`build_param_groups`).
    """
    tables: nn.ModuleDict = getattr(student, cfg.tables_attr)
    available = teacher_tables(teacher_state)
    mapping = cfg.tables or {name: name for name in tables}
    shared: list[nn.Parameter] = []
    new: list[nn.Parameter] = []
    report: dict[str, dict] = {}
    for student_name, teacher_name in mapping.items():
        if student_name not in tables:
            raise SharingError(f"student has no table {student_name!r}; its tables: {sorted(tables)}")
        if teacher_name not in available:
            raise SharingError(
                f"student table {student_name!r}: teacher table {teacher_name!r} not in the checkpoint; "
                f"teacher tables: {sorted(available)}"
            )
        table, shared_param, proj = _share_table(student_name, tables[student_name], available[teacher_name], cfg)
        tables[student_name] = table
        shared.append(shared_param)
        new += [proj] if proj is not None else []
        report[student_name] = {
            "teacher_table": teacher_name,
            "teacher_shape": list(available[teacher_name].shape),
            "projected": proj is not None,
        }
    for path, prefix in cfg.towers.items():
        shared += _share_tower(path, student.get_submodule(path), teacher_state, prefix)
        report[path] = {"teacher_prefix": prefix, "projected": False}
    if cfg.policy == "freeze":
        for p in shared:
            p.requires_grad_(False)
    return SharingResult(policy=cfg.policy, lr_scale=cfg.lr_scale, shared=shared, new=new, report=report)


def _share_table(
    name: str, student_table: nn.Module, weight: torch.Tensor, cfg: SharingConfig
) -> tuple[nn.Module, nn.Parameter, nn.Parameter | None]:
    """``(table to install, its teacher-valued weight, new projection weight or None)``."""
    if not isinstance(student_table, (nn.Embedding, nn.EmbeddingBag)):
        raise SharingError(f"student table {name!r} is a {type(student_table).__name__}, not nn.Embedding(Bag)")
    rows, dim = student_table.weight.shape
    if weight.shape[0] != rows:
        raise SharingError(
            f"table {name!r}: teacher has {weight.shape[0]} rows, student {rows}; shared tables need the same id space"
        )
    weight = weight.to(student_table.weight.device, student_table.weight.dtype)
    if weight.shape[1] == dim:
        with torch.no_grad():
            student_table.weight.copy_(weight)
        return student_table, student_table.weight, None
    if not cfg.project:
        raise SharingError(f"table {name!r}: teacher dim {weight.shape[1]} != student dim {dim} and project=False")
    projected = projected_table(_table_like(student_table, weight), dim)
    return projected, projected.table.weight, projected.proj.weight


def _share_tower(path: str, module: nn.Module, state: dict[str, torch.Tensor], prefix: str) -> list[nn.Parameter]:
    """Copy ``state[prefix + name]`` into every parameter of ``module``; returns those parameters."""
    prefix = prefix.rstrip(".") + "."
    params = list(module.named_parameters())
    for name, param in params:
        key = prefix + name
        if key not in state:
            near = sorted(k for k in state if k.startswith(prefix))[:5]
            raise SharingError(f"tower {path!r}: teacher has no parameter {key!r} (teacher has e.g. {near})")
        if state[key].shape != param.shape:
            raise SharingError(
                f"tower {path!r}: parameter {name!r} is {list(param.shape)} in the student, "
                f"{list(state[key].shape)} in the teacher ({key})"
            )
        with torch.no_grad():
            param.copy_(state[key])
    return [p for _, p in params]


def build_param_groups(student: nn.Module, result: SharingResult, lr: float) -> list[dict]:
    """Optimizer param groups: the student's own and new parameters at ``lr``, shared ones by the policy.

    ``freeze`` leaves the shared parameters out (they have ``requires_grad=False``);
    ``finetune_lower_lr`` puts them in a group at ``lr * lr_scale``.
    """
    shared_ids = {id(p) for p in result.shared}
    own = [p for p in student.parameters() if id(p) not in shared_ids and p.requires_grad]
    groups = [{"name": "student", "params": own, "lr": lr}]
    if result.policy == "finetune":
        groups[0]["params"] = own + list(result.shared)
    elif result.policy == "finetune_lower_lr":
        groups.append({"name": "shared", "params": list(result.shared), "lr": lr * result.lr_scale})
    return groups


def sharing_config(transfer: Mapping[str, Any]) -> SharingConfig:
    """The :class:`SharingConfig` of a run's ``transfer`` config section, as a dict (``share_tables``,
    ``share_towers``, ``share_policy``, ``share_lr_scale``; see :class:`gem.config.TransferConfig`)."""
    return SharingConfig(
        tables=dict(transfer["share_tables"]),
        towers=dict(transfer["share_towers"]),
        policy=transfer["share_policy"],
        lr_scale=transfer["share_lr_scale"],
    )


def share_from_checkpoint(
    student: nn.Module,
    checkpoint: str | Path,
    cfg: SharingConfig,
    *,
    student_arch: str,
    item_tables: Mapping[str, str],
    expected_sha256: str = "",
) -> SharingResult:
    """Start ``student`` from the teacher checkpoint ``checkpoint`` (module doc), in place.

    Tables follow ``cfg.tables``, else :func:`default_table_map` for the checkpoint's arch. With
    ``expected_sha256`` (the teacher of the run's teacher outputs), the checkpoint must be that teacher.
    Errors name the checkpoint and the missing or misfit table.
    """
    teacher = read_teacher_checkpoint(checkpoint)
    if expected_sha256 and teacher.sha256 != expected_sha256:
        raise SharingError(
            f"transfer.share_from {teacher.path} has sha256 {teacher.sha256[:12]}…, but the run's teacher outputs "
            f"come from checkpoint {expected_sha256[:12]}…; share from the same teacher"
        )
    tables: nn.ModuleDict = getattr(student, cfg.tables_attr)
    mapping = dict(cfg.tables) or default_table_map(tables, student_arch, teacher.arch, item_tables)
    try:
        return apply_sharing(student, teacher.state, dataclasses.replace(cfg, tables=mapping))
    except SharingError as exc:
        raise SharingError(f"{teacher.path} (model.arch={teacher.arch!r}): {exc}") from exc


def restore_shared_layout(student: nn.Module, shared_dims: Mapping[str, int], cfg: SharingConfig) -> SharingResult:
    """Rebuild what :func:`share_from_checkpoint` did to ``student`` without the teacher, from ``shared_dims``
    (student table -> the teacher dim it was built from, :attr:`SharingResult.table_dims`).

    Projected tables get their structure (values come from the student's own checkpoint), shared parameters
    (``cfg.towers`` too) their policy; used to load a trained student wherever the teacher checkpoint is not at hand.
    """
    if not shared_dims:
        raise SharingError(
            "transfer.share_from is set but transfer.shared_dims is empty: the config was not saved by a "
            "training run, so the student's shared layout is unknown"
        )
    tables: nn.ModuleDict = getattr(student, cfg.tables_attr)
    shared: list[nn.Parameter] = []
    new: list[nn.Parameter] = []
    report: dict[str, dict] = {}
    for name, teacher_dim in shared_dims.items():
        if name not in tables:
            raise SharingError(f"transfer.shared_dims names table {name!r}; the student's tables: {sorted(tables)}")
        table = tables[name]
        rows, dim = table.weight.shape
        if teacher_dim != dim:
            placeholder = _table_like(table, table.weight.new_zeros(rows, teacher_dim))
            table = projected_table(placeholder, dim, init_from_table=False)
            tables[name] = table
            new.append(table.proj.weight)
        shared.append(table.table.weight if isinstance(table, ProjectedTable) else table.weight)
        report[name] = {"teacher_shape": [rows, teacher_dim], "projected": teacher_dim != dim}
    for path in cfg.towers:
        shared += list(student.get_submodule(path).parameters())
    if cfg.policy == "freeze":
        for p in shared:
            p.requires_grad_(False)
    return SharingResult(policy=cfg.policy, lr_scale=cfg.lr_scale, shared=shared, new=new, report=report)
