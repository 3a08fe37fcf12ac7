"""FSDP2 over the teacher, in two real gloo processes: a training step raises no warning about the blocks' outputs."""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from foundation.model.teacher import build_teacher
from foundation.parallel.fsdp import FSDPConfig, apply_fsdp
from tests.teacher_batches import CTR_SCHEMA, make_batch, tiny_config
from tests.test_parallel_training import free_port

WORLD = 2


def step_warnings(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        model = build_teacher(tiny_config(dropout=0.0), CTR_SCHEMA)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            apply_fsdp(model, init_device_mesh("cpu", (WORLD,)), FSDPConfig(), ignored_params=set())
            batch = make_batch(CTR_SCHEMA, [3, 0, 5, 2])
            model.loss(batch, model(batch))["loss"].backward()
        grads = sum(p.grad is not None for p in model.parameters())
        messages = sorted({str(w.message)[:80] for w in caught if "FSDP" in str(w.message)})
        torch.save({"messages": messages, "grads": grads}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_sharded_teacher_step_warns_about_no_block_output():
    """FSDP2 warns when a wrapped module returns a view (an in-place op on it would skip the all-gather hook). The
    personalised FFN returns its residual stream through the norm's autograd op and the teacher its per-task logits
    as columns of one tensor, views that nothing changes in place; those warnings, and any other FSDP one, would be
    noise on every step of every parallel run."""
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(step_warnings, args=(free_port(), out_dir), nprocs=WORLD, join=False, start_method="spawn")
        deadline = time.monotonic() + 300
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail("FSDP workers did not finish within 300 s")
        results = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for result in results:
        assert result["grads"] > 0
        assert result["messages"] == []
