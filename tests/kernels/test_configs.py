"""Which tile config a launch takes: a checked-in pick (nearest length buckets of its variant), else the
heuristic, without autotuning on the critical path. The interpreter runs the real kernels, with the GPU
launch path forced on so the selection runs as it does on a GPU."""

from __future__ import annotations

import json

import pytest
import torch
import triton

from kernels import jagged_attention
from kernels.triton import configs
from kernels.triton import jagged_attention as triton_backend

DEVICE_KEY = "Test GPU | triton 9.9"


@pytest.fixture
def table(tmp_path, monkeypatch):
    """An empty checked-in table for a fake device, and a clean pick cache."""
    path = tmp_path / "tuned_configs.json"
    monkeypatch.setattr(configs, "TUNED_PATH", path)
    monkeypatch.setattr(configs, "device_key", lambda device: DEVICE_KEY)
    monkeypatch.setattr(triton_backend, "_PICKS", {})
    configs._table.cache_clear()
    yield path
    configs._table.cache_clear()


def _config(bm, bn, warps=4, stages=2):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


def _entry(n_bucket, avg_bucket, kernel="_fwd_kernel"):
    meta = dict(N_BUCKET=n_bucket, AVG_BUCKET=avg_bucket, DQK=16, DV=16, ACT=1, CAUSAL=True, HAS_TARGETS=False,
                HAS_WINDOW=False, HAS_PB=False, HAS_TB=False, TMA=False)
    return configs.entry_key(kernel, torch.float32, [*configs.TUNE_KEY, "TMA"], meta)


def test_write_tuned_merges_and_lookup_takes_the_nearest_length_buckets(table):
    configs.write_tuned({_entry(1024, 512): _config(64, 32)}, torch.device("cpu"), table)
    configs.write_tuned({_entry(8192, 8192): _config(32, 16)}, torch.device("cpu"), table)
    assert set(json.loads(table.read_text())[DEVICE_KEY]) == {_entry(1024, 512), _entry(8192, 8192)}
    cpu = torch.device("cpu")
    assert configs.checked_in_pick(cpu, _entry(1024, 512)).kwargs == {"BLOCK_M": 64, "BLOCK_N": 32}
    assert configs.checked_in_pick(cpu, _entry(2048, 256)).kwargs == {"BLOCK_M": 64, "BLOCK_N": 32}
    assert configs.checked_in_pick(cpu, _entry(16384, 4096)).kwargs == {"BLOCK_M": 32, "BLOCK_N": 16}
    # Another variant (here: another kernel) has no entry: no pick.
    assert configs.checked_in_pick(cpu, _entry(1024, 512, kernel="_bwd_dq_kernel")) is None


def _gpu_path_launches(monkeypatch):
    """Runs ``_launch`` as on a GPU (the interpreter runs the kernels) and records the configs taken."""
    real = triton_backend._launch
    taken = []

    def launch(tuned, plain, cpu_blocks, block_key, grid_rows, batch_heads, args, kwargs, on_cuda, work=None):
        before = dict(triton_backend._PICKS)
        real(tuned, plain, cpu_blocks, block_key, grid_rows, batch_heads, args, kwargs, True, work)
        taken.extend(c.kwargs for k, c in triton_backend._PICKS.items() if k not in before)

    monkeypatch.setattr(triton_backend, "_launch", launch)
    return taken


