"""The GEM teacher: shapes and gradient flow through every block, determinism, candidate-free
``user_repr``, empty and length-1 histories, masked labels, flavors, and a loss that falls."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from foundation.config import apply_overrides
from foundation.data.batch import take_rows
from foundation.data.schema import TASKS
from foundation.model.embeddings import HistoryEmbedding
from foundation.model.experts import MultiDomainExperts
from foundation.model.generative import next_item_targets
from foundation.model.interaction import DCNv2Block, WukongBlock
from foundation.model.jagged import RecentTokens, SuffixLayout, gather_rows
from foundation.model.teacher import build_teacher, pairwise_dots
from foundation.model.teacher_config import TeacherConfig
from gem.flavors import TEACHER_FLAVORS, teacher_flavor
from tests.teacher_batches import (
    CTR_SCHEMA,
    NEXT_ITEM_SCHEMA,
    make_batch,
    tiny_config,
    with_other_candidates,
)

LENGTHS = [0, 1, 5, 9, 3, 2]


pytestmark = pytest.mark.usefixtures("one_thread")


def build(cfg: TeacherConfig, schema, seed: int = 0):
    torch.manual_seed(seed)
    return build_teacher(cfg, schema)


def assert_every_parameter_learns(model: torch.nn.Module) -> None:
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"no (finite) gradient reaches {missing}"
    silent = [n for n, p in model.named_parameters() if p.numel() and p.grad.abs().sum() == 0]
    assert not silent, f"zero gradient on {silent}"


CTR_VARIANTS = {
    "wukong": {},
    "dcnv2": {"interaction": "dcnv2"},
    "no_interleave": {"interleave": False},
    "generative": {"generative": True, "in_batch_negatives": True},
    "not_target_aware": {"target_aware": False, "num_final_interaction_blocks": 0},
    "no_pooled_no_dots": {"pooled_history": False, "dot_interaction": False},
}


@pytest.mark.parametrize("variant", sorted(CTR_VARIANTS))
def test_ctr_shapes_and_gradient_flow(variant):
    cfg = tiny_config(**CTR_VARIANTS[variant])
    model = build(cfg, CTR_SCHEMA)
    batch = make_batch(CTR_SCHEMA, LENGTHS)
    out = model(batch)
    b = batch.batch_size
    assert set(out.logits) == set(TASKS)
    assert all(v.shape == (b,) and torch.isfinite(v).all() for v in out.logits.values())
    assert out.user_repr.shape == (b, cfg.repr_dim) and out.item_repr.shape == (b, cfg.repr_dim)
    losses = model.loss(batch, out)
    assert {"loss", "loss_click", "loss_conversion"} <= set(losses)
    assert ("loss_next_item" in losses) == cfg.generative
    losses["loss"].backward()
    assert_every_parameter_learns(model)


@pytest.mark.parametrize("variant", ["debug_like", "interleaved", "hstu"])
def test_next_item_shapes_gradient_flow_and_full_ranking(variant):
    changes = {
        "debug_like": {},
        "interleaved": {"num_cls": 0, "in_batch_negatives": True},
        "hstu": {
            "interleave": False,
            "num_cls": 0,
            "history_features": (),
            "abs_pos_emb": True,
            "item_dim": 16,
        },
    }[variant]
    cfg = tiny_config(**changes)
    model = build(cfg, NEXT_ITEM_SCHEMA)
    batch = make_batch(NEXT_ITEM_SCHEMA, LENGTHS)
    out = model(batch)
    b = batch.batch_size
    assert out.logits == {}
    assert out.user_repr.shape == (b, cfg.item_dim) and out.item_repr.shape == (b, cfg.item_dim)
    assert torch.allclose(out.user_repr.norm(dim=-1), torch.ones(b), atol=1e-5)
    assert out.extra["position_queries"].shape == (batch.num_tokens, cfg.item_dim)
    losses = model.loss(batch, out)
    assert set(losses) == {"loss", "loss_next_item"} and torch.isfinite(losses["loss"])
    losses["loss"].backward()
    assert_every_parameter_learns(model)
    model.eval()
    with torch.no_grad():
        scores, out = model.score_items(batch), model(batch)
    assert scores.shape == (b, NEXT_ITEM_SCHEMA.num_items) and torch.isfinite(scores).all()
    # Full-ranking scores and the candidate's own score agree.
    own = scores.gather(1, batch.candidate[:, None]).squeeze(1)
    torch.testing.assert_close(own, out.extra["candidate_score"], rtol=1e-4, atol=1e-4)


def test_determinism_with_a_seed():
    batch = make_batch(CTR_SCHEMA, LENGTHS)
    cfg = tiny_config(generative=True)
    results = []
    for _ in range(2):
        model = build(cfg, CTR_SCHEMA, seed=3)
        torch.manual_seed(7)  # dropout and negative sampling
        out = model(batch)
        loss = model.loss(batch, out)["loss"]
        loss.backward()
        results.append((model.state_dict(), out, loss, [p.grad.clone() for p in model.parameters()]))
    (state_a, out_a, loss_a, grads_a), (state_b, out_b, loss_b, grads_b) = results
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(out_a.user_repr, out_b.user_repr)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    other = build(cfg, CTR_SCHEMA, seed=4)
    assert not torch.equal(
        other.state_dict()["user_bias"] + other.cls_tokens.sum(),
        state_a["user_bias"] + state_a["cls_tokens"].sum(),
    )


@pytest.mark.parametrize("schema_name", ["ctr", "next_item"])
@pytest.mark.parametrize("interaction", ["wukong", "dcnv2"])
def test_user_repr_does_not_depend_on_the_candidate(schema_name, interaction):
    schema = CTR_SCHEMA if schema_name == "ctr" else NEXT_ITEM_SCHEMA
    model = build(tiny_config(interaction=interaction, generative=True), schema).eval()
    batch = make_batch(schema, LENGTHS)
    other = with_other_candidates(batch, schema, seed=1)
    with torch.no_grad():
        out, out_other = model(batch), model(other)
    torch.testing.assert_close(out.user_repr, out_other.user_repr, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        out.extra["next_item_query"], out_other.extra["next_item_query"], rtol=0, atol=1e-6
    )
    assert not torch.allclose(out.item_repr, out_other.item_repr)
    if schema_name == "ctr":
        assert not torch.allclose(out.logits["click"], out_other.logits["click"])


@pytest.mark.parametrize("schema_name", ["ctr", "next_item"])
def test_outputs_do_not_depend_on_the_rest_of_the_batch(schema_name):
    """A row scores the same alone as among longer histories (exported per user, so batching must not matter)."""
    schema = CTR_SCHEMA if schema_name == "ctr" else NEXT_ITEM_SCHEMA
    model = build(tiny_config(generative=True), schema).eval()
    batch = make_batch(schema, LENGTHS)
    with torch.no_grad():
        together = model(batch)
        for row in (1, 2, 4):
            alone = model(take_rows(batch, torch.tensor([row])))
            torch.testing.assert_close(alone.user_repr[0], together.user_repr[row], rtol=1e-5, atol=1e-6)
            for task, logit in alone.logits.items():
                torch.testing.assert_close(logit[0], together.logits[task][row], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schema_name", ["ctr", "next_item"])
@pytest.mark.parametrize("lengths", [[0, 0, 0], [1, 1], [0, 1, 0, 1], [1]])
def test_empty_and_length_one_histories(schema_name, lengths):
    schema = CTR_SCHEMA if schema_name == "ctr" else NEXT_ITEM_SCHEMA
    model = build(tiny_config(generative=True), schema)
    batch = make_batch(schema, lengths)
    out = model(batch)
    tensors = [*out.logits.values(), out.user_repr, out.item_repr, *out.extra.values()]
    assert all(torch.isfinite(t).all() for t in tensors)
    losses = model.loss(batch, out)
    assert all(torch.isfinite(v) for v in losses.values())
    losses["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert torch.isfinite(model.score_items(batch)).all()


def test_absent_conversion_labels_do_not_count():
    model = build(tiny_config(dropout=0.0), CTR_SCHEMA).eval()
    batch = make_batch(CTR_SCHEMA, LENGTHS)
    absent = ~batch.label_mask["conversion"]
    assert absent.any() and (~absent).any()
    flipped = dataclasses.replace(
        batch,
        labels={
            **batch.labels,
            "conversion": torch.where(absent, 1 - batch.labels["conversion"], batch.labels["conversion"]),
        },
    )
    with torch.no_grad():
        out = model(batch)
        assert torch.equal(model.loss(batch, out)["loss"], model.loss(flipped, out)["loss"])
        none_present = dataclasses.replace(
            batch, label_mask={**batch.label_mask, "conversion": torch.zeros_like(absent)}
        )
        assert model.loss(none_present, out)["loss_conversion"] == 0


def test_next_item_targets_shift_within_rows_and_end_at_the_candidate():
    ids = torch.tensor([10, 11, 12, 20, 30, 31])
    offsets = torch.tensor([0, 3, 3, 4, 6])
    candidate = torch.tensor([13, 99, 21, 32])
    targets, valid = next_item_targets(ids, offsets, candidate)
    assert targets.tolist() == [11, 12, 13, 21, 31, 32] and valid.all()
    targets, valid = next_item_targets(ids, offsets, None)
    assert valid.tolist() == [True, True, False, False, True, False]
    assert targets[valid].tolist() == [11, 12, 31]


def test_suffix_layout_round_trip_and_recent_tokens():
    offsets = torch.tensor([0, 2, 2, 5])
    history = torch.arange(5.0)[:, None]
    suffix = torch.tensor([[[100.0]], [[101.0]], [[102.0]]])
    layout = SuffixLayout.build(offsets, 5, 1)
    combined = layout.combine(history, suffix)
    assert combined.squeeze(1).tolist() == [0, 1, 100, 101, 2, 3, 4, 102]
    assert layout.offsets.tolist() == [0, 3, 4, 8]
    back_history, back_suffix = layout.split(combined)
    assert torch.equal(back_history, history) and torch.equal(back_suffix, suffix)
    two = RecentTokens.build(offsets, 2)
    recent = gather_rows(history, two.index, two.valid, torch.full((2, 1), -1.0))
    assert recent.squeeze(-1).tolist() == [[0, 1], [-1, -1], [3, 4]]


def test_suffix_layout_and_recent_tokens_gradients_match_advanced_indexing():
    offsets = torch.tensor([0, 2, 2, 5, 6])
    layout = SuffixLayout.build(offsets, 6, 2)
    history = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    suffix = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(layout.combine, (history, suffix))
    combined = torch.randn(14, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda c: layout.split(c), (combined,))
    # split's outputs are exactly advanced indexing's, so are their gradients.
    got_history, got_suffix = layout.split(combined)
    assert torch.equal(got_history, combined[layout.history_index])
    assert torch.equal(got_suffix, combined[layout.suffix_index])
    fill = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    three = RecentTokens.build(offsets, 3)
    torch.autograd.gradcheck(lambda h, f: gather_rows(h, three.index, three.valid, f), (history, fill))


def test_pooled_history_means_all_and_clicked_events_per_row():
    batch = make_batch(CTR_SCHEMA, [3, 0, 4])
    batch.history["actions"] = torch.tensor([0, 1, 2, 0, 0, 0, 0])
    items = torch.arange(7.0)[:, None].expand(7, 2)
    rows = torch.tensor([0, 0, 0, 2, 2, 2, 2])
    pooled = HistoryEmbedding.pool_items(items, rows, batch)
    # Row 0: all of 0, 1, 2 and clicked 1, 2; row 1 is empty; row 2 has no click.
    expected = torch.tensor([[1.0, 1.5], [0.0, 0.0], [4.5, 0.0]])
    assert torch.equal(pooled[:, :, 0], expected) and torch.equal(pooled[:, :, 1], expected)


def test_pairwise_dots_are_the_upper_triangle_of_the_gram_matrix():
    tokens = torch.randn(2, 4, 3)
    dots = pairwise_dots(tokens)
    assert dots.shape == (2, 6)
    assert torch.allclose(dots[:, 0], (tokens[:, 0] * tokens[:, 1]).sum(-1))
    assert torch.allclose(dots[:, -1], (tokens[:, 2] * tokens[:, 3]).sum(-1))


@pytest.mark.parametrize(
    "block",
    [
        WukongBlock(5, 4, 6, rank=3, hidden=8, dropout=0.0),
        DCNv2Block(5, 4, 6, rank=3, num_layers=2, dropout=0.0),
    ],
)
def test_interaction_blocks_map_tokens_and_pass_gradients(block):
    x = torch.randn(3, 5, 6, requires_grad=True)
    y = block(x)
    assert y.shape == (3, 4, 6)
    y.square().sum().backward()
    assert x.grad.abs().sum() > 0 and all(p.grad is not None for p in block.parameters())


def test_experts_route_rows_by_their_own_domain():
    experts = MultiDomainExperts(
        6, num_domains=3, num_tasks=2, num_shared=1, num_per_domain=2, hidden=5, expert_dim=4, dropout=0.0
    )
    z = torch.randn(4, 6)
    domain = torch.tensor([0, 0, 2, 2])
    before = experts(z, domain)
    with torch.no_grad():  # perturb the experts, gates and heads of domain 1 only
        experts.second[1 + 2 : 1 + 4].add_(1.0)
        experts.head_weight[1].add_(1.0)
    torch.testing.assert_close(experts(z, domain), before)
    assert not torch.allclose(experts(z, torch.tensor([1, 1, 1, 1])), experts(z, torch.tensor([0, 0, 0, 0])))


def test_experts_pad_their_input_to_whole_vectors_with_the_same_function():
    torch.manual_seed(0)
    experts = MultiDomainExperts(
        13, num_domains=2, num_tasks=2, num_shared=1, num_per_domain=1, hidden=3, expert_dim=4, dropout=0.0
    )
    assert experts.first.weight.shape == (9, 16) and experts.gates.weight.shape[1] == 16
    assert (experts.first.weight[:, 13:] == 0).all() and (experts.gates.weight[:, 13:] == 0).all()
    torch.manual_seed(0)  # the same draws as layers over the unpadded input
    plain = torch.nn.Linear(13, 9)
    torch.testing.assert_close(experts.first.weight[:, :13], plain.weight)
    z, domain = torch.randn(5, 13), torch.tensor([0, 1, 1, 0, 1])
    out = experts(z, domain)
    out.square().sum().backward()
    assert (experts.first.weight.grad[:, 13:] == 0).all() and (experts.gates.weight.grad[:, 13:] == 0).all()
    hidden = torch.nn.functional.silu(z @ experts.first.weight[:, :13].T + experts.first.bias).view(5, 3, 3)
    expected = torch.einsum("beh,ehd->bed", hidden, experts.second) + experts.second_bias
    torch.testing.assert_close(experts.run_experts(torch.nn.functional.pad(z, (0, 3))), expected)
    # A checkpoint from before the padding loads, and computes the same.
    old = {k: v[:, :13] if k in ("first.weight", "gates.weight") else v for k, v in experts.state_dict().items()}
    loaded = MultiDomainExperts(
        13, num_domains=2, num_tasks=2, num_shared=1, num_per_domain=1, hidden=3, expert_dim=4, dropout=0.0
    )
    loaded.load_state_dict(old)
    torch.testing.assert_close(loaded(z, domain), out.detach())


def test_flavors_match_the_issue_and_build():
    assert set(TEACHER_FLAVORS) >= {"debug", "small", "large", "ml1m_hstu", "ml1m_hstu_large"}
    small, large = TEACHER_FLAVORS["ml1m_hstu"], TEACHER_FLAVORS["ml1m_hstu_large"]
    assert (small.num_layers, small.num_heads, small.d_model, small.max_len) == (2, 1, 50, 200)
    assert (large.num_layers, large.num_heads, large.d_model, large.max_len) == (8, 2, 50, 200)
    for cfg in (small, large):
        assert (cfg.num_negatives, cfg.temperature, cfg.dropout, cfg.in_batch_negatives) == (
            128,
            0.05,
            0.2,
            False,
        )
    for name in ("debug", "ml1m_hstu"):
        schema = NEXT_ITEM_SCHEMA if name.startswith("ml1m") else CTR_SCHEMA
        model = build(teacher_flavor(name), schema)
        batch = make_batch(schema, [3, 0, 7])
        assert torch.isfinite(model.loss(batch, model(batch))["loss"])
    copy = teacher_flavor("debug")
    copy.loss_weights["click"] = 5.0
    assert TEACHER_FLAVORS["debug"].loss_weights["click"] == 1.0


def test_config_validates_and_takes_cli_overrides():
    with pytest.raises(ValueError, match="interaction"):
        TeacherConfig(interaction="mlp")
    with pytest.raises(ValueError, match="history_features"):
        TeacherConfig(history_features=("clicks",))
    cfg = apply_overrides(
        teacher_flavor("debug"), ["num_layers=3", "history_features=action,age", "attn_alpha=none"]
    )
    assert cfg.num_layers == 3 and cfg.history_features == ("action", "age") and cfg.attn_alpha is None


@pytest.mark.parametrize("negatives", ["batch", "position"])
@pytest.mark.parametrize("schema_name", ["ctr", "next_item"])
def test_debug_training_loss_falls(schema_name, negatives):
    """A few Adam steps on fixed batches: the loss (with the generative objective) falls well below its start."""
    schema = CTR_SCHEMA if schema_name == "ctr" else NEXT_ITEM_SCHEMA
    model = build(tiny_config(dropout=0.0, generative=True, negatives=negatives), schema)
    batches = [make_batch(schema, [4, 0, 6, 2, 8, 1, 3, 5], seed=s) for s in range(2)]
    if schema_name == "next_item":  # a learnable world: the next item follows the last one
        batches = [_successor_world(b, schema.num_items) for b in batches]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)

    def epoch_loss() -> float:
        total = 0.0
        for batch in batches:
            loss = model.loss(batch, model(batch))["loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss)
        return total / len(batches)

    first = epoch_loss()
    for _ in range(25):
        last = epoch_loss()
    assert last < 0.7 * first, (first, last)


def _successor_world(batch, num_items: int):
    """Histories of consecutive ids whose candidate is the next id."""
    lengths = batch.lengths
    start = batch.candidate % num_items
    rows = torch.repeat_interleave(torch.arange(batch.batch_size), lengths)
    position = torch.arange(batch.num_tokens) - batch.offsets[rows]
    items = (start[rows] + position) % num_items
    return dataclasses.replace(
        batch, history={**batch.history, "item_ids": items}, candidate=(start + lengths) % num_items
    )


@pytest.mark.parametrize("changes", [{}, {"num_pma_seeds": 0}], ids=["pma", "no_pma"])
def test_bf16_residual_stream_matches_the_float32_one_and_trains(changes):
    """``stream_dtype="autocast"`` under bf16 autocast: the blocks receive a bf16 stream (float32 without autocast),
    the loss and every gradient stay within bf16 rounding of the float32 stream's, and Adam steps on it lower the
    loss as on the float32 stream. (The Triton norms on a bf16 stream: tests/kernels/test_glue_fused.py.)"""
    from foundation.model.hstu import HSTUBlock

    batch = make_batch(CTR_SCHEMA, LENGTHS, seed=4)
    runs = {}
    for stream in ("float32", "autocast"):
        model = build(tiny_config(dropout=0.0, generative=True, stream_dtype=stream, **changes), CTR_SCHEMA)
        seen: list[torch.dtype] = []
        for module in model.modules():
            if isinstance(module, HSTUBlock):
                module.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[0].dtype))
        with torch.no_grad():
            model.loss(batch, model(batch))
        assert set(seen) == {torch.float32}  # no autocast: the stream stays float32 either way
        seen.clear()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for step in range(12):
            torch.manual_seed(step)  # the same negatives for both streams
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.loss(batch, model(batch))["loss"]
            optimizer.zero_grad()
            loss.backward()
            if step == 0:
                grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            optimizer.step()
            losses.append(float(loss))
        runs[stream] = (set(seen), losses, grads)
    assert runs["float32"][0] == {torch.float32} and runs["autocast"][0] == {torch.bfloat16}
    (_, losses32, grads32), (_, losses16, grads16) = runs["float32"], runs["autocast"]
    assert losses16[0] == pytest.approx(losses32[0], rel=2e-2)
    assert grads16.keys() == grads32.keys()
    for name, g in grads32.items():
        torch.testing.assert_close(grads16[name], g, rtol=0, atol=0.1 * float(g.abs().max()) + 1e-6, msg=name)
    assert losses16[-1] < 0.8 * losses16[0] and losses32[-1] < 0.8 * losses32[0]
