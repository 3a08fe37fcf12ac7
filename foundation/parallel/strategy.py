"""``GemParallelStrategy``: the Lightning strategy that runs ``gem train`` on any number of processes.

It is Lightning's ``ModelParallelStrategy`` with the parallelism of :mod:`foundation.parallel`:

- **process group**: Lightning's cluster environments (torchrun / torchelastic, SLURM, or one local
  process) give rank and world size; ``gloo`` on CPU, ``nccl`` on GPUs (``parallel.backend``).
- **mesh**: :class:`~foundation.parallel.dims.ParallelDims` from the ``parallel.*`` settings,
  validated against the world size (errors name the field).
- **model**: :func:`~foundation.parallel.parallelize.parallelize_teacher` on ``RecModule.model``
  before the optimizers exist; the optimizers that ``configure_optimizers`` returns then lose the
  embedding tables (their fused sparse optimizer runs in backward).
- **data**: with ``parallel.balance`` every data-parallel rank reads the same global batch and keeps
  the rows :func:`~foundation.parallel.balance.rank_share` gives it (even attention work); its
  per-rank mean loss is weighted (:attr:`GemParallelStrategy.loss_weight`, read by the module's training
  step) so that the gradient reduction yields the global batch's row mean.
  Without it each rank reads its own row groups (``EventStream`` rank/world = dp rank/degree).
  ``parallel/imbalance`` (heaviest rank / mean work) and ``train/global_loss`` are logged per step.
- **checkpoints**: ``X.ckpt`` becomes DCP step directories under ``X.dcp/`` (sharded tables, fused
  and dense optimizer state, plus Lightning's loops, callbacks, data position and RNG in
  ``extra.pt``), which reshard on load at another world size; :meth:`export_single_file_checkpoint`
  writes a plain single-file Lightning checkpoint (whole tensors) that ``gem eval`` and the transfer
  stage read through :func:`gem.module.load_module`.
- **MLflow**: only rank 0 has a run, tagged with the resolved degrees (``gem.parallel.dp_shard``, ...);
  the other nodes' local rank 0 log system metrics into it under their own ``node_id``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.tensor import DTensor

from foundation.config import ConfigError
from foundation.data.batch import JaggedBatch, take_rows
from foundation.data.io import atomic_path
from foundation.parallel.balance import BalanceConfig, rank_share, row_work
from foundation.parallel.checkpoint import (
    is_complete,
    latest_checkpoint,
    load_checkpoint,
    load_extra,
    prune_checkpoints,
    save_checkpoint,
)
from foundation.parallel.context import CP_ATTENTION
from foundation.parallel.dims import ParallelDims
from foundation.parallel.embeddings import EmbeddingShardingConfig
from foundation.parallel.fsdp import FSDPConfig
from foundation.parallel.parallelize import ParallelConfig, dense_parameters, parallelize_teacher
from foundation.parallel.settings import ParallelSettings
from foundation.parallel.state import gather_full_state_dict

DCP_SUFFIX = ".dcp"


def build_parallel_config(settings: ParallelSettings) -> ParallelConfig:
    """The :class:`ParallelConfig` that ``parallel.*`` describes; a bad value raises ``ConfigError`` naming its field."""
    try:
        tables = EmbeddingShardingConfig(
            sharding_types=tuple(settings.sharding_types), optimizer=settings.sparse_optimizer, lr=settings.sparse_lr
        )
    except ValueError as exc:
        raise ConfigError(f"parallel.sharding_types / parallel.sparse_optimizer: {exc}") from exc
    try:
        fsdp_options = FSDPConfig(param_dtype=settings.param_dtype)
    except ValueError as exc:
        raise ConfigError(f"parallel.param_dtype: {exc}") from exc
    if settings.cp_attention not in CP_ATTENTION:
        raise ConfigError(f"parallel.cp_attention={settings.cp_attention!r}: must be one of {CP_ATTENTION}")
    return ParallelConfig(
        shard_embeddings=settings.shard_embeddings,
        embeddings=tables,
        fsdp=settings.fsdp,
        fsdp_options=fsdp_options,
        activation_checkpointing=settings.activation_checkpointing,
        compile=settings.compile,
        cp_attention=settings.cp_attention,
    )


def build_dims(settings: ParallelSettings, world_size: int) -> ParallelDims:
    """Validated degrees for ``world_size`` ranks (``-1`` inferred)."""
    settings.validate(world_size)
    return ParallelDims(
        dp_replicate=settings.dp_replicate,
        dp_shard=settings.dp_shard,
        cp=settings.cp,
        tp=settings.tp,
        emb_shard=settings.emb_shard,
        world_size=world_size,
    )


def dcp_root(path: str | Path) -> Path:
    """Where the DCP step directories of Lightning checkpoint path ``X.ckpt`` live: ``X.dcp/``."""
    return Path(path).with_suffix(DCP_SUFFIX)


def has_distributed_checkpoint(path: str | Path) -> bool:
    """True when ``X.dcp/`` beside checkpoint path ``X.ckpt`` holds a complete step checkpoint."""
    return latest_checkpoint(dcp_root(path)) is not None


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete DCP step directory given either itself or a Lightning checkpoint path ``X.ckpt``."""
    path = Path(path)
    if is_complete(path):
        return path
    latest = latest_checkpoint(dcp_root(path))
    if latest is None:
        raise FileNotFoundError(
            f"{path}: no distributed checkpoint under {dcp_root(path)} (a single-process last.ckpt cannot be "
            "resumed with parallel.enabled=true; start afresh with --no-resume)"
        )
    return latest


