"""``TeacherConfig``: the typed configuration of the GEM teacher (its named flavors are in ``gem.flavors``).

This module imports no torch so that config tooling (flavor registry, CLI overrides) stays light.
Every field is an ``int``, ``float``, ``bool``, ``str``, ``tuple`` or ``dict`` so that dotted CLI
overrides (``model.teacher.num_layers=4``) can parse it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

INTERACTIONS = ("wukong", "dcnv2")
NEGATIVE_MODES = ("batch", "position")
HISTORY_FEATURES = ("action", "domain", "age")
SEQUENCE_BLOCKS = ("hstu", "sasrec")
QUERY_TIMES = ("auto", "target", "event")
ATTENTION_NORMS = ("max_len", "row")
NEGATIVE_POOLS = ("all", "used")
BLOCK_NORMS = ("affine", "plain")
BLOCK_INITS = ("torch", "reference")
REL_BIASES = ("head", "shared")
EMBEDDING_INITS = ("scaled", "reference")
STREAM_DTYPES = ("float32", "autocast")


@dataclass
class TeacherConfig:
    """Sizes and switches of the GEM teacher (see :mod:`foundation.model.teacher` for the architecture).

    Sequence arch (HSTU, arXiv 2402.17152):
        sequence_block: ``hstu`` (pointwise attention with relative bias and gating) or ``sasrec``
            (softmax self-attention and a pointwise FFN, arXiv 1808.09781: the baseline HSTU's ML-1M
            numbers are compared with; it reads no relative bias).
        d_model: token width of the sequence and interaction arches.
        num_layers, num_heads: sequence blocks and attention heads.
        attn_dim, value_dim: per-head query/key and value widths.
        attn_alpha: scale on ``QKᵀ``; None means ``1/sqrt(attn_dim)``.
        max_len: the longest history the model is sized for: HSTU's fixed ``1/N`` is
            ``1/(max_len + CLS/target tokens)``; relative-position buckets and the absolute
            position table cover it (longer distances share the last bucket).
        position_window: relative positions told apart exactly, ``0..position_window - 1``; every farther
            pair shares one last bucket (T5's relative bias treats far distances alike as well; here the time
            bias still tells far events apart by their age). ``0``: every distance up to ``max_len`` has its
            own bucket (HSTU's table). A short window also lets the attention kernels skip the position table
            on the far tiles of long sequences (kernels/triton/jagged_attention.py).
        time_buckets: log time-difference buckets of the relative time bias (0 disables it).
        query_time: the time a query position measures its time bias from, ``bucket(t_query - ts_j)``
            for key event ``j``: ``target`` is the time of the event the position predicts (the next
            event; the candidate's for a row's last event), as the reference HSTU buckets
            ``ts[i+1] - ts[j]``; ``event`` is the position's own event time (``ts[i] - ts[j]``);
            ``auto`` is ``target`` on next_item data and ``event`` on ctr data.
        attention_norm: HSTU's ``N`` in ``1/N``: ``max_len`` (the fixed ``max_len + CLS/target
            tokens``), ``row`` (each row's own length), or a number (e.g. ``211``, the reference's
            padded length at ``max_len = 200``: 200 history + 10 + 1 output slots).
        block_norm: the HSTU block's two LayerNorms (input, attention output): ``affine`` (a learned
            gain and bias, eps 1e-5) or ``plain`` (no parameters, eps 1e-6: the reference HSTU's).
        block_init: the HSTU block's initialisation: ``torch`` (``nn.Linear``'s defaults for ``uvqk`` and
            the output projection, zero relative-bias tables) or ``reference`` (the reference HSTU's:
            ``uvqk`` weight N(0, 0.02) and bias 0, output weight Xavier-uniform, bias tables N(0, 0.02)).
        uvqk_bias: give the ``uvqk`` projection a bias (the reference's is a bare matrix: ``false``).
        rel_bias: relative position and time bias tables per ``head`` or ``shared`` by the heads of a
            layer (the reference's).
        embedding_init: ``scaled`` (item table N(0, 0.02), in effect untruncated; position table
            N(0, 1/d)) or ``reference`` (item table N(0, 0.02) truncated at 2 std; position
            table Xavier-normal, std ``sqrt(2 / (max_len + d))``).
        stream_dtype: the residual stream's dtype through the sequence arch: ``float32``, or ``autocast`` (the
            autocast dtype while autocast is on, e.g. bf16 as torchtitan's and Megatron's default residuals, so the
            residual norms, which read and write the stream and its gradient, move fewer bytes; every norm still
            computes in float32).
        ffn_hidden: hidden width of the SASRec block's FFN (0: ``d_model``).
        dropout: on input embeddings, inside blocks, and in MLPs.
        abs_pos_emb: add a learned absolute position embedding to history tokens (HSTU's ML-1M
            preprocessor does).
        history_features: side features embedded into each history token besides its item:
            ``action``, ``domain`` and ``age`` (log bucket of impression time minus event time).
        age_buckets: buckets of the ``age`` feature.
        item_dim: width of the item embedding table (shared by history, candidate and the
            generative objective); projected to ``d_model`` when they differ.
        sparse_tables: the torchrec tables (items, feature bags) give sparse gradients of the rows a step
            looked up, and :class:`~foundation.model.precision.MasterAdamW` steps those rows only, with AdamW's
            result: the steps a row missed are applied when a lookup next reads it
            (:mod:`foundation.model.deferred_rows`). False: dense gradients and every row stepped at every step.
            (Lazy Adam, which drops the missed steps, trained worse on the synthetic ``large`` world:
            docs/benchmarks.md, issue 15 session 47.)

    InterFormer interleaving (arXiv 2411.09852):
        interleave: per layer, condition the sequence on the non-sequence summary (personalised
            FFN) and feed a sequence summary into the interaction arch.
        num_cls: CLS tokens appended to every sequence (they attend to the history only).
        num_pma_seeds: PMA seed tokens cross-attending to the history, per layer.
        num_recent: the K most recent history tokens added to the summary.
        pffn_hidden: hidden width of the personalised FFN.
        pffn_summary_dim: width each non-sequence token is narrowed to before it conditions the PFFN.
        target_aware: append the candidate as a target token that attends to the history (ctr).
        pooled_history: two more user-side tokens for ctr data, the mean of the history's item
            embeddings over every event and over clicked ones, in the candidate's item space: the
            pooled-bag features a DLRM ranks with, so the sequence arch only has to add what
            pooling misses (order, recency, target-aware selection).

    Interaction arch for non-sequence features:
        interaction: ``wukong`` (arXiv 2403.02545) or ``dcnv2``.
        interaction_tokens: tokens each interaction block emits.
        num_final_interaction_blocks: blocks of the candidate-aware interaction stack.
        dot_interaction: also hand the experts every pairwise dot product of the candidate-aware
            stack's input tokens (DLRM's interaction, exact where Wukong's FM is low-rank).
        wukong_rank: rank of Wukong's optimised FM projection.
        wukong_hidden: hidden width of Wukong's FM MLP.
        dcn_rank, dcn_cross_layers: low-rank width and depth of a DCNv2 block.

    Multi-domain, multi-task output:
        num_shared_experts, num_domain_experts: experts shared by every domain, and per domain.
        expert_hidden, expert_dim: expert MLP widths.
        repr_dim: width of ``user_repr`` / ``item_repr`` for ctr data (next_item data uses
            ``item_dim``, the retrieval space).
        loss_weights: task -> weight of its masked BCE.

    Generative next-item objective (always on for next_item data, optional for ctr):
        generative: add the next-item loss to the ctr loss.
        generative_weight: its weight in the ctr loss.
        num_negatives: uniform negatives each position is scored against.
        negatives: how they are drawn: ``batch`` (``num_negatives`` ids per batch, shared by every
            position: one GEMM, see :mod:`foundation.model.generative`) or ``position`` (``num_negatives``
            ids per position, HSTU's ML-1M recipe: ``positions x num_negatives`` table rows per step).
        negative_pool: the ids they are drawn from: ``all`` (every id below ``num_items``, unused ones
            included) or ``used`` (the dataset's item ids, handed to the model as ``negative_items``).
        in_batch_negatives: also use the batch's candidates as negatives (shared by every position).
        temperature: softmax temperature on cosine similarities.
    """

    sequence_block: str = "hstu"
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    attn_dim: int = 32
    value_dim: int = 32
    attn_alpha: float | None = None
    max_len: int = 256
    position_window: int = 0
    time_buckets: int = 64
    query_time: str = "auto"
    attention_norm: str = "max_len"
    block_norm: str = "affine"
    block_init: str = "torch"
    uvqk_bias: bool = True
    rel_bias: str = "head"
    embedding_init: str = "scaled"
    stream_dtype: str = "float32"
    ffn_hidden: int = 0
    dropout: float = 0.1
    abs_pos_emb: bool = False
    history_features: tuple[str, ...] = HISTORY_FEATURES
    age_buckets: int = 48
    item_dim: int = 64
    sparse_tables: bool = False

    interleave: bool = True
    num_cls: int = 2
    num_pma_seeds: int = 2
    num_recent: int = 4
    pffn_hidden: int = 128
    pffn_summary_dim: int = 16
    target_aware: bool = True
    pooled_history: bool = True

    interaction: str = "wukong"
    interaction_tokens: int = 8
    num_final_interaction_blocks: int = 2
    dot_interaction: bool = True
    wukong_rank: int = 8
    wukong_hidden: int = 256
    dcn_rank: int = 32
    dcn_cross_layers: int = 2

    num_shared_experts: int = 2
    num_domain_experts: int = 1
    expert_hidden: int = 256
    expert_dim: int = 64
    repr_dim: int = 64
    loss_weights: dict[str, float] = field(default_factory=lambda: {"click": 1.0, "conversion": 1.0})

    generative: bool = False
    generative_weight: float = 0.1
    num_negatives: int = 128
    negatives: str = "batch"
    negative_pool: str = "all"
    in_batch_negatives: bool = False
    temperature: float = 0.05

    def __post_init__(self) -> None:
        self.history_features = tuple(self.history_features)
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad field (again after CLI overrides, which skip ``__init__``)."""
        if self.interaction not in INTERACTIONS:
            raise ValueError(f"teacher.interaction must be one of {INTERACTIONS}, got {self.interaction!r}")
        if self.negatives not in NEGATIVE_MODES:
            raise ValueError(f"teacher.negatives must be one of {NEGATIVE_MODES}, got {self.negatives!r}")
        unknown = set(self.history_features) - set(HISTORY_FEATURES)
        if unknown:
            raise ValueError(
                f"teacher.history_features: unknown {sorted(unknown)}; valid: {HISTORY_FEATURES}"
            )
        positive = (
            "d_model",
            "num_layers",
            "num_heads",
            "attn_dim",
            "value_dim",
            "max_len",
            "item_dim",
            "interaction_tokens",
            "expert_dim",
            "repr_dim",
            "num_negatives",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"teacher.{name} must be positive, got {getattr(self, name)}")
        if self.num_shared_experts + self.num_domain_experts < 1:
            raise ValueError("teacher needs at least one expert (shared or per domain)")
        if not 0.0 <= self.dropout < 1.0 or self.temperature <= 0:
            raise ValueError("teacher.dropout must be in [0, 1) and teacher.temperature positive")
        for name, allowed in (
            ("sequence_block", SEQUENCE_BLOCKS),
            ("query_time", QUERY_TIMES),
            ("negative_pool", NEGATIVE_POOLS),
            ("block_norm", BLOCK_NORMS),
            ("block_init", BLOCK_INITS),
            ("rel_bias", REL_BIASES),
            ("embedding_init", EMBEDDING_INITS),
            ("stream_dtype", STREAM_DTYPES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"teacher.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        self.attention_norm_length(0)
        if self.ffn_hidden < 0:
            raise ValueError(f"teacher.ffn_hidden must be 0 (d_model) or positive, got {self.ffn_hidden}")
        if self.position_window < 0:
            raise ValueError(f"teacher.position_window must be 0 (every distance) or positive, got {self.position_window}")

    @property
    def num_pooled_tokens(self) -> int:
        """User-side pooled-history tokens on ctr data: the mean over every event and over clicked ones."""
        return 2 if self.pooled_history else 0

    def attention_norm_length(self, num_suffix: int) -> int:
        """HSTU's fixed ``N`` for ``1/N`` with ``num_suffix`` CLS/target tokens per row; 0 means each row's
        own length. Raises ValueError on an ``attention_norm`` that is none of those."""
        norm = str(self.attention_norm)
        if norm == "max_len":
            return self.max_len + num_suffix
        if norm == "row":
            return 0
        if not norm.isdigit() or int(norm) < 1:
            raise ValueError(
                f"teacher.attention_norm must be one of {ATTENTION_NORMS} or a positive integer, got {norm!r}"
            )
        return int(norm)

    def resolved_query_time(self, next_item: bool) -> str:
        """``target`` or ``event``: what ``query_time`` means on next_item (True) or ctr data."""
        if self.query_time == "auto":
            return "target" if next_item else "event"
        if self.query_time not in QUERY_TIMES:
            raise ValueError(f"teacher.query_time must be one of {QUERY_TIMES}, got {self.query_time!r}")
        return self.query_time

    @property
    def pos_buckets(self) -> int:
        """Relative-position buckets: every distance inside a full sequence plus its CLS/target tokens, or the
        ``position_window`` exact ones and one for every farther pair."""
        every = self.max_len + self.num_cls + 2
        return min(every, self.position_window + 1) if self.position_window else every

    def replace(self, **changes) -> TeacherConfig:
        return dataclasses.replace(self, **changes)
