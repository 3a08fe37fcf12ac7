"""Parallel training on real processes (gloo, CPU) equals single-process training.

One spawn of ``WORLD`` processes (1, 2, 4 and 8) runs every case of that world size in turn on one
process group (start-up dominates on a small CPU). Each case builds the same seeded model, applies ``parallelize_teacher``, trains
``STEPS`` steps with each rank reading its slice of the global batch, and returns the per-step loss
(mean over ranks) and the final whole parameters. The reference trains the same seeded model in
this process on the mean of the per-slice losses, which is what data parallelism computes.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from foundation.data.batch import take_rows
from foundation.model.baseline import DLRMBaseline, DLRMConfig
from foundation.model.teacher import build_teacher
from foundation.parallel import (
    EmbeddingShardingConfig,
    FSDPConfig,
    ParallelConfig,
    ParallelDims,
    build_dense_optimizer,
    parallelize_teacher,
)
from foundation.parallel import checkpoint as checkpoint_module
from foundation.parallel.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from foundation.parallel.context import unwrapped
from foundation.parallel.embeddings import SHARDING_TYPES, apply_sparse_optimizer, summarize_plan
from foundation.parallel.state import export_single_file, gather_full_state_dict
from foundation.parallel.tensor import find_linear_pairs
from tests.teacher_batches import CTR_SCHEMA, make_batch, tiny_config

STEPS = 20
SAVE_AT = 3
GLOBAL_ROWS = 12
SPAWN_TIMEOUT_S = 240
# Float32 sums in another order (reduce-scatter, all-to-all) differ by ~1e-7 per step.
TOLERANCE = 1e-5
# Parameters after 20 Adam steps: Adam divides by sqrt(v), so on a parameter whose gradient is nearly zero
# that order difference is magnified (measured: 1e-5 to 4e-5 on single elements of the teacher's expert
# input, varying from run to run with the reduction order; every other element stays within 1e-5).
PARAM_TOLERANCE = 1e-4
# bf16 keeps 8 mantissa bits: activations differ by ~1e-3 relative; the loss stays within this.
BF16_TOLERANCE = 3e-3
# The teacher is deeper (HSTU blocks, interleaved arches, experts): over 20 Adam steps its bf16 losses
# drift from fp32 (measured: up to 0.7% without the pooled-history and dot features, 1.6% with the
# pooled tokens, 2.6% with both, the dots summed in float32), so they are held to 3% relative.
BF16_TEACHER_REL_TOLERANCE = 3e-2


def sparse(
    types: tuple[str, ...], optimizer: str = "rowwise_adagrad", **per_table: tuple[str, ...]
) -> ParallelConfig:
    """Sharding types for every table (and per-table overrides), a fused sparse optimizer, dense AdamW.

    Some gradients are zero in exact arithmetic (a key bias under softmax) and float noise
    (~1e-9) otherwise; Adam would turn that noise into steps of size ``lr`` whose sign depends on
    summation order. ``eps=1e-6`` keeps such steps ~1e-3·lr, far below the tolerance.
    """
    tables = EmbeddingShardingConfig(
        sharding_types=types, table_sharding_types=per_table or None, optimizer=optimizer, lr=0.05
    )
    return ParallelConfig(embeddings=tables, lr=0.01, eps=1e-6)


@dataclasses.dataclass(frozen=True)
class Case:
    """One parallel run: ``world`` ranks, a model, ``ParallelDims`` degrees and a ``ParallelConfig``.

    ``resume_from`` names a case whose latest complete checkpoint this one loads before training
    the remaining steps. ``killed_in_save`` makes rank 1 die inside the save at ``SAVE_AT``,
    after writing its shards and before the checkpoint is published (the run yields no results).
    """

    world: int
    kind: str
    degrees: dict
    cfg: ParallelConfig
    resume_from: str | None = None
    export: bool = False
    killed_in_save: bool = False

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many distinct slices of the global batch the ranks read."""
        return ParallelDims(world_size=self.world, **self.degrees).dp

    @property
    def first_step(self) -> int:
        """The step training starts at: the step of the checkpoint it resumes (SAVE_AT, or 1 if that save was killed)."""
        if self.resume_from is None:
            return 0
        return 1 if CASES[self.resume_from].killed_in_save else SAVE_AT

    def step_slices(self) -> list[int]:
        """How many slices the global batch of each trained step is cut into (the reference's view)."""
        if self.resume_from is None:
            return [self.dp] * STEPS
        first = self.first_step
        return [CASES[self.resume_from].dp] * first + [self.dp] * (STEPS - first)


