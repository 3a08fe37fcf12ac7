"""The teacher's sequence-arch options for the ML-1M A/Bs: the SASRec block, the target-time bias, the
attention normaliser, and negatives drawn from the dataset's item ids."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from foundation.data.batch import take_rows
from foundation.model.hstu import HSTUBlock
from foundation.model.jagged import SuffixLayout
from foundation.model.sasrec import SASRecBlock
from foundation.model.teacher import build_teacher
from foundation.model.teacher_config import TeacherConfig
from gem.flavors import teacher_flavor
from kernels import jagged_attention
from tests.teacher_batches import CTR_SCHEMA, NEXT_ITEM_SCHEMA, make_batch, tiny_config
from tests.test_teacher import (
    _successor_world,
    assert_every_parameter_learns,
    build,
)

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [0, 1, 5, 9, 3, 2]
HSTU_NEXT_ITEM = {"interleave": False, "num_cls": 0, "history_features": (), "abs_pos_emb": True}
SASREC = {**HSTU_NEXT_ITEM, "sequence_block": "sasrec", "time_buckets": 0, "ffn_hidden": 20}


def offsets_of(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])


# -- SASRec ------------------------------------------------------------------------------------------


def sasrec_block(seed: int = 0) -> SASRecBlock:
    torch.manual_seed(seed)
    return SASRecBlock(12, 2, 6, 5, ffn_hidden=10, dropout=0.0).double()


def test_sasrec_block_is_the_softmax_transformer_it_documents():
    """Against a dense per-row computation written from the block's formula."""
    block = sasrec_block()
    lengths = [0, 1, 4, 7]
    x = torch.randn(sum(lengths), 12, dtype=torch.float64)
    out = block(x, offsets_of(lengths), max(lengths))
    rows = []
    for row in x.split(lengths):
        n = row.shape[0]
        q_in = block.query_norm(row)
        q = block.query(q_in).view(n, 2, 6)
        k, v = block.key_value(row).split([12, 10], -1)
        scores = torch.einsum("ihd,jhd->hij", q, k.view(n, 2, 6)) / 6**0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        attn = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v.view(n, 2, 5)).reshape(n, 10)
        hidden = block.ffn_norm(q_in + block.output(attn))
        rows.append(hidden + block.ffn_out(torch.relu(block.ffn_in(hidden))))
    torch.testing.assert_close(out, torch.cat(rows))


def test_sasrec_block_is_causal_and_rows_are_independent():
    block = sasrec_block()
    lengths = [3, 6, 1]
    offsets = offsets_of(lengths)
    x = torch.randn(10, 12, dtype=torch.float64)
    out = block(x, offsets, 6)
    later = x.clone()
    later[3 + 4 :] += 1.0  # the last two tokens of row 1 and all of row 2
    changed = block(later, offsets, 6)
    torch.testing.assert_close(changed[: 3 + 4], out[: 3 + 4])
    assert not torch.allclose(changed[3 + 4 : 3 + 6], out[3 + 4 : 3 + 6])


def test_sasrec_block_gradients_reach_inputs_and_every_parameter():
    block = sasrec_block()
    x = torch.randn(8, 12, dtype=torch.float64, requires_grad=True)
    block(x, offsets_of([0, 1, 7]), 7).square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert_every_parameter_learns(block)


@pytest.mark.parametrize(("schema", "changes"), [(NEXT_ITEM_SCHEMA, SASREC), (CTR_SCHEMA, {"sequence_block": "sasrec"})])
def test_sasrec_teacher_trains_every_parameter(schema, changes):
    model = build(tiny_config(**changes), schema)
    assert all(isinstance(block, SASRecBlock) for block in model.blocks)
    batch = make_batch(schema, LENGTHS)
    model.loss(batch, model(batch))["loss"].backward()
    assert_every_parameter_learns(model)


