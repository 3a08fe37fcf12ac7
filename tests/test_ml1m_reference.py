"""The switches that give the teacher the reference HSTU's behaviour where ours differs
(docs/ml1m_reference_diff.md): each changes exactly what it says, and the sweep plans that A/B them parse."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from experiments.ml1m_sweep import (
    ALL_REFERENCE,
    ONE_SHARD,
    ONE_SHARD_ROWS,
    REFERENCE_SWITCHES,
    SEQUENCES,
    check_runs,
    plan_runs,
    prepare_dataset,
)
from foundation.config import apply_overrides
from foundation.data.pipeline import DataConfig, EventStream, build_dataloader
from foundation.model.embeddings import HistoryEmbedding, ItemEmbedding
from foundation.model.hstu import HSTUBlock
from foundation.model.norms import PlainLayerNorm
from foundation.model.teacher import build_teacher
from foundation.model.teacher_config import TeacherConfig
from gem.flavors import get_flavor, teacher_flavor
from kernels import jagged_attention
from tests.teacher_batches import NEXT_ITEM_SCHEMA, make_batch, tiny_config
from tests.test_teacher import (
    _successor_world,
    assert_every_parameter_learns,
    build,
)

pytestmark = pytest.mark.usefixtures("one_thread")

HSTU_NEXT_ITEM = {"interleave": False, "num_cls": 0, "history_features": (), "abs_pos_emb": True}
ALL_BLOCK_SWITCHES = {"norm": "plain", "init": "reference", "uvqk_bias": False, "rel_bias": "shared"}
ALL_SWITCHES = {
    "block_norm": "plain", "block_init": "reference", "uvqk_bias": False, "rel_bias": "shared",
    "embedding_init": "reference",
}


def offsets_of(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])


def hstu_block(seed: int = 0, *, d: int = 8, heads: int = 2, dim: int = 4, **switches) -> HSTUBlock:
    torch.manual_seed(seed)
    options = dict(dropout=0.0, alpha=1.0, pos_buckets=12, time_buckets=8, attention_norm=9)
    return HSTUBlock(d, heads, dim, dim, **{**options, **switches})


def relative_std_close(values: torch.Tensor, std: float, tolerance: float) -> bool:
    return abs(values.float().std().item() / std - 1) < tolerance


# -- block_norm ---------------------------------------------------------------------------------------


def test_plain_layer_norm_has_no_parameters_and_eps_1e6():
    norm = PlainLayerNorm(7).double()
    assert list(norm.parameters()) == [] and norm.state_dict() == {} and norm.eps == 1e-6
    # A variance of ~1e-6 makes the eps visible: 1e-6 and nn.LayerNorm's 1e-5 give different outputs.
    x = 1e-3 * torch.randn(5, 7, dtype=torch.float64)
    torch.testing.assert_close(norm(x), F.layer_norm(x, (7,), eps=1e-6))
    assert not torch.allclose(norm(x), F.layer_norm(x, (7,), eps=1e-5), rtol=1e-3)


def block_by_formula(block: HSTUBlock, x, offsets, max_len, ts, *, eps: float, affine: bool) -> torch.Tensor:
    """The block's forward from its documented formula, with F.layer_norm of the given eps and affinity."""

    def norm(module, y):
        return F.layer_norm(y, y.shape[-1:], module.weight if affine else None, module.bias if affine else None, eps)

    h, dv = block.num_heads, block.value_dim
    u, v, q, k = F.silu(F.linear(norm(block.input_norm, x), block.uvqk.weight, block.uvqk.bias)).split(
        [h * dv, h * dv, h * block.attn_dim, h * block.attn_dim], -1
    )
    attn = jagged_attention(
        q.reshape(-1, h, block.attn_dim), k.reshape(-1, h, block.attn_dim), v.reshape(-1, h, dv), offsets, max_len,
        activation="silu", causal=True, alpha=1.0, pos_bias=block.pos_bias, time_bias=block.time_bias,
        timestamps=ts, backend="pytorch",
    )
    scaled = attn.reshape(x.shape[0], -1) * (max_len / block.attention_norm)
    return x + block.output(norm(block.attn_norm, scaled) * u)


@pytest.mark.parametrize(("kind", "eps", "affine"), [("affine", 1e-5, True), ("plain", 1e-6, False)])
def test_block_norm_is_the_stated_layer_norm(kind, eps, affine):
    block = hstu_block(norm=kind).double()
    with torch.no_grad():  # a non-trivial gain and bias, which the plain norm must not have
        for module in (block.input_norm, block.attn_norm):
            if affine:
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    lengths = [0, 1, 4, 7]
    x = 1e-2 * torch.randn(12, 8, dtype=torch.float64)
    ts = torch.arange(12)
    out = block(x, offsets_of(lengths), 7, ts)
    torch.testing.assert_close(out, block_by_formula(block, x, offsets_of(lengths), 7, ts, eps=eps, affine=affine))
    assert block.input_norm.eps == eps and block.attn_norm.eps == eps
    norm_parameters = [n for n, _ in block.named_parameters() if "norm" in n]
    assert norm_parameters == ([] if not affine else ["input_norm.weight", "input_norm.bias", "attn_norm.weight", "attn_norm.bias"])


