"""The static-shape training step (:class:`gem.loop.StaticStep`) on CPU: everything but the CUDA graph capture —
per-bucket static buffers reused across steps, the lookups run apart from the dense part, and training that
equals the plain step on the same padded batches."""

from __future__ import annotations

import pytest
import torch

from foundation.model.padding import StaticShapes, pad_batch
from foundation.model.teacher import build_teacher
from gem.loop import GraphConfig, StaticStep, train_step
from tests.teacher_batches import CTR_SCHEMA, make_batch, tiny_config
from tests.test_ml1m_reference import ALL_SWITCHES

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPES = StaticShapes(tokens=48, rows=(8, 16), max_len=12)
# Two buckets: 16 rows (the first two: 6 rows and 3 padding rows of 28 missing tokens; 10 rows and 1) and
# 8 rows (the third: 6 rows and 2 padding rows).
LENGTHS = [[0, 1, 5, 9, 3, 2], [4, 4, 1, 0, 7, 2, 3, 1, 9, 5], [12, 3, 0, 1, 6, 2]]


def padded_batches(steps: int) -> list:
    return [pad_batch(make_batch(CTR_SCHEMA, LENGTHS[i % 3], seed=i), SHAPES) for i in range(steps)]


def build(seed: int = 0, **changes):
    torch.manual_seed(seed)
    model = build_teacher(tiny_config(generative=True, in_batch_negatives=True, dropout=0.1, **changes), CTR_SCHEMA)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("changes", [{}, ALL_SWITCHES], ids=["default", "reference_block"])
def test_static_step_trains_as_the_plain_step(changes):
    batches = padded_batches(5)
    model, optimizer = build(**changes)
    torch.manual_seed(9)  # negatives and dropout, drawn in the same order by both
    plain = [train_step(model, b, optimizer)["loss"].detach() for b in batches]
    plain_state = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = build(**changes)
    step = StaticStep(model, optimizer, autocast_dtype=None, config=GraphConfig())
    torch.manual_seed(9)
    static = [step(b)["loss"] for b in batches]
    torch.testing.assert_close(torch.stack(static), torch.stack(plain), rtol=1e-6, atol=1e-7)
    for name, value in model.state_dict().items():  # dense parameters and the tables alike
        torch.testing.assert_close(value, plain_state[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_static_buffers_are_made_once_per_bucket_and_reused():
    batches = padded_batches(6)
    originals = [b.history["item_ids"].clone() for b in batches]
    model, optimizer = build()
    step = StaticStep(model, optimizer, autocast_dtype=None, config=GraphConfig())
    pointers = []
    for batch in batches:
        step(batch)
        pointers.append({id(slot): [t.data_ptr() for t in (slot.batch.offsets, *slot.leaves)] for slot in step.slots.values()})
    assert len(step.slots) == 2 and {tuple(s.batch.offsets.shape) for s in step.slots.values()} == {(9,), (17,)}
    assert len(pointers[1]) == 1 and all(p == pointers[-1] for p in pointers[2:])  # the same buffers every step
    assert [s.steps for s in step.slots.values()] == [4, 2]
    last = step.slots[next(iter(step.slots))]
    assert torch.equal(last.batch.history["item_ids"], batches[4].history["item_ids"])  # holds the latest batch
    # The caller's batches are copied from, never written to.
    assert all(torch.equal(b.history["item_ids"], o) for b, o in zip(batches, originals, strict=True))


def test_cuda_graphs_on_a_cpu_model_say_so_once_and_run_eagerly():
    lines = []
    model, optimizer = build()
    step = StaticStep(model, optimizer, autocast_dtype=None, config=GraphConfig(cuda_graphs=True, warmup_steps=0), log=lines.append)
    losses = [step(b)["loss"] for b in padded_batches(3)]
    assert lines == ["cuda graphs off: the model is on cpu; eager steps"]
    assert step.graphs == 0 and all(torch.isfinite(loss) for loss in losses)


def test_parameters_cast_once_inside_the_static_step_train_exactly_as_autocast():
    """Under bf16 autocast, a CastOnce inside the static step (its copies refreshed and their gradients converted
    back inside the dense part, where a graph would hold them) gives the losses and parameters of autocast's own
    casts, to the last bit; the copies stand in for the GEMM weights from the second step on."""
    from foundation.model.precision import CastOnce

    batches = padded_batches(4)
    runs = []
    for cast_once in (False, True):
        model, optimizer = build()
        cast = CastOnce(model) if cast_once else None
        step = StaticStep(model, optimizer, autocast_dtype=torch.bfloat16, config=GraphConfig(), cast_once=cast)
        torch.manual_seed(9)
        losses = torch.stack([step(b)["loss"] for b in batches])
        runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}, cast))
    (plain, plain_state, _), (losses, state, cast) = runs
    assert torch.equal(losses, plain)
    assert all(torch.equal(state[k], plain_state[k]) for k in plain_state), "parameters moved apart"
    assert "blocks.0.uvqk.weight" in cast.names and "items.collection.embeddings.t_item.weight" not in cast.names
    params = list(cast.model.parameters())
    assert sum(t.dtype == torch.bfloat16 for t in cast.grad_targets(params)) == len(cast.names)
    # The last step's gradients of the cast parameters are the copies' ones, converted into the cast's buffers.
    assert all(p.grad.data_ptr() == buffer.data_ptr() for p, buffer in zip(cast.params, cast.grads, strict=True))