def node_rank() -> int:
    """This host's index among the job's nodes, from torchrun (``GROUP_RANK``), Lightning or SLURM."""
    for var in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def node_id() -> str:
    """The ``node_id`` MLflow system metrics carry (``node0``, ``node1``, ...)."""
    return f"node{node_rank()}"


def launch_world() -> tuple[int, int]:
    """``(devices per node, nodes)`` of the launching job: torchrun's / SLURM's variables, else one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", world)))
    if world % local:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
    return local, world // local


def restart_safe_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun's agent store, a client of it with keys prefixed by the restart attempt; else None.

    After ``--max-restarts`` restarts the workers, the agent's store still holds the previous attempt's
    keys (the gloo peers' addresses among them): a fast rank would read a dead peer's address and fail
    to connect. A per-attempt prefix makes every attempt start from an empty key space.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"gem/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", client)


def clip_grad_norm_across_meshes(parameters: list[torch.Tensor], max_norm: float) -> float:
    """``clip_grad_norm_`` for gradients that are plain tensors or DTensors on different meshes; returns the norm.

    Gradients are grouped by (mesh, placements); each group's norm is made whole (one collective per
    group), the groups' norms are combined, and every gradient is scaled by ``min(1, max_norm / norm)``
    (the scale of ``torch.nn.utils.clip_grad_norm_``).
    """
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    squares = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    if not squares:
        return 0.0
    total = float(torch.stack(squares).sum().sqrt())
    scale = min(1.0, max_norm / (total + 1e-6))
    if scale < 1.0:
        for grads in groups.values():
            torch._foreach_mul_(grads, scale)
    return total


class GemParallelStrategy(ModelParallelStrategy):
    """Lightning strategy applying ``parallel.*`` (see the module docstring); one process or many."""

    def __init__(self, settings: ParallelSettings) -> None:
        super().__init__(save_distributed_checkpoint=True, process_group_backend=settings.backend or None)
        # Fail before the process group waits for peers; setup_environment checks again with its world.
        settings.validate(int(os.environ.get("WORLD_SIZE", "1")))
        self.settings = settings
        self.parallel_config = build_parallel_config(settings)
        self.balance = BalanceConfig(attention_weight=settings.attention_weight)
        self.dims: ParallelDims | None = None
        self.loss_weight = 1.0
        self.imbalance = 1.0
        self.system_metrics = None

    # -- process group, mesh, model ----------------------------------------------------------------

    def _setup_distributed(self) -> None:
        """Lightning's process-group set-up, on a :func:`restart_safe_store` under torchrun."""
        ParallelStrategy.setup_environment(self)
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        kwargs["device_id"] = self.root_device if self.root_device.type != "cpu" else None
        store = restart_safe_store(self._timeout)
        if store is not None:
            kwargs["store"] = store
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    def setup_environment(self) -> None:
        self._setup_distributed()
        self.dims = build_dims(self.settings, self.world_size)
        self.dims.build_mesh(self.root_device.type)
        self._device_mesh = self.dims.mesh
        self.lightning_module._device_mesh = self._device_mesh
        self.share_mlflow_run()

    def share_mlflow_run(self) -> None:
        """Tag rank 0's MLflow run with the resolved degrees (``gem.parallel.*``: tags, since a resumed job
        may have another world size) and share its id: the first process of every other node logs its
        system metrics there."""
        logger = self.lightning_module.trainer.logger if self.lightning_module._trainer is not None else None
        run_id = getattr(logger, "run_id", None) if self.global_rank == 0 else None
        if run_id:
            for key, value in self.dims.to_dict().items():
                logger.experiment.set_tag(run_id, f"gem.parallel.{key}", str(value))
        run_id = self.broadcast(run_id)
        if run_id and self.local_rank == 0 and self.global_rank != 0:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.system_metrics = SystemMetricsMonitor(run_id, sampling_interval=2, node_id=node_id())
            self.system_metrics.start()

    @property
    def data_rank_world(self) -> tuple[int, int]:
        """``(rank, world)`` the train stream is read as: one global stream with ``balance``, else the dp rank."""
        if self.settings.balance:
            return 0, 1
        return self.dims.dp_rank(), self.dims.dp

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.dims.dp, "rank": self.dims.dp_rank()}

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        self.model_to_device()
        parallelize_teacher(self.lightning_module.model, self.dims, self.parallel_config, device=self.root_device)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Lightning clips through the precision plugin with one clip_grad_norm_ over all parameters,
        # which cannot stack the norms of DTensors on different meshes (TP x FSDP beside FSDP only).
        self.precision_plugin.clip_grad_by_norm = self.clip_grad_by_norm
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_across_meshes(params, clip_val)

    def setup_optimizers(self, trainer) -> None:
        """``configure_optimizers``' optimizer (one), without the tables the fused sparse optimizer owns."""
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"{type(self).__name__} needs exactly one optimizer, got {len(self.optimizers)}")
        model = self.lightning_module.model
        dense = {id(p) for p in dense_parameters(model)}
        tables = {id(p) for p in model.parameters()} - dense
        for group in self.dense_optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in tables]

    @property
    def dense_optimizer(self) -> torch.optim.Optimizer:
        optimizer = self.optimizers[0]
        return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

    # -- balanced batches --------------------------------------------------------------------------

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        trainer = self.lightning_module._trainer
        if isinstance(batch, JaggedBatch) and trainer is not None and trainer.training:
            batch = self.apply_rank_share(batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    def apply_rank_share(self, batch: JaggedBatch) -> JaggedBatch:
        """This dp rank's rows of the global batch (``balance``), or its own batch weighted by the global row count."""
        if self.settings.balance:
            share = rank_share(batch.lengths, self.dims.dp, self.dims.dp_rank(), self.balance)
            self.loss_weight, self.imbalance = share.loss_weight, share.imbalance
            batch = take_rows(batch, share.rows)
            self.count_rank_work(batch)
            return batch
        self.loss_weight, self.imbalance = self.weigh_own_batch(batch)
        return batch

    def count_rank_work(self, batch: JaggedBatch) -> None:
        """``RecModule`` counted the global batch's tokens and FLOPs before the split; its perf/* figures are per rank."""
        throughput = getattr(self.lightning_module, "throughput", None)
        if throughput is not None:
            throughput.reset()
            throughput.count(batch)

    def weigh_own_batch(self, batch: JaggedBatch) -> tuple[float, float]:
        """``(loss weight, imbalance)`` of a batch this rank read itself: rows and work gathered over dp ranks."""
        mine = torch.tensor([batch.batch_size, float(row_work(batch.lengths, self.balance).sum())], dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(self.dims.dp)]
        dist.all_gather(gathered, mine, group=self.dims.mesh_for("dp").get_group())
        rows, work = torch.stack(gathered).unbind(1)
        imbalance = float(work.max() / work.mean()) if work.sum() > 0 else 1.0
        return self.dims.dp * batch.batch_size / float(rows.sum()), imbalance

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's step, which trains on its loss times :attr:`loss_weight` and returns that weighted loss."""
        output = super().training_step(*args, **kwargs)
        self.log_global_loss(output["loss"] if isinstance(output, Mapping) else output)
        return output

    def log_global_loss(self, weighted: torch.Tensor) -> None:
        """Log the global batch's loss (mean of the weighted per-rank losses) and this step's imbalance."""
        total = weighted.detach().clone()
        if self.dims.dp > 1:
            dist.all_reduce(total, group=self.dims.mesh_for("dp").get_group())
        module = self.lightning_module
        module.log("train/global_loss", total / self.dims.dp, batch_size=1)
        module.log("parallel/imbalance", self.imbalance, batch_size=1)

    # -- checkpoints -------------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the model is saved by DCP in save_checkpoint

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return {}  # the dense and fused optimizers are saved by DCP in save_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Collective: DCP step directory ``<filepath without suffix>.dcp/step_<global step>``; old ones pruned."""
        root = dcp_root(self.broadcast(str(filepath)))
        extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if not self.settings.balance:
            self.merge_data_positions(extra)
        step = self.lightning_module.trainer.global_step
        save_checkpoint(root, self.lightning_module.model, self.dense_optimizer, step, extra=extra)
        if self.global_rank == 0:
            prune_checkpoints(root, self.settings.checkpoints_kept)
        self.barrier()

    def merge_data_positions(self, extra: dict[str, Any]) -> None:
        """Without ``balance`` each rank reads its own streams: gather every rank's consumed counts into
        the data position rank 0 saves (stream ids ``rank * workers + worker`` do not collide)."""
        datamodule = self.lightning_module.trainer.datamodule
        key = type(datamodule).__qualname__ if datamodule is not None else None
        if key not in extra or "consumed" not in extra[key]:
            return
        positions: list[Any] = [None] * self.world_size
        dist.all_gather_object(positions, extra[key]["consumed"])
        extra[key] = {**extra[key], "consumed": {s: n for consumed in positions for s, n in consumed.items()}}

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: fill the parallelized model and optimizers (any saved layout); returns Lightning's state."""
        path = resolve_checkpoint(self.broadcast(str(checkpoint_path)))
        load_checkpoint(path, self.lightning_module.model, self.dense_optimizer)
        return load_extra(path)

    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0 and dcp_root(filepath).is_dir():
            shutil.rmtree(dcp_root(filepath))

    def export_single_file_checkpoint(self, path: str | Path) -> None:
        """Collective: whole tensors to one Lightning-format file (``hyper_parameters`` + ``state_dict``), atomically.

        ``gem.module.load_module`` loads it into a plain single-device ``RecModule``.
        """
        module = self.lightning_module
        full = gather_full_state_dict(module.model)
        if self.global_rank == 0:
            payload = {
                "hyper_parameters": dict(module.hparams),
                "state_dict": {f"model.{k}": v for k, v in full.items()},
                "global_step": module.trainer.global_step,
            }
            with atomic_path(Path(path)) as tmp:
                torch.save(payload, tmp)
        self.barrier()

    def teardown(self) -> None:
        if self.system_metrics is not None:
            self.system_metrics.finish()
            self.system_metrics = None
        super().teardown()