def test_launch_takes_the_checked_in_pick_then_the_heuristic_without_tuning(table, monkeypatch):
    """With a checked-in pick the launch does not tune even with autotuning on (a tuning run would time
    the kernels with CUDA events, which fails here)."""
    monkeypatch.setenv("GEM_KERNELS_AUTOTUNE", "1")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, 1, 16, generator=g) for _ in range(3))
    offsets = torch.tensor([0, 25, 40])
    configs.write_tuned({_entry(64, 64): _config(16, 16)}, torch.device("cpu"), table)
    taken = _gpu_path_launches(monkeypatch)
    out = jagged_attention(q, k, v, offsets, 25, activation="silu", backend="triton")
    want = jagged_attention(q, k, v, offsets, 25, activation="silu", backend="pytorch")
    assert taken == [{"BLOCK_M": 16, "BLOCK_N": 16}]
    assert torch.allclose(out, want, atol=1e-5)
    # Softmax has no checked-in entry: its heuristic, the first config of the plain list.
    monkeypatch.setenv("GEM_KERNELS_AUTOTUNE", "0")
    taken.clear()
    jagged_attention(q, k, v, offsets, 25, activation="softmax", backend="triton")
    assert taken == [configs.configs_for(configs.FWD_CONFIGS, {}, q.dtype)[0].kwargs]


def test_a_checked_in_biased_dq_tile_that_breaks_the_kernel_is_refused(table):
    """The biased dQ pass scatters from its registers, which needs one owner per element: a hand-edited
    table entry with too small a BLOCK_M is an error naming the entry, not double-counted gradients."""
    meta = dict(N_BUCKET=64, AVG_BUCKET=64, DQK=16, DV=16, ACT=1, CAUSAL=True, HAS_TARGETS=False,
                HAS_WINDOW=False, HAS_PB=True, HAS_TB=True)
    entry = configs.entry_key("_bwd_dq_kernel", torch.float32, configs.TUNE_KEY, meta)
    table.write_text(json.dumps({DEVICE_KEY: {entry: [64, 32, 8, 2]}}))
    with pytest.raises(ValueError, match=r"_bwd_dq_kernel.*BLOCK_M >= max"):
        configs.checked_in_pick(torch.device("cpu"), entry)


@pytest.mark.parametrize("listed", [configs.FWD_CONFIGS, configs.DQ_CONFIGS, configs.DKDV_CONFIGS])
def test_configs_survive_the_autotuning_disk_cache(listed):
    """Triton's disk cache (``TRITON_CACHE_AUTOTUNING=1``) stores ``config.__dict__`` and rebuilds each config
    with ``Config(**stored)``: a config carrying any attribute of ours fails that rebuild on the second run."""
    for config in listed:
        rebuilt = triton.Config(**config.__dict__)
        assert rebuilt.all_kwargs() == config.all_kwargs()
    for dtype in (torch.bfloat16, torch.float32):
        assert configs.configs_for(listed, {"HAS_PB": True}, dtype) and configs.configs_for(listed, {"HAS_PB": False}, dtype)


def _pipelined_bytes(config: triton.Config, elem: int, d: int) -> int:
    """Shared memory of a tile pair: the resident ``[BLOCK_M, d]`` tile and ``num_stages`` buffered pairs of
    ``[BLOCK_N, d]`` tiles (the forward's Q and K/V), at ``elem`` bytes per element."""
    kw = config.kwargs
    return elem * d * (kw["BLOCK_M"] + 2 * config.num_stages * kw["BLOCK_N"])


@pytest.mark.parametrize("listed", [configs.FWD_CONFIGS, configs.DQ_CONFIGS, configs.DKDV_CONFIGS])
def test_float32_inputs_take_tiles_that_fit_an_sm(listed):
    """Float32 inputs at head dim 128 take tiles whose pipelined loads fit Hopper's 227 KiB of shared memory; the
    16-bit forward heuristic would need 320 KiB there (Triton's OutOfResources on every 16-bit forward config,
    found evaluating a float32 model on an H100)."""
    hopper = 232_448
    for meta in ({"HAS_PB": False}, {"HAS_PB": True}):
        picked = configs.configs_for(listed, meta, torch.float32)
        assert picked and all(_pipelined_bytes(c, 4, 128) <= hopper for c in picked)
        assert not set(map(id, picked)) & set(map(id, configs.configs_for(listed, meta, torch.bfloat16)))
    wide = configs.configs_for(configs.FWD_CONFIGS, {}, torch.bfloat16)
    assert all(_pipelined_bytes(c, 4, 128) > hopper for c in wide)
