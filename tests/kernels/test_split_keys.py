"""Cross-attention on key chunks (:mod:`kernels.triton.split_keys`): against the reference and the unsplit kernels."""

from __future__ import annotations

import pytest
import torch

from kernels import jagged_cross_attention
from kernels.triton import jagged_attention as triton_backend
from kernels.triton import split_keys

CHUNK = split_keys.tiles(torch.empty(0)).chunk


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0)


def _attend(q, k, v, q_lens, kv_lens, backend, upstream):
    for x in (q, k, v):
        x.grad = None
    out = jagged_cross_attention(q, k, v, _offsets(q_lens), _offsets(kv_lens), max(q_lens), max(kv_lens),
                                 backend=backend)
    out.backward(upstream)
    return [out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]


def _leaves(q_lens, kv_lens, heads, dqk, dv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), heads, dqk, generator=gen).to(dtype).requires_grad_(True)
    # Scores large enough that the chunks' maxima differ: the combine's rescaling matters.
    k = (3 * torch.randn(sum(kv_lens), heads, dqk, generator=gen)).to(dtype).requires_grad_(True)
    v = torch.randn(sum(kv_lens), heads, dv, generator=gen).to(dtype).requires_grad_(True)
    upstream = torch.randn(sum(q_lens), heads, dv, generator=gen).to(dtype)
    return q, k, v, upstream


@pytest.fixture
def split_switch(monkeypatch):
    def set_split(on: bool) -> None:
        monkeypatch.setenv("GEM_KERNELS_SPLIT_KEYS", "1" if on else "0")

    return set_split


# Sequences of one key, of a chunk's keys exactly, across chunks and tiles, without keys, without queries.
_SHAPES = {
    "pma": ([8, 8, 8, 8, 8], [3 * CHUNK + 5, 0, 1, CHUNK, 2 * CHUNK - 1]),
    "ragged-queries": ([5, 0, 16, 1], [70, 40, 0, 2 * CHUNK + 17]),
}


@pytest.mark.parametrize("shape", list(_SHAPES), ids=list(_SHAPES))
@pytest.mark.parametrize("dims", [(16, 16), (32, 24)], ids=["d16", "dqk32-dv24"])
def test_chunked_cross_attention_matches_the_reference_forward_and_backward(shape, dims, split_switch):
    q_lens, kv_lens = _SHAPES[shape]
    q, k, v, upstream = _leaves(q_lens, kv_lens, 2, *dims, torch.float32, seed=3)
    assert split_keys.applies("softmax", max(q_lens), max(kv_lens), q)
    split_switch(True)
    got = _attend(q, k, v, q_lens, kv_lens, "triton", upstream)
    want = _attend(q, k, v, q_lens, kv_lens, "pytorch", upstream)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=name)
    split_switch(False)
    unsplit = _attend(q, k, v, q_lens, kv_lens, "triton", upstream)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, unsplit, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=f"{name} against the unsplit kernels")
    # A query whose sequence has no keys gets zeros, and its gradient is zero.
    empty = kv_lens.index(0)
    rows = slice(sum(q_lens[:empty]), sum(q_lens[: empty + 1]))
    assert torch.equal(got[0][rows], torch.zeros_like(got[0][rows]))
    assert torch.equal(got[1][rows], torch.zeros_like(got[1][rows]))


def test_chunked_cross_attention_in_half_precision(split_switch):
    q_lens, kv_lens = _SHAPES["pma"]
    q, k, v, upstream = _leaves(q_lens, kv_lens, 2, 16, 16, torch.float16, seed=4)
    split_switch(True)
    got = _attend(q, k, v, q_lens, kv_lens, "triton", upstream)
    want = _attend(*(x.detach().float().requires_grad_(True) for x in (q, k, v)), q_lens, kv_lens, "pytorch",
                   upstream.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2, msg=name)


def test_the_chunked_passes_run_only_where_they_apply(split_switch, monkeypatch):
    """The split runs for softmax calls of at most MAX_QUERIES queries over keys for more than one chunk, with the
    switch on; every other call runs the general kernels."""
    calls = []
    for name in ("chunked_forward", "chunked_backward"):
        real = getattr(split_keys, name)
        monkeypatch.setattr(split_keys, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    q_lens, kv_lens = [8, 3], [CHUNK + 1, 4]
    q, k, v, upstream = _leaves(q_lens, kv_lens, 1, 16, 16, torch.float32, seed=5)
    split_switch(True)
    _attend(q, k, v, q_lens, kv_lens, "triton", upstream)
    assert calls == ["chunked_forward", "chunked_backward"]
    for case in ("switch off", "one chunk", "too many queries", "pointwise"):
        calls.clear()
        split_switch(case != "switch off")
        lens = ([8, 3], [CHUNK, 4]) if case == "one chunk" else ([17, 3], kv_lens) if case == "too many queries" \
            else (q_lens, kv_lens)
        q, k, v, upstream = _leaves(*lens, 1, 16, 16, torch.float32, seed=6)
        offsets = [_offsets(x) for x in lens]
        out = triton_backend.jagged_cross_attention(q, k, v, *offsets, max(lens[0]), max(lens[1]),
                                                    activation="silu" if case == "pointwise" else "softmax")
        out.backward(upstream)
        assert calls == [], case


def test_the_chunks_of_a_batch():
    """``base`` counts each sequence's chunks in key order; ``owner`` names each slot's sequence, ``B`` past them."""
    kv_lens = [CHUNK + 1, 0, CHUNK, 1]
    slots = -(-sum(kv_lens) // CHUNK) + len(kv_lens)
    base, owner = split_keys._chunks(_offsets(kv_lens), CHUNK, slots)
    assert base.tolist() == [0, 2, 2, 3, 4]
    assert owner.tolist() == [0, 0, 2, 3] + [4] * (slots - 4)
