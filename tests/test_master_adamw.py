""":class:`foundation.model.precision.MasterAdamW`: AdamW through :func:`kernels.multi_adamw`, taking the bf16
gradients of :class:`CastOnce`'s copies as they are and writing the copies as it updates, in the static step
(:class:`gem.loop.StaticStep`) and the plain one; trains as ``torch.optim.AdamW`` with the cast's own refresh and
conversion does, and shares AdamW's checkpoint state."""

from __future__ import annotations

import pytest
import torch

from foundation.model.precision import CastOnce, MasterAdamW
from gem.loop import GraphConfig, StaticStep, train_step
from tests.test_static_step import build, padded_batches

pytestmark = pytest.mark.usefixtures("one_thread")


def _run_static(master: bool, steps: int = 4, grad_clip: float = 0.0):
    model, _ = build()
    cast = CastOnce(model)
    if master:
        optimizer = MasterAdamW(model.parameters(), lr=1e-2)
        optimizer.keep_copies(cast)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = StaticStep(model, optimizer, autocast_dtype=torch.bfloat16, config=GraphConfig(), cast_once=cast,
                      grad_clip=grad_clip)
    torch.manual_seed(9)
    losses, fresh = [], []
    for batch in padded_batches(steps):
        losses.append(step(batch)["loss"])
        fresh.append(all(torch.equal(c, p.detach().to(c.dtype)) for p, c in zip(cast.params, cast.copies, strict=True)))
    return torch.stack(losses), {k: v.clone() for k, v in model.state_dict().items()}, cast, optimizer, fresh


@pytest.mark.parametrize("grad_clip", [0.0, 0.5], ids=["held_bf16_grads", "clipped_float_grads"])
def test_static_step_with_master_adamw_trains_as_adamw_with_refreshed_copies(grad_clip):
    """Same losses and parameters to the last bit: the held bf16 gradients are converted inside the update as
    the cast's conversion would, and the copies the optimizer writes are what a refresh would copy. Without
    clipping the copies' gradients never reach ``.grad``; with it they do (clipping needs them there)."""
    plain, plain_state, _, _, _ = _run_static(master=False, grad_clip=grad_clip)
    losses, state, cast, optimizer, fresh = _run_static(master=True, grad_clip=grad_clip)
    assert cast.kept_by_optimizer and cast.names and all(fresh)
    assert torch.equal(losses, plain)
    for name, value in plain_state.items():
        assert torch.equal(state[name], value), f"{name} moved apart"
    converted = [p.grad is not None for p in cast.params]
    assert all(converted) if grad_clip > 0 else not any(converted)
    assert cast.held == {}  # taken by the step
    assert {int(s["step"]) for s in optimizer.state.values()} == {4}


def test_plain_step_with_master_adamw_does_not_refresh_or_accumulate():
    """In the eager step the copies' gradients reach ``.grad`` through :meth:`CastOnce.collect_grads`; the copies
    are not refreshed by the forward but written by the optimizer, and their gradients do not pile up."""
    runs = []
    for master in (False, True):
        model, _ = build()
        cast = CastOnce(model)
        optimizer = MasterAdamW(model.parameters(), lr=1e-2) if master else torch.optim.AdamW(model.parameters(), lr=1e-2)
        if master:
            optimizer.keep_copies(cast)
        torch.manual_seed(9)
        losses = [train_step(model, b, optimizer, autocast_dtype=torch.bfloat16, cast_once=cast)["loss"].detach()
                  for b in padded_batches(4)]
        runs.append((torch.stack(losses), model.state_dict(), cast))
    (plain, plain_state, _), (losses, state, cast) = runs
    assert torch.equal(losses, plain)
    assert all(torch.equal(state[k], v) for k, v in plain_state.items())
    assert all(torch.equal(c, p.detach().to(c.dtype)) for p, c in zip(cast.params, cast.copies, strict=True))


