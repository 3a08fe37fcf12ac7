"""Model FLOPs of the GEM teacher on valid tokens only, and MFU / tokens-per-second helpers.

Conventions: a ``[m, k] @ [k, n]`` product costs ``2·m·k·n``; only matrix products count (no
elementwise work, no embedding lookups). A training step costs the forward plus a backward of 2x the
forward (the input and weight gradients), except for layers fed by data (``dense_proj``), which need
no input gradient and cost 1x.

Attention counts only the (query, key) pairs that attend (:func:`self_attention_pairs`: causal pairs
inside each history plus every target's history and itself; PMA seeds times history tokens): never
the padded or masked pairs a kernel tile may compute. Its forward is ``2·(Dqk + Dv)`` per pair and head
(``QKᵀ`` and ``PV``) and its backward 2x that (``dV``, ``dP``, ``dQ``, ``dK``). The kernels' backward
also recomputes ``QKᵀ`` (:data:`kernels.flops.BACKWARD_FACTOR` = 2.5 counts it, for kernel
throughput); that is rematerialisation, not model work, so MFU leaves it out, as PaLM's definition does.

``tests/test_teacher_flops.py`` checks the dense count against ``torch.utils.flop_counter`` on the real
forward and on the real forward+backward.
"""

from __future__ import annotations

import torch

from foundation.data.schema import TASKS, EventSchema
from foundation.model.experts import INPUT_ALIGN
from foundation.model.teacher_config import TeacherConfig
from kernels.flops import attention_flops

# Model FLOPs of a backward pass per forward FLOP: two products (input and weight gradients) per product.
MODEL_BACKWARD_FACTOR = 2.0

# Dense (no sparsity) peak matmul throughput in FLOP/s, by device name fragment and precision.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}


def mm(m: float, k: float, n: float) -> float:
    """FLOPs of an ``[m, k] @ [k, n]`` product."""
    return 2.0 * m * k * n


def self_attention_pairs(lengths: torch.Tensor, num_suffix: int) -> float:
    """Attending pairs of HSTU self-attention: causal over each history, plus ``num_suffix`` targets
    per row that each see the history and themselves (``lengths[B]`` are history lengths)."""
    n = lengths.double()
    return float((n * (n + 1) / 2 + num_suffix * (n + 1)).sum())


