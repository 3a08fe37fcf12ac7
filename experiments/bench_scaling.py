"""Data-parallel scaling of a GEM teacher flavor: tokens/s, MFU and peak memory per rank, under torchrun.

Usage::

    torchrun --nproc_per_node 2 -m experiments.bench_scaling --flavor large --steps 30 --data /tmp/world \\
        --json /tmp/scaling_2.json --baseline-json /tmp/scaling_1.json --profile
    python -m experiments.bench_scaling --flavor large --steps 30 --data /tmp/world --json /tmp/scaling_1.json
    torchrun --nproc_per_node 2 -m experiments.bench_scaling --flavor teacher-debug --steps 3 --rows 64 \\
        --token-budget 2048 --examples 2000          # CPU smoke check (gloo)

Every rank builds the flavor, :func:`~foundation.parallel.parallelize.parallelize_teacher` applies
FSDP2 (``--dp-replicate`` > 1: HSDP), ``--tp`` and, with ``--shard-embeddings``, torchrec table
sharding (CUDA needs torchrec's GPU kernels: fbgemm-gpu, not fbgemm-gpu-cpu; without it the tables
are FSDP-sharded like dense weights). NCCL on GPUs, gloo on CPU. The data path is the training one
(:mod:`foundation.parallel.balance`): every rank reads the same global batch of ``--token-budget``
tokens *per data-parallel rank* times the dp degree and keeps its balanced share, so each rank
does the work of one ``experiments.bench_teacher`` step and the world processes dp times the tokens.

Reported per rank and in total (stdout, and ``--json`` from rank 0): steady-state tokens/s, TFLOP/s,
MFU (against :func:`foundation.model.flops.peak_flops`), step time, peak memory, the heaviest/mean
attention-work ratio; with ``--baseline-json`` (a world-1 result of this script) the scaling
efficiency ``total tokens/s / (world * baseline tokens/s)``; with ``--profile`` a torch.profiler
summary of a few steps on rank 0: time in communication kernels, in compute kernels, and the share
of communication that overlaps compute.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from experiments.bench_teacher import PRECISIONS, prepare_world, summarize
from foundation.data.batch import take_rows
from foundation.data.io import atomic_write_text
from foundation.data.pipeline import DataConfig, EventStream, build_dataloader
from foundation.data.schema import EventSchema
from foundation.model.flops import peak_flops
from foundation.model.teacher import build_teacher
from foundation.parallel import ParallelConfig, ParallelDims, build_dense_optimizer, parallelize_teacher
from foundation.parallel.balance import BalanceConfig, rank_share
from foundation.parallel.embeddings import EmbeddingShardingConfig
from gem.flavors import TEACHER_FLAVORS, teacher_flavor

COMM_KERNEL_MARKERS = ("nccl", "gloo", "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "alltoall")


def init_distributed() -> torch.device:
    """Join torchrun's process group (a world of one when launched plainly); returns this rank's device."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def flavor_name(name: str) -> str:
    """``teacher-debug`` (a ``gem train`` flavor name) or ``debug`` -> the teacher flavor ``debug``."""
    base = name.removeprefix("teacher-")
    if base not in TEACHER_FLAVORS:
        raise SystemExit(f"unknown teacher flavor {name!r}; known: {sorted(TEACHER_FLAVORS)}")
    return base


def build_parallel_model(args: argparse.Namespace, schema: EventSchema, device: torch.device):
    """The flavor on ``device``, parallelized over the world; returns ``(model, optimizer, dims)``."""
    cfg = teacher_flavor(flavor_name(args.flavor))
    dims = ParallelDims(dp_replicate=args.dp_replicate, dp_shard=-1, tp=args.tp, world_size=dist.get_world_size())
    dims.build_mesh(device.type)
    model = build_teacher(cfg, schema).to(device)
    tables = EmbeddingShardingConfig(sharding_types=("table_wise",), optimizer="rowwise_adagrad", lr=args.lr)
    parallel = ParallelConfig(
        shard_embeddings=args.shard_embeddings,
        embeddings=tables,
        activation_checkpointing=args.activation_checkpointing,
        lr=args.lr,
    )
    parallelize_teacher(model, dims, parallel, device=device)
    return model, build_dense_optimizer(model, parallel), dims