def test_plain_norm_block_has_exactly_the_norm_parameters_fewer():
    affine, plain = hstu_block(), hstu_block(norm="plain")
    count = sum(p.numel() for p in affine.parameters()) - sum(p.numel() for p in plain.parameters())
    assert count == 2 * 8 + 2 * (2 * 4)  # gain and bias of the input norm [d] and the attention norm [H*Dv]
    assert not any("norm" in key for key in plain.state_dict())


# -- block_init and uvqk_bias ---------------------------------------------------------------------------


def wide_block(**switches) -> HSTUBlock:
    """Big enough that a sample std is within a few percent of the drawn one."""
    torch.manual_seed(0)
    return HSTUBlock(96, 4, 32, 32, dropout=0.0, alpha=1.0, pos_buckets=600, time_buckets=500, attention_norm=1,
                     **switches)


def test_reference_init_gives_the_reference_stds():
    block = wide_block(init="reference")
    assert relative_std_close(block.uvqk.weight, 0.02, 0.03) and abs(block.uvqk.weight.mean()) < 1e-3
    assert torch.equal(block.uvqk.bias, torch.zeros_like(block.uvqk.bias))
    fan_in, fan_out = 4 * 32, 96
    bound = math.sqrt(6 / (fan_in + fan_out))  # Xavier-uniform
    assert block.output.weight.abs().max() <= bound and block.output.weight.abs().max() > 0.95 * bound
    assert relative_std_close(block.output.weight, math.sqrt(2 / (fan_in + fan_out)), 0.03)
    for table in (block.pos_bias, block.time_bias):
        assert relative_std_close(table, 0.02, 0.05)


def test_torch_init_is_the_linear_default_and_zero_tables():
    block = wide_block()
    # nn.Linear's default: uniform with bound 1/sqrt(fan_in), std 1/sqrt(3 fan_in).
    assert relative_std_close(block.uvqk.weight, 1 / math.sqrt(3 * 96), 0.03)
    assert block.uvqk.bias.abs().max() > 0.5 / math.sqrt(96)
    assert not block.pos_bias.any() and not block.time_bias.any()
    with pytest.raises(ValueError, match="block_init"):
        hstu_block(init="xavier")


def test_uvqk_without_bias_drops_exactly_its_bias():
    with_bias, without = hstu_block(), hstu_block(uvqk_bias=False)
    assert without.uvqk.bias is None and "uvqk.bias" not in without.state_dict()
    count = sum(p.numel() for p in with_bias.parameters()) - sum(p.numel() for p in without.parameters())
    assert count == with_bias.uvqk.out_features == 2 * (2 * 4 + 2 * 4)
    x = torch.randn(6, 8)
    u = without.split_uvqk(x)[0].value()
    normed = F.layer_norm(x, (8,), without.input_norm.weight, without.input_norm.bias)
    torch.testing.assert_close(u, F.silu(normed @ without.uvqk.weight.T)[:, :8])


def attention_output_variance(block: HSTUBlock, x: torch.Tensor, attention_norm: int) -> float:
    """Median over tokens of the variance of the attention output that the block's second norm receives."""
    n = x.shape[0]
    _, v, q, k = block.split_uvqk(x)
    attn = jagged_attention(q, k, v, offsets_of([n]), n, activation="silu", causal=True, alpha=1.0,
                            pos_bias=block.pos_bias, time_bias=block.time_bias, timestamps=torch.arange(n),
                            backend="pytorch")
    return float((attn.reshape(n, -1) * (n / attention_norm)).var(-1).median())


@torch.no_grad()
def test_reference_block_starts_with_attention_outputs_below_its_eps():
    """At init the reference's attention outputs are far below its norm's eps 1e-6, so its plain norm starts
    as a damped linear map (and 1/N matters); ours are far above eps 1e-5, so the norm only rescales them.
    The tokens are ML-1M's at init under each embedding_init: sqrt(50) * item + position."""
    for reference in (False, True):
        torch.manual_seed(0)
        block = HSTUBlock(50, 1, 50, 50, dropout=0.0, alpha=1.0, pos_buckets=202, time_buckets=128,
                          attention_norm=200, **(ALL_BLOCK_SWITCHES if reference else {}))
        item_std, position_std = (0.02 * 0.8796, math.sqrt(2 / 250)) if reference else (0.02, math.sqrt(1 / 50))
        x = math.sqrt(50) * item_std * torch.randn(150, 50) + position_std * torch.randn(150, 50)
        variance = attention_output_variance(block, x, 200)
        if reference:
            assert variance < 0.1 * block.attn_norm.eps
        else:
            assert variance > 3 * block.attn_norm.eps


