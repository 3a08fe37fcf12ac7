"""Context parallelism: each jagged sequence's tokens split across the ``cp`` ranks (zigzag), keys and values
all-gathered for attention through the ``kernels`` dispatcher.

**Layout.** Causal attention work grows along a sequence (token ``i`` attends to ``i + 1`` keys), so cutting
each sequence into ``cp`` contiguous pieces would give the last rank most of the work. Zigzag cuts every
sequence into ``2 * cp`` near-equal chunks and gives rank ``r`` chunks ``r`` and ``2 * cp - 1 - r``: one
cheap early chunk and one expensive late one. Every cp rank knows every rank's share (it is a function of
the offsets), so gathers need no size exchange.

**Attention.** Each rank computes ``U, V, Q, K`` for its own tokens only, all-gathers ``K`` and ``V`` of the
whole sequences, and calls :func:`kernels.jagged_attention` on *prefix sequences*: for each row, the keys
from position 0 up to its last own token (causal; the whole row otherwise), with its own queries at their
global positions and zero queries elsewhere (their outputs are dropped). Positions inside a prefix are the
global ones, so the causal mask, the relative position and time biases (each slot takes its token's time
and query time) and ``num_targets`` (the prefix keeps the row's history length:
``num_targets' = max(prefix - history, 0)``) are exactly those of the whole sequence, and ``max_len`` (HSTU's ``1/N``) is passed through unchanged. The kernels cannot start
queries mid-sequence, so a rank pays for the queries before its late chunk: the attention FLOPs of the
rank holding a row's last chunk stay those of the whole row (see ``docs/parallel.md``). The ``heads`` route
(:meth:`ContextParallel.attention_by_heads`) splits those FLOPs instead: an all-to-all gives each rank every
token of ``H/cp`` heads, and the kernels run on whole sequences.

**Gradients.** The all-gather's backward sums every rank's gradient for a token and hands it to the rank
that holds it (all-reduce, then select; the adjoint of the gather). Everything after a gather is
replicated on the cp ranks, each computing the same loss, so over the cp ranks each parameter's
gradients add up to ``cp`` times the true gradient; FSDP averages over ``dp_shard x cp`` and torchrec over
the world, which divides the ``cp`` back out.

**Where the model is cut** (:func:`sequence_regions`): the teacher's whole-sequence readers (PMA and CLS
summaries, the K most recent tokens, the candidate token, next-item queries) see gathered sequences.
Interleaved teachers summarise after every layer, so each layer is one region: its PFFN shards the
sequence on entry, its HSTU block gathers it on exit. Without interleaving, nothing reads the sequence
between blocks: one region spans the whole stack.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from foundation.model.hstu import HSTUBlock
from foundation.model.interformer import PersonalizedFFN
from kernels import jagged_attention, route_jagged_attention

# How the HSTU attention sees every rank's tokens: all-gather K/V (the default), or all-to-all to head groups.
CP_ATTENTION = ("gather", "heads")


@dataclass
class ContextShard:
    """One cp rank's share of a jagged batch.

    Attributes:
        token_index: ``[L_r]`` int64 indices into the batch's ``[L]`` tokens, ordered by row then
            position (so ``values[token_index]`` is this rank's jagged tensor).
        offsets: ``[B+1]`` row boundaries into ``token_index``.
        positions: ``[L_r]`` each token's position inside its own sequence (for causal masks and
            relative position bias).
    """

    token_index: torch.Tensor
    offsets: torch.Tensor
    positions: torch.Tensor


def chunk_bounds(length: int, num_chunks: int) -> list[int]:
    """``num_chunks + 1`` boundaries cutting ``length`` tokens into near-equal chunks (earlier chunks longer)."""
    base, extra = divmod(length, num_chunks)
    bounds = [0]
    for c in range(num_chunks):
        bounds.append(bounds[-1] + base + int(c < extra))
    return bounds


def zigzag_shard(offsets: torch.Tensor, cp_size: int, cp_rank: int) -> ContextShard:
    """The tokens of ``offsets[B+1]`` that cp rank ``cp_rank`` of ``cp_size`` holds, zigzag-balanced."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank} (cp_size={cp_size})")
    chunks = (cp_rank, 2 * cp_size - 1 - cp_rank)
    index, positions, lengths = [], [], []
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        bounds = chunk_bounds(end - start, 2 * cp_size)
        mine = [torch.arange(bounds[c], bounds[c + 1]) for c in chunks]
        row = torch.cat(mine)
        positions.append(row)
        index.append(row + start)
        lengths.append(row.numel())
    empty = torch.zeros(0, dtype=torch.int64)
    device = offsets.device
    return ContextShard(
        token_index=torch.cat([empty, *index]).to(device),
        offsets=torch.cat(
            [torch.zeros(1, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64).cumsum(0)]
        ).to(device),
        positions=torch.cat([empty, *positions]).to(device),
    )


