"""DLRM-style baseline: the reference the GEM teacher must beat.

Sparse features and the candidate item go through a torchrec ``EmbeddingBagCollection``. The
history is mean-pooled in the same collection: ``history_items`` (every past event) and
``history_clicks`` (past events with a click or conversion) share the candidate's item table, so
pooled history lives in the candidate's space. Dense features go through a bottom MLP. All
vectors meet in a pairwise dot-product interaction, then a top MLP feeds one logit per
``(domain, task)``; each row reads the head of its own domain.

:func:`dlrm_flops` counts its model FLOPs with the teacher's conventions (:mod:`foundation.model.flops`):
matrix products only (``2·m·k·n``), so the pooling of the history bags, which is additions, costs nothing
and a DLRM's FLOPs per example do not grow with the history's length.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from foundation.data.batch import JaggedBatch
from foundation.data.schema import TASKS, EventSchema
from foundation.model.flops import MODEL_BACKWARD_FACTOR, mm
from foundation.model.outputs import ModelOutput, multitask_bce

HISTORY_KEYS = ("history_items", "history_clicks")
ITEM_TABLE = "t_item_id"


@dataclass
class DLRMConfig:
    """DLRM-style baseline: pooled embeddings, dot interaction, MLP, per-domain task heads."""

    embedding_dim: int = 32
    bottom_mlp: tuple[int, ...] = (64, 32)
    top_mlp: tuple[int, ...] = (256, 128)
    use_history: bool = True
    repr_dim: int = 64


def mlp_flops(sizes: list[int], rows: int) -> float:
    """Forward FLOPs of :func:`build_mlp` ``(sizes)`` on ``rows`` inputs."""
    return sum(mm(rows, a, b) for a, b in itertools.pairwise(sizes))


def dlrm_flops(cfg: DLRMConfig, schema: EventSchema, batch: int, *, training: bool = True) -> float:
    """Model FLOPs of :class:`DLRMBaseline` on ``batch`` rows: one forward, or a training step's forward+backward.

    The backward is 2x the forward for what the loss reaches, except the bottom MLP's first layer, which
    reads data and needs no input gradient (1x), and the user/item towers, which the loss does not read (0x).
    """
    d = cfg.embedding_dim
    bottom_sizes = [max(schema.dense_dim, 1), *cfg.bottom_mlp, d]
    num_vectors = len(schema.sparse) + 1 + (len(HISTORY_KEYS) if cfg.use_history else 0) + 2
    num_pairs = num_vectors * (num_vectors - 1) // 2
    num_user = len(schema.user_features) + (len(HISTORY_KEYS) if cfg.use_history else 0)
    num_item = len(schema.item_features) + 1
    in_loss = (
        mlp_flops(bottom_sizes, batch)
        + batch * mm(num_vectors, d, num_vectors)
        + mlp_flops([d + num_pairs, *cfg.top_mlp], batch)
        + mm(batch, cfg.top_mlp[-1], schema.num_domains * len(TASKS))
    )
    towers = (mm(batch, d * num_user, cfg.repr_dim) if num_user else 0.0) + mm(batch, d * num_item, cfg.repr_dim)
    if not training:
        return in_loss + towers
    data_fed = mm(batch, bottom_sizes[0], bottom_sizes[1])
    return (1.0 + MODEL_BACKWARD_FACTOR) * in_loss - data_fed + towers


def build_mlp(sizes: list[int], *, last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def build_item_kjt(batch: JaggedBatch, use_history: bool) -> KeyedJaggedTensor:
    """KJT with ``candidate`` (one id per row) and, optionally, the two pooled history bags."""
    b = batch.batch_size
    keys = ["candidate"]
    values = [batch.candidate]
    lengths = [torch.ones(b, dtype=torch.int32, device=batch.candidate.device)]
    if use_history:
        items = batch.history["item_ids"]
        clicked = batch.history["actions"] >= 1
        row = torch.repeat_interleave(torch.arange(b, device=items.device), batch.lengths)
        keys += list(HISTORY_KEYS)
        values += [items, items[clicked]]
        lengths += [batch.lengths.int(), torch.bincount(row[clicked], minlength=b).int()]
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


class DLRMBaseline(nn.Module):
    """``forward(batch) -> ModelOutput`` with ``logits[task]: [B]`` and ``user_repr/item_repr: [B, repr_dim]``."""

    def __init__(self, cfg: DLRMConfig, schema: EventSchema, loss_weights: dict[str, float]) -> None:
        super().__init__()
        if schema.task != "ctr":
            raise ValueError("the DLRM baseline scores impressions (task 'ctr'); use the GEM teacher for next_item data")
        self.cfg, self.schema, self.loss_weights = cfg, schema, loss_weights
        d = cfg.embedding_dim
        self.sparse_ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"t_{f.name}", embedding_dim=d, num_embeddings=f.cardinality, feature_names=[f.name]
                )
                for f in schema.sparse
            ]
        )
        item_features = ["candidate", *(HISTORY_KEYS if cfg.use_history else ())]
        self.item_ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=ITEM_TABLE,
                    embedding_dim=d,
                    num_embeddings=schema.num_items,
                    feature_names=item_features,
                    pooling=PoolingType.MEAN,
                )
            ]
        )
        self.domain_emb = nn.Embedding(schema.num_domains, d)
        self.bottom = build_mlp([max(schema.dense_dim, 1), *cfg.bottom_mlp, d])
        self.feature_order = [*item_features, *(f.name for f in schema.sparse)]
        self.user_keys = [f.name for f in schema.user_features] + (list(HISTORY_KEYS) if cfg.use_history else [])
        self.item_keys = [f.name for f in schema.item_features] + ["candidate"]
        num_vectors = len(schema.sparse) + len(item_features) + 2
        num_pairs = num_vectors * (num_vectors - 1) // 2
        self.top = build_mlp([d + num_pairs, *cfg.top_mlp])
        self.heads = nn.Linear(cfg.top_mlp[-1], schema.num_domains * len(TASKS))
        self.user_tower = nn.Linear(d * len(self.user_keys), cfg.repr_dim) if self.user_keys else None
        self.item_tower = nn.Linear(d * len(self.item_keys), cfg.repr_dim)

    def embed(self, batch: JaggedBatch) -> dict[str, torch.Tensor]:
        """Every pooled vector by feature name, each ``[B, d]``."""
        pooled = self.item_ebc(build_item_kjt(batch, self.cfg.use_history)).to_dict()
        if self.schema.sparse:
            pooled.update(self.sparse_ebc(batch.sparse).to_dict())
        return pooled

    def forward(self, batch: JaggedBatch) -> ModelOutput:
        pooled = self.embed(batch)
        dense_in = batch.dense if self.schema.dense_dim else batch.dense.new_zeros(batch.batch_size, 1)
        # By name, not dict order: a sharded EBC returns its features grouped by shard.
        vectors = [self.bottom(dense_in), self.domain_emb(batch.domain), *(pooled[k] for k in self.feature_order)]
        stacked = torch.stack(vectors, dim=1)
        gram = stacked @ stacked.transpose(1, 2)
        i, j = torch.triu_indices(len(vectors), len(vectors), offset=1, device=gram.device)
        top = self.top(torch.cat([vectors[0], gram[:, i, j]], dim=1))
        heads = self.heads(top).view(-1, self.schema.num_domains, len(TASKS))
        per_row = heads[torch.arange(batch.batch_size, device=heads.device), batch.domain]
        user_repr = None
        if self.user_tower is not None:
            user_repr = self.user_tower(torch.cat([pooled[k] for k in self.user_keys], dim=1))
        item_repr = self.item_tower(torch.cat([pooled[k] for k in self.item_keys], dim=1))
        return ModelOutput(
            logits={t: per_row[:, i] for i, t in enumerate(TASKS)}, user_repr=user_repr, item_repr=item_repr
        )

    def loss(self, batch: JaggedBatch, out: ModelOutput) -> dict[str, torch.Tensor]:
        return multitask_bce(batch, out, self.loss_weights)

    def flops(self, batch: JaggedBatch, *, training: bool = True) -> float:
        """Matmul FLOPs of one step on this batch (:func:`dlrm_flops`)."""
        return dlrm_flops(self.cfg, self.schema, batch.batch_size, training=training)
