"""Teacher embeddings, all through torchrec for the sparse tables so that ``foundation.parallel`` can shard them.

- :class:`ItemEmbedding`: an ``EmbeddingCollection`` (non-pooled) over item ids, one table shared by
  the history, the candidate and the generative objective's negatives;
- :class:`SparseFeatureEmbedding`: an ``EmbeddingBagCollection`` (mean-pooled bags) over the
  schema's non-sequence categorical features;
- :class:`HistoryEmbedding`: one token per history event from its item plus action, domain and
  age (time before the impression) embeddings, and optionally its absolute position.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    PoolingType,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from foundation.data.batch import JaggedBatch
from foundation.data.schema import EventSchema
from foundation.model.jagged import token_positions, token_rows
from foundation.model.teacher_config import TeacherConfig

ITEM_FEATURE = "item_id"
ITEM_TABLE = "t_item"
# Ages use HSTU's log time bucketing (ln|dt| / 0.301), the scale of the attention's time bias.
AGE_BUCKET_DIVISOR = 0.301
ITEM_INIT_STD = 0.02


def log_bucket(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``[N]`` int64 ``min(floor(ln(max(|dt|, 1)) / 0.301), num_buckets - 1)``."""
    x = dt.abs().clamp(min=1).to(torch.float32)
    return (torch.log(x) / AGE_BUCKET_DIVISOR).floor().to(torch.int64).clamp(0, num_buckets - 1)


def sparse_gradients(collection: nn.Module, sparse: bool = True) -> None:
    """Make an unsharded torchrec collection's tables (or a whole model's) give sparse gradients
    (``nn.Embedding(sparse=True)``: the looked-up ids and their rows' gradients, no dense ``[rows, dim]`` tensor)
    for a row optimizer, or dense ones again (``sparse=False``)."""
    for module in collection.modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag):
            module.sparse = sparse


