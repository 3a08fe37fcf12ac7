"""Blocks rewritten to launch fewer copies, casts and reductions (issue 15) compute what their previous
formulation computed: outputs and every gradient, in float32 and under bf16 autocast (with and without
:class:`~foundation.model.precision.CastOnce`), with unchanged parameter names and shapes."""

from __future__ import annotations

import pytest
import torch

from foundation.model.hstu import HSTUBlock
from foundation.model.interaction import WukongBlock, mix_tokens
from foundation.model.interformer import PersonalizedFFN, SequenceSummary, SummaryLayout
from foundation.model.jagged import RecentTokens, SuffixLayout, gather_rows
from foundation.model.norms import apply_layer_norm, apply_residual_layer_norm
from foundation.model.precision import CastOnce
from kernels import jagged_cross_attention, jagged_silu_modulate, silu_split

pytestmark = pytest.mark.usefixtures("one_thread")


def wukong_before(block: WukongBlock, x: torch.Tensor) -> torch.Tensor:
    """``[B, n_in, d]`` -> ``[B, n_out, d]``: the block as it was, one contraction per weight."""
    interactions = x @ torch.einsum("bnd,nr->bdr", x, block.projection)
    fm = block.fm_mlp(interactions.flatten(1)).view(x.shape[0], block.n_fm, block.d)
    compressed = torch.einsum("oi,bid->bod", block.compress.weight, x)
    residual = torch.einsum("oi,bid->bod", block.residual.weight, x)
    return block.norm(torch.cat([fm, compressed], dim=1) + residual)


class Call(torch.nn.Module):
    """``forward(x) = fn(inner, x)``: a formulation of ``inner``'s computation, as one module for :class:`CastOnce`."""

    def __init__(self, inner: torch.nn.Module, fn) -> None:
        super().__init__()
        self.inner, self.fn = inner, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.inner, x)


def outputs_and_grads(module: Call, x: torch.Tensor, autocast: bool, cast_once: bool):
    """``(output, input grad, {name: grad})`` of ``module(x)`` under a fixed random cotangent."""
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if cast_once:
            once = CastOnce(module)
            once.run(lambda forward: {"loss": forward(x).float().sum()})  # discovery step, discarded
            module.zero_grad(set_to_none=True)
            x.grad = None
            out = once.run(lambda forward: {"loss": forward(x)})["loss"]
        else:
            out = module(x)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.float().backward(cotangent)
    if cast_once:
        once.collect_grads()
    return out.float(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def assert_same(new: tuple, old: tuple, autocast: bool) -> None:
    """Equal up to float32 rounding; under bf16 autocast up to a few bf16 roundings placed differently (e.g. a
    bias added after the GEMM's rounding instead of before), which the attention and norms amplify: within 4% of
    each tensor's largest entry."""
    olds = [old[0], old[1], *old[2].values()]
    news = [new[0], new[1], *(new[2][name] for name in old[2])]
    assert new[2].keys() == old[2].keys()
    for name, a, b in zip(["output", "input", *old[2]], news, olds, strict=True):
        assert a is not None, name
        tol = {"atol": 0.04 * float(b.abs().max()), "rtol": 0.0} if autocast else {"atol": 1e-5, "rtol": 1e-5}
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(("autocast", "cast_once"), [(False, False), (True, False), (True, True)])
def test_wukong_block_equals_its_previous_formulation(autocast, cast_once):
    torch.manual_seed(0)
    block = WukongBlock(7, 6, 16, rank=3, hidden=12, dropout=0.0)
    assert {n: tuple(p.shape) for n, p in block.named_parameters()} == {
        "projection": (7, 3), "fm_mlp.0.weight": (21,), "fm_mlp.0.bias": (21,), "fm_mlp.1.weight": (12, 21),
        "fm_mlp.1.bias": (12,), "fm_mlp.4.weight": (48, 12), "fm_mlp.4.bias": (48,), "compress.weight": (3, 7),
        "residual.weight": (6, 7), "norm.weight": (16,), "norm.bias": (16,),
    }
    x = torch.randn(5, 7, 16)
    new = outputs_and_grads(Call(block, WukongBlock.forward), x, autocast, cast_once)
    old = outputs_and_grads(Call(block, wukong_before), x, autocast, False)
    assert_same(new, old, autocast)


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_mix_tokens_equals_the_einsum(rows):
    """The batched product gives einsum's output and both gradients, for any row count (none included)."""
    torch.manual_seed(0)
    weight = torch.randn(4, 7, requires_grad=True)
    x = torch.randn(rows, 7, 16, requires_grad=True)
    cotangent = torch.randn(rows, 4, 16)
    out = mix_tokens(weight, x)
    grads = torch.autograd.grad(out, (weight, x), cotangent)
    ref = torch.einsum("oi,bid->bod", weight, x)
    ref_grads = torch.autograd.grad(ref, (weight, x), cotangent)
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)