def train_steps(model, optimizer, dims: ParallelDims, data_cfg: DataConfig, args, device, profiler=None) -> dict:
    """``args.steps`` steps on this rank's balanced share of each global batch; a trace like bench_teacher's."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    balance = BalanceConfig(attention_weight=args.attention_weight)
    stream = EventStream(data_cfg.path, "train", data_cfg, training=True)
    trace: dict[str, list] = {k: [] for k in ("times", "flops", "tokens", "rows", "max_lens", "losses", "imbalance")}
    last = time.perf_counter()
    for batch in build_dataloader(stream, data_cfg):
        if len(trace["times"]) == args.steps:
            break
        share = rank_share(batch.lengths, dims.dp, dims.dp_rank(), balance)
        batch = take_rows(batch, share.rows)
        trace["flops"].append(model.flops(batch))
        trace["tokens"].append(batch.num_tokens)
        trace["rows"].append(batch.batch_size)
        trace["max_lens"].append(batch.max_len)
        trace["imbalance"].append(share.imbalance)
        batch = batch.to(device, non_blocking=True)
        with autocast:
            loss = model.loss(batch, model(batch))["loss"] * share.loss_weight
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        trace["losses"].append(float(loss.detach()))
        trace["times"].append(now - last)
        last = now
        if profiler is not None:
            profiler.step()
        if dist.get_rank() == 0:
            print(
                f"step {len(trace['times']):4d}  {trace['times'][-1] * 1e3:8.1f} ms  rows {trace['rows'][-1]:5d}"
                f"  tokens {trace['tokens'][-1]:7d}  imbalance {share.imbalance:.3f}",
                flush=True,
            )
    return trace


def interval_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_summary(events, on_gpu: bool) -> dict:
    """Communication vs compute time of the profiled steps and the share of communication hidden under compute.

    GPU: device kernels (NCCL kernels are communication). CPU: gloo collectives run on host threads,
    compared with the ``aten::`` ops (which nest, so compute is their union); indicative only.
    """
    comm, compute = [], []
    for event in events:
        kernel = event.device_type == torch.autograd.DeviceType.CUDA
        if on_gpu != kernel:
            continue
        span = (event.time_range.start, event.time_range.end)
        name = event.name.lower()
        if any(m in name for m in COMM_KERNEL_MARKERS):
            comm.append(span)
        elif on_gpu or name.startswith("aten::"):
            compute.append(span)
    comm_u, compute_u = interval_union(comm), interval_union(compute)
    comm_us = sum(e - s for s, e in comm_u)
    hidden = overlap_length(comm_u, compute_u)
    return {
        "comm_ms": comm_us / 1e3,
        "compute_ms": sum(e - s for s, e in compute_u) / 1e3,
        "comm_overlapped_ms": hidden / 1e3,
        "comm_overlap_fraction": hidden / comm_us if comm_us else None,
    }


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # host RSS (KiB on Linux)


def run(args: argparse.Namespace) -> dict | None:
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_float32_matmul_precision("high")
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        data_dir = Path(args.data or dist_broadcast_str(tmp)) / ("" if args.data else "world")
        world_info = prepare_world(args, data_dir) if rank == 0 else None
        dist.barrier()
        schema = EventSchema.load(data_dir)
        model, optimizer, dims = build_parallel_model(args, schema, device)
        cfg = teacher_flavor(flavor_name(args.flavor))
        data_cfg = DataConfig(
            path=str(data_dir),
            max_len=args.max_history or cfg.max_len,
            batch_size=args.rows * dims.dp,
            token_budget=args.token_budget * dims.dp,
            num_workers=args.workers,
            seed=args.seed,
            pin_memory=device.type == "cuda",
        )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        trace = train_steps(model, optimizer, dims, data_cfg, args, device)
        profile = profile_steps(model, optimizer, dims, data_cfg, args, device) if args.profile else None
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        peak = peak_flops(device_name, PRECISIONS[args.precision]) if device.type == "cuda" else None
        mine = {
            "rank": rank,
            "peak_memory_gib": peak_memory_gib(device),
            "imbalance_mean": sum(trace["imbalance"]) / max(len(trace["imbalance"]), 1),
            **summarize(trace, args.warmup, peak),
        }
        ranks: list = [None] * world
        dist.all_gather_object(ranks, mine)
        if rank != 0:
            return None
        total = sum(r["steady_tokens_per_s"] for r in ranks)
        result = {
            "flavor": args.flavor,
            "world_size": world,
            "dims": dims.to_dict(),
            "backend": dist.get_backend(),
            "device_name": device_name,
            "torch": torch.__version__,
            "precision": args.precision,
            "token_budget_per_rank": args.token_budget,
            "shard_embeddings": args.shard_embeddings,
            "parameters": sum(p.numel() for p in model.parameters()),
            "world": world_info,
            "total_tokens_per_s": total,
            "mean_mfu": _mean(r.get("steady_mfu") for r in ranks),
            "max_peak_memory_gib": max(r["peak_memory_gib"] for r in ranks),
            "ranks": ranks,
            "profile": profile,
            "args": vars(args),
        }
        if args.baseline_json:
            baseline = json.loads(Path(args.baseline_json).read_text())
            result["scaling_efficiency"] = total / (world * baseline["total_tokens_per_s"])
        return result


def profile_steps(model, optimizer, dims, data_cfg, args, device) -> dict | None:
    """``--profile-steps`` more steps under torch.profiler; rank 0's communication/compute summary."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    steps = argparse.Namespace(**{**vars(args), "steps": args.profile_steps})
    with profile(activities=activities) as prof:
        train_steps(model, optimizer, dims, data_cfg, steps, device)
    if dist.get_rank() != 0:
        return None
    summary = overlap_summary(prof.events(), on_gpu=device.type == "cuda")
    summary["steps"] = args.profile_steps
    if args.trace_out:
        prof.export_chrome_trace(args.trace_out)
    return summary