# The checkpointed case uses exact Adagrad: row-wise Adagrad's state under column-wise sharding
# is per row shard and cannot move to another layout.
MIXED_4 = sparse(("table_wise",), "adagrad", t_item=("row_wise",), t_user_country=("column_wise",))
CASES = {
    "dlrm_table_wise_fsdp": Case(2, "dlrm", {}, sparse(("table_wise",))),
    # Row-wise Adagrad keeps one state per row *shard* under column-wise sharding: exact Adagrad.
    "dlrm_column_wise_fsdp": Case(2, "dlrm", {}, sparse(("column_wise",), "adagrad")),
    # bf16 compute, fp32 reduce: losses follow the fp32 reference to BF16_TOLERANCE.
    "dlrm_table_wise_fsdp_bf16": Case(
        2,
        "dlrm",
        {},
        dataclasses.replace(
            sparse(("table_wise",)), fsdp_options=FSDPConfig(param_dtype="bf16", shard_children=True)
        ),
    ),
    # The teacher's dense children each get their own FSDP unit, so every parameter is cast to bf16
    # around the forward that uses it (the teacher calls no module method outside forward).
    "teacher_table_wise_fsdp_bf16": Case(
        2,
        "teacher",
        {},
        dataclasses.replace(
            sparse(("table_wise",)), fsdp_options=FSDPConfig(param_dtype="bf16", shard_children=True)
        ),
    ),
    # Tensor parallel alone (dp = 1: both ranks read the whole batch), tables table-wise.
    "dlrm_table_wise_tp": Case(2, "dlrm", {"dp_shard": 1, "tp": 2}, sparse(("table_wise",))),
    "teacher_table_wise_tp": Case(2, "teacher", {"dp_shard": 1, "tp": 2}, sparse(("table_wise",))),
    "dlrm_fsdp_only": Case(2, "dlrm", {}, dataclasses.replace(sparse(()), shard_embeddings=False)),
    # Also exports one safetensors file that a single-device teacher loads.
    "teacher_table_wise_fsdp": Case(2, "teacher", {}, sparse(("table_wise",)), export=True),
    # Row-wise EBCs need CUDA in torchrec; the teacher's item table is an EC, row-wise on CPU too.
    "teacher_row_wise_hsdp": Case(
        2, "teacher", {"dp_replicate": 2, "dp_shard": 1}, sparse(("table_wise",), t_item=("row_wise",))
    ),
    "teacher_column_wise_fsdp": Case(2, "teacher", {}, sparse(("column_wise",), "adagrad")),
    "teacher_table_wise_fsdp_activation_checkpointing": Case(
        2, "teacher", {}, dataclasses.replace(sparse(("table_wise",)), activation_checkpointing=True)
    ),
    # HSDP 2 x 2 with tables sharded over all 4 ranks, mixing all three sharding types; saves a
    # DCP checkpoint after SAVE_AT steps.
    "teacher_mixed_hsdp_2x2": Case(4, "teacher", {"dp_replicate": 2, "dp_shard": 2}, MIXED_4),
    # Three dimensions at once: tables over 4 ranks x FSDP over dp_shard=2 x TP over tp=2.
    "dlrm_table_wise_fsdp2_tp2": Case(4, "dlrm", {"dp_shard": 2, "tp": 2}, sparse(("table_wise",))),
    # Context parallel: each sequence's tokens zigzag-split over cp ranks, K/V all-gathered; ragged
    # histories (0 and 1 events included), CLS + candidate targets (num_targets), time and position bias.
    "teacher_cp2": Case(2, "teacher", {"dp_shard": 1, "cp": 2}, sparse(("table_wise",))),
    # Without interleaving the sequence stays sharded across all blocks (one region); checkpointed blocks
    # recompute their K/V all-gather in backward.
    "teacher_flat_cp2_activation_checkpointing": Case(
        2,
        "teacher_flat",
        {"dp_shard": 1, "cp": 2},
        dataclasses.replace(sparse(("table_wise",)), activation_checkpointing=True),
    ),
    # The generative next-item loss, with the item table sharded on one rank and under CP: the table
    # must take one optimiser step per training step, and every cp rank scores the gathered sequences'
    # positions against the same sampled negatives as the single process.
    "teacher_generative_w1": Case(1, "teacher_generative", {}, sparse(("table_wise",))),
    "teacher_generative_cp2": Case(2, "teacher_generative", {"dp_shard": 1, "cp": 2}, sparse(("table_wise",))),
    # Head-parallel CP attention: all-to-all to one head per rank, whole-sequence attention per head.
    "teacher_cp2_heads": Case(
        2, "teacher", {"dp_shard": 1, "cp": 2}, dataclasses.replace(sparse(("table_wise",)), cp_attention="heads")
    ),
    "teacher_cp4": Case(
        4, "teacher", {"dp_shard": 1, "cp": 4}, sparse(("table_wise",), t_item=("row_wise",))
    ),
    "teacher_fsdp2_cp2": Case(4, "teacher", {"dp_shard": 2, "cp": 2}, sparse(("table_wise",))),
    "teacher_hsdp2_cp2": Case(
        4, "teacher", {"dp_replicate": 2, "dp_shard": 1, "cp": 2}, sparse(("table_wise",))
    ),
    # Four dimensions: tables sharded over 8 ranks (table- and row-wise) x FSDP 2 x CP 2 x TP 2.
    "teacher_tables_fsdp2_cp2_tp2": Case(
        8, "teacher", {"dp_shard": 2, "cp": 2, "tp": 2}, sparse(("table_wise",), t_item=("row_wise",))
    ),
    # Resume that checkpoint on 2 ranks (FSDP, every table table-wise) and on 1 rank.
    "teacher_resume_4_to_2": Case(
        2, "teacher", {}, sparse(("table_wise",), "adagrad"), resume_from="teacher_mixed_hsdp_2x2"
    ),
    "teacher_resume_4_to_1": Case(
        1, "teacher", {}, sparse(("table_wise",), "adagrad"), resume_from="teacher_mixed_hsdp_2x2"
    ),
    # Kill test: a rank dies mid-save at SAVE_AT; the resumed run (another world size) must start
    # from the last complete checkpoint (step 1) and still match uninterrupted training.
    "dlrm_killed_mid_save": Case(2, "dlrm", {}, sparse(("table_wise",)), killed_in_save=True),
    "dlrm_resume_after_kill": Case(
        1, "dlrm", {}, sparse(("table_wise",)), resume_from="dlrm_killed_mid_save"
    ),
}
SAVES = {c.resume_from for c in CASES.values() if c.resume_from}
KILLED_EXIT_CODE = 17
STEP_SEED = 1000