class ItemEmbedding(nn.Module):
    """Item id -> ``[item_dim]`` through a torchrec ``EmbeddingCollection`` keyed ``item_id``.

    Rows start N(0, 0.02) as in HSTU; ``truncated`` cuts the draw at 2 std (the reference's truncated
    normal), otherwise at torch's default bounds of +-2, which a std of 0.02 never reaches.
    """

    def __init__(self, num_items: int, item_dim: int, *, truncated: bool = False, sparse: bool = False) -> None:
        super().__init__()
        self.num_items = num_items
        bound = 2 * ITEM_INIT_STD if truncated else 2.0
        table = EmbeddingConfig(
            name=ITEM_TABLE,
            embedding_dim=item_dim,
            num_embeddings=num_items,
            feature_names=[ITEM_FEATURE],
            init_fn=partial(nn.init.trunc_normal_, std=ITEM_INIT_STD, a=-bound, b=bound),
        )
        self.collection = EmbeddingCollection(tables=[table])
        if sparse:
            sparse_gradients(self.collection)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids[N]`` int64 -> ``[N, item_dim]``; all ids go in one bag (order preserved)."""
        n = ids.numel()
        lengths = torch.full((1,), n, dtype=torch.int32, device=ids.device)
        # Known per-key sizes spare torchrec a device-to-host sync to compute them.
        kjt = KeyedJaggedTensor(
            keys=[ITEM_FEATURE], values=ids, lengths=lengths, length_per_key=[n], offset_per_key=[0, n]
        )
        return self.collection(kjt)[ITEM_FEATURE].values()

    def all_items(self, device: torch.device) -> torch.Tensor:
        """``[num_items, item_dim]``: every row of the table, looked up like any other ids."""
        return self(torch.arange(self.num_items, device=device))


class SparseFeatureEmbedding(nn.Module):
    """The schema's categorical features -> one mean-pooled ``[B, d]`` vector per feature.

    ``forward`` returns ``(user_tokens[B, F_user, d], item_tokens[B, F_item, d])``; a side without
    features yields ``[B, 0, d]``. ``with_item_features=False`` leaves the candidate's features out
    (on next_item data they would reveal the label).
    """

    def __init__(self, schema: EventSchema, dim: int, *, with_item_features: bool = True, sparse: bool = False) -> None:
        super().__init__()
        self.dim = dim
        self.user_names = [f.name for f in schema.user_features]
        self.item_names = [f.name for f in schema.item_features] if with_item_features else []
        tables = [
            EmbeddingBagConfig(
                name=f"t_{f.name}",
                embedding_dim=dim,
                num_embeddings=f.cardinality,
                feature_names=[f.name],
                pooling=PoolingType.MEAN,
            )
            for f in schema.sparse
            if f.name in self.user_names or f.name in self.item_names
        ]
        self.collection = EmbeddingBagCollection(tables=tables) if tables else None
        if sparse and self.collection is not None:
            sparse_gradients(self.collection)

    def forward(self, sparse: KeyedJaggedTensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.collection is None:
            empty = torch.zeros(batch_size, 0, self.dim, device=sparse.values().device)
            return empty, empty
        pooled = self.collection(sparse).to_dict()

        def stack(names: list[str]) -> torch.Tensor:
            if not names:
                return next(iter(pooled.values())).new_zeros(batch_size, 0, self.dim)
            return torch.stack([pooled[n] for n in names], dim=1)

        return stack(self.user_names), stack(self.item_names)


class HistoryEmbedding(nn.Module):
    """History events -> ``tokens[L, d_model]`` (jagged, same ``offsets`` as the batch).

    A token is ``sqrt(d) * item + action + domain + age (+ absolute position)``, then dropout. The
    ``sqrt(d)`` scale follows HSTU, whose item table is initialised small (std 0.02).
    """

    def __init__(self, cfg: TeacherConfig, schema: EventSchema) -> None:
        super().__init__()
        d = cfg.d_model
        self.item_proj = nn.Identity() if cfg.item_dim == d else nn.Linear(cfg.item_dim, d, bias=False)
        self.scale = math.sqrt(d)
        features = set(cfg.history_features)
        self.action = nn.Embedding(schema.num_actions, d) if "action" in features else None
        self.domain = nn.Embedding(schema.num_domains, d) if "domain" in features else None
        self.age = nn.Embedding(cfg.age_buckets, d) if "age" in features else None
        self.age_buckets = cfg.age_buckets
        self.pooled = cfg.pooled_history and schema.task == "ctr"
        self.position = nn.Embedding(cfg.max_len, d) if cfg.abs_pos_emb else None
        # Side embeddings start at the scale of the scaled item part (std 0.02·sqrt(d) ~ sqrt(1/d) per
        # coordinate, HSTU's position init) so that they do not drown the item identity.
        for table in (self.action, self.domain, self.age, self.position):
            if table is not None:
                nn.init.trunc_normal_(table.weight, std=math.sqrt(1.0 / d))
        # The reference HSTU's model-wide Xavier-normal pass re-draws its position table after that init.
        if self.position is not None and cfg.embedding_init == "reference":
            nn.init.xavier_normal_(self.position.weight)
        self.dropout = nn.Dropout(cfg.dropout)

    @staticmethod
    def pool_items(items: torch.Tensor, rows: torch.Tensor, batch: JaggedBatch) -> torch.Tensor:
        """``items[L, d]`` -> ``[B, 2, d]``: the mean over each row's events, then over its clicked ones
        (action >= 1); zeros where a row has none. Sums run in float32 (a bf16 sum over thousands of
        events would keep three significant digits)."""
        clicked = (batch.history["actions"] >= 1).float()
        weights = torch.stack([torch.ones_like(clicked), clicked], dim=1)  # [L, 2]
        sums = items.new_zeros(batch.batch_size, 2, items.shape[1], dtype=torch.float32).index_add_(
            0, rows, weights[:, :, None] * items.float()[:, None, :]
        )
        counts = weights.new_zeros(batch.batch_size, 2).index_add_(0, rows, weights)
        return (sums / counts.clamp_min(1.0)[:, :, None]).to(items.dtype)

    def embed_items(self, item_vectors: torch.Tensor) -> torch.Tensor:
        """``[N, item_dim]`` looked-up items -> ``[N, d_model]`` item part of a token (history or candidate)."""
        return self.scale * self.item_proj(item_vectors)

    def forward(
        self, batch: JaggedBatch, item_vectors: torch.Tensor, candidate_vectors: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """History and candidate tokens, in one call so that FSDP gathers the parameters once, around it.

        Args:
            item_vectors: ``[L, item_dim]`` the history items, looked up by the caller in the shared table.
            candidate_vectors: ``[B, item_dim]`` the candidates, from the same table; None when the caller
                needs no candidate token (next_item data), and then both candidate outputs are None.

        Returns:
            ``tokens[L, d_model]`` history tokens; ``candidate_items[B, d_model]`` the candidates' item
            part; ``candidate_tokens[B, d_model]`` the candidate as a token on its surface (its action is
            the label: absent); ``pooled[B, P, d_model]`` the item part averaged over each history's
            events and over its clicked events (``P = 2`` with ``pooled_history``, else 0).
        """
        candidate_items = candidate_tokens = None
        if candidate_vectors is not None:
            candidate_items = self.embed_items(candidate_vectors)
            candidate_tokens = candidate_items
            if self.domain is not None:
                candidate_tokens = candidate_items + self.domain(batch.domain)
        history = batch.history
        tokens = self.embed_items(item_vectors)
        rows = token_rows(batch.offsets, tokens.shape[0])
        pooled = (
            self.pool_items(tokens, rows, batch) if self.pooled else tokens.new_zeros(batch.batch_size, 0, tokens.shape[1])
        )
        if self.action is not None:
            tokens = tokens + self.action(history["actions"])
        if self.domain is not None:
            tokens = tokens + self.domain(history["domains"])
        if self.age is not None:
            age = batch.timestamp[rows] - history["timestamps"]
            tokens = tokens + self.age(log_bucket(age, self.age_buckets))
        if self.position is not None:
            positions = token_positions(batch.offsets, rows).clamp(max=self.position.num_embeddings - 1)
            tokens = tokens + self.position(positions)
        return self.dropout(tokens), candidate_items, candidate_tokens, pooled