def test_sasrec_next_item_loss_falls():
    model = build(tiny_config(**SASREC, dropout=0.0), NEXT_ITEM_SCHEMA)
    batches = [_successor_world(make_batch(NEXT_ITEM_SCHEMA, [4, 0, 6, 2, 8, 1, 3, 5], seed=s), 25) for s in range(2)]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        for batch in batches:
            loss = model.loss(batch, model(batch))["loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
    assert sum(losses[-2:]) < 0.5 * sum(losses[:2]), losses


def test_sasrec_flavor_is_the_published_baseline():
    cfg = teacher_flavor("sasrec")
    assert (cfg.sequence_block, cfg.num_layers, cfg.num_heads, cfg.d_model, cfg.attn_dim) == ("sasrec", 2, 1, 50, 50)
    assert (cfg.ffn_hidden, cfg.dropout, cfg.abs_pos_emb, cfg.max_len, cfg.attn_alpha) == (50, 0.2, True, 200, None)
    assert (cfg.num_negatives, cfg.temperature, cfg.history_features) == (128, 0.05, ())
    model = build(cfg, NEXT_ITEM_SCHEMA)
    assert not any("bias" in name and "blocks" in name and p.dim() == 2 for name, p in model.named_parameters())
    batch = make_batch(NEXT_ITEM_SCHEMA, [3, 0, 7])
    assert torch.isfinite(model.loss(batch, model(batch))["loss"])


# -- target-time bias ---------------------------------------------------------------------------------


def test_query_timestamps_are_the_next_event_and_the_candidate():
    model = build(tiny_config(**HSTU_NEXT_ITEM), NEXT_ITEM_SCHEMA)
    batch = make_batch(NEXT_ITEM_SCHEMA, [3, 0, 2])
    layout = SuffixLayout.build(batch.offsets, batch.num_tokens, 0)
    ts, t = batch.history["timestamps"], batch.timestamp
    expected = torch.stack([ts[1], ts[2], t[0], ts[4], t[2]])
    torch.testing.assert_close(model.query_timestamps(batch, layout), expected)


def test_query_timestamps_with_cls_tokens_take_the_row_time():
    model = build(tiny_config(), CTR_SCHEMA)  # 2 CLS and 1 candidate token per row
    batch = make_batch(CTR_SCHEMA, [2, 0])
    layout = SuffixLayout.build(batch.offsets, batch.num_tokens, 3)
    ts, t = batch.history["timestamps"], batch.timestamp
    expected = torch.stack([ts[1], t[0], t[0], t[0], t[0], t[1], t[1], t[1]])
    torch.testing.assert_close(model.query_timestamps(batch, layout), expected)


def positional_times(batch):
    """Event ``k`` of a row at time ``3k``, the candidate right after the last: differences stay inside the
    tiny config's 16 log buckets (``e^(15 * 0.301) ~ 91``), so a shift of an event moves its bucket."""
    rows = torch.repeat_interleave(torch.arange(batch.batch_size), batch.lengths)
    position = torch.arange(batch.num_tokens) - batch.offsets[rows]
    return dataclasses.replace(
        batch, history={**batch.history, "timestamps": 3 * position}, timestamp=3 * batch.lengths
    )


def shifted_next_event(batch, token: int, delta: int):
    history = {**batch.history, "timestamps": batch.history["timestamps"].clone()}
    history["timestamps"][token] += delta
    return dataclasses.replace(batch, history=history)


@pytest.mark.parametrize("query_time", ["target", "event"])
def test_target_time_lets_a_position_see_when_its_next_event_happens(query_time):
    """Under ``target`` position i's output depends on the time of event i+1 (and the last position's on the
    candidate's time); under ``event`` (the old bias) it cannot, since attention is causal."""
    cfg = tiny_config(**HSTU_NEXT_ITEM, dropout=0.0, query_time=query_time)
    model = build(cfg, NEXT_ITEM_SCHEMA).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.time_bias.normal_()
    batch = positional_times(make_batch(NEXT_ITEM_SCHEMA, [6, 4]))
    with torch.no_grad():
        queries = model(batch).extra["position_queries"]
        # Event 3 of row 0 happens 40 later: position 2 (which predicts it) may change, positions 0-1 not.
        later = model(shifted_next_event(batch, 3, 40)).extra["position_queries"]
        candidate_later = model(dataclasses.replace(batch, timestamp=batch.timestamp + 40)).extra
    torch.testing.assert_close(later[:2], queries[:2])
    assert torch.allclose(later[2], queries[2]) == (query_time == "event")
    last_rows = [5, 9]
    assert torch.allclose(candidate_later["position_queries"][last_rows], queries[last_rows]) == (query_time == "event")


def test_event_query_time_is_the_old_bias():
    """``query_time=event`` calls the kernel exactly as before the option existed (no query times)."""
    cfg = tiny_config(**HSTU_NEXT_ITEM, dropout=0.0, query_time="event")
    model = build(cfg, NEXT_ITEM_SCHEMA).eval()
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("query_timestamps"))
        return jagged_attention(*args, **{**kwargs, "backend": "pytorch"})

    batch = make_batch(NEXT_ITEM_SCHEMA, LENGTHS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("foundation.model.hstu.jagged_attention", spy)
        model(batch)
    assert calls == [None, None]


def test_query_time_defaults_to_target_on_next_item_and_event_on_ctr():
    assert build(tiny_config(**HSTU_NEXT_ITEM), NEXT_ITEM_SCHEMA).target_time
    assert not build(tiny_config(), CTR_SCHEMA).target_time
    assert build(tiny_config(query_time="target"), CTR_SCHEMA).target_time
    assert not build(tiny_config(**HSTU_NEXT_ITEM, time_buckets=0), NEXT_ITEM_SCHEMA).target_time
    assert not build(tiny_config(**SASREC), NEXT_ITEM_SCHEMA).target_time
    with pytest.raises(ValueError, match="query_time"):
        TeacherConfig(query_time="next")


def test_target_time_teacher_trains_every_parameter():
    model = build(tiny_config(**HSTU_NEXT_ITEM, query_time="target"), NEXT_ITEM_SCHEMA)
    batch = make_batch(NEXT_ITEM_SCHEMA, LENGTHS)
    model.loss(batch, model(batch))["loss"].backward()
    assert_every_parameter_learns(model)


# -- attention normaliser -----------------------------------------------------------------------------


def hstu_block(attention_norm: int) -> HSTUBlock:
    torch.manual_seed(0)
    block = HSTUBlock(8, 2, 4, 4, dropout=0.0, alpha=1.0, pos_buckets=12, time_buckets=8, attention_norm=attention_norm)
    # Expose the normaliser, which a LayerNorm would undo: with an eps far above the variance the norm
    # is the linear map (y - mean(y)) * weight / sqrt(eps), and weight = sqrt(eps) makes it y - mean(y).
    block.attn_norm = torch.nn.LayerNorm(8, eps=1e12)
    torch.nn.init.constant_(block.attn_norm.weight, 1e6)
    torch.nn.init.zeros_(block.output.bias)
    return block.double()


def test_row_normaliser_divides_each_row_by_its_own_length():
    lengths = [3, 5, 0, 1]
    x = torch.randn(9, 8, dtype=torch.float64)
    ts = torch.arange(9)
    row, fixed = hstu_block(0), hstu_block(7)
    together = row(x, offsets_of(lengths), 5, ts)
    for start, n in ((0, 3), (3, 5), (8, 1)):
        alone = fixed(x[start : start + n], offsets_of([n]), n, ts[start : start + n])
        # The fixed block divides by 7; the row block by n.
        torch.testing.assert_close(
            (together[start : start + n] - x[start : start + n]) * n,
            (alone - x[start : start + n]) * 7,
        )


def test_attention_norm_option_parses_and_rejects():
    cfg = tiny_config()
    assert cfg.attention_norm_length(2) == cfg.max_len + 2
    assert tiny_config(attention_norm="row").attention_norm_length(2) == 0
    assert tiny_config(attention_norm="211").attention_norm_length(0) == 211
    model = build(tiny_config(**HSTU_NEXT_ITEM, attention_norm="row"), NEXT_ITEM_SCHEMA)
    assert all(block.attention_norm == 0 for block in model.blocks)
    for bad in ("0", "-3", "batch"):
        with pytest.raises(ValueError, match="attention_norm"):
            TeacherConfig(attention_norm=bad)
        overridden = tiny_config()
        overridden.attention_norm = bad  # a CLI override sets the field without __post_init__
        with pytest.raises(ValueError, match="attention_norm"):
            build_teacher(overridden, CTR_SCHEMA)


@pytest.mark.parametrize("norm", ["row", "211"])
def test_normaliser_options_keep_rows_independent_of_the_batch(norm):
    model = build(tiny_config(**HSTU_NEXT_ITEM, attention_norm=norm), NEXT_ITEM_SCHEMA).eval()
    batch = make_batch(NEXT_ITEM_SCHEMA, LENGTHS)
    with torch.no_grad():
        together = model(batch).user_repr
        for row in (1, 2, 4):
            torch.testing.assert_close(model(take_rows(batch, torch.tensor([row]))).user_repr[0], together[row], rtol=1e-5, atol=1e-6)


# -- negatives from the used ids ----------------------------------------------------------------------


def test_used_negatives_come_from_the_given_ids_only():
    used = torch.tensor([2, 3, 5, 7, 11, 13], dtype=torch.int64)
    per_position = {**HSTU_NEXT_ITEM, "negatives": "position"}
    model = build_teacher(tiny_config(**per_position, negative_pool="used"), NEXT_ITEM_SCHEMA, negative_items=used)
    batch = make_batch(NEXT_ITEM_SCHEMA, LENGTHS)
    drawn = model.draw_negatives(batch)
    assert drawn.shape == (batch.num_tokens + batch.batch_size, 8)
    assert set(drawn.unique().tolist()) == set(used.tolist())  # 256 draws from 6 ids reach every one
    out = model(batch)
    assert set(out.extra["negative_ids"].unique().tolist()) <= set(used.tolist())
    assert "negative_items" not in model.state_dict()
    everything = build_teacher(tiny_config(**per_position), NEXT_ITEM_SCHEMA).draw_negatives(batch)
    assert not set(everything.unique().tolist()) <= set(used.tolist())


def test_used_negatives_reject_bad_ids():
    cfg = tiny_config(**HSTU_NEXT_ITEM, negative_pool="used")
    with pytest.raises(ValueError, match="pass negative_items"):
        build_teacher(cfg, NEXT_ITEM_SCHEMA)
    with pytest.raises(ValueError, match=r"only with teacher\.negative_pool='used'"):
        build_teacher(tiny_config(), NEXT_ITEM_SCHEMA, negative_items=torch.tensor([1]))
    for bad in (torch.tensor([1, 25]), torch.tensor([-1, 3]), torch.tensor([], dtype=torch.int64), torch.tensor([1.0])):
        with pytest.raises(ValueError, match="negative_items"):
            build_teacher(cfg, NEXT_ITEM_SCHEMA, negative_items=bad)
    with pytest.raises(ValueError, match="negative_pool"):
        TeacherConfig(negative_pool="popular")


# -- position window ----------------------------------------------------------------------------------


def test_position_window_is_a_full_table_whose_far_entries_are_one():
    """``position_window=W`` keeps W exact distances and one bucket for every farther pair: a block with that
    table computes what a block with an entry for every distance computes when its entries from W on all equal
    the last one; the teacher's tables get W + 1 entries, the last one learns, and a negative window is refused."""
    assert tiny_config(position_window=3).pos_buckets == 4
    assert tiny_config(position_window=10**6).pos_buckets == tiny_config().pos_buckets
    lengths = [9, 0, 4, 7]
    x = torch.randn(sum(lengths), 8, dtype=torch.float64)
    ts = torch.arange(sum(lengths)) * 30
    short, full = (HSTUBlock(8, 2, 4, 4, dropout=0.0, alpha=1.0, pos_buckets=n, time_buckets=8, attention_norm=9)
                   for n in (4, 12))
    full.load_state_dict({k: v for k, v in short.state_dict().items() if k != "pos_bias"}, strict=False)
    with torch.no_grad():
        short.pos_bias.copy_(torch.randn(2, 4))
        full.pos_bias.copy_(torch.cat([short.pos_bias, short.pos_bias[:, -1:].expand(2, 8)], 1))
    short, full = short.double(), full.double()
    torch.testing.assert_close(short(x, offsets_of(lengths), 9, ts), full(x, offsets_of(lengths), 9, ts))

    model = build(tiny_config(**HSTU_NEXT_ITEM, position_window=3), NEXT_ITEM_SCHEMA)
    assert all(block.pos_bias.shape[-1] == 4 for block in model.blocks)
    batch = make_batch(NEXT_ITEM_SCHEMA, LENGTHS)
    model.loss(batch, model(batch))["loss"].backward()
    assert all(block.pos_bias.grad[:, -1].abs().sum() > 0 for block in model.blocks)
    with pytest.raises(ValueError, match="position_window"):
        TeacherConfig(position_window=-1)
