"""``ParallelDims`` validation and inference, its MLflow dict, the named mesh (world size 1 in-process),
and the configs' clear errors. Multi-rank meshes are exercised in ``test_parallel_training``."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from foundation.parallel import EmbeddingShardingConfig, FSDPConfig, ParallelConfig, ParallelDims
from foundation.parallel.parallelize import check_supported


def test_infers_the_one_minus_one_degree():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == (2, 2, 1, 2)
    assert dims.dp == 4 and dims.hsdp
    assert dims.emb_shard == 8 and dims.emb_replicate == 1


def test_to_dict_has_resolved_degrees_only():
    out = ParallelDims(dp_shard=-1, cp=2, emb_shard=2, world_size=4).to_dict()
    assert out == {
        "dp_replicate": 1,
        "dp_shard": 2,
        "cp": 2,
        "tp": 1,
        "emb_shard": 2,
        "world_size": 4,
        "dp": 2,
        "emb_replicate": 2,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp_shard": -1, "tp": -1, "world_size": 4}, "at most one"),
        ({"dp_shard": 2, "tp": 2, "world_size": 8}, "multiply to 4"),
        ({"dp_shard": -1, "tp": 3, "world_size": 4}, "not divisible"),
        ({"dp_shard": 0, "world_size": 1}, "positive or -1"),
        ({"dp_shard": -2, "world_size": 1}, "positive or -1"),
        ({"dp_shard": -1, "emb_shard": 3, "world_size": 4}, "emb_shard must divide"),
        ({"world_size": 0}, "world_size must be positive"),
    ],
)
def test_bad_degrees_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_unsupported_combinations_are_rejected_before_any_collective():
    with pytest.raises(ValueError, match=r"2-D embedding sharding .* DMPCollection asserts a CUDA or MTIA"):
        check_supported(ParallelDims(dp_shard=-1, emb_shard=1, world_size=2), ParallelConfig())
    with pytest.raises(ValueError, match="fsdp=True"):
        check_supported(ParallelDims(dp_shard=-1, world_size=2), ParallelConfig(fsdp=False))
    with pytest.raises(ValueError, match="fsdp=True"):
        check_supported(ParallelDims(dp_shard=1, cp=2, world_size=2), ParallelConfig(fsdp=False))
    check_supported(ParallelDims(dp_shard=1, cp=2, world_size=2), ParallelConfig())
    with pytest.raises(ValueError, match="cp_attention must be one of"):
        check_supported(ParallelDims(dp_shard=1, cp=2, world_size=2), ParallelConfig(cp_attention="ring"))


def test_torchrec_dmp_collection_still_refuses_cpu():
    """Why 2-D embedding sharding is refused: torchrec's DMPCollection asserts CUDA/MTIA before anything else.

    When a torchrec upgrade lifts that, this test fails and the refusal in ``check_supported`` can go.
    """
    from torchrec.distributed.model_parallel import DMPCollection

    with pytest.raises(AssertionError, match="DMPCollection only supports CUDA or MTIA"):
        DMPCollection(
            module=torch.nn.Linear(1, 1),
            device=torch.device("cpu"),
            plan=None,
            world_size=2,
            sharding_group_size=1,
            global_pg=None,
        )


def test_config_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match="unknown embedding sharding type"):
        EmbeddingShardingConfig(sharding_types=("diagonal",))
    with pytest.raises(ValueError, match="unknown embedding sharding type"):
        EmbeddingShardingConfig(table_sharding_types={"t": ("diagonal",)})
    with pytest.raises(ValueError, match="unknown sparse optimizer"):
        EmbeddingShardingConfig(optimizer="lamb2")
    with pytest.raises(ValueError, match="FSDP dtype"):
        FSDPConfig(param_dtype="fp8")


def test_mixed_precision_policy_computes_in_bf16_and_reduces_in_fp32():
    policy = FSDPConfig(param_dtype="bf16").mixed_precision()
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert FSDPConfig().mixed_precision().param_dtype is None  # fp32: parameters used as stored


@pytest.fixture
def single_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_mesh_has_every_named_dim_and_flattened_views(single_rank_group):
    dims = ParallelDims(world_size=1)
    mesh = dims.build_mesh("cpu")
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "tp")
    assert dims.mesh_for("dp_replicate", "dp_shard").mesh_dim_names == ("dp_replicate", "dp_shard")
    assert dims.mesh_for("dp").mesh_dim_names == ("dp",)
    assert dims.mesh_for("dp_shard_cp").size() == 1
    assert dims.fsdp_mesh().mesh_dim_names == ("dp_shard",)
    assert dims.dp_rank() == 0
    with pytest.raises(KeyError, match="unknown mesh dim"):
        dims.mesh_for("ep")


def test_mesh_needs_a_process_group_of_the_resolved_size(single_rank_group):
    with pytest.raises(ValueError, match="world size 2"):
        ParallelDims(dp_shard=2, world_size=2).build_mesh("cpu")


def test_mesh_before_build_is_a_clear_error():
    with pytest.raises(RuntimeError, match="build_mesh"):
        ParallelDims().mesh_for("dp")


def test_sparse_tables_get_dense_gradients_under_a_parallel_plan(single_rank_group):
    """``sparse_tables`` (on in the ``large`` flavor) is a single-device optimisation: a model built with it and
    parallelized with its tables unsharded (FSDP over them, torch's AdamW) trains, its tables' gradients dense."""
    from foundation.model.deferred_rows import sparse_tables
    from foundation.model.teacher import build_teacher
    from foundation.parallel import build_dense_optimizer, parallelize_teacher
    from tests.teacher_batches import CTR_SCHEMA, make_batch, tiny_config

    torch.manual_seed(0)
    model = build_teacher(tiny_config(dropout=0.0, sparse_tables=True), CTR_SCHEMA)
    assert sparse_tables(model)
    dims = ParallelDims(world_size=1)
    dims.build_mesh("cpu")
    cfg = ParallelConfig(shard_embeddings=False)
    parallelize_teacher(model, dims, cfg)
    assert not sparse_tables(model)
    optimizer = build_dense_optimizer(model, cfg)
    batch = make_batch(CTR_SCHEMA, [0, 3, 5, 2])
    losses = []
    for _ in range(3):
        loss = model.loss(batch, model(batch))["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
