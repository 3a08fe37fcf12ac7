"""Context-parallel attention on real processes (gloo, CPU) with the target-time bias: cp=2 ranks, both routes
(``gather``: K/V all-gather and prefix sequences; ``heads``: all-to-all to head groups), give the single-device
outputs and gradients when ``query_timestamps`` (the reference HSTU's ``ts[i+1] - ts[j]``) are set, and not
when the route drops them."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from foundation.parallel.context import ContextParallel
from kernels import jagged_attention, route_jagged_attention
from tests.test_parallel_training import free_port

CP = 2
LENGTHS = [0, 1, 2, 5, 9, 16]
HEADS = 2
MAX_LEN = 20  # above the longest row: HSTU's fixed 1/N, passed through unchanged
LEAVES = ("q", "k", "v", "pos_bias", "time_bias")
TIMEOUT_S = 240


def offsets_of(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])


def batch() -> dict:
    """The same random batch on every rank: leaves, options, the upstream gradient and next-event query times."""
    g = torch.Generator().manual_seed(7)
    tokens = sum(LENGTHS)
    leaves = {name: torch.randn(tokens, HEADS, 4, generator=g) for name in ("q", "k", "v")}
    leaves.update(pos_bias=torch.randn(HEADS, 8, generator=g), time_bias=torch.randn(HEADS, 6, generator=g))
    timestamps = torch.randint(0, 400, (tokens,), generator=g).cumsum(0)
    query_timestamps = timestamps.clone()
    for start, end in zip(offsets_of(LENGTHS)[:-1].tolist(), offsets_of(LENGTHS)[1:].tolist(), strict=True):
        if end > start:
            query_timestamps[start : end - 1] = timestamps[start + 1 : end]
            query_timestamps[end - 1] = timestamps[end - 1] + 900
    options = dict(activation="silu", causal=True, num_targets=torch.tensor([0, 1, 1, 2, 3, 4]),
                   timestamps=timestamps)
    upstream = torch.randn(tokens, HEADS, 4, generator=g)
    return dict(leaves=leaves, options=options, query_timestamps=query_timestamps, upstream=upstream)


def output_and_grads(attend, b: dict) -> list[torch.Tensor]:
    """``attend(q, k, v, pos_bias=, time_bias=)`` -> its output and the leaves' gradients of ``<out, upstream>``."""
    leaves = {name: x.clone().requires_grad_(True) for name, x in b["leaves"].items()}
    out = attend(leaves["q"], leaves["k"], leaves["v"], pos_bias=leaves["pos_bias"], time_bias=leaves["time_bias"])
    (out * b["upstream"]).sum().backward()
    return [out.detach()] + [leaves[name].grad for name in LEAVES]


def single_device(b: dict, query_timestamps: torch.Tensor | None) -> list[torch.Tensor]:
    offsets = offsets_of(LENGTHS)

    def attend(q, k, v, **tables):
        return jagged_attention(q, k, v, offsets, MAX_LEN, query_timestamps=query_timestamps, **b["options"], **tables)

    return output_and_grads(attend, b)


def context_parallel(cp: ContextParallel, b: dict, query_timestamps: torch.Tensor | None) -> list[torch.Tensor]:
    """The model's path: whole-batch leaves sharded, attention through the route, the output gathered. Every rank
    computes the same loss, so its gradients summed over the cp ranks are ``cp`` times the single-device ones."""
    offsets = offsets_of(LENGTHS)
    plan = cp.plan_for(offsets)

    def attend(q, k, v, **tables):
        with route_jagged_attention(cp.attention):
            local = jagged_attention(
                cp.shard(q, plan), cp.shard(k, plan), cp.shard(v, plan), offsets, MAX_LEN,
                query_timestamps=query_timestamps, **b["options"], **tables,
            )
        return cp.gather(local, plan)

    out, *grads = output_and_grads(attend, b)
    for grad in grads:
        dist.all_reduce(grad)
        grad /= cp.size
    return [out, *grads]


def worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=CP)
    try:
        mesh = init_device_mesh("cpu", (CP,))
        b = batch()
        results = {
            "single": single_device(b, b["query_timestamps"]),
            "single_without_times": single_device(b, None),
        }
        for route in ("gather", "heads"):
            cp = ContextParallel(mesh, route)
            results[route] = context_parallel(cp, b, b["query_timestamps"])
            results[f"{route}_without_times"] = context_parallel(cp, b, None)
        if rank == 0:
            torch.save(results, Path(out_dir) / "results.pt")
    finally:
        dist.destroy_process_group()


def run_ranks() -> dict:
    """``worker`` on ``CP`` processes; fails (never hangs) past ``TIMEOUT_S``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(worker, args=(free_port(), out_dir), nprocs=CP, join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                for process in ctx.processes:
                    process.kill()
                pytest.fail(f"cp workers did not finish within {TIMEOUT_S}s")
        return torch.load(Path(out_dir) / "results.pt", weights_only=True)


def test_context_parallel_attention_with_query_times_equals_single_device():
    results = run_ranks()
    single = results["single"]
    # The query times matter for this batch: without them the single-device answer is far from it.
    assert (results["single_without_times"][0] - single[0]).abs().max() > 1e-2
    for route in ("gather", "heads"):
        for name, got, want in zip(("out", *LEAVES), results[route], single, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, r=route, n=name: f"{r} {n}: {m}")
        # A route that dropped them would give the answer without them.
        dropped = results[f"{route}_without_times"]
        assert (dropped[0] - single[0]).abs().max() > 1e-2, route
        torch.testing.assert_close(dropped[0], results["single_without_times"][0], atol=1e-5, rtol=1e-5)