def test_state_moves_between_master_adamw_and_adamw():
    """A checkpoint of either optimizer resumes in the other: the next steps agree to the last bit."""
    def make(kind, model):
        return (MasterAdamW if kind == "master" else torch.optim.AdamW)(model.parameters(), lr=1e-2, weight_decay=0.1)

    batches = padded_batches(6)
    for first, second in (("master", "adamw"), ("adamw", "master")):
        results = []
        for resumed_kind in (first, second):
            model, _ = build()
            optimizer = make(first, model)
            torch.manual_seed(9)
            for b in batches[:3]:
                train_step(model, b, optimizer)
            saved = optimizer.state_dict()
            resumed = make(resumed_kind, model)
            resumed.load_state_dict(saved)
            losses = [train_step(model, b, resumed)["loss"].detach() for b in batches[3:]]
            results.append((torch.stack(losses), model.state_dict()))
        (a, state_a), (b, state_b) = results
        assert torch.equal(a, b), f"{first} -> {second}"
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_unsupported_options_say_so():
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    optimizer = MasterAdamW([p])
    optimizer.param_groups[0]["amsgrad"] = True  # as a loaded AdamW state of amsgrad would set it
    with pytest.raises(ValueError, match="neither amsgrad nor maximize"):
        optimizer.step()
    sparse = torch.nn.Parameter(torch.randn(4, 2))
    sparse.grad = torch.sparse_coo_tensor([[1], [0]], torch.ones(1), (4, 2))  # one entry, not a whole row
    with pytest.raises(ValueError, match=r"sparse gradients of whole rows only .* sparse_dim 2"):
        MasterAdamW([sparse]).step()


TABLE = "items.collection.embeddings.t_item.weight"


