"""Parameters cast to the autocast dtype once per step instead of at every use.

Under bf16 autocast an ``nn.Linear`` casts its float32 weight and bias to bf16 at every call, and autograd
casts their bf16 gradients back to float32: two kernel launches per parameter per step, several hundred for
a deep model, each costing the host as much as a GEMM launch. :class:`CastOnce` keeps low-precision copies
of the parameters whose every use is such a cast, refreshes them with one multi-tensor copy per step
(:func:`kernels.multi_copy`), runs the forward on them (:func:`torch.func.functional_call`), and after the
backward moves their gradients into the float32 parameters' ``.grad`` with one more. Values are those of plain
autocast: the copy rounds as the cast does, and the gradient reaching the copy is the one the cast's backward
would convert, exactly. A step that differentiates with ``torch.autograd.grad`` (:class:`gem.loop.StaticStep`,
inside a CUDA graph) asks for the copies' gradients (:meth:`CastOnce.grad_targets`) and converts them with
:meth:`CastOnce.float_grads`.

Which parameters qualify is read from one traced forward (:meth:`CastOnce.discover`): a parameter whose
autograd node is reached only through a single cast to the autocast dtype (``ToCopyBackward0``), and never
by anything else (a kernel that reads it directly, a float32 op, a second cast), gets a copy.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from foundation.model.deferred_rows import DeferredRows, hook_lookups, sparse_tables
from kernels import multi_adamw, multi_copy, row_adamw, sum_rows


class _CastDtypes(TorchDispatchMode):
    """Records the dtypes each tensor storage is cast to (``_to_copy``) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: dict[int, set[torch.dtype]] = defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            self.casts[args[0].untyped_storage().data_ptr()].add(out.dtype)
        return out


def single_cast_parameters(model: nn.Module, loss: torch.Tensor, casts: dict[int, set[torch.dtype]], dtype: torch.dtype) -> list[str]:
    """Names of ``model``'s float32 parameters that ``loss``'s autograd graph reaches only through one cast,
    and that forward cast only to ``dtype`` (``casts``: storage pointer -> dtypes, from :class:`_CastDtypes`)."""
    # Autograd hands out a fresh Python wrapper for a node whenever the last one died, so ``id`` of a wrapper is
    # only an identity while the wrapper lives: ``visited`` keeps every node's wrapper alive for the whole walk. An
    # accumulator is recognised by its ``variable`` (the leaf it feeds), not by its class name.
    users: dict[int, list[str]] = defaultdict(list)
    visited: dict[int, object] = {}
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited[id(node)] = node
        for child, _ in node.next_functions:
            leaf = getattr(child, "variable", None)
            if leaf is not None:
                users[id(leaf)].append(type(node).__name__)
            stack.append(child)
    names = []
    for name, p in model.named_parameters():
        if p.dtype != torch.float32 or not p.requires_grad or p.grad_fn is not None:
            continue
        only_cast = users.get(id(p)) == ["ToCopyBackward0"]
        if only_cast and casts.get(p.untyped_storage().data_ptr()) == {dtype}:
            names.append(name)
    return names