def dist_broadcast_str(value: str) -> str:
    """Rank 0's ``value`` on every rank (the temporary world directory must be one directory)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="large", help=f"teacher flavor: {sorted(TEACHER_FLAVORS)} (or teacher-<name>)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the steady state")
    parser.add_argument("--rows", type=int, default=4096, help="row cap per data-parallel rank")
    parser.add_argument("--token-budget", type=int, default=16384, help="history tokens per data-parallel rank")
    parser.add_argument("--max-history", type=int, default=0, help="history truncation (0: the flavor's max_len)")
    parser.add_argument("--precision", default="bf16", choices=sorted(PRECISIONS))
    parser.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (dp_shard is the rest)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--shard-embeddings", action="store_true", help="torchrec table sharding (needs fbgemm-gpu)")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--attention-weight", type=float, default=1.0, help="balance: attention cost per (q, k) pair")
    parser.add_argument("--profile", action="store_true", help="profile --profile-steps more steps")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--trace-out", default=None, help="rank 0's chrome trace of the profiled steps")
    parser.add_argument("--baseline-json", default=None, help="a world-1 result: report scaling efficiency")
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")
    parser.add_argument("--data", default=None, help="world dir: reused if it holds a dataset, else generated")
    parser.add_argument("--examples", type=int, default=80_000, help="impressions of a generated world")
    parser.add_argument("--users", type=int, default=0, help="users of a generated world (0: examples / 10)")
    parser.add_argument("--world-max-history", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    if result is not None:
        if args.json:
            atomic_write_text(Path(args.json), json.dumps(result, indent=2))
        summary = {k: v for k, v in result.items() if k not in ("args", "world")}
        summary["ranks"] = [{k: v for k, v in r.items() if not k.startswith("steady_no_outliers")} for r in result["ranks"]]
        print(json.dumps(summary, indent=2), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