def hstu_split_before(block: HSTUBlock, x: torch.Tensor, normed: torch.Tensor | None = None):
    """``x[L, d]`` -> ``u, v, q, k``: the projection with its bias in the GEMM, then the SiLU split."""
    h, dv, dqk = block.num_heads, block.value_dim, block.attn_dim
    normed = apply_layer_norm(block.input_norm, x) if normed is None else normed
    u, v, q, k = silu_split(block.uvqk(normed), [h * dv, h * dv, h * dqk, h * dqk])
    return u, v.view(-1, h, dv), q.view(-1, h, dqk), k.view(-1, h, dqk)


@pytest.mark.parametrize(("autocast", "cast_once"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("uvqk_bias", [True, False])
def test_hstu_block_equals_its_previous_formulation(autocast, cast_once, uvqk_bias):
    torch.manual_seed(0)
    block = HSTUBlock(
        16, 2, 4, 6, dropout=0.0, alpha=1.0, pos_buckets=8, time_buckets=4, attention_norm=8, uvqk_bias=uvqk_bias
    )
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))  # non-zero bias tables and uvqk bias
    offsets, timestamps = torch.tensor([0, 3, 3, 8]), torch.arange(8) * 100

    def forward(b: HSTUBlock, x: torch.Tensor) -> torch.Tensor:
        return HSTUBlock.forward(b, x, offsets, 5, timestamps)

    def forward_before(b: HSTUBlock, x: torch.Tensor) -> torch.Tensor:
        b.split_uvqk = lambda x, normed=None: hstu_split_before(b, x, normed)
        try:
            return forward(b, x)
        finally:
            del b.split_uvqk

    x = torch.randn(8, 16)
    new = outputs_and_grads(Call(block, forward), x, autocast, cast_once)
    old = outputs_and_grads(Call(block, forward_before), x, autocast, False)
    assert_same(new, old, autocast)