def train_static(batches, prepare_after: int | None, monkeypatch=None) -> tuple[torch.Tensor, dict, StaticStep]:
    """Losses and final state of a static step over ``batches`` (dropout on, so the random numbers count), with
    :meth:`StaticStep.prepare` called on the first batch after ``prepare_after`` steps (None: never)."""
    model, optimizer = build()
    step = StaticStep(model, optimizer, autocast_dtype=None, config=GraphConfig(warmup_steps=2))
    torch.manual_seed(9)
    losses = []
    for i, batch in enumerate(batches):
        if i == prepare_after:
            params = {k: v.clone() for k, v in model.state_dict().items()}
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            assert step.prepare(batches[0], SHAPES) == [8, 16]
            assert {tuple(s.batch.offsets.shape): s.steps >= 2 for s in step.slots.values()} == {(9,): True, (17,): True}
            assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
            assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if n in grads)
        losses.append(step(batch)["loss"])
    return torch.stack(losses), {k: v.clone() for k, v in model.state_dict().items()}, step


@pytest.mark.parametrize("prepare_after", [0, 1], ids=["before_the_first_step", "after_it"])
def test_buckets_prepared_up_front_leave_training_exactly_as_it_was(prepare_after):
    """Every bucket's warm-up steps run on stand-ins (the 8-row one from the first batch's first rows), and the
    training that follows is the one without them to the last bit: no parameter, gradient, optimizer state or
    random number is touched."""
    batches = padded_batches(5)
    plain_losses, plain_state, _ = train_static(batches, None)
    losses, state, step = train_static(batches, prepare_after)
    assert torch.equal(losses, plain_losses)
    assert all(torch.equal(state[k], plain_state[k]) for k in plain_state)
    # Batches 0, 1, 3, 4 take the 16-row bucket, 2 the 8-row one; the warm-ups count as steps.
    steps = {s.batch.batch_size: s.steps for s in step.slots.values()}
    assert steps == ({16: 2 + 4, 8: 2 + 1} if prepare_after == 0 else {16: 2 + 3, 8: 2 + 1})


def test_prepared_buckets_would_shift_the_random_numbers_without_the_restore(monkeypatch):
    """The test above can fail: with the generators not restored, the stand-ins' dropout and negatives use up
    random numbers and the later losses differ."""
    import contextlib

    batches = padded_batches(3)
    plain_losses, _, _ = train_static(batches, None)
    monkeypatch.setattr(torch.random, "fork_rng", lambda **_: contextlib.nullcontext())
    losses, _, _ = train_static(batches, 1)
    assert torch.equal(losses[0], plain_losses[0]) and not torch.equal(losses[1:], plain_losses[1:])
