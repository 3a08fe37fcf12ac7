"""The GEM teacher: HSTU sequence blocks interleaved InterFormer-style with a Wukong/DCNv2 interaction
arch, target-aware, with multi-domain experts and click/conversion heads, plus a generative
next-item objective.

Data flow for one batch (``L`` history tokens, ``B`` rows, ``d = d_model``)::

    item table (torchrec EC) ─► history tokens [L, d] ─┐
    candidate ─► candidate token [B, d] ───────────────┤ appended after each history as attention
    CLS tokens [C, d] ─────────────────────────────────┘ targets: they see the history, not each other
    user features (torchrec EBC) + a bias token ─► user tokens [B, n_u, d]

    per layer:  sequence ← PFFN(sequence | user tokens)        (InterFormer: non-seq → seq)
                sequence ← HSTU block (jagged, causal, targets)
                summary  ← gate(CLS ⊕ PMA(history) ⊕ K most recent)
                user tokens ← interaction(user tokens ⊕ summary)  (InterFormer: seq → non-seq)

    pooled     = mean item embedding of the history, over all and over clicked events  [B, 2, d]
    user_repr  = tower(user tokens ⊕ summary ⊕ pooled)   never sees the candidate (targets are unseen)
    tokens     = user ⊕ summary ⊕ pooled ⊕ candidate-after-attention ⊕ item features ⊕ domain ⊕ dense
    logits     = heads_domain(experts(interaction(tokens) ⊕ pairwise dots(tokens)))

For ``next_item`` data (e.g. MovieLens) the model is HSTU's generative recommender: every
history position predicts the next item (the last one predicts the candidate) with sampled
softmax, and ``score_items`` ranks the whole catalogue. ``sequence_block="sasrec"`` swaps the HSTU
blocks for SASRec's softmax blocks and keeps everything else (the same-data baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from foundation.data.batch import JaggedBatch
from foundation.data.schema import TASKS, EventSchema
from foundation.model.embeddings import HistoryEmbedding, ItemEmbedding, SparseFeatureEmbedding
from foundation.model.experts import MultiDomainExperts
from foundation.model.flops import teacher_flops
from foundation.model.generative import l2_normalize, next_item_targets, sampled_softmax_loss
from foundation.model.hstu import HSTUBlock
from foundation.model.interaction import build_interaction_block, build_interaction_stack
from foundation.model.interformer import PersonalizedFFN, SequenceSummary, SummaryLayout
from foundation.model.jagged import SuffixLayout, gather_rows, token_rows
from foundation.model.norms import add_branch, autocast_dtype
from foundation.model.outputs import ModelOutput, multitask_bce
from foundation.model.padding import PaddedBatch, real_tokens_and_rows
from foundation.model.profiling import EMBEDDINGS, GENERATIVE, profile_region
from foundation.model.sasrec import SASRecBlock
from foundation.model.teacher_config import TeacherConfig

__all__ = ["GEMTeacher", "Lookups", "TeacherConfig", "build_teacher"]


@dataclass
class Lookups:
    """What a batch reads from the teacher's torchrec tables: :meth:`GEMTeacher.look_up`'s result, the input of
    the dense rest of the model (``GEMTeacher.forward(batch, lookups)``). A step that runs the lookups apart
    (eagerly, while the dense part replays from a CUDA graph) passes them in.

    Attributes:
        negative_ids: the uniform negatives a training forward of the generative objective draws (else None):
            ``[K]`` (``negatives="batch"``) or ``[N, K]`` (``"position"``).
        item_vectors: ``[L + B + K', item_dim]`` item-table rows of the history, the candidates, then the
            negatives (``K'`` of them: ``negative_ids.numel()``, or 0), from one lookup.
        user_features: ``[B, F_user, d]`` pooled user-side feature bags.
        item_features: ``[B, F_item, d]`` pooled candidate-side feature bags.
    """

    negative_ids: torch.Tensor | None
    item_vectors: torch.Tensor
    user_features: torch.Tensor
    item_features: torch.Tensor


@dataclass
class Encoded:
    """What the sequence and interleaved arches produce for a batch.

    Attributes:
        history: ``[L, d]`` history tokens after the last layer.
        suffix: ``[B, S, d]`` CLS tokens then (ctr, target-aware) the candidate token, after the last layer.
        user_tokens: ``[B, n_u, d]`` non-sequence user state (``n_u = 0`` when the model has none).
        summary: ``[B, n_s, d]`` last sequence summary (``n_s = 0`` when none is built).
        item_features: ``[B, F_item, d]`` the candidate's categorical features (ctr only).
        history_vectors: ``[L, item_dim]`` history item embeddings from the item table.
        candidate_vectors: ``[B, item_dim]`` candidate embeddings from the item table.
        negative_ids, negative_vectors: uniform negatives drawn in a training forward of the generative
            objective (else None) and their raw table rows: ``[K]`` and ``[K, item_dim]`` shared by the
            batch (``negatives="batch"``), or ``[N, K]`` and ``[N * K, item_dim]`` for its ``N`` positions.
        candidate_items: ``[B, d]`` the candidate's item part of a token (scaled, projected); None on
            next_item data, where nothing reads it.
        pooled: ``[B, P, d]`` mean item part of each history, over all and over clicked events (ctr with
            ``pooled_history``; ``P = 0`` otherwise).
    """

    history: torch.Tensor
    suffix: torch.Tensor
    user_tokens: torch.Tensor
    summary: torch.Tensor
    item_features: torch.Tensor
    history_vectors: torch.Tensor
    candidate_vectors: torch.Tensor
    candidate_items: torch.Tensor | None
    pooled: torch.Tensor
    negative_ids: torch.Tensor | None
    negative_vectors: torch.Tensor | None


class GEMTeacher(nn.Module):
    """``forward(batch) -> ModelOutput``, ``loss(batch, out)``, ``score_items(batch) -> [B, num_items]``.

    On ctr data ``user_repr``/``item_repr`` are ``[B, repr_dim]`` towers whose scaled dot product is
    part of every task logit (so the exported embeddings retrieve); on next_item data they are the
    L2-normalised next-item query and candidate embedding (``[B, item_dim]``).
    """

    def __init__(self, cfg: TeacherConfig, schema: EventSchema, negative_items: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg, self.schema = cfg, schema
        self.next_item = schema.task == "next_item"
        self.register_buffer("negative_items", check_negative_items(cfg, schema, negative_items), persistent=False)
        d = cfg.d_model
        self.items = ItemEmbedding(
            schema.num_items, cfg.item_dim, truncated=cfg.embedding_init == "reference", sparse=cfg.sparse_tables
        )
        self.history_embedding = HistoryEmbedding(cfg, schema)
        # Next-item models read user features only through the interleaving (never item features).
        self.uses_user_tokens = not self.next_item or cfg.interleave
        if self.uses_user_tokens:
            self.sparse_embedding = SparseFeatureEmbedding(
                schema, d, with_item_features=not self.next_item, sparse=cfg.sparse_tables
            )
            self.user_bias = nn.Parameter(torch.zeros(1, d))
        self.cls_tokens = nn.Parameter(torch.randn(cfg.num_cls, d) * 0.02)
        self.with_candidate_token = cfg.target_aware and not self.next_item
        self.num_suffix = cfg.num_cls + int(self.with_candidate_token)
        self.blocks = nn.ModuleList(build_sequence_block(cfg, self.num_suffix) for _ in range(cfg.num_layers))
        # The target-time bias (query_time="target") needs each position's next event time.
        self.target_time = (
            cfg.sequence_block == "hstu" and cfg.time_buckets > 0 and cfg.resolved_query_time(self.next_item) == "target"
        )
        self.num_user_tokens = self.build_interleaving(cfg, schema)
        self.with_queries = self.next_item or cfg.generative
        if self.with_queries:
            self.query_proj = nn.Identity() if cfg.item_dim == d else nn.Linear(d, cfg.item_dim)
        if self.next_item:
            self.empty_history_query = nn.Parameter(torch.randn(cfg.item_dim) * 0.02)
        else:
            self.build_ctr_output(cfg, schema)

    @property
    def num_summary_tokens(self) -> int:
        return self.cfg.num_cls + self.cfg.num_pma_seeds + self.cfg.num_recent if len(self.summaries) else 0

    def build_interleaving(self, cfg: TeacherConfig, schema: EventSchema) -> int:
        """Per-layer PFFN, sequence summary and interaction (InterFormer) when interleaving.

        Without interleaving, ctr models summarise the sequence once, after the last layer. A
        next_item model needs no summary after its last layer (nothing reads it).

        Returns the number of user tokens leaving the sequence arch.
        """
        d = cfg.d_model
        n_user = len(schema.user_features) + 1 if self.uses_user_tokens else 0
        n_summary = cfg.num_cls + cfg.num_pma_seeds + cfg.num_recent
        if cfg.interleave:
            num_summaries = cfg.num_layers - 1 if self.next_item else cfg.num_layers
        else:
            num_summaries = int(not self.next_item)
        self.summaries = nn.ModuleList(
            SequenceSummary(d, cfg.num_heads, cfg.num_pma_seeds, cfg.num_recent) for _ in range(num_summaries)
        )
        if not cfg.interleave:
            self.pffns, self.user_interactions = nn.ModuleList(), nn.ModuleList()
            return n_user
        widths = [n_user] + [cfg.interaction_tokens] * cfg.num_layers
        self.pffns = nn.ModuleList(
            PersonalizedFFN(d, widths[i], cfg.pffn_summary_dim, cfg.pffn_hidden, cfg.dropout)
            for i in range(cfg.num_layers)
        )
        self.user_interactions = nn.ModuleList(
            build_interaction_block(cfg, widths[i] + n_summary, cfg.interaction_tokens)
            for i in range(num_summaries)
        )
        return cfg.interaction_tokens

    def build_ctr_output(self, cfg: TeacherConfig, schema: EventSchema) -> None:
        """User/item towers, the candidate-aware interaction stack, experts and per-domain heads."""
        d = cfg.d_model
        n_item = 1 + len(schema.item_features)
        n_user_side = self.num_user_tokens + self.num_summary_tokens + cfg.num_pooled_tokens
        self.user_tower = nn.Linear(n_user_side * d, cfg.repr_dim)
        self.item_tower = nn.Linear(n_item * d, cfg.repr_dim)
        self.two_tower_scale = nn.Parameter(torch.ones(len(TASKS)))
        self.domain_embedding = nn.Embedding(schema.num_domains, d)
        self.dense_proj = nn.Linear(schema.dense_dim, d) if schema.dense_dim else None
        n_final = n_user_side + int(self.with_candidate_token) + n_item + 1 + int(schema.dense_dim > 0)
        self.final_interaction = build_interaction_stack(cfg, n_final, cfg.num_final_interaction_blocks)
        n_out = cfg.interaction_tokens if cfg.num_final_interaction_blocks else n_final
        n_dots = n_final * (n_final - 1) // 2 if cfg.dot_interaction else 0
        self.dot_norm = nn.LayerNorm(n_dots) if n_dots else None
        self.experts = MultiDomainExperts(
            n_out * d + n_dots,
            num_domains=schema.num_domains,
            num_tasks=len(TASKS),
            num_shared=cfg.num_shared_experts,
            num_per_domain=cfg.num_domain_experts,
            hidden=cfg.expert_hidden,
            expert_dim=cfg.expert_dim,
            dropout=cfg.dropout,
        )

    # -- sequence and interleaved arches ---------------------------------------------------------

    def look_up(self, batch: JaggedBatch) -> Lookups:
        """Every torchrec lookup of the batch (:class:`Lookups`): the item table once, the feature bags once.

        A training step looks the item table up once: the generative loss's negatives join the history
        and candidates here. Fused sparse optimisers (torchrec) step once per lookup, so a second
        lookup in the loss would give its rows a second optimiser step that one device never takes.
        """
        b = batch.batch_size
        with profile_region(EMBEDDINGS):
            negative_ids = self.draw_negatives(batch) if self.training and self.with_queries else None
            ids = [batch.history["item_ids"], batch.candidate]
            if negative_ids is not None:
                ids.append(negative_ids.flatten())
            vectors = self.items(torch.cat(ids))
            if self.uses_user_tokens:
                user_features, item_features = self.sparse_embedding(batch.sparse, b)
            else:
                user_features = item_features = batch.dense.new_zeros(b, 0, self.cfg.d_model)
        return Lookups(negative_ids, vectors, user_features, item_features)

    def embed_non_sequence(self, batch: JaggedBatch, lookups: Lookups) -> torch.Tensor:
        """``user_tokens[B, n_u, d]``: the user features plus a learned bias token (none without user tokens)."""
        if not self.uses_user_tokens:
            return lookups.user_features
        bias = self.user_bias.expand(batch.batch_size, 1, -1)
        return torch.cat([lookups.user_features, bias], dim=1)

    def build_suffix(self, batch: JaggedBatch, candidate_tokens: torch.Tensor | None) -> torch.Tensor:
        """``[B, S, d]``: CLS tokens, then the candidate token ``candidate_tokens[B, d]`` when target-aware."""
        parts = [self.cls_tokens.expand(batch.batch_size, -1, -1)]
        if self.with_candidate_token:
            parts.append(candidate_tokens[:, None])
        return torch.cat(parts, dim=1)

    def encode(self, batch: JaggedBatch, lookups: Lookups) -> Encoded:
        """Embeddings from the lookups, then the HSTU layers interleaved with the non-sequence arch."""
        num_tokens, b = batch.num_tokens, batch.batch_size
        negative_ids, item_features = lookups.negative_ids, lookups.item_features
        history_vectors, candidate_vectors, negative_vectors = lookups.item_vectors.split(
            [num_tokens, b, lookups.item_vectors.shape[0] - num_tokens - b]
        )
        with profile_region(EMBEDDINGS):
            user_tokens = self.embed_non_sequence(batch, lookups)
            history_tokens, candidate_items, candidate_tokens, pooled = self.history_embedding(
                batch, history_vectors, None if self.next_item else candidate_vectors
            )
        layout = SuffixLayout.build(batch.offsets, num_tokens, self.num_suffix)
        seq = layout.combine(history_tokens, self.build_suffix(batch, candidate_tokens))
        if self.cfg.stream_dtype == "autocast" and (dtype := autocast_dtype(seq)) is not None:
            seq = seq.to(dtype)
        # CLS and candidate tokens happen "now": at the impression time.
        timestamps = layout.combine(
            batch.history["timestamps"], batch.timestamp[:, None].expand(b, self.num_suffix)
        )
        query_timestamps = self.query_timestamps(batch, layout) if self.target_time else None
        num_targets = layout.num_targets() if self.num_suffix else None
        max_len = max(batch.max_len + self.num_suffix, 1)  # a batch of empty histories still has N >= 1
        rows = token_rows(layout.offsets, seq.shape[0]) if self.cfg.interleave else None
        summary = user_tokens.new_zeros(b, 0, self.cfg.d_model)
        summary_layout = None
        if len(self.summaries):
            c = self.cfg
            summary_layout = SummaryLayout.build(
                batch.offsets, layout, batch.max_len, c.num_cls, c.num_pma_seeds, c.num_recent
            )
        # Each module's output joins the stream in the next one's input norm (one pass over the stream, not two):
        # ``branch`` is the output not yet added to ``seq``, ``bias`` its projection's bias (summed in that norm).
        branch = bias = None
        for layer, block in enumerate(self.blocks):
            if self.cfg.interleave:
                seq, branch, bias = self.pffns[layer](
                    seq, rows, user_tokens, branch=branch, branch_bias=bias, defer_residual=True
                )
            seq, branch, bias = block(
                seq, layout.offsets, max_len, timestamps, num_targets, query_timestamps=query_timestamps, branch=branch,
                branch_bias=bias, defer_residual=True,
            )
            if self.cfg.interleave and layer < len(self.summaries):
                seq, summary = self.summaries[layer](seq, summary_layout, branch, bias)
                branch = bias = None
                user_tokens = self.user_interactions[layer](torch.cat([user_tokens, summary], dim=1))
        if not self.cfg.interleave and len(self.summaries):
            seq, summary = self.summaries[0](seq, summary_layout, branch, bias)
            branch = bias = None
        seq = add_branch(seq, branch, bias)
        history, suffix = layout.split(seq)
        return Encoded(
            history, suffix, user_tokens, summary, item_features, history_vectors, candidate_vectors,
            candidate_items, pooled, negative_ids, negative_vectors if negative_ids is not None else None,
        )

    def query_timestamps(self, batch: JaggedBatch, layout: SuffixLayout) -> torch.Tensor:
        """``[L + B*S]`` the time each token's attention measures its time bias from (``query_time="target"``).

        A history token predicts the next event, so it takes that event's time; a row's last history
        token and its CLS/candidate tokens take the row's time (the candidate's, or the impression's).
        """
        next_times, _ = next_item_targets(batch.history["timestamps"], batch.offsets, batch.timestamp)
        return layout.combine(next_times, batch.timestamp[:, None].expand(batch.batch_size, self.num_suffix))

    # -- outputs ----------------------------------------------------------------------------------

    def next_item_queries(
        self, batch: JaggedBatch, history: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """L2-normalised retrieval queries: ``([L, item_dim]`` per position, ``[B, item_dim]`` per row).

        A row's query is its last history position's. Rows with an empty history get a learned
        query on next_item data (trained on their candidate) and a zero query on ctr data.
        """
        queries = l2_normalize(self.query_proj(history))
        fallback = l2_normalize(self.empty_history_query) if self.next_item else queries.new_zeros(())
        last = gather_rows(queries, batch.offsets[1:] - 1, batch.lengths > 0, fallback)
        return queries, last

    def forward(self, batch: JaggedBatch, lookups: Lookups | None = None) -> ModelOutput:
        """The outputs on ``batch``; ``lookups``: its :meth:`look_up` result when the caller ran it (default:
        looked up here)."""
        enc = self.encode(batch, self.look_up(batch) if lookups is None else lookups)
        extra = {}
        if self.with_queries:
            with profile_region(GENERATIVE):
                extra["position_queries"], extra["next_item_query"] = self.next_item_queries(batch, enc.history)
            extra["history_vectors"], extra["candidate_vectors"] = enc.history_vectors, enc.candidate_vectors
            if enc.negative_ids is not None:
                extra["negative_ids"], extra["negative_vectors"] = enc.negative_ids, enc.negative_vectors
        if self.next_item:
            user_repr, item_repr = extra["next_item_query"], l2_normalize(enc.candidate_vectors)
            extra["candidate_score"] = (user_repr * item_repr).sum(-1) / self.cfg.temperature
            return ModelOutput(logits={}, user_repr=user_repr, item_repr=item_repr, extra=extra)
        return self.ctr_output(batch, enc, extra)

    def ctr_output(self, batch: JaggedBatch, enc: Encoded, extra: dict[str, torch.Tensor]) -> ModelOutput:
        """Towers, then the candidate-aware interaction, experts and per-domain heads."""
        user_side = torch.cat([enc.user_tokens, enc.summary, enc.pooled], dim=1)
        item_tokens = torch.cat(
            [enc.candidate_items[:, None], enc.item_features], 1
        )
        user_repr = self.user_tower(user_side.flatten(1))
        item_repr = self.item_tower(item_tokens.flatten(1))
        parts = [user_side]
        if self.with_candidate_token:
            parts.append(enc.suffix[:, -1:])
        parts += [item_tokens, self.domain_embedding(batch.domain)[:, None]]
        if self.dense_proj is not None:
            parts.append(self.dense_proj(batch.dense)[:, None])
        tokens = torch.cat(parts, dim=1)
        expert_input = self.final_interaction(tokens).flatten(1)
        if self.dot_norm is not None:
            dots = self.dot_norm(pairwise_dots(tokens))
            expert_input = torch.cat([expert_input, dots.to(expert_input.dtype)], dim=1)
        two_tower = (user_repr * item_repr).sum(-1, keepdim=True) / self.cfg.repr_dim**0.5
        logits = self.experts(expert_input, batch.domain) + self.two_tower_scale * two_tower
        return ModelOutput(
            logits={task: logits[:, i] for i, task in enumerate(TASKS)},
            user_repr=user_repr,
            item_repr=item_repr,
            extra=extra,
        )

    # -- losses and ranking -----------------------------------------------------------------------

    def generative_loss(self, batch: JaggedBatch, out: ModelOutput) -> torch.Tensor:
        """Mean sampled-softmax loss over the positions that have a next item.

        On next_item data the last history position predicts the candidate, and a row with an
        empty history predicts it from the learned empty-history query.
        """
        num_tokens, b, device = batch.num_tokens, batch.batch_size, batch.offsets.device
        # Targets index the forward's item vectors ``[history; candidates]``: the next token's item,
        # and on next_item data the candidate after a row's last token and for empty rows.
        candidate_index = num_tokens + torch.arange(b, device=device)
        target_index, valid = next_item_targets(
            torch.arange(num_tokens, device=device), batch.offsets, candidate_index if self.next_item else None
        )
        queries = out.extra["position_queries"]
        if self.next_item:
            queries = torch.cat([queries, out.extra["next_item_query"]])
            target_index = torch.cat([target_index, candidate_index])
            valid = torch.cat([valid, batch.lengths == 0])
        real = real_tokens_and_rows(batch)
        if real is not None:  # padding positions weigh nothing (foundation/model/padding.py)
            valid = valid & (torch.cat(real) if self.next_item else real[0])
        item_ids = torch.cat([batch.history["item_ids"], batch.candidate])
        item_vectors = torch.cat([out.extra["history_vectors"], out.extra["candidate_vectors"]])
        per_position = sampled_softmax_loss(
            queries,
            item_ids.index_select(0, target_index),
            item_vectors.index_select(0, target_index),
            self.cfg.temperature,
            **self.negative_arguments(batch, out),
        )
        weight = valid.to(per_position.dtype)
        return (per_position * weight).sum() / weight.sum().clamp_min(1.0)

    def negative_arguments(self, batch: JaggedBatch, out: ModelOutput) -> dict[str, torch.Tensor | None]:
        """The loss's negatives: ``shared_ids/vectors`` (the batch's draw, the in-batch candidates) and
        ``position_ids/vectors`` (a per-position draw), as :func:`sampled_softmax_loss` takes them."""
        if "negative_ids" in out.extra:
            negatives, vectors = out.extra["negative_ids"], out.extra["negative_vectors"]
        else:  # evaluation: no optimiser step follows, so a second lookup changes nothing
            negatives = self.draw_negatives(batch)
            vectors = self.items(negatives.flatten())
        per_position = self.cfg.negatives == "position"
        shared_ids, shared_vectors = ([], []) if per_position else ([negatives], [vectors])
        shared_valid = None
        if self.cfg.in_batch_negatives:
            shared_ids.append(batch.candidate)
            shared_vectors.append(out.extra["candidate_vectors"])
            real = real_tokens_and_rows(batch)
            if real is not None:  # a padding row's candidate is no negative
                shared_valid = torch.cat([real[1].new_ones(sum(t.numel() for t in shared_ids[:-1])), real[1]])
        return {
            "shared_ids": torch.cat(shared_ids) if shared_ids else None,
            "shared_vectors": torch.cat(shared_vectors) if shared_vectors else None,
            "shared_valid": shared_valid,
            "position_ids": negatives if per_position else None,
            "position_vectors": vectors.view(*negatives.shape, -1) if per_position else None,
        }

    def draw_negatives(self, batch: JaggedBatch) -> torch.Tensor:
        """Uniform item ids (from every id, or from ``negative_items`` under ``negative_pool="used"``):
        ``[num_negatives]`` shared by the batch (``negatives="batch"``), or ``[N, num_negatives]`` for its ``N``
        next-item positions (every history token, plus one per row on next_item data)."""
        shape = (self.cfg.num_negatives,)
        if self.cfg.negatives == "position":
            shape = (batch.num_tokens + (batch.batch_size if self.next_item else 0), *shape)
        return self.sample_items(shape, batch.offsets.device)

    def sample_items(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Uniform item ids of ``shape``: any id below ``num_items``, or one of ``negative_items``."""
        if self.negative_items is None:
            return torch.randint(self.schema.num_items, shape, device=device)
        return self.negative_items[torch.randint(self.negative_items.numel(), shape, device=device)]

    def loss(self, batch: JaggedBatch, out: ModelOutput) -> dict[str, torch.Tensor]:
        """``{"loss", ...terms}``: the generative loss (next_item), or masked BCE per task (ctr) plus,
        when ``cfg.generative``, the weighted generative loss."""
        if self.next_item:
            with profile_region(GENERATIVE):
                generative = self.generative_loss(batch, out)
            return {"loss": generative, "loss_next_item": generative}
        terms = multitask_bce(batch, out, self.cfg.loss_weights)
        if self.cfg.generative:
            with profile_region(GENERATIVE):
                generative = self.generative_loss(batch, out)
            terms["loss"] = terms["loss"] + self.cfg.generative_weight * generative
            terms["loss_next_item"] = generative
        return terms

    def score_items(self, batch: JaggedBatch) -> torch.Tensor:
        """``[B, num_items]`` cosine / temperature of every row's next-item query against the whole catalogue.

        Excluding items the user has already seen is the evaluator's job.
        """
        if not self.with_queries:
            raise ValueError(
                "score_items needs the generative objective: set teacher.generative=true for ctr data"
            )
        query = self(batch).extra["next_item_query"]
        table = l2_normalize(self.items.all_items(query.device))
        return query @ table.T / self.cfg.temperature

    def flops(self, batch: JaggedBatch, *, training: bool = True) -> float:
        """Matmul FLOPs of one step on this batch, valid tokens only (see :mod:`foundation.model.flops`): a
        padded batch's real rows."""
        offsets = batch.offsets[: batch.real_rows + 1] if isinstance(batch, PaddedBatch) else batch.offsets
        return teacher_flops(self.cfg, self.schema, offsets, training=training)


def pairwise_dots(tokens: torch.Tensor) -> torch.Tensor:
    """``[B, n, d]`` -> ``[B, n(n-1)/2]`` float32: the dot product of every token pair (upper triangle).

    In float32 whatever the tokens' dtype: a bf16 dot of ``d`` terms keeps too few bits for the
    small differences between candidates that these features exist to expose.
    """
    n = tokens.shape[1]
    i, j = torch.triu_indices(n, n, offset=1, device=tokens.device)
    tokens = tokens.float()
    return (tokens @ tokens.transpose(1, 2))[:, i, j]


def build_sequence_block(cfg: TeacherConfig, num_suffix: int) -> nn.Module:
    """One layer of the sequence arch (``cfg.sequence_block``); ``num_suffix`` CLS/target tokens per row."""
    if cfg.sequence_block == "sasrec":
        return SASRecBlock(
            cfg.d_model, cfg.num_heads, cfg.attn_dim, cfg.value_dim, ffn_hidden=cfg.ffn_hidden or cfg.d_model,
            dropout=cfg.dropout,
        )
    if cfg.sequence_block != "hstu":
        raise ValueError(f"teacher.sequence_block must be 'hstu' or 'sasrec', got {cfg.sequence_block!r}")
    return HSTUBlock(
        cfg.d_model,
        cfg.num_heads,
        cfg.attn_dim,
        cfg.value_dim,
        dropout=cfg.dropout,
        alpha=cfg.attn_alpha,
        pos_buckets=cfg.pos_buckets,
        time_buckets=cfg.time_buckets,
        attention_norm=cfg.attention_norm_length(num_suffix),
        norm=cfg.block_norm,
        init=cfg.block_init,
        uvqk_bias=cfg.uvqk_bias,
        rel_bias=cfg.rel_bias,
    )


def check_negative_items(cfg: TeacherConfig, schema: EventSchema, items: torch.Tensor | None) -> torch.Tensor | None:
    """The ``[K]`` int64 ids ``negative_pool="used"`` draws from (None under ``"all"``), checked against the schema."""
    if cfg.negative_pool == "all":
        if items is not None:
            raise ValueError("negative_items are drawn from only with teacher.negative_pool='used' (it is 'all')")
        return None
    if cfg.negative_pool != "used":
        raise ValueError(f"teacher.negative_pool must be 'all' or 'used', got {cfg.negative_pool!r}")
    if items is None:
        raise ValueError("teacher.negative_pool='used' needs the dataset's item ids: pass negative_items")
    if items.dim() != 1 or items.numel() == 0 or items.dtype != torch.int64:
        raise ValueError(f"negative_items must be a non-empty 1-D int64 tensor, got {items.dtype} {tuple(items.shape)}")
    if int(items.min()) < 0 or int(items.max()) >= schema.num_items:
        raise ValueError(f"negative_items must lie in [0, num_items={schema.num_items}), got {int(items.min())}..{int(items.max())}")
    return items.clone()


def build_teacher(cfg: TeacherConfig, schema: EventSchema, negative_items: torch.Tensor | None = None) -> GEMTeacher:
    """The GEM teacher for a dataset's schema (``ctr`` or ``next_item`` task); ``negative_items`` ``[K]``: the
    item ids its negatives are drawn from under ``negative_pool="used"`` (e.g. those of ``item_ids.parquet``)."""
    cfg.check()
    return GEMTeacher(cfg, schema, negative_items)