def pffn_before(pffn: PersonalizedFFN, x: torch.Tensor, rows: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
    """``x[L, d]`` -> ``[L, d]``: the up projection with its bias in the GEMM, ``1 + gain`` computed apart."""
    gain, shift = pffn.condition(pffn.narrow(summary).flatten(1)).chunk(2, dim=-1)
    x, normed = apply_residual_layer_norm(pffn.norm, x, None)
    up = pffn.up(normed)
    return x + pffn.down(jagged_silu_modulate(up, 1 + gain, shift, rows))


@pytest.mark.parametrize(("autocast", "cast_once"), [(False, False), (True, False), (True, True)])
def test_personalized_ffn_equals_its_previous_formulation(autocast, cast_once):
    torch.manual_seed(0)
    pffn = PersonalizedFFN(16, 3, 4, 24, dropout=0.0)
    with torch.no_grad():
        pffn.condition.weight.normal_(std=0.3)  # a gain far from 0, so that 1 + g matters
        pffn.up.bias.normal_()
    rows = torch.tensor([0, 0, 0, 2, 2, 2, 2, 2])
    summary = torch.randn(3, 3, 16)
    x = torch.randn(8, 16)
    new = outputs_and_grads(Call(pffn, lambda m, t: PersonalizedFFN.forward(m, t, rows, summary)), x, autocast, cast_once)
    old = outputs_and_grads(Call(pffn, lambda m, t: pffn_before(m, t, rows, summary)), x, autocast, False)
    assert_same(new, old, autocast)


def summary_before(m: SequenceSummary, seq: torch.Tensor, layout: SuffixLayout, offsets: torch.Tensor,
                   max_len: int, num_cls: int, key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[L + B*S, d]`` -> ``[B, C + seeds + K, d]``: the summary as it was, on the stream split into history and
    suffix at every layer (one permutation of the whole stream each way), its PMA's bias on every key
    (``key_bias[d]``, none when None) and every value."""
    history, suffix = layout.split(seq)
    batch, d = offsets.numel() - 1, seq.shape[-1]
    parts = [suffix[:, :num_cls]]
    if m.num_seeds:
        h, s = m.num_heads, m.num_seeds
        q = m.query(m.seeds).view(1, s, h, d // h).expand(batch, s, h, d // h).reshape(batch * s, h, d // h)
        k, v = m.key_value(apply_layer_norm(m.kv_norm, history)).view(-1, 2, h, d // h).unbind(1)
        v = (v + m.value_bias.view(h, d // h)).to(v.dtype)
        if key_bias is not None:
            k = (k + key_bias.view(h, d // h)).to(k.dtype)
        seeds = torch.arange(batch + 1) * s
        pooled = jagged_cross_attention(q, k, v, seeds, offsets, s, max(max_len, 1), activation="softmax")
        parts.append(m.seeds + m.pma_out(pooled.reshape(batch, s, d)))
    if m.num_recent:
        recent = RecentTokens.build(offsets, m.num_recent)
        parts.append(gather_rows(history, recent.index, recent.valid, m.recent_fill))
    summary = torch.cat(parts, dim=1)
    return summary * torch.sigmoid(m.gate(summary))


def summary_case(num_seeds: int, num_recent: int, num_cls: int = 2):
    """A summary module, a batch (an empty history, histories shorter and longer than ``num_recent``; CLS and
    candidate suffix tokens) and the two formulations as :class:`Call` s of the stream ``x[L + B*S, d]``, each
    giving the summary and the stream it hands on, flattened into one output."""
    torch.manual_seed(0)
    module = SequenceSummary(16, 2, num_seeds, num_recent)
    with torch.no_grad():
        if num_recent:
            module.recent_fill.normal_()
    lengths, num_suffix = [5, 0, 2, 9], 3
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    layout = SuffixLayout.build(offsets, sum(lengths), num_suffix)
    summary_layout = SummaryLayout.build(offsets, layout, max(lengths), num_cls, num_seeds, num_recent)

    def new(m, x):
        out, summary = SequenceSummary.forward(m, x, summary_layout)
        return torch.cat([summary.flatten(), out.flatten()])

    def old(m, x):
        return torch.cat([summary_before(m, x, layout, offsets, max(lengths), num_cls).flatten(), x.flatten()])

    x = torch.randn(sum(lengths) + len(lengths) * num_suffix, 16)
    return Call(module, new), Call(module, old), x


# (3, 0, 0): seeds only, nothing picked from the stream.
@pytest.mark.parametrize(("num_seeds", "num_recent", "num_cls"), [(3, 4, 2), (3, 0, 2), (0, 4, 2), (3, 0, 0)])
@pytest.mark.parametrize(("autocast", "cast_once"), [(False, False), (True, False), (True, True)])
def test_sequence_summary_on_the_stream_equals_its_previous_formulation(autocast, cast_once, num_seeds, num_recent,
                                                                        num_cls):
    new, old, x = summary_case(num_seeds, num_recent, num_cls)
    assert_same(outputs_and_grads(new, x, autocast, cast_once), outputs_and_grads(old, x, autocast, False), autocast)


def test_pma_key_bias_cancels_in_the_softmax_and_checkpoints_with_it_load():
    """A checkpoint of the PMA projection with a bias on keys and values loads (the values' half becomes
    ``value_bias``) and the summary equals the one with both biases on every key and value, empty history included."""
    new, _, x = summary_case(3, 2)
    module = new.inner
    state = module.state_dict()
    del state["value_bias"]
    state["key_value.bias"] = torch.randn(32, generator=torch.Generator().manual_seed(2))
    module.load_state_dict(state)
    torch.testing.assert_close(module.value_bias.detach(), state["key_value.bias"][16:], rtol=0, atol=0)
    assert "key_value.bias" not in module.state_dict()

    lengths, num_suffix = [5, 0, 2, 9], 3
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    layout = SuffixLayout.build(offsets, sum(lengths), num_suffix)
    key_bias = state["key_value.bias"][:16]
    old = Call(module, lambda m, t: summary_before(m, t, layout, offsets, max(lengths), 2, key_bias=key_bias).flatten())
    summary_size = len(lengths) * (2 + 3 + 2) * 16
    got = outputs_and_grads(Call(module, lambda m, t: new.fn(m, t)[:summary_size]), x, False, False)
    want = outputs_and_grads(old, x, False, False)
    assert_same(got, want, autocast=False)


def test_static_step_hands_the_fused_optimizer_gradients_in_the_parameters_layout():
    """The Wukong projection's gradient arrives transposed (it reaches the parameter through ``.T``); torch's fused
    AdamW would step it as if laid out like the parameter, so gem.loop gives it the parameter's layout."""
    from gem.loop import in_layout_of

    torch.manual_seed(0)
    grad = torch.randn(4, 10).T
    steps = []
    for g in (in_layout_of(torch.empty(10, 4), grad), grad.contiguous()):
        p = torch.nn.Parameter(torch.ones(10, 4))
        p.grad = g
        torch.optim.AdamW([p], lr=1e-3, fused=True).step()
        steps.append(p.detach())
    torch.testing.assert_close(steps[0], steps[1], rtol=0, atol=0)