# -- rel_bias ---------------------------------------------------------------------------------------------


def test_shared_rel_bias_is_the_per_head_block_with_equal_tables():
    """One ``[1, buckets]`` table per layer is a per-head block whose heads share it, forward and backward."""
    shared = hstu_block(rel_bias="shared").double()
    per_head = hstu_block(rel_bias="head").double()
    assert shared.pos_bias.shape == (1, 12) and shared.time_bias.shape == (1, 8)
    with torch.no_grad():
        shared.pos_bias.normal_()
        shared.time_bias.normal_()
        state = {k: v.expand(2, -1).clone() if k in ("pos_bias", "time_bias") else v
                 for k, v in shared.state_dict().items()}
    per_head.load_state_dict(state)
    lengths = [0, 3, 6]
    x = torch.randn(9, 8, dtype=torch.float64)
    ts = torch.arange(9) * 5
    out_shared = shared(x, offsets_of(lengths), 6, ts)
    out_head = per_head(x, offsets_of(lengths), 6, ts)
    torch.testing.assert_close(out_shared, out_head)
    out_shared.square().sum().backward()
    out_head.square().sum().backward()
    for name in ("pos_bias", "time_bias"):
        grad = getattr(shared, name).grad
        assert grad.shape[0] == 1 and grad.abs().sum() > 0
        torch.testing.assert_close(grad, getattr(per_head, name).grad.sum(0, keepdim=True))
    with pytest.raises(ValueError, match="rel_bias"):
        hstu_block(rel_bias="layer")


# -- embedding_init ---------------------------------------------------------------------------------------


def test_reference_item_init_is_truncated_at_two_std():
    torch.manual_seed(0)
    truncated = ItemEmbedding(4000, 16, truncated=True).all_items(torch.device("cpu"))
    assert truncated.abs().max() <= 0.04
    # A N(0, 1) truncated to [-2, 2] has std 0.8796.
    assert relative_std_close(truncated, 0.02 * 0.8796, 0.02)
    torch.manual_seed(0)
    default = ItemEmbedding(4000, 16).all_items(torch.device("cpu"))
    assert default.abs().max() > 0.06 and relative_std_close(default, 0.02, 0.02)


@pytest.mark.parametrize(("init", "std"), [("scaled", math.sqrt(1 / 64)), ("reference", math.sqrt(2 / (400 + 64)))])
def test_position_table_init(init, std):
    cfg = TeacherConfig(d_model=64, item_dim=64, max_len=400, abs_pos_emb=True, history_features=(), embedding_init=init)
    torch.manual_seed(0)
    position = HistoryEmbedding(cfg, NEXT_ITEM_SCHEMA).position.weight
    assert relative_std_close(position, std, 0.03)
    assert position.abs().max() > 2.5 * std  # normal draws (a uniform of this std stops at 1.73 std)


def test_teacher_builds_what_the_switches_say():
    model = build(tiny_config(**HSTU_NEXT_ITEM, **ALL_SWITCHES), NEXT_ITEM_SCHEMA)
    for block in model.blocks:
        assert isinstance(block.input_norm, PlainLayerNorm) and isinstance(block.attn_norm, PlainLayerNorm)
        assert block.uvqk.bias is None and block.pos_bias.shape[0] == 1 and block.time_bias.shape[0] == 1
    assert model.items.all_items(torch.device("cpu")).abs().max() <= 0.04
    default = build(tiny_config(**HSTU_NEXT_ITEM), NEXT_ITEM_SCHEMA)
    assert all(isinstance(b.input_norm, torch.nn.LayerNorm) and b.uvqk.bias is not None for b in default.blocks)
    assert all(b.pos_bias.shape[0] == 2 and not b.pos_bias.any() for b in default.blocks)


def test_bad_switch_values_name_their_field():
    for field, bad in (("block_norm", "rms"), ("block_init", "xavier"), ("rel_bias", "layer"), ("embedding_init", "x")):
        with pytest.raises(ValueError, match=field):
            TeacherConfig(**{field: bad})
        overridden = tiny_config()
        setattr(overridden, field, bad)  # a CLI override sets the field without __post_init__
        with pytest.raises(ValueError, match=field):
            build_teacher(overridden, NEXT_ITEM_SCHEMA)


