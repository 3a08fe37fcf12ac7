"""A small value model (student ranker): pooled embeddings, a short history, an MLP trunk, per-domain heads.

It follows the model protocol of :mod:`foundation.model.outputs` (``forward(batch) -> ModelOutput``,
``loss(batch, out)``) and learns from a teacher in the three ways of :mod:`transfer`:

- distillation (``distill``): ``"none"``, ``"kd"`` (standard KD), or ``"ah"`` (ExFM auxiliary head,
  optionally with a student adapter per task); teacher soft labels come from
  :mod:`transfer.teacher_outputs`, passed as ``forward(batch, teacher=outputs.take(batch.example_id))``;
- parameter sharing: its tables live in ``self.tables`` named like the teacher's (``t_<feature>``,
  ``t_item_id``), the layout :func:`transfer.sharing.apply_sharing` expects;
- representation transfer (``teacher_repr``): the teacher's ``user_repr`` / ``item_repr`` are extra
  input features.

The history is the ``history_len`` most recent items, mean-pooled in the candidate's item table (so
it lives in the candidate's space), instead of the teacher's sequence model over thousands of events.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import nn

from foundation.data.batch import JaggedBatch
from foundation.data.schema import TASKS, EventSchema
from foundation.model.baseline import build_mlp
from foundation.model.outputs import ModelOutput, masked_bce
from transfer.distill import (
    AdapterConfig,
    AuxHeadConfig,
    AuxiliaryHeads,
    KDConfig,
    StudentAdapter,
    adapter_distill_loss,
    adapter_loss,
    aux_head_loss,
    kd_loss,
)

DISTILL_MODES = ("none", "kd", "ah")
ITEM_TABLE = "t_item_id"


@dataclass
class StudentConfig:
    """Size and transfer options of :class:`StudentRanker`.

    ``history_len`` most recent history items are pooled (0: no history). With ``teacher_repr``, the
    teacher's ``user_repr[B, user_repr_dim]`` and ``item_repr[B, item_repr_dim]`` are inputs.
    ``use_adapter`` adds an ExFM student adapter per task (configured by ``adapter``); it needs
    ``distill="ah"``. No field is optional-typed, so the harness's dotted overrides reach every one.
    """

    embedding_dim: int = 8
    hidden: tuple[int, ...] = (64, 32)
    history_len: int = 16
    teacher_repr: bool = False
    user_repr_dim: int = 0
    item_repr_dim: int = 0
    distill: str = "none"
    kd: KDConfig = field(default_factory=KDConfig)
    aux: AuxHeadConfig = field(default_factory=AuxHeadConfig)
    use_adapter: bool = False
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    loss_weights: dict[str, float] = field(default_factory=lambda: {"click": 1.0, "conversion": 1.0})

    def __post_init__(self) -> None:
        if self.distill not in DISTILL_MODES:
            raise ValueError(f"student.distill must be one of {DISTILL_MODES}, got {self.distill!r}")
        if self.use_adapter and self.distill != "ah":
            raise ValueError("student.use_adapter (ExFM SA) is a target for the auxiliary head: set distill='ah'")
        if self.teacher_repr and (self.user_repr_dim <= 0 or self.item_repr_dim <= 0):
            raise ValueError("student.teacher_repr needs user_repr_dim and item_repr_dim > 0")
        if not self.hidden:
            raise ValueError("student.hidden needs at least one layer")


def recent_history(batch: JaggedBatch, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``keep`` most recent history item ids per row: ``(values[N], offsets[B])`` for ``nn.EmbeddingBag``."""
    lengths = batch.lengths
    row = torch.repeat_interleave(torch.arange(batch.batch_size, device=lengths.device), lengths)
    from_end = batch.offsets[1:][row] - 1 - torch.arange(batch.num_tokens, device=lengths.device)
    kept = lengths.clamp(max=keep)
    starts = torch.cumsum(kept, 0) - kept
    return batch.history["item_ids"][from_end < keep], starts