def causal_work(shard: ContextShard) -> int:
    """Query-key pairs this rank's tokens attend to under a causal mask (``position + 1`` each)."""
    return int((shard.positions + 1).sum())


@dataclass
class AttentionPrefixes:
    """The prefix sequences one rank's queries attend over (see the module docstring).

    Attributes:
        offsets: ``[B+1]`` boundaries of the prefixes (a row without own tokens has an empty one).
        token_index: ``[P]`` int64 indices of the prefixes' tokens into the whole batch's ``[L]`` tokens.
        query_slots: ``[L_r]`` where each own token sits among the ``P`` prefix tokens.
    """

    offsets: torch.Tensor
    token_index: torch.Tensor
    query_slots: torch.Tensor


@dataclass
class ContextPlan:
    """Every cp rank's zigzag share of one jagged batch (``offsets[B+1]``, ``num_tokens = L``), and this rank's."""

    offsets: torch.Tensor
    shards: list[ContextShard]
    rank: int
    _prefixes: dict[bool, AttentionPrefixes] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def mine(self) -> ContextShard:
        return self.shards[self.rank]

    def prefixes(self, causal: bool) -> AttentionPrefixes:
        """Per row, the keys this rank's queries need: up to its last own token (causal) or the whole row."""
        if causal not in self._prefixes:
            self._prefixes[causal] = build_prefixes(self.offsets, self.mine, causal)
        return self._prefixes[causal]


def build_context_plan(offsets: torch.Tensor, cp_size: int, cp_rank: int) -> ContextPlan:
    """:class:`ContextPlan` of ``offsets[B+1]`` for rank ``cp_rank`` of ``cp_size``."""
    return ContextPlan(offsets, [zigzag_shard(offsets, cp_size, r) for r in range(cp_size)], cp_rank)


def build_prefixes(offsets: torch.Tensor, mine: ContextShard, causal: bool) -> AttentionPrefixes:
    """:class:`AttentionPrefixes` of the tokens ``mine`` in the batch ``offsets[B+1]``."""
    batch = offsets.numel() - 1
    my_lengths = mine.offsets[1:] - mine.offsets[:-1]
    my_rows = torch.repeat_interleave(torch.arange(batch, device=offsets.device), my_lengths)
    if causal:
        ends = torch.zeros(batch, dtype=torch.int64, device=offsets.device)
        ends = ends.scatter_reduce(0, my_rows, mine.positions + 1, reduce="amax")
    else:
        ends = torch.where(my_lengths > 0, offsets[1:] - offsets[:-1], 0)
    prefix_offsets = torch.cat([ends.new_zeros(1), ends.cumsum(0)])
    prefix_rows = torch.repeat_interleave(torch.arange(batch, device=offsets.device), ends)
    within = torch.arange(prefix_rows.numel(), device=offsets.device) - prefix_offsets[prefix_rows]
    return AttentionPrefixes(
        offsets=prefix_offsets,
        token_index=offsets[prefix_rows] + within,
        query_slots=prefix_offsets[my_rows] + mine.positions,
    )