def interaction_flops(cfg: TeacherConfig, batch: int, n_in: int, n_out: int) -> float:
    """One interaction block ``[B, n_in, d] -> [B, n_out, d]`` (see :mod:`foundation.model.interaction`)."""
    d = cfg.d_model
    token_mix = mm(batch * d, n_in, n_out)
    if cfg.interaction == "wukong":
        n_fm, r, h = max(n_out // 2, 1), cfg.wukong_rank, cfg.wukong_hidden
        fm = 2 * mm(batch * n_in, d, r) + mm(batch, n_in * r, h) + mm(batch, h, n_fm * d)
        return fm + mm(batch * d, n_in, n_out - n_fm) + token_mix
    cross = cfg.dcn_cross_layers * 2 * mm(batch, n_in * d, cfg.dcn_rank)
    return cross + token_mix


def summary_flops(cfg: TeacherConfig, batch: int, num_tokens: int, combined: int) -> tuple[float, float]:
    """``(dense, attention)`` FLOPs of one sequence summary (PMA + gate) over ``num_tokens`` history tokens; its
    key/value projection runs over the whole stream of ``combined`` tokens, the suffix tokens too."""
    d, s = cfg.d_model, cfg.num_pma_seeds
    n_summary = cfg.num_cls + s + cfg.num_recent
    dense = mm(batch * n_summary, d, d)
    attention = 0.0
    if s:
        dense += mm(s, d, d) + mm(combined, d, 2 * d) + mm(batch * s, d, d)
        attention = attention_flops(s * num_tokens, cfg.num_heads, d // cfg.num_heads, d // cfg.num_heads)
    return dense, attention


def sequence_block_flops(cfg: TeacherConfig, num_tokens: int) -> float:
    """Dense FLOPs of one sequence block on ``num_tokens`` tokens (attention apart): HSTU's U/V/Q/K and
    output projections, or SASRec's Q/K/V and output projections plus its two-layer FFN."""
    d, h = cfg.d_model, cfg.num_heads
    if cfg.sequence_block == "sasrec":
        ffn = 2 * mm(num_tokens, d, cfg.ffn_hidden or d)
        return mm(num_tokens, d, h * (2 * cfg.attn_dim + cfg.value_dim)) + mm(num_tokens, h * cfg.value_dim, d) + ffn
    return mm(num_tokens, d, h * (2 * cfg.value_dim + 2 * cfg.attn_dim)) + mm(num_tokens, h * cfg.value_dim, d)


def teacher_flop_breakdown(
    cfg: TeacherConfig, schema: EventSchema, offsets: torch.Tensor
) -> dict[str, float]:
    """Forward FLOPs of one batch by part: ``sequence``, ``attention``, ``interleave``, ``output``, ``generative``.

    Args:
        offsets: ``[B+1]`` history offsets of the batch (after truncation to ``max_len``).
    """
    next_item = schema.task == "next_item"
    lengths = (offsets[1:] - offsets[:-1]).cpu()
    b, num_tokens = lengths.numel(), int(lengths.sum())
    d, h, e = cfg.d_model, cfg.num_heads, cfg.item_dim
    with_candidate = cfg.target_aware and not next_item
    num_suffix = cfg.num_cls + int(with_candidate)
    combined = num_tokens + b * num_suffix
    # History tokens and (ctr) the candidates' item part (projected once; the candidate token and the
    # ctr output's item token share it).
    item_proj = 0.0 if e == d else mm(num_tokens + (0 if next_item else b), e, d)
    layer = sequence_block_flops(cfg, combined)
    parts = {
        "sequence": item_proj + cfg.num_layers * layer,
        "attention": cfg.num_layers
        * attention_flops(self_attention_pairs(lengths, num_suffix), h, cfg.attn_dim, cfg.value_dim),
        "interleave": 0.0,
        "output": 0.0,
        "generative": 0.0,
    }
    n_user = len(schema.user_features) + 1 if (not next_item or cfg.interleave) else 0
    n_summary = cfg.num_cls + cfg.num_pma_seeds + cfg.num_recent
    if cfg.interleave:
        num_summaries = cfg.num_layers - 1 if next_item else cfg.num_layers
        widths = [n_user] + [cfg.interaction_tokens] * cfg.num_layers
        for i in range(cfg.num_layers):
            narrow = mm(b * widths[i], d, cfg.pffn_summary_dim)
            pffn = (
                narrow
                + mm(b, widths[i] * cfg.pffn_summary_dim, 2 * cfg.pffn_hidden)
                + 2 * mm(combined, d, cfg.pffn_hidden)
            )
            parts["interleave"] += pffn
            if i < num_summaries:
                dense, attention = summary_flops(cfg, b, num_tokens, combined)
                parts["interleave"] += dense + interaction_flops(
                    cfg, b, widths[i] + n_summary, cfg.interaction_tokens
                )
                parts["attention"] += attention
        n_user = cfg.interaction_tokens
    if not next_item:
        if not cfg.interleave:
            dense, attention = summary_flops(cfg, b, num_tokens, combined)
            parts["interleave"] += dense
            parts["attention"] += attention
        parts["output"] = ctr_output_flops(cfg, schema, b, n_user + n_summary, with_candidate)
    if next_item or cfg.generative:
        positions = num_tokens + (b if next_item else 0)
        # The positive's logit is elementwise; negatives (uniform, in-batch) are matrix products.
        candidates = cfg.num_negatives + (b if cfg.in_batch_negatives else 0)
        parts["generative"] = (0.0 if e == d else mm(num_tokens, d, e)) + mm(positions, e, candidates)
    return parts


def ctr_output_flops(
    cfg: TeacherConfig, schema: EventSchema, b: int, n_user_side: int, with_candidate: bool
) -> float:
    """Towers, the final interaction stack (and pairwise dots), experts, gates and heads."""
    d = cfg.d_model
    n_item = 1 + len(schema.item_features)
    n_user_side += cfg.num_pooled_tokens
    towers = mm(b, n_user_side * d, cfg.repr_dim) + mm(b, n_item * d, cfg.repr_dim)
    dense = mm(b, schema.dense_dim, d) if schema.dense_dim else 0.0
    n_in = n_user_side + int(with_candidate) + n_item + 1 + int(schema.dense_dim > 0)
    n_dots = n_in * (n_in - 1) // 2 if cfg.dot_interaction else 0
    stack = mm(b * n_in, d, n_in) if cfg.dot_interaction else 0.0
    for _ in range(cfg.num_final_interaction_blocks):
        stack += interaction_flops(cfg, b, n_in, cfg.interaction_tokens)
        n_in = cfg.interaction_tokens
    tasks = len(TASKS)
    per_row = cfg.num_shared_experts + cfg.num_domain_experts
    num_experts = cfg.num_shared_experts + schema.num_domains * cfg.num_domain_experts
    # The experts' GEMMs run over their input padded to whole vectors (foundation/model/experts.py).
    d_in = -(-(n_in * d + n_dots) // INPUT_ALIGN) * INPUT_ALIGN
    experts = mm(b, d_in, num_experts * cfg.expert_hidden) + mm(
        b * num_experts, cfg.expert_hidden, cfg.expert_dim
    )
    gates = mm(b, d_in, schema.num_domains * tasks * per_row) + mm(b * tasks, per_row, cfg.expert_dim)
    return towers + dense + stack + experts + gates


def data_input_flops(cfg: TeacherConfig, schema: EventSchema, batch: int) -> float:
    """Forward FLOPs of the layers whose input is data (no input gradient): the dense-feature projection."""
    if schema.task == "next_item" or not schema.dense_dim:
        return 0.0
    return mm(batch, schema.dense_dim, cfg.d_model)


def teacher_flops(
    cfg: TeacherConfig, schema: EventSchema, offsets: torch.Tensor, *, training: bool = True
) -> float:
    """Model FLOPs of one forward (``training=False``) or forward+backward step on a batch with ``offsets[B+1]``."""
    parts = teacher_flop_breakdown(cfg, schema, offsets)
    forward = sum(parts.values())
    if not training:
        return forward
    # Layers fed by data skip the input gradient: their backward is 1x their forward, not 2x.
    return (1.0 + MODEL_BACKWARD_FACTOR) * forward - data_input_flops(cfg, schema, offsets.numel() - 1)


def precision_key(precision: str) -> str:
    """Lightning precision (``bf16-mixed``, ``16-mixed``, ``32-true``, ...) -> a :data:`PEAK_FLOPS` column.

    float32 matmuls count at the TF32 peak when TF32 is enabled, else at the FP32 peak.
    """
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of a device (``torch.cuda.get_device_name()``) at a Lightning precision; None if unknown."""
    for fragment, table in PEAK_FLOPS.items():
        if fragment in device_name:
            return table[precision_key(precision)]
    return None


def throughput_metrics(flops: float, tokens: int, seconds: float, peak: float | None) -> dict[str, float]:
    """``tokens_per_s``, ``tflops_per_s`` and (with a known peak) ``mfu`` of one step."""
    seconds = max(seconds, 1e-9)
    out = {"tokens_per_s": tokens / seconds, "tflops_per_s": flops / seconds / 1e12}
    if peak:
        out["mfu"] = flops / seconds / peak
    return out