def _run_tables(sparse: bool, static: bool, steps: int = 3, defer: bool = False, weight_decay: float = 0.0):
    """A float32 teacher (``sparse_tables`` as given) stepped by MasterAdamW (its tables deferred or not);
    per step the item-table rows it looked up, and the table after it."""
    model, _ = build(sparse_tables=sparse)
    optimizer = MasterAdamW(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    if defer:
        assert optimizer.defer_rows(model) == [n for n, p in model.named_parameters() if "collection" in n]
    step = StaticStep(model, optimizer, autocast_dtype=None, config=GraphConfig()) if static else None
    table = dict(model.named_parameters())[TABLE]
    torch.manual_seed(9)
    losses, touched, tables = [], [], []
    for batch in padded_batches(steps):
        losses.append(step(batch)["loss"] if static else train_step(model, batch, optimizer)["loss"].detach())
        grad = table.grad
        assert grad.is_sparse == sparse
        touched.append(torch.unique(grad._indices()[0]) if sparse else None)
        tables.append(table.detach().clone())
    return torch.stack(losses), touched, tables, model, optimizer


@pytest.mark.parametrize("static", [False, True], ids=["plain_step", "static_step"])
def test_sparse_tables_step_only_the_rows_a_batch_looked_up(static):
    """With ``sparse_tables`` the tables' gradients are sparse and MasterAdamW steps only the rows they name. The
    first step equals dense AdamW's (an untouched row's first AdamW update is zero); from the second on, a row
    looked up before but not in this step keeps its value where dense AdamW moves it on its momentum."""
    losses, touched, tables, model, _ = _run_tables(sparse=True, static=static)
    dense_losses, _, dense_tables, _, _ = _run_tables(sparse=False, static=static)
    torch.testing.assert_close(losses[:2], dense_losses[:2], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(tables[0], dense_tables[0], rtol=1e-6, atol=1e-7)
    assert model.cfg.sparse_tables and not any(p.grad.is_sparse for n, p in model.named_parameters() if "collection" not in n)
    first = torch.zeros(tables[0].shape[0], dtype=torch.bool)
    first[touched[0]] = True
    second = torch.zeros_like(first)
    second[touched[1]] = True
    idle = first & ~second  # looked up at step 1, not at step 2
    assert idle.any() and second.any()
    assert torch.equal(tables[1][idle], tables[0][idle])
    assert not torch.allclose(dense_tables[1][idle], dense_tables[0][idle])
    assert not torch.equal(tables[1][second], tables[0][second])


@pytest.mark.parametrize("static", [False, True], ids=["plain_step", "static_step"])
def test_deferred_tables_train_as_dense_adamw(static):
    """With ``defer_rows`` the sparse tables step only the rows a batch looked up, yet every forward reads what
    dense AdamW would have (the losses of 6 steps agree), and the state a checkpoint takes is dense AdamW's: the
    tables and their moments after ``state_dict`` (which brings every row to date; before it some rows were behind).
    With weight decay, so the rows no step named also decay."""
    losses, _, tables, model, optimizer = _run_tables(sparse=True, static=static, steps=6, defer=True, weight_decay=0.1)
    dense_losses, _, dense_tables, dense_model, dense_optimizer = _run_tables(sparse=False, static=static, steps=6,
                                                                              weight_decay=0.1)
    torch.testing.assert_close(losses, dense_losses, rtol=1e-5, atol=1e-6)
    deferred = optimizer.deferred[dict(model.named_parameters())[TABLE]]
    behind = deferred.last < deferred.now
    assert behind.any() and not torch.allclose(tables[-1][behind], dense_tables[-1][behind])
    state, dense_state = optimizer.state_dict()["state"], dense_optimizer.state_dict()["state"]
    assert bool((deferred.last == deferred.now).all())
    for (name, p), dense_p in zip(model.named_parameters(), dense_model.parameters(), strict=True):
        torch.testing.assert_close(p, dense_p, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    for i, moments in state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(moments[key], dense_state[i][key], rtol=1e-4, atol=1e-9)


def test_deferred_tables_resume_from_their_state():
    """A deferred optimizer's state loads into a fresh one over the same model (every row current at the loaded
    step), which then steps as the original would."""
    batches = padded_batches(5)
    runs = []
    for split in (False, True):
        model, _ = build(sparse_tables=True)
        optimizer = MasterAdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        optimizer.defer_rows(model)
        torch.manual_seed(9)
        for i, batch in enumerate(batches):
            if split and i == 3:
                state = optimizer.state_dict()
                optimizer = MasterAdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
                optimizer.load_state_dict(state)
                optimizer.defer_rows(model)
            train_step(model, batch, optimizer)
        optimizer.flush_rows()
        runs.append({k: v.clone() for k, v in model.state_dict().items()})
    for key in runs[0]:
        torch.testing.assert_close(runs[1][key], runs[0][key], rtol=1e-6, atol=1e-7, msg=key)


def test_deferred_rows_across_schedule_restarts(monkeypatch):
    """A table whose schedule holds 3 steps (it restarts every 2: all rows brought to date, then on) under a rate
    that changes every step and weight decay: each step's loss and the final table are dense AdamW's."""
    import foundation.model.deferred_rows as deferred_rows

    monkeypatch.setattr(deferred_rows, "CAPACITY", 3)
    torch.manual_seed(0)
    ours = torch.nn.Embedding(30, 6, sparse=True)
    theirs = torch.nn.Embedding(30, 6)
    theirs.weight.data.copy_(ours.weight.data)
    optimizers = [MasterAdamW(table.parameters(), lr=1e-2, weight_decay=0.1) for table in (ours, theirs)]
    optimizers[0].defer_rows(ours)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 12):
        ids = torch.randint(0, 30, (5,), generator=g)  # most rows sit out most steps
        target = torch.randn(5, 6, generator=g)
        losses = []
        for table, optimizer in zip((ours, theirs), optimizers, strict=True):
            optimizer.param_groups[0]["lr"] = 1e-2 * (1 + 0.5 * (step % 3))
            optimizer.zero_grad(set_to_none=True)
            loss = ((table(ids) - target) ** 2).sum()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6, msg=f"step {step}")
    rows = optimizers[0].deferred[ours.weight]
    assert rows.base == 10 and bool((rows.last < rows.now).any())
    optimizers[0].flush_rows()
    torch.testing.assert_close(ours.weight, theirs.weight, rtol=1e-6, atol=1e-7)


def _clip_case(sparse: bool, scale: float):
    """An embedding (ids repeated) and a linear layer after a backward, the loss scaled by ``scale``."""
    torch.manual_seed(4)
    table, linear = torch.nn.Embedding(12, 6, sparse=sparse), torch.nn.Linear(6, 1)
    ids = torch.tensor([3, 7, 3, 3, 0, 7])
    (scale * linear(table(ids)).square().sum()).backward()
    return [table.weight, *linear.parameters()]


@pytest.mark.parametrize("scale", [100.0, 1e-3], ids=["clipped", "under_the_norm"])
def test_clip_with_sparse_table_gradients_is_the_dense_clip(scale):
    """clip_grad_norm over a sparse table gradient (repeated rows) returns torch's norm of the dense gradients and
    leaves the same gradients (as dense tensors) as torch's clip of those; without sparse gradients it is torch's
    clip to the bit."""
    from foundation.model.precision import clip_grad_norm

    dense = _clip_case(sparse=False, scale=scale)
    sparse = _clip_case(sparse=True, scale=scale)
    assert sparse[0].grad.is_sparse and sparse[0].grad._values().shape[0] == 6
    expected = torch.nn.utils.clip_grad_norm_(dense, 1.0)
    total = clip_grad_norm(sparse, 1.0)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for ours, theirs in zip(sparse, dense, strict=True):
        got = ours.grad.to_dense() if ours.grad.is_sparse else ours.grad
        torch.testing.assert_close(got, theirs.grad, rtol=1e-6, atol=1e-7)
    assert (float(expected) > 1.0) == (scale > 1)  # the first case clips, the second does not
    plain, ours = _clip_case(sparse=False, scale=scale), _clip_case(sparse=False, scale=scale)
    assert torch.equal(clip_grad_norm(ours, 1.0), torch.nn.utils.clip_grad_norm_(plain, 1.0))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, plain, strict=True))