def gather_tokens_forward(local: torch.Tensor, plan: ContextPlan, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's ``[L_r, ...]`` tokens -> the whole batch's ``[L, ...]``, every rank's share in its place."""
    counts = [s.token_index.numel() for s in plan.shards]
    width = max(counts)
    if width == 0:  # an empty batch on every rank alike (L is global): nothing to exchange
        return local.new_zeros(0, *local.shape[1:])
    # gloo's all_gather needs equal sizes: pad to the largest share, which every rank knows.
    padded = local.new_zeros(width, *local.shape[1:])
    padded[: local.shape[0]] = local
    received = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(received, padded.contiguous(), group=group)
    full = local.new_empty(plan.num_tokens, *local.shape[1:])
    for shard, part, count in zip(plan.shards, received, counts, strict=True):
        full[shard.token_index] = part[:count]
    return full


class GatherTokens(torch.autograd.Function):
    """All-gather of jagged tokens across the cp ranks; backward sums every rank's gradient of each token
    (all-reduce) and keeps this rank's tokens' (the adjoint: each rank used every token)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, plan: ContextPlan, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.plan, ctx.group = plan, group
        return gather_tokens_forward(local, plan, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        total = grad.contiguous().clone()
        if total.numel():
            dist.all_reduce(total, group=ctx.group)
        return total[ctx.plan.mine.token_index], None, None


def tokens_to_heads(local: torch.Tensor, plan: ContextPlan, group: dist.ProcessGroup) -> torch.Tensor:
    """``[L_r, H, D]`` (this rank's tokens, every head) -> ``[L, H/cp, D]`` (every token, this rank's heads).

    One ``all_to_all_single``: rank ``s`` receives head group ``s`` of every rank's tokens.
    """
    size, counts = len(plan.shards), [s.token_index.numel() for s in plan.shards]
    tokens, heads, width = local.shape
    group_heads = heads // size
    if plan.num_tokens == 0:
        return local.new_zeros(0, group_heads, width)
    # [cp * L_r, H/cp, D]: head group s of every own token, then group s + 1 (all_to_all splits dim 0)
    send = local.reshape(tokens, size, group_heads, width).transpose(0, 1).reshape(size * tokens, group_heads, width)
    received = local.new_empty(plan.num_tokens, group_heads, width)
    dist.all_to_all_single(
        received, send, output_split_sizes=counts, input_split_sizes=[tokens] * size, group=group
    )
    full = torch.empty_like(received)
    full[torch.cat([s.token_index for s in plan.shards])] = received
    return full


def heads_to_tokens(full: torch.Tensor, plan: ContextPlan, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of :func:`tokens_to_heads`: ``[L, H/cp, D]`` -> ``[L_r, H, D]``."""
    size = len(plan.shards)
    _, group_heads, width = full.shape
    tokens = plan.mine.token_index.numel()
    if plan.num_tokens == 0:
        return full.new_zeros(0, group_heads * size, width)
    send = full[torch.cat([s.token_index for s in plan.shards])].contiguous()
    received = full.new_empty(size * tokens, group_heads, width)
    dist.all_to_all_single(
        received,
        send,
        output_split_sizes=[tokens] * size,
        input_split_sizes=[s.token_index.numel() for s in plan.shards],
        group=group,
    )
    return received.view(size, tokens, group_heads, width).transpose(0, 1).reshape(tokens, size * group_heads, width)


class HeadExchange(torch.autograd.Function):
    """:func:`tokens_to_heads` (``to_heads``) or :func:`heads_to_tokens`: permutations of the elements, each
    the other's adjoint, so the backward runs the other one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: ContextPlan, group: dist.ProcessGroup, to_heads: bool) -> torch.Tensor:
        ctx.plan, ctx.group, ctx.to_heads = plan, group, to_heads
        return (tokens_to_heads if to_heads else heads_to_tokens)(x, plan, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        adjoint = heads_to_tokens if ctx.to_heads else tokens_to_heads
        return adjoint(grad.contiguous(), ctx.plan, ctx.group), None, None, None


class ContextParallel:
    """The cp group's token sharding, gathering and attention route for one model.

    The plan of the last seen offsets is kept: every layer of a forward (and activation checkpointing's
    recomputation in backward) sees the same sequences.
    """

    def __init__(self, mesh: DeviceMesh, attention: str = "gather") -> None:
        if attention not in CP_ATTENTION:
            raise ValueError(f"context parallel attention must be one of {CP_ATTENTION}, got {attention!r}")
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.mode = attention
        self._plan: ContextPlan | None = None

    def plan_for(self, offsets: torch.Tensor) -> ContextPlan:
        """The :class:`ContextPlan` of the (whole-sequence) ``offsets[B+1]``."""
        if self._plan is None or not torch.equal(self._plan.offsets, offsets):
            self._plan = build_context_plan(offsets, self.size, self.rank)
        return self._plan

    def shard(self, tokens: torch.Tensor, plan: ContextPlan) -> torch.Tensor:
        """Whole-batch ``[L, ...]`` -> this rank's ``[L_r, ...]``."""
        if tokens.shape[0] != plan.num_tokens:
            raise ValueError(
                f"context parallel: expected the whole batch's {plan.num_tokens} tokens, got {tokens.shape[0]}"
            )
        return tokens[plan.mine.token_index]

    def gather(self, tokens: torch.Tensor, plan: ContextPlan) -> torch.Tensor:
        """This rank's ``[L_r, ...]`` -> the whole batch's ``[L, ...]`` (differentiable)."""
        if tokens.shape[0] != plan.mine.token_index.numel():
            raise ValueError(
                f"context parallel: expected this rank's {plan.mine.token_index.numel()} tokens, "
                f"got {tokens.shape[0]}"
            )
        return GatherTokens.apply(tokens, plan, self.group)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        offsets: torch.Tensor,
        max_len: int,
        *,
        causal: bool,
        num_targets: torch.Tensor | None,
        timestamps: torch.Tensor | None,
        query_timestamps: torch.Tensor | None = None,
        **options,
    ) -> torch.Tensor:
        """:func:`kernels.jagged_attention` of this rank's queries against every rank's keys.

        Args:
            q, k, v: ``[L_r, H, D]`` this rank's tokens.
            offsets: ``[B+1]`` the whole sequences'.
            max_len: passed through (the ``1/N`` of pointwise attention).
            num_targets: ``[B]`` of the whole sequences, or None.
            timestamps: ``[L]`` of the whole sequences (the model passes them unsharded), or None.
            query_timestamps: ``[L]`` of the whole sequences (the target-time bias's ``qts``), or None.
            options: the remaining :func:`kernels.jagged_attention` arguments, passed through.

        Returns:
            ``[L_r, H, Dv]``.
        """
        plan = self.plan_for(offsets)
        for name, times in (("timestamps", timestamps), ("query_timestamps", query_timestamps)):
            if times is not None and times.shape[0] != plan.num_tokens:
                raise ValueError(
                    f"context parallel attention needs the whole sequences' {name} [{plan.num_tokens}], "
                    f"got {tuple(times.shape)}"
                )
        times = dict(timestamps=timestamps, query_timestamps=query_timestamps)
        if self.mode == "heads":
            return self.attention_by_heads(
                q, k, v, offsets, max_len, plan, causal=causal, num_targets=num_targets, **times, **options
            )
        keys_values = self.gather(torch.cat([k, v], dim=-1), plan)  # one collective for both
        k_all, v_all = keys_values.split([k.shape[-1], v.shape[-1]], dim=-1)
        return attend_over_prefixes(
            q, k_all, v_all, offsets, max_len, plan.prefixes(causal), causal=causal, num_targets=num_targets,
            **times, **options,
        )


    def attention_by_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        offsets: torch.Tensor,
        max_len: int,
        plan: ContextPlan,
        *,
        pos_bias: torch.Tensor | None = None,
        time_bias: torch.Tensor | None = None,
        **options,
    ) -> torch.Tensor:
        """Head-parallel attention: all-to-all from (own tokens, all heads) to (all tokens, ``H/cp`` heads), the
        whole sequences' :func:`kernels.jagged_attention` on those heads, and back; ``[L_r, H, Dv]``.

        Every rank computes ``1/cp`` of the attention FLOPs whatever the lengths, with the kernels unchanged.
        """
        heads, dqk = q.shape[1], q.shape[2]
        group_heads = heads // self.size
        mine = slice(self.rank * group_heads, (self.rank + 1) * group_heads)
        qkv = HeadExchange.apply(torch.cat([q, k, v], dim=-1), plan, self.group, True)
        q_h, k_h, v_h = qkv.split([dqk, dqk, v.shape[2]], dim=-1)
        with route_jagged_attention(None):
            out = jagged_attention(
                q_h,
                k_h,
                v_h,
                offsets,
                max_len,
                # a shared [1, P] table serves every head; a per-head [H, P] one is sliced to this rank's heads
                pos_bias=pos_bias if pos_bias is None or pos_bias.shape[0] == 1 else pos_bias[mine],
                time_bias=time_bias if time_bias is None or time_bias.shape[0] == 1 else time_bias[mine],
                **options,
            )
        return HeadExchange.apply(out, plan, self.group, False)