def build_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "dlrm":
        cfg = DLRMConfig(embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 8), repr_dim=8)
        return DLRMBaseline(cfg, CTR_SCHEMA, {"click": 1.0, "conversion": 1.0})
    cfg = tiny_config(dropout=0.0, interleave=kind != "teacher_flat", generative=kind == "teacher_generative")
    return build_teacher(cfg, CTR_SCHEMA)


def global_batches():
    """``STEPS`` global batches of ``GLOBAL_ROWS`` rows with ragged histories (0 to 8 events)."""
    return [
        make_batch(CTR_SCHEMA, [(3 * step + 5 * r) % 9 for r in range(GLOBAL_ROWS)], seed=step)
        for step in range(STEPS)
    ]


def slices_of(batch, num_slices: int) -> list:
    """The global batch cut into ``num_slices`` contiguous slices (one per data-parallel rank)."""
    rows = GLOBAL_ROWS // num_slices
    return [take_rows(batch, torch.arange(r * rows, (r + 1) * rows)) for r in range(num_slices)]


def train_reference(case: Case) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process: each step on the mean of the per-slice losses, as data parallelism computes it."""
    model = build_model(case.kind)
    if case.cfg.shard_embeddings:
        apply_sparse_optimizer(model, case.cfg.embeddings)
    optimizer = build_dense_optimizer(model, case.cfg)
    losses = []
    for step, (batch, num_slices) in enumerate(zip(global_batches(), case.step_slices(), strict=True)):
        torch.manual_seed(STEP_SEED + step)  # the sampled negatives of the generative loss
        loss = sum(model.loss(b, model(b))["loss"] for b in slices_of(batch, num_slices)) / num_slices
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_parallel(name: str, checkpoints: Path) -> tuple[list[float], dict[str, torch.Tensor], dict, float]:
    """This rank's share of the case, through ``parallelize_teacher``.

    Returns the per-step losses (mean over ranks) of the steps it trained, the whole final
    parameters, the table placement and the share of the sequence tokens its first HSTU block saw.
    """
    case = CASES[name]
    world = dist.get_world_size()
    dims = ParallelDims(world_size=world, **case.degrees)
    dims.build_mesh("cpu")
    model = build_model(case.kind)
    # TP has something to shard: MLP pairs (DLRM bottom/top, the teacher's Wukong FM MLPs).
    assert bool(find_linear_pairs(model)) or dims.tp == 1
    plan = parallelize_teacher(model, dims, case.cfg)
    token_counts = count_block_tokens(model) if case.kind != "dlrm" else []
    wrapped = any(isinstance(m, CheckpointWrapper) for m in model.modules())
    assert wrapped == case.cfg.activation_checkpointing
    optimizer = build_dense_optimizer(model, case.cfg)
    first = 0
    if case.resume_from:
        first = load_checkpoint(latest_checkpoint(checkpoints / case.resume_from), model, optimizer)
        assert first == case.first_step
    losses = []
    for step, batch in enumerate(global_batches()[first:], start=first):
        # An earlier checkpoint too: resuming must pick the latest complete one.
        if name in SAVES and step in (1, SAVE_AT):
            if case.killed_in_save and step == SAVE_AT:
                die_after_writing_shards(rank=1)
            save_checkpoint(checkpoints / name, model, optimizer, step)
        part = slices_of(batch, dims.dp)[dims.dp_rank()]
        # Every rank draws the reference's negatives (exact only with one data-parallel slice).
        torch.manual_seed(STEP_SEED + step)
        loss = model.loss(part, model(part))["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    if case.export:
        export_single_file(model, checkpoints / f"{name}.safetensors")
    held, whole = (sum(c) for c in zip(*token_counts, strict=True)) if token_counts else (1, 1)
    return losses, gather_full_state_dict(model), summarize_plan(plan) if plan else {}, held / whole


def count_block_tokens(model: torch.nn.Module) -> list[tuple[int, int]]:
    """Records ``(tokens this rank's first HSTU block computes, tokens of the whole batch)`` per forward.

    Registered after ``parallelize_teacher``, on the block inside any checkpoint wrapper, so it sees the
    block's input as context parallelism hands it over.
    """
    counts = []
    block = unwrapped(model.blocks[0])
    block.register_forward_pre_hook(lambda _, args: counts.append((args[0].shape[0], int(args[1][-1]))))
    return counts


def die_after_writing_shards(rank: int) -> None:
    """Make ``rank`` exit abruptly once DCP has written its shards, before the checkpoint is published."""
    write_shards = checkpoint_module.dcp.save

    def save_then_die(*args, **kwargs):
        write_shards(*args, **kwargs)
        if dist.get_rank() == rank:
            os._exit(KILLED_EXIT_CODE)

    checkpoint_module.dcp.save = save_then_die


def worker(rank: int, world: int, port: int, cases: list[str], out_dir: str, checkpoints: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {name: train_parallel(name, Path(checkpoints)) for name in cases}
        if rank == 0:
            torch.save(results, Path(out_dir) / "results.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, cases: list[str], checkpoints: Path) -> dict:
    """Run ``worker`` on ``world`` processes; fail (never hang) past ``SPAWN_TIMEOUT_S``.

    Cases that kill a rank get no results: the first process to exit abnormally makes ``join``
    terminate the others, and ``{}`` is returned when that was the planned kill.
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            worker,
            args=(world, free_port(), cases, out_dir, str(checkpoints)),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        try:
            while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    pytest.fail(f"parallel workers did not finish within {SPAWN_TIMEOUT_S}s")
        except mp.ProcessExitedException as exited:
            if not all(CASES[n].killed_in_save for n in cases) or exited.exit_code != KILLED_EXIT_CODE:
                raise
            return {}
        return torch.load(Path(out_dir) / "results.pt", weights_only=True)


def assert_plan_follows_config(plan: dict, cfg: ParallelConfig, world: int) -> None:
    """Each table got the type asked for; row- and column-wise tables really span several ranks."""
    if not cfg.shard_embeddings:
        assert plan == {}
        return
    per_table = cfg.embeddings.table_sharding_types or {}
    for table, placed in plan.items():
        wanted = per_table.get(table, cfg.embeddings.sharding_types)
        assert placed["sharding_type"] in [SHARDING_TYPES[t].value for t in wanted], (table, placed)
        if placed["sharding_type"] in ("row_wise", "column_wise"):
            assert len(placed["ranks"]) > 1, (table, placed)
        assert set(placed["ranks"]) <= set(range(world))


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    """DCP checkpoints and single-file exports written by the workers."""
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def parallel_results(checkpoint_dir):
    """Case name -> (losses, params, plan); one spawn per world size, run on first use, after the
    spawns whose checkpoints its cases resume from."""
    cache: dict[int, dict] = {}

    killed: set[str] = set()

    def run_killed(name: str) -> None:
        if name not in killed:
            assert spawn(CASES[name].world, [name], checkpoint_dir) == {}
            killed.add(name)

    def run_world(world: int) -> dict:
        if world not in cache:
            names = [n for n, c in CASES.items() if c.world == world and not c.killed_in_save]
            for source in {CASES[n].resume_from for n in names} - {None}:
                if CASES[source].killed_in_save:
                    run_killed(source)
                else:
                    run_world(CASES[source].world)
            cache[world] = spawn(world, names, checkpoint_dir)
        return cache[world]

    return lambda name: run_world(CASES[name].world)[name]


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.killed_in_save])
def test_parallel_training_matches_single_process(name, parallel_results):
    """Losses of every trained step and all final parameters (tables included) match the reference.

    Resume cases check the steps after the checkpoint: state saved at one layout and world size,
    loaded at another, continues exactly.
    """
    case = CASES[name]
    torch.set_num_threads(1)
    ref_losses, ref_params = train_reference(case)
    losses, params, plan, token_share = parallel_results(name)
    cp = ParallelDims(world_size=case.world, **case.degrees).cp
    if case.kind != "dlrm":
        # Context parallel ranks really compute only their zigzag share of the sequence tokens.
        assert (token_share < 1) == (cp > 1), token_share
    assert_plan_follows_config(plan, case.cfg, case.world)
    assert len(losses) == STEPS - case.first_step
    if case.cfg.fsdp_options.param_dtype == "bf16":
        tolerance = {"rel": BF16_TEACHER_REL_TOLERANCE} if case.kind == "teacher" else {"abs": BF16_TOLERANCE}
        assert losses == pytest.approx(ref_losses, **tolerance)
        assert losses != pytest.approx(ref_losses, abs=1e-6), "bf16 compute should not be bit-identical"
        return
    assert losses == pytest.approx(ref_losses[STEPS - len(losses) :], abs=TOLERANCE)
    assert set(params) == set(ref_params)
    for key, ref in ref_params.items():
        torch.testing.assert_close(params[key], ref, atol=PARAM_TOLERANCE, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    assert ref_losses[-1] != ref_losses[0], "training should move the loss"


def test_single_file_export_loads_into_a_single_device_model(parallel_results, checkpoint_dir):
    """The safetensors export of a sharded, FSDP-wrapped teacher is the whole model, loadable strictly."""
    name = next(n for n, c in CASES.items() if c.export)
    _, params, _, _ = parallel_results(name)
    model = build_model(CASES[name].kind)
    model.load_state_dict(load_file(str(checkpoint_dir / f"{name}.safetensors")), strict=True)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, params[key], atol=0, rtol=0)