class CastOnce:
    """Low-precision copies of the parameters autocast casts at every use (module doc).

    Per step: ``losses = cast.run(lambda forward: model.loss(batch, forward(batch)))`` under autocast, the
    backward, then :meth:`collect_grads` before the optimizer step. The first :meth:`run` is a plain step that
    :meth:`discover` watches; later ones :meth:`refresh` the copies and run ``forward`` on them. Where
    discovery found nothing (no autocast), ``forward`` is ``model(...)`` and the other calls do nothing.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        self.model, self.dtype = model, dtype
        self.discovered = False
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.copies: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        # Set by MasterAdamW.keep_copies: the optimizer writes the copies as it updates the parameters and takes
        # their low-precision gradients as they are (hold_grads), so the forward does not refresh them.
        self.kept_by_optimizer = False
        self.held: dict[int, torch.Tensor] = {}

    def discover(self, loss_of_forward) -> torch.Tensor:
        """Run ``loss_of_forward()`` (a forward and loss of ``model`` under autocast to ``dtype``), find the
        parameters that qualify (module doc), allocate their copies; returns the loss for a backward."""
        with _CastDtypes() as watch:
            loss = loss_of_forward()
        self.names = single_cast_parameters(self.model, loss, watch.casts, self.dtype)
        named = dict(self.model.named_parameters())
        self.params = [named[n] for n in self.names]
        self.copies = [torch.empty_like(p, dtype=self.dtype).requires_grad_() for p in self.params]
        self.grads = [torch.empty_like(p) for p in self.params]
        self.discovered = True
        # The first refresh, outside any CUDA graph capture: the copy kernel's table for these tensors is made here.
        self.refresh()
        return loss

    def run(self, compute: Callable[[Callable], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``compute(forward)`` (a dict with the ``"loss"``) with ``forward`` standing for ``model``: watched by
        :meth:`discover` the first time, on refreshed copies after that."""
        if self.discovered:
            if self.kept_by_optimizer:
                self.clear_copy_grads()
            else:
                self.refresh()
            return compute(self.forward)
        out: dict[str, torch.Tensor] = {}

        def loss() -> torch.Tensor:
            out.update(compute(self.model))
            return out["loss"]

        self.discover(loss)
        return out

    def refresh(self) -> None:
        """Copy the float32 parameters into their low-precision copies (one multi-tensor copy)."""
        if self.copies:
            with torch.no_grad():
                multi_copy(self.copies, self.params)
        self.clear_copy_grads()

    def clear_copy_grads(self) -> None:
        """Drop the copies' gradients of the last backward (an eager backward accumulates into them)."""
        for copy in self.copies:
            copy.grad = None

    def copy_of(self) -> dict[int, torch.Tensor]:
        """The low-precision copy of each parameter that has one, by ``id`` of the parameter."""
        return {id(p): copy for p, copy in zip(self.params, self.copies, strict=True)}

    def forward(self, *args, **kwargs):
        """``model(*args, **kwargs)`` with the copies standing in for their parameters."""
        if not self.copies:
            return self.model(*args, **kwargs)
        return torch.func.functional_call(self.model, dict(zip(self.names, self.copies, strict=True)), args, kwargs, strict=False)

    def grad_targets(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """What the forward reads each of ``params`` through, to differentiate with ``torch.autograd.grad``: its
        low-precision copy once discovered, else the parameter itself. Called before :meth:`run`, whose first
        (discovering) call runs the model on its own parameters."""
        if not self.discovered:
            return list(params)
        copy_of = self.copy_of()
        return [copy_of.get(id(p), p) for p in params]

    def float_grads(self, params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """``grads`` of :meth:`grad_targets` ``(params)``, the copies' converted to their parameters' float32 in
        this object's buffers by one multi-tensor copy (the values autocast's cast backward gives); the buffers are
        overwritten by the next call."""
        buffer_of = {id(p): buffer for p, buffer in zip(self.params, self.grads, strict=True)}
        out, targets, sources = list(grads), [], []
        for i, (p, grad) in enumerate(zip(params, grads, strict=True)):
            buffer = buffer_of.get(id(p))
            if buffer is not None and grad is not None and grad.dtype != p.dtype:
                targets.append(buffer)
                sources.append(grad)
                out[i] = buffer
        if targets:
            multi_copy(targets, sources)
        return out

    def hold_grads(self, params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """:meth:`float_grads` without the conversion, for an optimizer that reads low-precision gradients
        (:class:`MasterAdamW`): the copies' gradients among ``grads`` are held for :meth:`take_held_grads` and
        returned as None; the others are returned as they are. The held tensors are the caller's (e.g. a CUDA
        graph's outputs): the optimizer must step before they are overwritten."""
        mine = {id(p) for p in self.params}
        out = list(grads)
        self.held = {}
        for i, (p, grad) in enumerate(zip(params, grads, strict=True)):
            if grad is not None and id(p) in mine and grad.dtype != p.dtype:
                self.held[id(p)] = grad
                out[i] = None
        return out

    def take_held_grads(self) -> dict[int, torch.Tensor]:
        """The gradients :meth:`hold_grads` held, by ``id`` of their parameter; held no longer."""
        held, self.held = self.held, {}
        return held

    def collect_grads(self) -> None:
        """Add the copies' gradients to their float32 parameters' ``.grad`` (one multi-tensor copy)."""
        fresh, accumulate = [], []
        for i, (p, copy) in enumerate(zip(self.params, self.copies, strict=True)):
            if copy.grad is not None:
                (fresh if p.grad is None else accumulate).append(i)
        if fresh:
            multi_copy([self.grads[i] for i in fresh], [self.copies[i].grad for i in fresh])
            for i in fresh:
                self.params[i].grad = self.grads[i]
        for i in accumulate:
            self.params[i].grad.add_(self.copies[i].grad)


class MasterAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` over float32 (master) parameters, stepped by :func:`kernels.multi_adamw`: one launch
    per gradient dtype for all parameters of a group, where torch's fused AdamW needs float32 gradients.

    :meth:`keep_copies` binds it to a :class:`CastOnce`: the step then also reads the copies' bf16 gradients that
    :meth:`CastOnce.hold_grads` held (no float32 conversion) and writes every updated parameter into its copy,
    so the next forward reads the copies without a refresh. The parameters must then change only through this
    optimizer; after any other change (a checkpoint load) call :meth:`CastOnce.refresh`. The state (``step``,
    ``exp_avg``, ``exp_avg_sq``, ``step`` on the host) is AdamW's, so checkpoints move between the two. No
    ``amsgrad``, ``maximize``, ``capturable`` or ``differentiable``.

    A sparse gradient of whole rows (an embedding table's with ``sparse=True``: the teacher's ``sparse_tables``)
    steps only the rows it names, with their moments, by :func:`kernels.row_adamw`; no dense gradient is formed and
    the other rows are not read. Alone that is lazy Adam (``torch.optim.SparseAdam``'s rule, with AdamW's decay on
    the named rows); after :meth:`defer_rows` it is AdamW's result (:mod:`foundation.model.deferred_rows`: the
    zero-gradient steps a row missed are applied when a forward looks it up), and :meth:`state_dict` first brings
    every row to date.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self.cast_once: CastOnce | None = None
        # Each parameter's step count on the host, mirroring state["step"]: reading the tensor at every step
        # would be one `.item()` per parameter (a device sync where a loaded state put it on the GPU).
        self.host_steps: dict[torch.Tensor, int] = {}
        self.deferred: dict[torch.Tensor, DeferredRows] = {}

    def defer_rows(self, model: nn.Module) -> list[str]:
        """Step the sparse-gradient tables of ``model`` that this optimizer holds as dense AdamW would (class doc):
        their lookups catch their rows up first. Returns the tables' parameter names."""
        held = {p for group in self.param_groups for p in group["params"]}
        names = {p: name for name, p in model.named_parameters()}
        for weight, module in sparse_tables(model).items():
            if weight not in held or weight in self.deferred:
                continue
            group = next(g for g in self.param_groups if any(p is weight for p in g["params"]))
            state = self.state[weight]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
            step = int(state["step"].item())
            self.deferred[weight] = DeferredRows(weight, state["exp_avg"], state["exp_avg_sq"], step=step,
                                                 betas=group["betas"], eps=group["eps"])
            hook_lookups(module, self.deferred[weight])
        return [names[p] for p in self.deferred]

    def flush_rows(self) -> None:
        """Bring every row of the deferred tables to the current step."""
        for rows in self.deferred.values():
            rows.flush()

    def state_dict(self) -> dict:
        self.flush_rows()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.host_steps = {}
        for weight, rows in self.deferred.items():
            state = self.state[weight]
            rows.rebind(state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()))

    def keep_copies(self, cast_once: CastOnce) -> None:
        """Write ``cast_once``'s copies and take its held gradients from now on (class doc)."""
        self.cast_once = cast_once
        cast_once.kept_by_optimizer = True

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        cast = self.cast_once
        held = cast.take_held_grads() if cast is not None else {}
        copy_of = cast.copy_of() if cast is not None else {}
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("MasterAdamW supports neither amsgrad nor maximize")
            by_step: dict[int, tuple[list, ...]] = {}
            for p in group["params"]:
                grad = p.grad if p.grad is not None else held.get(id(p))
                if grad is None:
                    continue
                if grad.is_sparse and (grad.sparse_dim() != 1 or id(p) in copy_of):
                    raise ValueError("MasterAdamW takes sparse gradients of whole rows only (an embedding table's, "
                                     f"with no low-precision copy); got sparse_dim {grad.sparse_dim()}")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    self.host_steps[p] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if p not in self.host_steps:  # new, or loaded (from a fused AdamW's state: on the device)
                    state["step"] = state["step"].detach().to("cpu", torch.float32)
                    self.host_steps[p] = int(state["step"].item())
                self.host_steps[p] += 1
                state["step"] += 1
                deferred = self.deferred.get(p)
                if grad.is_sparse:
                    rows = grad._indices()[0]
                    if deferred is not None:  # a no-op on the rows a hooked lookup caught up
                        deferred.catch_up(rows)
                    row_adamw(p, state["exp_avg"], state["exp_avg_sq"], rows, grad._values(), lr=float(group["lr"]),
                              betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                              step=self.host_steps[p])
                    if deferred is not None:
                        deferred.stepped(rows, step=self.host_steps[p], lr=float(group["lr"]),
                                         weight_decay=group["weight_decay"])
                    continue
                if deferred is not None:
                    raise ValueError("MasterAdamW: a deferred table got a dense gradient; its rows would step stale")
                lists = by_step.setdefault(self.host_steps[p], ([], [], [], [], []))
                for out, value in zip(lists, (p, grad, state["exp_avg"], state["exp_avg_sq"], copy_of.get(id(p))),
                                      strict=True):
                    out.append(value)
            for step, (params, grads, exp_avgs, exp_avg_sqs, copies) in by_step.items():
                multi_adamw(params, grads, exp_avgs, exp_avg_sqs, copies=copies, lr=float(group["lr"]),
                            betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"], step=step)
        return loss


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm) that also takes the sparse row gradients of embedding tables
    (``sparse_tables``), whose entries may name a row several times: a table's share of the norm is that of its rows'
    summed gradients (as the dense gradient would hold them), and its entries are scaled like every other gradient.
    No device sync (the rows are summed by :func:`kernels.sum_rows`); returns the total norm (a device scalar).
    Without sparse gradients it is torch's own clip, to the bit."""
    params = [p for p in parameters if p.grad is not None]
    sparse = [p.grad for p in params if p.grad.is_sparse]
    if not sparse:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    dense = [p.grad for p in params if not p.grad.is_sparse]
    squares = [sum_rows(grad._indices()[0], grad._values()).square().sum() for grad in sparse]
    if dense:
        squares.append(torch.nn.utils.get_total_norm(dense).to(torch.float32).square())
    total = torch.stack([s.to(squares[0].device) for s in squares]).sum().sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if dense:
        torch._foreach_mul_(dense, coef.to(dense[0].device))
    for grad in sparse:
        grad._values().mul_(coef.to(grad.device))
    return total