def attend_over_prefixes(
    q: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    prefixes: AttentionPrefixes,
    *,
    causal: bool,
    num_targets: torch.Tensor | None,
    timestamps: torch.Tensor | None,
    query_timestamps: torch.Tensor | None = None,
    **options,
) -> torch.Tensor:
    """One rank's queries ``q[L_r, H, Dqk]`` against the whole batch's ``k_all[L, H, Dqk]``, ``v_all[L, H, Dv]``
    (``offsets[B+1]``), through :func:`kernels.jagged_attention` on ``prefixes``; returns ``[L_r, H, Dv]``.

    ``num_targets[B]``, ``timestamps[L]`` and ``query_timestamps[L]`` are the whole sequences'; a prefix keeps its
    row's history length, so it gets the targets it contains, and each prefix slot takes the times of the token
    it holds (own queries their own ``qts``; the zero queries' outputs are dropped).
    """
    q_prefix = q.new_zeros(prefixes.token_index.numel(), *q.shape[1:]).index_copy(0, prefixes.query_slots, q)
    prefix_targets = None
    if num_targets is not None:
        history = (offsets[1:] - offsets[:-1]) - num_targets
        prefix_targets = ((prefixes.offsets[1:] - prefixes.offsets[:-1]) - history).clamp(min=0)
    with route_jagged_attention(None):
        out = jagged_attention(
            q_prefix,
            k_all[prefixes.token_index],
            v_all[prefixes.token_index],
            prefixes.offsets,
            max_len,
            causal=causal,
            num_targets=prefix_targets,
            timestamps=None if timestamps is None else timestamps[prefixes.token_index],
            query_timestamps=None if query_timestamps is None else query_timestamps[prefixes.token_index],
            **options,
        )
    return out[prefixes.query_slots]