def test_reference_teacher_trains_every_parameter_and_its_loss_falls():
    model = build(tiny_config(**HSTU_NEXT_ITEM, **ALL_SWITCHES, dropout=0.0), NEXT_ITEM_SCHEMA)
    batch = make_batch(NEXT_ITEM_SCHEMA, [4, 0, 6, 2, 8, 1, 3, 5])
    model.loss(batch, model(batch))["loss"].backward()
    assert_every_parameter_learns(model)
    batches = [_successor_world(make_batch(NEXT_ITEM_SCHEMA, [4, 0, 6, 2, 8, 1, 3, 5], seed=s), 25) for s in range(2)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.0)
    losses = []
    for _ in range(25):
        for b in batches:
            loss = model.loss(b, model(b))["loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
    assert sum(losses[-2:]) < 0.5 * sum(losses[:2]), losses


# -- the sweep plans --------------------------------------------------------------------------------------


def test_reference_plans_ab_each_switch_and_all_of_them():
    everything = " ".join(ALL_REFERENCE[0]) + " GEM_KERNELS_FAST_SIGMOID=0"
    runs = plan_runs("reference", [0, 1, 2])
    groups = {(r.data, r.variant) for r in runs}
    assert groups == {
        *(("sequences", v) for v in ("default", *REFERENCE_SWITCHES)), (ONE_SHARD, "default"), (ONE_SHARD, everything)
    }
    assert len(runs) == 21 and {r.flavor for r in runs} == {"ml1m_hstu"}
    large = plan_runs("reference-large", [0, 1, 2])
    assert len(large) == 9 and {r.flavor for r in large} == {"ml1m_hstu_large"}
    assert {(r.data, r.variant) for r in large} == {
        ("sequences", "default"), ("sequences", "rel_bias=shared"), (ONE_SHARD, everything)
    }
    check_runs(runs + large)


def sequences_file(path, users: int):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{u}\t{' '.join(str((u + i) % 40 + 1) for i in range(5))}\n" for u in range(1, users + 1)))
    return path.parent


def epoch_batches(dataset, epoch: int) -> list[torch.Tensor]:
    """The train rows (``example_id``, which counts users in file order) of every batch of one epoch."""
    cfg = DataConfig(path=str(dataset), max_len=200, batch_size=128, num_workers=0, seed=0)
    stream = EventStream(dataset, "train", cfg, training=True)
    stream.set_epoch(epoch)
    return [batch.example_id for batch in build_dataloader(stream, cfg)]


def test_one_shard_data_shuffles_all_users_together(tmp_path):
    """``sequences`` splits 4,200 users into shards of 4,096 and 104 and a batch holds one shard's users (but
    the one that straddles); ``sequences-one-shard`` holds the same rows, and its batches mix all users."""
    raw = sequences_file(tmp_path / "raw" / SEQUENCES, 4200)
    two, one = prepare_dataset("sequences", raw, tmp_path / "out"), prepare_dataset(ONE_SHARD, raw, tmp_path / "out")
    assert len(list((two / "train").glob("*.parquet"))) == 2 and len(list((one / "train").glob("*.parquet"))) == 1
    for epoch in (0, 1):
        split = [b for b in epoch_batches(two, epoch) if (b < 4096).any() and (b >= 4096).any()]
        assert len(split) <= 1
        mixed = [b for b in epoch_batches(one, epoch) if (b < 4096).any() and (b >= 4096).any()]
        assert len(mixed) > 1
        assert torch.equal(torch.cat(epoch_batches(one, epoch)).sort().values, torch.arange(4200))
    with pytest.raises(ValueError, match="do not fit"):
        prepare_dataset(ONE_SHARD, sequences_file(tmp_path / "big" / SEQUENCES, ONE_SHARD_ROWS + 1), tmp_path / "out2")


@pytest.mark.parametrize("flavor", ["ml1m_hstu", "ml1m_hstu_large"])
def test_every_reference_override_parses_on_its_flavor(flavor):
    """What the GPU sweep passes each run: a typo here would fail every run of the call."""
    for spec in plan_runs("reference", [0]) + plan_runs("reference-large", [0]):
        cfg = apply_overrides(teacher_flavor(flavor), list(spec.overrides))
        cfg.check()
    cfg = apply_overrides(teacher_flavor(flavor), list(ALL_REFERENCE[0]))
    assert (cfg.block_norm, cfg.block_init, cfg.uvqk_bias, cfg.rel_bias, cfg.embedding_init) == (
        "plain", "reference", False, "shared", "reference"
    )
    assert cfg.attention_norm_length(0) == 211


def test_flavor_defaults_follow_the_sweep():
    """The sweep (docs/benchmarks.md) kept our blocks and initialisation and adopted shared bias tables and one
    permutation of all users per epoch."""
    for flavor in ("ml1m_hstu", "ml1m_hstu_large", "sasrec"):
        cfg = teacher_flavor(flavor)
        assert (cfg.block_norm, cfg.block_init, cfg.uvqk_bias, cfg.rel_bias, cfg.embedding_init) == (
            "affine", "torch", True, "shared", "scaled"
        )
        assert get_flavor(flavor).data.shuffle_window == 0