class StudentRanker(nn.Module):
    """``forward(batch, teacher=None) -> ModelOutput`` with ``logits[task]: [B]`` of each row's domain head.

    ``teacher`` is :meth:`transfer.teacher_outputs.TeacherOutputs.take` for the batch's example ids
    (``{task}_logit [B]``, ``{task}_prob [B]``, ``user_repr/item_repr [B, d]``); it is required when
    ``distill != "none"`` or ``teacher_repr``. Distillation logits and teacher targets go to
    ``out.extra`` for :meth:`loss`.
    """

    def __init__(self, cfg: StudentConfig, schema: EventSchema) -> None:
        super().__init__()
        if schema.task != "ctr":
            raise ValueError("the student ranker scores impressions (task 'ctr')")
        self.cfg, self.schema = cfg, schema
        d = cfg.embedding_dim
        tables = {f"t_{f.name}": nn.EmbeddingBag(f.cardinality, d, mode="mean") for f in schema.sparse}
        tables[ITEM_TABLE] = nn.EmbeddingBag(schema.num_items, d, mode="mean")
        self.tables = nn.ModuleDict(tables)
        self.domain_emb = nn.Embedding(schema.num_domains, d)
        self.trunk = build_mlp([self.input_dim, *cfg.hidden])
        num_out = schema.num_domains * len(TASKS)
        if cfg.distill == "ah":
            self.heads = AuxiliaryHeads(cfg.hidden[-1], num_out, cfg.aux)
        else:
            self.heads = nn.Linear(cfg.hidden[-1], num_out)
        self.adapters = (
            nn.ModuleDict({t: StudentAdapter(cfg.adapter) for t in TASKS}) if cfg.use_adapter else None
        )

    @property
    def input_dim(self) -> int:
        """Width of the trunk's input: bags, candidate, history, domain, dense and teacher reprs."""
        d = self.cfg.embedding_dim
        width = d * (len(self.schema.sparse) + 2 + (self.cfg.history_len > 0)) + self.schema.dense_dim
        return width + (self.cfg.user_repr_dim + self.cfg.item_repr_dim if self.cfg.teacher_repr else 0)

    def embed(self, batch: JaggedBatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(user-side [B, d] vectors, item-side [B, d] vectors)``."""
        user, item = [], []
        for f in self.schema.sparse:
            jt = batch.sparse[f.name]
            # Bag starts from the lengths in plain torch: torchrec's offsets() calls an fbgemm op that the
            # CPU fbgemm build lacks for CUDA tensors.
            lengths = jt.lengths().to(jt.values().dtype)
            pooled = self.tables[f"t_{f.name}"](jt.values(), torch.cumsum(lengths, 0) - lengths)
            (user if f.side == "user" else item).append(pooled)
        item.append(self.tables[ITEM_TABLE](batch.candidate.unsqueeze(1)))
        if self.cfg.history_len > 0:
            user.append(self.tables[ITEM_TABLE](*recent_history(batch, self.cfg.history_len)))
        return user, item

    def _check_teacher(self, teacher: dict[str, torch.Tensor] | None) -> None:
        needs = self.cfg.distill != "none" or self.cfg.teacher_repr
        if needs and teacher is None:
            raise ValueError(
                f"student (distill={self.cfg.distill!r}, teacher_repr={self.cfg.teacher_repr}) needs teacher "
                "outputs: forward(batch, teacher=TeacherOutputs.take(batch.example_id))"
            )

    def forward(self, batch: JaggedBatch, teacher: dict[str, torch.Tensor] | None = None) -> ModelOutput:
        self._check_teacher(teacher)
        user, item = self.embed(batch)
        features = [*user, *item, self.domain_emb(batch.domain)]
        if self.schema.dense_dim:
            features.append(batch.dense)
        if self.cfg.teacher_repr:
            features += [teacher["user_repr"].to(batch.dense.device), teacher["item_repr"].to(batch.dense.device)]
        hidden = self.trunk(torch.cat(features, dim=1))
        rows = torch.arange(batch.batch_size, device=hidden.device)

        def per_row(flat: torch.Tensor) -> dict[str, torch.Tensor]:
            by_domain = flat.view(-1, self.schema.num_domains, len(TASKS))[rows, batch.domain]
            return {t: by_domain[:, i] for i, t in enumerate(TASKS)}

        extra: dict[str, torch.Tensor] = {}
        if self.cfg.distill == "ah":
            serve, distill = self.heads(hidden)
            logits = per_row(serve)
            extra.update({f"distill_logit/{t}": v for t, v in per_row(distill).items()})
        else:
            logits = per_row(self.heads(hidden))
        if self.cfg.distill != "none":
            extra.update({f"teacher_logit/{t}": teacher[f"{t}_logit"].to(hidden.device) for t in TASKS})
        return ModelOutput(logits=logits, user_repr=torch.cat(user, dim=1), item_repr=torch.cat(item, dim=1), extra=extra)

    def loss(self, batch: JaggedBatch, out: ModelOutput) -> dict[str, torch.Tensor]:
        """``{"loss", "loss_<task>", "<task>/<term>" ...}``: per-task terms of the configured transfer, weighted."""
        terms: dict[str, torch.Tensor] = {}
        total = torch.zeros((), device=batch.dense.device)
        for task, logit in out.logits.items():
            label, mask = batch.labels[task], batch.label_mask[task]
            parts = self._task_loss(task, logit, label, mask, out.extra)
            terms.update({f"{task}/{k}": v for k, v in parts.items() if k != "loss"})
            terms[f"loss_{task}"] = parts["loss"]
            total = total + self.cfg.loss_weights.get(task, 1.0) * parts["loss"]
        return {"loss": total, **terms}

    def _task_loss(
        self, task: str, logit: torch.Tensor, label: torch.Tensor, mask: torch.Tensor, extra: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        if self.cfg.distill == "none":
            return {"loss": masked_bce(logit, label, mask)}
        teacher_logit = extra[f"teacher_logit/{task}"]
        if self.cfg.distill == "kd":
            return kd_loss(logit, teacher_logit, label, mask, self.cfg.kd)
        distill_logit = extra[f"distill_logit/{task}"]
        parts = aux_head_loss(logit, distill_logit, torch.sigmoid(teacher_logit), label, mask, self.cfg.aux)
        if self.adapters is not None:
            adapter = self.adapters[task]
            parts["loss_adapter"] = adapter_loss(adapter, teacher_logit, label, mask)
            parts["loss_sa"] = adapter_distill_loss(distill_logit, adapter, teacher_logit)
            parts["loss"] = parts["loss"] + parts["loss_adapter"] + self.cfg.aux.weight * parts["loss_sa"]
        return parts

    def serving_flops(self) -> float:
        """Matmul FLOPs per scored example at serving (trunk + serving head; lookups and pooling not counted).

        Same convention as :mod:`foundation.model.flops`: ``[m, k] @ [k, n]`` costs ``2·m·k·n``.
        """
        sizes = [self.input_dim, *self.cfg.hidden, self.schema.num_domains * len(TASKS)]
        return float(sum(2 * a * b for a, b in itertools.pairwise(sizes)))