def unwrapped(module: nn.Module) -> nn.Module:
    """The module inside an activation-checkpointing wrapper (or the module itself)."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def sequence_regions(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """``(entry, exit)`` module pairs between which the teacher's sequence stays sharded.

    Interleaved teachers (per-layer PFFN and summary) give one region per layer, ``(pffns[i], blocks[i])``;
    otherwise one region spans ``blocks[0]`` to ``blocks[-1]``.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not all(isinstance(unwrapped(b), HSTUBlock) for b in blocks):
        raise ValueError(
            f"context parallel needs a model whose `blocks` is a ModuleList of HSTUBlock; {type(model).__name__} "
            "has none"
        )
    if not len(blocks):
        return []
    pffns = getattr(model, "pffns", None)
    if pffns is not None and len(pffns):
        return list(zip(pffns, blocks, strict=True))
    return [(blocks[0], blocks[-1])]


def shard_region_input(cp: ContextParallel, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Entry of a region: a sequence module's whole-batch token arguments -> this rank's, the stream's pending
    ``branch[L, d]`` (a keyword: the previous block's deferred output) sharded as the stream (its ``branch_bias[d]``
    as it is)."""
    inner = unwrapped(module)
    if isinstance(inner, HSTUBlock):  # (x[L, d], offsets[B+1], max_len, timestamps[L], num_targets[B])
        x, offsets, *rest = args
        plan = cp.plan_for(offsets)
        args = (cp.shard(x, plan), offsets, *rest)
    elif isinstance(inner, PersonalizedFFN):  # (x[L, d], rows[L], summary[B, n, d])
        x, rows, summary = args
        lengths = torch.bincount(rows, minlength=summary.shape[0])
        plan = cp.plan_for(torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]))
        args = (cp.shard(x, plan), cp.shard(rows, plan), summary)
    else:
        raise TypeError(f"context parallel cannot shard the inputs of {type(inner).__name__}")
    if kwargs.get("branch") is not None:
        kwargs = {**kwargs, "branch": cp.shard(kwargs["branch"], plan)}
    return args, kwargs


def gather_region_output(cp: ContextParallel, args: tuple, out: torch.Tensor | tuple) -> torch.Tensor | tuple:
    """Exit of a region: this rank's tokens -> the whole batch's; a block that defers its residual returns
    ``(x, branch, branch_bias)``: the stream and the branch gathered, the bias (``[d]``, not per token) as it is."""
    plan = cp.plan_for(args[1])
    if isinstance(out, tuple):
        x, branch, bias = out
        return cp.gather(x, plan), cp.gather(branch, plan), bias
    return cp.gather(out, plan)


def check_heads_divide(model: nn.Module, cp: int) -> None:
    """Head-parallel attention gives each cp rank ``H/cp`` heads of every HSTU block: ``cp`` must divide ``H``."""
    for name, module in model.named_modules():
        if isinstance(module, HSTUBlock) and module.num_heads % cp:
            raise ValueError(
                f"context parallel attention='heads': {name} has {module.num_heads} heads, not divisible by "
                f"cp={cp}; use attention='gather'"
            )


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, attention: str = "gather") -> ContextParallel:
    """Shard the teacher's sequence over ``cp_mesh``, in place, with forward hooks (model code unchanged).

    - each region's entry module shards its token inputs, its exit block all-gathers its output;
    - each HSTU block's ``jagged_attention`` call is routed to :meth:`ContextParallel.attention` for the
      duration of the block (its recomputation under activation checkpointing included).

    Regions are found on the modules as they are now: apply after activation checkpointing, so that the
    shard/gather hooks sit outside the checkpointed blocks and the attention route inside them.
    ``attention`` picks the route: ``gather`` (K/V all-gather, prefix sequences) or ``heads`` (all-to-all).
    """
    if attention == "heads":
        check_heads_divide(model, cp_mesh.size())
    cp = ContextParallel(cp_mesh, attention)
    for entry, exit_ in sequence_regions(model):
        entry.register_forward_pre_hook(
            lambda module, args, kwargs: shard_region_input(cp, module, args, kwargs), with_kwargs=True
        )
        exit_.register_forward_hook(lambda module, args, out: gather_region_output(cp, args, out))
    routes: list[contextlib.ExitStack] = []

    def open_route(module: nn.Module, args: tuple) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(route_jagged_attention(cp.attention))
        routes.append(stack)

    def close_route(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if routes:  # also called when forward raised, possibly before open_route ran
            routes.pop().close()

    for block in model.blocks:
        inner = unwrapped(block)
        inner.register_forward_pre_hook(open_route)
        inner.register_forward_hook(close_route, always_call=True)
    return cp
