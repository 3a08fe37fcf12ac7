"""``ParallelDims``: the degrees of every parallel dimension, validated, and the one named device mesh.

Dense mesh layout (outermost first)::

    ("dp_replicate", "dp_shard", "cp", "tp")

``tp`` is innermost so that tensor-parallel peers are adjacent ranks (same host, fastest links);
``dp_replicate`` is outermost so that HSDP replicas span hosts and only all-reduce across them.
The embedding tables are sharded by torchrec over ``emb_shard`` ranks and replicated
``world // emb_shard`` times; with ``emb_shard == world`` (the default) every rank holds a slice
of every sharded table and the all-to-alls span the whole world.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DENSE_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
# Flattened views handed out by name, each made of mesh dims (in mesh order).
FLATTENED_DIMS = {
    "dp": ("dp_replicate", "dp_shard"),
    # FSDP shards parameters over dp_shard and cp together: cp ranks see different tokens of the
    # same rows, so their gradients must be reduced like data-parallel ones.
    "dp_shard_cp": ("dp_shard", "cp"),
}


@dataclass
class ParallelDims:
    """Degrees of each dimension; ``-1`` means "whatever is left of ``world_size``" (at most one dense dim).

    Attributes:
        dp_replicate: HSDP replicas (parameters replicated, gradients all-reduced across them).
        dp_shard: FSDP2 shards (parameters, gradients and optimizer state sharded).
        cp: context parallel: each sequence's tokens split across these ranks.
        tp: tensor parallel: big projections split column/row-wise across these ranks.
        emb_shard: ranks the torchrec tables are sharded across (``-1``: the whole world).
        world_size: number of ranks.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    emb_shard: int = -1
    world_size: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"parallel.world_size must be positive, got {self.world_size}")
        degrees = {name: getattr(self, name) for name in DENSE_DIM_NAMES}
        bad = {n: d for n, d in degrees.items() if d == 0 or d < -1}
        if bad:
            raise ValueError(f"parallel degrees must be positive or -1 (inferred), got {bad}")
        inferred = [n for n, d in degrees.items() if d == -1]
        if len(inferred) > 1:
            raise ValueError(f"at most one parallel degree may be -1 (inferred), got -1 for {inferred}")
        known = math.prod(d for d in degrees.values() if d != -1)
        if inferred:
            if self.world_size % known:
                raise ValueError(
                    f"cannot infer parallel.{inferred[0]}: world size {self.world_size} is not divisible "
                    f"by the product {known} of the other degrees {degrees}"
                )
            setattr(self, inferred[0], self.world_size // known)
        elif known != self.world_size:
            raise ValueError(
                f"parallel degrees {degrees} multiply to {known}, but the world size is {self.world_size}"
            )
        if self.emb_shard == -1:
            self.emb_shard = self.world_size
        if self.emb_shard < 1 or self.world_size % self.emb_shard:
            raise ValueError(
                f"parallel.emb_shard must divide the world size {self.world_size} (or be -1), got {self.emb_shard}"
            )

    # -- derived degrees ---------------------------------------------------------------------------

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different rows of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def emb_replicate(self) -> int:
        """Copies of each embedding table shard (2-D embedding parallelism when > 1)."""
        return self.world_size // self.emb_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DENSE_DIM_NAMES}

    def to_dict(self) -> dict[str, int]:
        """Resolved degrees for MLflow (``log_params``); inferred ``-1`` s are filled in."""
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        out.update(dp=self.dp, emb_replicate=self.emb_replicate)
        return out

    # -- the mesh ----------------------------------------------------------------------------------

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The one ``DeviceMesh`` of shape ``[dp_replicate, dp_shard, cp, tp]`` (needs an initialised process group).

        Flattened views (``dp``, ``dp_shard_cp``) are built with it so that :meth:`mesh_for` can
        hand them out by name.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelDims.build_mesh needs torch.distributed initialised (torchrun or init_process_group)"
            )
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims was resolved for world size {self.world_size}, but the process group has "
                f"{dist.get_world_size()} ranks"
            )
        shape = tuple(getattr(self, n) for n in DENSE_DIM_NAMES)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=DENSE_DIM_NAMES)
        # Kept here rather than sliced from the root later: torch deprecates slicing flattened dims.
        self._flat = {name: mesh[parts]._flatten(name) for name, parts in FLATTENED_DIMS.items()}
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh() first")
        return self._mesh

    def mesh_for(self, *names: str) -> DeviceMesh:
        """Sub-mesh by dim name(s): ``mesh_for("tp")``, ``mesh_for("dp_replicate", "dp_shard")``, ``mesh_for("dp")``."""
        known = (*DENSE_DIM_NAMES, *FLATTENED_DIMS)
        unknown = [n for n in names if n not in known]
        if not names or unknown:
            raise KeyError(f"unknown mesh dim(s) {unknown or names}; known: {known}")
        root = self.mesh
        if len(names) == 1 and names[0] in FLATTENED_DIMS:
            return self._flat[names[0]]
        return root[names[0] if len(names) == 1 else names]

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards the dense parameters over: ``dp_shard`` (with ``cp`` folded in when ``cp > 1``:
        cp ranks' gradients are reduced like data-parallel ones), preceded by ``dp_replicate`` for HSDP (2-D)."""
        shard = self.mesh_for("dp_shard_cp") if self.cp > 1 else self.mesh_for("dp_shard")
        if not self.hsdp:
            return shard
        if self.cp == 1:
            return self.mesh_for("dp_replicate", "dp_shard")
        # Joined from the kept flattened view: torch deprecates slicing flattened dims off the root mesh.
        return DeviceMesh._concatenate([self.mesh_for("dp_replicate"), shard])

    def dp_rank(self) -> int:
        """This rank's index among the ``dp`` data-parallel ranks (which slice of the global batch it reads)."""
        return self.mesh_for("dp").get_local_rank()
