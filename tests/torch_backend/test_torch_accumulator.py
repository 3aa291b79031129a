"""`gradaccum.GradientAccumulator` on PyTorch: a custom training loop in keras.io's
"training loop from scratch in PyTorch" pattern (`loss.backward()`, the parameters'
`.grad` handed to `acc.step`, `acc.apply` for the last partial window), against one
large batch per window: weights, optimizer variables and counters."""

from __future__ import annotations

import doctest
import re
import warnings

import keras
import numpy as np
import pytest
import torch
from largebatch import SCE, assert_optimizer_close, assert_weights_close, data, mlp

import gradaccum
from gradaccum.core.validation import variable_name

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
}


def grads_of(model, x, y, loss_scale_optimizer=None):
    """One micro-batch's backward pass as keras.io's torch loop does it: the
    parameters' `.grad` (of the scaled loss with a LossScaleOptimizer)."""
    loss = SCE(torch.as_tensor(y), model(torch.as_tensor(x), training=True))
    if loss_scale_optimizer is not None:
        loss = loss_scale_optimizer.scale_loss(loss)
    model.zero_grad()
    loss.backward()
    return [v.value.grad for v in model.trainable_weights]


class Loop:
    """A model, its optimizer and an accumulator, trained micro-batch by micro-batch
    with `acc.step`, each micro-batch weighted by its size."""

    def __init__(self, optimizer, seed=0, **options):
        self.model = mlp(seed)
        self.optimizer = optimizer
        self.acc = gradaccum.GradientAccumulator(self.model.trainable_weights, **options)

    def run(self, x, y, sizes, start=0):
        """Steps through micro-batches of `sizes` from `start`; returns whether each
        made an update."""
        applied = []
        for size in sizes:
            part = slice(start, start + size)
            grads = grads_of(self.model, x[part], y[part])
            applied.append(bool(self.acc.step(self.optimizer, grads, weight=size)))
            start += size
        return applied

    def finish(self):
        """Applies the partial window left at the end of the data."""
        return bool(self.acc.apply(self.optimizer))


def reference(optimizer, x, y, windows, seed=0):
    """Plain Keras on torch: one `train_on_batch` per window on the concatenated
    window (`windows`: their sizes, in order)."""
    model = mlp(seed)
    model.compile(optimizer=optimizer, loss=SCE)
    start = 0
    for size in windows:
        model.train_on_batch(x[start:start + size], y[start:start + size])
        start += size
    return model


def zeros_like(variables):
    return [torch.zeros(tuple(v.shape)) for v in variables]


def is_empty(acc):
    return (int(acc.micro_step.numpy()) == 0 and float(acc.total_weight.numpy()) == 0.0
            and all(not np.any(v.numpy()) for v in acc.accumulators))


# Against one large batch ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_unequal_micro_batches_and_a_partial_window_equal_one_large_batch_each(name):
    x, y = data(87)
    loop = Loop(OPTIMIZERS[name](), steps=3)
    applied = loop.run(x, y, [16, 16, 8, 5, 20, 15, 3, 4])  # 40, 40, then 7 open
    assert applied == [False, False, True] * 2 + [False, False]
    assert int(loop.acc.micro_step.numpy()) == 2
    assert loop.finish()
    expected = reference(OPTIMIZERS[name](), x, y, [40, 40, 7])
    assert_weights_close(loop.model, expected)
    assert_optimizer_close(loop.optimizer, expected.optimizer)
    assert int(loop.optimizer.iterations.numpy()) == 3
    assert int(loop.acc.updates.numpy()) == 3
    assert int(loop.acc.micro_batches.numpy()) == 8
    assert int(loop.acc.last_window_micro_batches.numpy()) == 2
    assert float(loop.acc.last_window_weight.numpy()) == 7.0
    assert int(loop.acc.skipped.numpy()) == 0 and loop.acc.all_reduces == 0
    assert is_empty(loop.acc)
    # The window is applied: a second apply has nothing to do.
    assert not loop.finish()
    assert int(loop.optimizer.iterations.numpy()) == 3


def test_uniform_weights_are_not_exact_for_unequal_micro_batches():
    """Why weights exist: the plain 1/k mean misses the large-batch update."""
    x, y = data(40)
    model = mlp(0)
    optimizer = keras.optimizers.SGD(0.1)
    acc = gradaccum.GradientAccumulator(model.trainable_weights, steps=3)
    for part in (slice(0, 16), slice(16, 32), slice(32, 40)):
        acc.step(optimizer, grads_of(model, x[part], y[part]))  # weight 1 each
    expected = reference(keras.optimizers.SGD(0.1), x, y, [40])
    gap = max(float(np.abs(a - b).max())
              for a, b in zip(model.get_weights(), expected.get_weights()))
    assert gap > 1e-4


def test_counters_and_iterations_advance_once_per_update():
    x, y = data(8)
    loop = Loop(keras.optimizers.SGD(0.1), steps=4)
    seen = []
    for _ in range(10):
        applied = loop.run(x, y, [8])[0]
        seen.append((applied, int(loop.acc.micro_step.numpy()),
                     float(loop.acc.total_weight.numpy()),
                     int(loop.optimizer.iterations.numpy()), int(loop.acc.window_length()),
                     bool(loop.acc.window_due())))
    assert [s[0] for s in seen] == [False, False, False, True] * 2 + [False, False]
    assert [s[1] for s in seen] == [1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    assert [s[2] for s in seen] == [8, 16, 24, 0, 8, 16, 24, 0, 8, 16]
    assert [s[3] for s in seen] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert [s[4] for s in seen] == [1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    assert not any(s[5] for s in seen)
    assert int(loop.acc.updates.numpy()) == 2 and int(loop.acc.micro_batches.numpy()) == 10


def test_without_apply_the_open_window_stays_in_the_state():
    x, y = data(24)
    loop = Loop(keras.optimizers.SGD(0.1), steps=2)
    before = [v.numpy() for v in loop.model.trainable_weights]
    assert loop.run(x, y, [8, 8, 8]) == [False, True, False]
    assert int(loop.acc.micro_step.numpy()) == 1
    assert float(loop.acc.total_weight.numpy()) == 8.0
    assert int(loop.optimizer.iterations.numpy()) == 1
    # The open window's sums hold 8 x its micro-batch's gradient.
    model = mlp(0)
    first = reference(keras.optimizers.SGD(0.1), x, y, [16])
    model.set_weights(first.get_weights())
    for total, grad in zip(loop.acc.accumulators, grads_of(model, x[16:], y[16:])):
        np.testing.assert_allclose(total.numpy(), 8 * grad.numpy(), rtol=1e-5, atol=1e-6)
    assert any(np.any(a != v.numpy()) for a, v in zip(before, loop.model.trainable_weights))


def test_apply_with_nothing_accumulated_is_a_no_op():
    model = mlp(0)
    optimizer = keras.optimizers.Adam(0.1)
    before = model.get_weights()
    acc = gradaccum.GradientAccumulator(model.trainable_weights)
    assert not bool(acc.apply(optimizer))
    assert int(optimizer.iterations.numpy()) == 0 and int(acc.updates.numpy()) == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


# Schedules, budgets, reductions --------------------------------------------------------


def test_a_schedule_of_pairs_by_update_index():
    x, y = data(56)
    loop = Loop(keras.optimizers.Adam(0.01), steps=[(0, 1), (1, 2), (3, 3)])
    assert loop.acc.steps == ((0, 1), (1, 2), (3, 3))
    # Windows of 1, 2, 2 micro-batches, then one of 3 that the data ends after 2.
    assert loop.run(x, y, [8] * 7) == [True, False, True, False, True, False, False]
    assert loop.finish()
    expected = reference(keras.optimizers.Adam(0.01), x, y, [8, 16, 16, 16])
    assert_weights_close(loop.model, expected)
    assert_optimizer_close(loop.optimizer, expected.optimizer)
    assert int(loop.acc.updates.numpy()) == 4
    assert int(loop.acc.last_window_micro_batches.numpy()) == 2


def test_a_callable_schedule_is_read_when_a_window_opens():
    x, y = data(28)
    calls = []

    def steps(update_index):
        calls.append(update_index)
        return update_index + 1

    loop = Loop(keras.optimizers.RMSprop(0.01), steps=steps)
    assert loop.acc.steps is steps
    applied = loop.run(x, y, [4, 6, 2, 8, 3, 5])  # windows of 1, 2 and 3 micro-batches
    assert applied == [True, False, True, False, False, True]
    expected = reference(keras.optimizers.RMSprop(0.01), x, y, [4, 8, 16])
    assert_weights_close(loop.model, expected)
    assert_optimizer_close(loop.optimizer, expected.optimizer)
    assert int(loop.acc.updates.numpy()) == 3
    assert {0, 1, 2} <= set(calls)


def test_a_weight_budget_closes_a_window_once_its_weight_reaches_it():
    x, y = data(40)
    loop = Loop(keras.optimizers.Adam(0.01), weight_per_update=12)
    assert loop.acc.weight_per_update == 12.0 and loop.acc.steps is None
    applied = loop.run(x, y, [8, 8, 4, 12, 8])  # windows 16, 16, then 8 open
    assert applied == [False, True, False, True, False]
    assert float(loop.acc.total_weight.numpy()) == 8.0
    assert loop.finish()
    expected = reference(keras.optimizers.Adam(0.01), x, y, [16, 16, 8])
    assert_weights_close(loop.model, expected)
    assert_optimizer_close(loop.optimizer, expected.optimizer)
    assert float(loop.acc.last_window_weight.numpy()) == 8.0


@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_reduction_sum_applies_the_sum_of_the_micro_batch_gradients(name):
    x, y = data(36)
    loop = Loop(OPTIMIZERS[name](), steps=3, reduction="sum")
    assert loop.acc.reduction == "sum"
    for start in range(0, 36, 6):  # weights are ignored
        part = slice(start, start + 6)
        loop.acc.step(loop.optimizer, grads_of(loop.model, x[part], y[part]), weight=123.0)
    # The reference: keras.io's loop on the window's loss whose gradient is
    # sum_i grad(L_i), the sum of the micro-batch means.
    model, optimizer = mlp(0), OPTIMIZERS[name]()
    for window in (0, 18):
        loss = sum(SCE(torch.as_tensor(y[s:s + 6]), model(torch.as_tensor(x[s:s + 6])))
                   for s in range(window, window + 18, 6))
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            optimizer.apply([v.value.grad for v in model.trainable_weights],
                            model.trainable_weights)
    assert_weights_close(loop.model, model)
    assert_optimizer_close(loop.optimizer, optimizer)
    assert int(loop.acc.updates.numpy()) == 2


# accumulate, apply_if, drop, reset, gradients() -----------------------------------------


def test_accumulate_then_apply_if_drop_and_reset():
    v = keras.Variable([1.0, 1.0])
    optimizer = keras.optimizers.SGD(0.5)
    acc = gradaccum.GradientAccumulator([v])
    assert acc.steps is None and acc.weight_per_update is None
    assert bool(acc.accumulate([torch.tensor([1.0, 2.0])], weight=1.0))
    assert bool(acc.accumulate([torch.tensor([4.0, 8.0])], weight=3.0))
    # gradients() reads the open window without emptying it.
    for _ in range(2):
        np.testing.assert_allclose(acc.gradients()[0].numpy(), [13 / 4, 26 / 4])
    assert int(acc.micro_step.numpy()) == 2 and float(acc.total_weight.numpy()) == 4.0
    assert not bool(acc.window_due())  # without steps, the caller decides
    assert not bool(acc.apply_if(optimizer, False))
    assert int(acc.micro_step.numpy()) == 2
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])
    assert bool(acc.apply_if(optimizer, torch.tensor(True)))
    np.testing.assert_allclose(v.numpy(), [1 - 0.5 * 13 / 4, 1 - 0.5 * 26 / 4])
    assert int(optimizer.iterations.numpy()) == 1 and int(acc.updates.numpy()) == 1
    assert is_empty(acc)
    assert not bool(acc.apply_if(optimizer, True))  # an empty window: nothing

    # drop discards a window (and says whether there was one); v stays.
    acc.accumulate([torch.tensor([5.0, 5.0])], weight=2.0)
    assert bool(acc.drop())
    assert is_empty(acc) and not bool(acc.drop())
    # reset empties the window too.
    acc.accumulate([torch.tensor([5.0, 5.0])], weight=2.0)
    acc.reset()
    assert is_empty(acc)
    assert not bool(acc.apply(optimizer))
    np.testing.assert_allclose(v.numpy(), [1 - 0.5 * 13 / 4, 1 - 0.5 * 26 / 4])
    assert int(acc.updates.numpy()) == 1 and int(acc.micro_batches.numpy()) == 4


def test_accumulate_weighted_equals_accumulate():
    v = keras.Variable([0.0, 0.0])
    plain = gradaccum.GradientAccumulator([v])
    weighted = gradaccum.GradientAccumulator([v])
    for grad, w in (([1.0, 2.0], 3.0), ([5.0, -1.0], 1.0)):
        plain.accumulate([torch.tensor(grad)], weight=w)
        weighted.accumulate_weighted([w * torch.tensor(grad)], weight=w)
    np.testing.assert_allclose(weighted.gradients()[0].numpy(), plain.gradients()[0].numpy())
    np.testing.assert_allclose(plain.gradients()[0].numpy(), [8 / 4, 5 / 4])
    assert float(weighted.total_weight.numpy()) == 4.0
    assert int(weighted.micro_step.numpy()) == 2


def test_a_manual_loop_with_accumulate_and_apply_equals_the_large_batch():
    x, y = data(48)
    model = mlp(0)
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    acc = gradaccum.GradientAccumulator(model.trainable_weights)
    for window in ((0, 10, 16), (16, 40, 48)):
        for start, end in zip(window, window[1:]):
            acc.accumulate(grads_of(model, x[start:end], y[start:end]), weight=end - start)
        assert bool(acc.apply(optimizer))
    expected = reference(keras.optimizers.AdamW(0.01, weight_decay=0.1), x, y, [16, 32])
    assert_weights_close(model, expected)
    assert_optimizer_close(optimizer, expected.optimizer)


# None gradients ----------------------------------------------------------------------------


def two_heads():
    """A shared layer and two heads: a loss that leaves out head `b` gives its
    parameters no `.grad`."""
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(3)(hidden), keras.layers.Dense(3)(hidden)])
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def head_loss(model, x, y, use_b):
    a, b = model(torch.as_tensor(x), training=True)
    loss = SCE(torch.as_tensor(y), a)
    return loss + SCE(torch.as_tensor(y), b) if use_b else loss


def head_grads(model, x, y, use_b):
    loss = head_loss(model, x, y, use_b)
    model.zero_grad()
    loss.backward()
    return [v.value.grad for v in model.trainable_weights]


def head_reference(x, y, windows):
    """keras.io's loop on each window's loss `sum_i n_i L_i / sum_i n_i` (head `b`'s
    term where used), Keras's `optimizer.apply` leaving out a None gradient."""
    model = two_heads()
    optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.5)
    for window in windows:
        total = sum(end - start for start, end, _ in window)
        loss = sum((end - start) * head_loss(model, x[start:end], y[start:end], use_b)
                   for start, end, use_b in window) / total
        model.zero_grad()
        loss.backward()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Gradients do not exist")
            optimizer.apply([v.value.grad for v in model.trainable_weights],
                            model.trainable_weights)
    return model, optimizer


def test_a_none_gradient_in_some_micro_batches_counts_as_zero_there():
    x, y = data(20)
    window = [(0, 6, True), (6, 10, False), (10, 20, True)]
    model = two_heads()
    optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.5)
    acc = gradaccum.GradientAccumulator(model.trainable_weights, steps=3)
    b = [4, 5]  # head b's kernel and bias
    for i, (start, end, use_b) in enumerate(window):
        grads = head_grads(model, x[start:end], y[start:end], use_b)
        assert (grads[b[0]] is None) is (not use_b)
        if i == 1:
            before = [t.numpy().copy() for t in acc.accumulators]
        acc.step(optimizer, grads, weight=end - start)
        if i == 1:
            # Head b's sums keep what they held; the others grew.
            for j in b:
                np.testing.assert_array_equal(acc.accumulators[j].numpy(), before[j])
            np.testing.assert_array_equal(acc.received.numpy(), [2, 2, 2, 2, 1, 1])
    assert int(acc.updates.numpy()) == 1
    expected, expected_optimizer = head_reference(x, y, [window])
    assert_weights_close(model, expected)
    assert_optimizer_close(optimizer, expected_optimizer)


def test_a_variable_without_a_gradient_in_the_whole_window_is_left_out():
    """As Keras leaves out a None gradient: head b takes no step, no weight decay,
    and its optimizer slots stay as they were."""
    x, y = data(32)
    windows = [[(0, 8, True), (8, 16, False)], [(16, 24, False), (24, 32, False)]]
    model = two_heads()
    optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.5)
    acc = gradaccum.GradientAccumulator(model.trainable_weights, steps=2)
    b_variables = model.trainable_weights[4:]
    optimizer.build(model.trainable_weights)
    b_slots = [s for s in optimizer.variables
               if any(s.path.endswith(v.path.replace("/", "_") + "_" + kind)
                      for v in b_variables for kind in ("momentum", "velocity"))]
    assert len(b_slots) == 4
    for window in windows:
        if window is windows[1]:
            b_before = [v.numpy().copy() for v in b_variables]
            slots_before = [s.numpy().copy() for s in b_slots]
            assert any(np.any(s) for s in slots_before)
        for i, (start, end, use_b) in enumerate(window):
            grads = head_grads(model, x[start:end], y[start:end], use_b)
            acc.step(optimizer, grads, weight=end - start)
            if window is windows[1] and i == 0:
                combined = acc.gradients()
                assert [g is None for g in combined] == [False] * 4 + [True] * 2
    for variable, value in zip(b_variables, b_before):
        np.testing.assert_array_equal(variable.numpy(), value)
    for slot, value in zip(b_slots, slots_before):
        np.testing.assert_array_equal(slot.numpy(), value)
    assert int(optimizer.iterations.numpy()) == 2
    expected, expected_optimizer = head_reference(x, y, windows)
    assert_weights_close(model, expected)
    assert_optimizer_close(optimizer, expected_optimizer)


# Non-finite gradients ----------------------------------------------------------------------


def poisoned(x, rows, value=np.nan):
    bad = x.copy()
    bad[rows, 0] = value
    return bad


def test_skip_drops_the_micro_batch_with_its_weight_and_warns_once():
    x, y = data(24)
    bad = poisoned(x, 9)  # in the third micro-batch of 4
    loop = Loop(keras.optimizers.Adam(0.01), steps=3)
    assert loop.acc.nonfinite == "skip"
    with pytest.warns(UserWarning, match=r"skipped 1 micro-batch\(es\) whose gradient is "
                                         r"not finite") as caught:
        applied = loop.run(bad, y, [4] * 6)
    assert len([w for w in caught if "gradaccum skipped" in str(w.message)]) == 1
    assert applied == [False, False, True, False, False, True]
    assert int(loop.acc.skipped.numpy()) == 1 and int(loop.acc.micro_batches.numpy()) == 6
    assert int(loop.acc.updates.numpy()) == 2
    # The window closed after 3 micro-batches all the same, from the 2 good ones.
    model = mlp(0)
    optimizer = keras.optimizers.Adam(0.01)
    for index in (np.r_[0:8], np.r_[12:24]):
        grads = grads_of(model, x[index], y[index])
        with torch.no_grad():
            optimizer.apply(grads, model.trainable_weights)
    assert_weights_close(loop.model, model)
    assert_optimizer_close(loop.optimizer, optimizer)

    # The skipped weight is dropped: the open window weighs what was accepted.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second skip does not warn again
        loop.acc.accumulate(grads_of(loop.model, x[:4], y[:4]), weight=4)
        accepted = loop.acc.accumulate(grads_of(loop.model, bad[8:12], y[8:12]), weight=4)
    assert not bool(accepted)
    assert int(loop.acc.skipped.numpy()) == 2
    assert float(loop.acc.total_weight.numpy()) == 4.0
    # The window counts it (a window of steps=3 closes after it), its sums do not.
    assert int(loop.acc.window_length()) == 2 and int(loop.acc.micro_step.numpy()) == 1
    assert int(loop.acc.window_skipped.numpy()) == 1


def test_apply_lets_a_nan_through_as_keras_does():
    x, y = data(8)
    loop = Loop(keras.optimizers.SGD(0.1), steps=2, nonfinite="apply")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.run(poisoned(x, 5), y, [4, 4])
    assert int(loop.acc.skipped.numpy()) == 0 and int(loop.acc.updates.numpy()) == 1
    assert np.isnan(loop.model.get_weights()[0]).any()


def test_raise_names_the_micro_batch_and_changes_nothing():
    x, y = data(24)
    loop = Loop(keras.optimizers.SGD(0.1), steps=2, nonfinite="raise")
    loop.run(x, y, [4, 4, 4])  # one window applied, one micro-batch open
    weights = loop.model.get_weights()
    state = {k: v.clone() for k, v in loop.acc.state_dict().items()}
    message = ("gradaccum: a gradient is not finite (inf or nan) in micro-batch 4 "
               "(counted from 1; the micro-batch 2 of its window): nonfinite=raise stops "
               "here. Check the data and the loss of that micro-batch, or use "
               "nonfinite=skip to drop it.")
    with pytest.raises(FloatingPointError, match=f"^{re.escape(message)}$"):
        loop.run(poisoned(x, 13, np.inf), y, [4], start=12)
    for a, b in zip(weights, loop.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for name, value in loop.acc.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), state[name].numpy(), err_msg=name)
    # The loop can go on with good data.
    assert loop.run(x, y, [4], start=12) == [True]
    assert int(loop.acc.updates.numpy()) == 2 and int(loop.acc.skipped.numpy()) == 0


def test_a_nonfinite_callable_decides_which_micro_batches_are_skipped():
    x, y = data(24)
    seen = []

    def too_large(gradients):
        seen.append(len(gradients))
        return torch.stack([g.abs().max() for g in gradients if g is not None]).max() > 1e3

    model = mlp(0)
    optimizer = keras.optimizers.Adam(0.01)
    acc = gradaccum.GradientAccumulator(model.trainable_weights, steps=3,
                                        nonfinite=too_large)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a callable's skip is not warned about
        for start in range(0, 24, 4):
            grads = grads_of(model, x[start:start + 4], y[start:start + 4])
            if start == 4:  # an exploding micro-batch
                grads = [g * 1e6 for g in grads]
            acc.step(optimizer, grads, weight=4)
    assert seen == [4] * 6
    assert int(acc.skipped.numpy()) == 1 and int(acc.updates.numpy()) == 2
    expected = keras.optimizers.Adam(0.01)
    reference_model = mlp(0)
    for index in (np.r_[0:4, 8:12], np.r_[12:24]):
        grads = grads_of(reference_model, x[index], y[index])
        with torch.no_grad():
            expected.apply(grads, reference_model.trainable_weights)
    assert_weights_close(model, reference_model)
    assert_optimizer_close(optimizer, expected)


def test_a_nonfinite_callable_must_return_a_boolean():
    v = keras.Variable([1.0])
    acc = gradaccum.GradientAccumulator([v], nonfinite=lambda gradients: 1.0)
    with pytest.raises(ValueError, match=re.escape(
            "The `nonfinite` callable must return a boolean (True: skip the micro-batch). "
            "Received: a value of dtype float32")):
        acc.accumulate([torch.tensor([1.0])])
    acc = gradaccum.GradientAccumulator(
        [v], nonfinite=lambda gradients: torch.tensor([True, False]))
    with pytest.raises(ValueError, match=re.escape(
            "The `nonfinite` callable must return a scalar boolean. "
            "Received: a value of shape (2,)")):
        acc.accumulate([torch.tensor([1.0])])


# Mixed precision: a LossScaleOptimizer -----------------------------------------------------


def test_a_loss_scale_optimizer_unscales_skips_an_overflow_and_backs_off():
    x, y = data(32)
    bad = poisoned(x, 10, np.inf)
    model = mlp(0)
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                                    initial_scale=2.0 ** 10)
    acc = gradaccum.GradientAccumulator(model.trainable_weights, steps=3)
    applied = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow is expected: no warning
        for start in range(0, 32, 8):
            part = slice(start, start + 8)
            grads = grads_of(model, bad[part], y[part], loss_scale_optimizer=optimizer)
            applied.append(bool(acc.step(optimizer, grads, weight=8)))
    assert applied == [False, False, True, False]
    assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 9
    assert int(optimizer.step_counter.numpy()) == 2  # accepted in a row since
    assert int(acc.skipped.numpy()) == 1
    assert int(optimizer.inner_optimizer.iterations.numpy()) == 1
    assert bool(acc.apply(optimizer))
    assert int(optimizer.inner_optimizer.iterations.numpy()) == 2
    # Equal to the unscaled run without the overflowing micro-batch.
    expected = reference(keras.optimizers.Adam(0.01), np.concatenate([x[:8], x[16:]]),
                         np.concatenate([y[:8], y[16:]]), [16, 8])
    assert_weights_close(model, expected, rtol=1e-5, atol=1e-6)
    assert_optimizer_close(optimizer.inner_optimizer, expected.optimizer)


def test_a_loss_scale_optimizer_without_overflow_equals_the_unscaled_run():
    x, y = data(40)
    sizes = [16, 16, 8]
    unscaled = Loop(keras.optimizers.Adam(0.01), steps=2)
    unscaled.run(x, y, sizes)
    unscaled.finish()
    model = mlp(0)
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                                    dynamic_growth_steps=2)
    acc = gradaccum.GradientAccumulator(model.trainable_weights)
    # accumulate + apply: the LossScaleOptimizer is named once per micro-batch.
    start = 0
    for i, size in enumerate(sizes):
        grads = grads_of(model, x[start:start + size], y[start:start + size],
                         loss_scale_optimizer=optimizer)
        acc.accumulate(grads, weight=size, loss_scale_optimizer=optimizer)
        start += size
        if i % 2 == 1 or i == len(sizes) - 1:
            assert bool(acc.apply(optimizer))
    assert_weights_close(model, unscaled.model, rtol=1e-6, atol=1e-7)
    assert_optimizer_close(optimizer.inner_optimizer, unscaled.optimizer, rtol=1e-6,
                           atol=1e-7)
    # Three accepted micro-batches in a row with growth every 2: doubled once.
    assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 15 * 2
    assert int(optimizer.step_counter.numpy()) == 1
    assert int(acc.updates.numpy()) == 2


def test_under_loss_scaling_an_overflow_is_skipped_even_with_nonfinite_raise():
    v = keras.Variable([1.0, 1.0])
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0),
                                                    initial_scale=8.0)
    acc = gradaccum.GradientAccumulator([v], steps=2, nonfinite="raise")
    assert bool(acc.accumulate([torch.tensor([8.0, 16.0])], weight=1.0,
                               loss_scale_optimizer=optimizer))
    assert not bool(acc.accumulate([torch.tensor([np.inf, 1.0])], weight=3.0,
                                   loss_scale_optimizer=optimizer))
    assert float(optimizer.dynamic_scale.numpy()) == 4.0
    assert int(acc.skipped.numpy()) == 1 and float(acc.total_weight.numpy()) == 1.0
    # The sums hold unscaled gradients (8 / 8, 16 / 8).
    np.testing.assert_array_equal(acc.accumulators[0].numpy(), [1.0, 2.0])
    assert bool(acc.apply(optimizer))
    np.testing.assert_array_equal(v.numpy(), [0.0, -1.0])


# Checkpoints: state_dict / load_state_dict --------------------------------------------------


def test_state_dict_saved_in_the_middle_of_a_window_goes_on_exactly(tmp_path):
    x, y = data(48)
    whole = Loop(keras.optimizers.Adam(0.01), steps=3)
    whole.run(x, y, [8] * 6)

    first = Loop(keras.optimizers.Adam(0.01), steps=3)
    first.run(x, y, [8] * 4)
    assert int(first.acc.micro_step.numpy()) == 1
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": first.model.get_weights(),
                "optimizer": [v.value.detach().clone() for v in first.optimizer.variables],
                "accumulator": first.acc.state_dict()}, path)

    keras.utils.clear_session()
    second = Loop(keras.optimizers.Adam(0.01), seed=7, steps=3)
    second.optimizer.build(second.model.trainable_weights)
    saved = torch.load(path, weights_only=False)
    second.model.set_weights(saved["model"])
    for variable, value in zip(second.optimizer.variables, saved["optimizer"]):
        variable.assign(value)
    second.acc.load_state_dict(saved["accumulator"])
    assert int(second.acc.micro_step.numpy()) == 1
    assert float(second.acc.total_weight.numpy()) == 8.0
    assert int(second.acc.updates.numpy()) == 1
    assert second.run(x, y, [8, 8], start=32) == [False, True]
    assert_weights_close(second.model, whole.model, rtol=1e-6, atol=1e-7)
    assert_optimizer_close(second.optimizer, whole.optimizer, rtol=1e-6, atol=1e-7)
    for name, value in second.acc.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), whole.acc.state_dict()[name].numpy(),
                                      err_msg=name)


def test_the_state_is_the_window_record_and_the_sums_by_name():
    model = mlp(0)
    acc = gradaccum.GradientAccumulator(model.trainable_weights)
    fields = ("received", "micro_step", "total_weight", "window_skipped", "skipped",
              "micro_batches", "updates", "window_steps", "last_window_micro_batches",
              "last_window_weight")
    sums = [f"accumulator_{i}" for i in range(len(model.trainable_weights))]
    assert sorted(acc.state_dict()) == sorted(sums + list(fields))
    assert sorted(acc.state_variables()) == sorted(sums + list(fields))
    assert [acc.state_variables()[name] for name in sums] == acc.accumulators
    assert all(not v.trainable for v in acc.state_variables().values())
    for name, value in acc.state_dict().items():  # copies, not the variables
        assert value is not acc.state_variables()[name].value
    assert {str(v.dtype) for v in acc.accumulators} == {"float32"}


def test_load_state_dict_refuses_a_state_of_another_accumulator():
    model = mlp(0)
    acc = gradaccum.GradientAccumulator(model.trainable_weights)
    state = acc.state_dict()
    missing = dict(state)
    del missing["micro_step"], missing["accumulator_1"]
    missing["extra"] = torch.tensor(0)
    with pytest.raises(ValueError, match=re.escape(
            "`state_dict` must hold this accumulator's state. Received: a state missing "
            "['accumulator_1', 'micro_step'] and with unknown entries ['extra'].")):
        acc.load_state_dict(missing)
    wrong = dict(state)
    wrong["accumulator_2"] = torch.zeros((3, 8))
    with pytest.raises(ValueError, match=re.escape(
            "`state_dict` must hold entries of this accumulator's shapes. Received: "
            "'accumulator_2' of shape (3, 8) for (8, 3).")):
        acc.load_state_dict(wrong)
    other = gradaccum.GradientAccumulator(model.trainable_weights[:2])
    with pytest.raises(ValueError, match=re.escape(
            "Received: a state missing [] and with unknown entries ['accumulator_2', "
            "'accumulator_3'].")):
        other.load_state_dict(state)


# Dtypes ----------------------------------------------------------------------------------


def test_float64_sums_keep_what_float32_sums_round_away():
    v = keras.Variable([0.0, 0.0])
    wide = gradaccum.GradientAccumulator([v], reduction="sum", accumulator_dtype="float64")
    narrow = gradaccum.GradientAccumulator([v], reduction="sum")
    assert str(wide.accumulators[0].dtype) == "float64"
    assert str(wide.total_weight.dtype) == "float64"
    for acc in (wide, narrow):
        acc.accumulate([torch.tensor([2.0 ** 24, 1.0])])
        for _ in range(64):
            acc.accumulate([torch.tensor([1.0, 1.0])])
    np.testing.assert_array_equal(wide.accumulators[0].numpy(), [2.0 ** 24 + 64, 65.0])
    # In float32, 2**24 + 1 rounds back to 2**24.
    np.testing.assert_array_equal(narrow.accumulators[0].numpy(), [2.0 ** 24, 65.0])
    combined = wide.gradients()[0]
    assert combined.dtype == torch.float32  # the variable's dtype
    np.testing.assert_array_equal(combined.numpy(), [2.0 ** 24 + 64, 65.0])


def test_float64_sums_equal_the_large_batch():
    x, y = data(40)
    loop = Loop(keras.optimizers.SGD(0.1, momentum=0.9), steps=3, accumulator_dtype="float64")
    loop.run(x, y, [16, 16, 8])
    expected = reference(keras.optimizers.SGD(0.1, momentum=0.9), x, y, [40])
    assert_weights_close(loop.model, expected)
    assert_optimizer_close(loop.optimizer, expected.optimizer)
    assert {str(v.dtype) for v in loop.acc.accumulators} == {"float64"}


def test_bfloat16_gradients_go_into_float32_sums():
    v = keras.Variable(np.zeros(2), dtype="bfloat16")
    acc = gradaccum.GradientAccumulator([v], reduction="sum")
    low = gradaccum.GradientAccumulator([v], reduction="sum", accumulator_dtype="bfloat16")
    assert str(acc.accumulators[0].dtype) == "float32"
    assert str(low.accumulators[0].dtype) == "bfloat16"
    for a in (acc, low):
        a.accumulate([torch.tensor([256.0, 1.0], dtype=torch.bfloat16)])
        for _ in range(64):
            a.accumulate([torch.tensor([1.0, 1.0], dtype=torch.bfloat16)])
    # 256 + 64 x 1 is exact in float32; in bfloat16, 256 + 1 rounds back to 256.
    np.testing.assert_array_equal(acc.accumulators[0].numpy(), [320.0, 65.0])
    np.testing.assert_array_equal(low.accumulators[0].numpy().astype("float32"),
                                  [256.0, 65.0])
    combined = acc.gradients()[0]
    assert combined.dtype == torch.bfloat16
    np.testing.assert_array_equal(combined.float().numpy(), [320.0, 65.0])


def test_bfloat16_micro_batch_gradients_are_summed_in_float32():
    x, y = data(16)
    model = mlp(0)
    acc = gradaccum.GradientAccumulator(model.trainable_weights, steps=4)
    expected = None
    for start in (0, 4):
        grads = grads_of(model, x[start:start + 4], y[start:start + 4])
        low = [g.to(torch.bfloat16) for g in grads]
        acc.step(keras.optimizers.SGD(0.1), low, weight=4)
        part = [g.float().numpy() * 4 for g in low]
        expected = part if expected is None else [a + b for a, b in zip(expected, part)]
    assert {str(v.dtype) for v in acc.accumulators} == {"float32"}
    for variable, value in zip(acc.accumulators, expected):
        np.testing.assert_allclose(variable.numpy(), value, rtol=1e-6, atol=1e-7)


# Bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    *[(dict(steps=steps), "`steps` must be an integer >= 1, a list of `(from_update, k)` "
                          f"pairs or a callable `update_index -> int`. Received: steps={shown}")
      for steps, shown in ((0, "0"), (-1, "-1"), (2.5, "2.5"), ("4", "'4'"), (True, "True"))],
    (dict(steps=[]), "`steps` pairs must be a non-empty list of `(from_update, k)` pairs. "
                     "Received: steps=[]"),
    (dict(steps=[(1, 2)]), "`steps` pairs must start at update 0 (the first window's "
                           "length). Received: steps=[(1, 2)]"),
    (dict(steps=[(0, 2), (0, 3)]), "`steps` pairs must be sorted by `from_update`, each "
                                   "after the one before. Received: steps=[(0, 2), (0, 3)]"),
    (dict(steps=[(0, 0)]), "`steps` pairs must be `(from_update, k)` with integers "
                           "from_update >= 0 and k >= 1. Received: steps=[(0, 0)]"),
    (dict(steps=lambda update_index: 0), "The `steps` callable must return an integer "
                                         ">= 1. Received: 0 for update_index=0"),
    (dict(steps=2, weight_per_update=3), "`steps` and `weight_per_update` cannot be used "
                                         "together: a window closes after `steps` "
                                         "micro-batches or once its total weight reaches "
                                         "`weight_per_update`. Received: steps=2, "
                                         "weight_per_update=3"),
    *[(dict(weight_per_update=w), "`weight_per_update` must be a finite number > 0. "
                                  f"Received: weight_per_update={w!r}")
      for w in (0, -1.0, float("nan"))],
    (dict(reduction="max"), "`reduction` must be one of 'mean', 'sum'. "
                            "Received: reduction='max'"),
    (dict(nonfinite="ignore"), "`nonfinite` must be one of 'skip', 'raise', 'apply' or a "
                               "callable gradients -> bool (True skips the micro-batch). "
                               "Received: nonfinite='ignore'"),
    (dict(accumulator_dtype="int32"), "`accumulator_dtype` must be a floating dtype, one of "
                                      "'float16', 'bfloat16', 'float32', 'float64'. "
                                      "Received: accumulator_dtype='int32'"),
])
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        gradaccum.GradientAccumulator(mlp(0).trainable_weights, **kwargs)


@pytest.mark.parametrize("variables", [[], None])
def test_an_empty_variable_list_is_refused(variables):
    with pytest.raises(ValueError, match=re.escape(
            "`variables` must be a non-empty list of variables. "
            f"Received: variables={variables!r}")):
        gradaccum.GradientAccumulator(variables)
    with pytest.raises(ValueError, match=re.escape("Received: an element of type str: 'w'")):
        gradaccum.GradientAccumulator([keras.Variable(1.0), "w"])


def test_a_callable_schedule_that_goes_bad_later_names_the_update():
    v = keras.Variable([1.0])
    optimizer = keras.optimizers.SGD(0.1)
    acc = gradaccum.GradientAccumulator([v], steps=lambda i: 1 if i == 0 else 0)
    assert bool(acc.step(optimizer, [torch.tensor([1.0])]))
    with pytest.raises(ValueError, match=re.escape(
            "The `steps` callable must return an integer >= 1. Received: 0 for "
            "update_index=1")):
        acc.step(optimizer, [torch.tensor([1.0])])
    assert int(acc.micro_batches.numpy()) == 1 and int(acc.updates.numpy()) == 1


def test_gradients_of_the_wrong_count_or_shape_are_refused():
    model = mlp(0)
    optimizer = keras.optimizers.SGD(0.1)
    acc = gradaccum.GradientAccumulator(model.trainable_weights, steps=2)
    grads = zeros_like(model.trainable_weights)
    count = "`gradients` must have one entry per variable (4). Received: 3 gradients."
    with pytest.raises(ValueError, match=f"^{re.escape(count)}$"):
        acc.step(optimizer, grads[:3])
    with pytest.raises(ValueError, match=f"^{re.escape(count)}$"):
        acc.accumulate(grads[:3])
    grads[2] = torch.zeros((3, 8))
    shape = (f"The gradient of variable '{variable_name(model.trainable_weights[2])}' "
             "must have shape (8, 3). Received: shape=(3, 8)")
    with pytest.raises(ValueError, match=f"^{re.escape(shape)}$"):
        acc.step(optimizer, grads)
    assert is_empty(acc) and int(acc.micro_batches.numpy()) == 0


@pytest.mark.parametrize("weight, message", [
    (-1.0, "`weight` must be a finite number >= 0. Received: weight=-1.0"),
    (float("nan"), "`weight` must be a finite number >= 0. Received: weight=nan"),
    (float("inf"), "`weight` must be a finite number >= 0. Received: weight=inf"),
    (torch.tensor(-2.0), "`weight` must be a finite number >= 0. Received: weight=-2.0"),
    ([1.0, 2.0], "`weight` must be a scalar. Received: weight with shape (2,)"),
    (torch.ones((1, 2)), "`weight` must be a scalar. Received: weight with shape (1, 2)"),
    ("a", "`weight` must be a finite number >= 0. Received: weight='a'"),
    (None, "`weight` must be a finite number >= 0. Received: weight=None"),
])
def test_a_bad_weight_is_refused_and_changes_nothing(weight, message):
    v = keras.Variable([1.0])
    acc = gradaccum.GradientAccumulator([v], steps=1)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        acc.accumulate([torch.tensor([1.0])], weight=weight)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        acc.step(keras.optimizers.SGD(0.1), [torch.tensor([1.0])], weight=weight)
    assert is_empty(acc) and int(acc.micro_batches.numpy()) == 0
    assert float(v.numpy()[0]) == 1.0


def test_step_without_steps_is_refused():
    acc = gradaccum.GradientAccumulator([keras.Variable([1.0])])
    with pytest.raises(ValueError, match=re.escape(
            "`steps` or `weight_per_update` must be given to use `step()`. Received: "
            "steps=None, weight_per_update=None. Pass one of them to GradientAccumulator, "
            "or call `accumulate()` and `apply()` yourself.")):
        acc.step(keras.optimizers.SGD(0.1), [torch.tensor([1.0])])


def test_what_is_not_a_usable_optimizer_is_refused():
    acc = gradaccum.GradientAccumulator([keras.Variable([1.0])], steps=2)
    with pytest.raises(ValueError, match=re.escape(
            "`optimizer` must be a keras.optimizers.Optimizer. Received: optimizer of "
            "type SGD")):
        acc.step(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
                 [torch.tensor([1.0])])
    with pytest.raises(ValueError, match=re.escape(
            "`optimizer` must be a keras.optimizers.Optimizer. Received: optimizer of "
            "type str")):
        acc.apply("sgd")
    with pytest.raises(ValueError, match=re.escape(
            "The optimizer must not accumulate gradients itself when gradaccum does. "
            "Received: gradient_accumulation_steps=2.")):
        acc.step(keras.optimizers.SGD(gradient_accumulation_steps=2), [torch.tensor([1.0])])


def test_a_loss_scale_optimizer_that_is_not_one_is_refused():
    acc = gradaccum.GradientAccumulator([keras.Variable([1.0])])
    with pytest.raises(ValueError, match=re.escape(
            "`loss_scale_optimizer` must be a keras.optimizers.LossScaleOptimizer. "
            "Received: loss_scale_optimizer of type Adam")):
        acc.accumulate([torch.tensor([1.0])], loss_scale_optimizer=keras.optimizers.Adam())
    assert is_empty(acc)


# The docstring -------------------------------------------------------------------------


def test_the_class_docstring_example_runs_as_a_doctest():
    from gradaccum.backends.torch import accumulator

    result = doctest.testmod(accumulator, verbose=False)
    assert result.failed == 0
    assert result.attempted > 0


def test_float64_sums_combine_in_float64():
    # Weights 1 and 2 on the same gradient: G is that gradient exactly (1 / W in
    # float32 would be off by about 3e-8).
    v = keras.Variable(np.zeros(2, "float64"))
    acc = gradaccum.GradientAccumulator([v], accumulator_dtype="float64")
    gradient = torch.tensor([1.0, 1.0], dtype=torch.float64)
    acc.accumulate([gradient], weight=1.0)
    acc.accumulate([gradient], weight=2.0)
    (combined,) = acc.gradients()
    assert combined.dtype == torch.float64
    np.testing.assert_array_equal(combined.numpy(), [1.0, 1.0])


def test_gradients_are_copies_the_next_micro_batch_leaves_alone():
    # Under reduction "sum" the combination is the sums: `gradients()` hands out a
    # copy, which the apply-it-yourself pattern then applies after `reset`.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
    model.set_weights([np.zeros((3, 1), "float32")])
    acc = gradaccum.GradientAccumulator(model.trainable_variables, reduction="sum")
    ones = [torch.ones((3, 1))]
    acc.accumulate(ones)
    acc.accumulate(ones)
    combined = acc.gradients()
    acc.reset()
    acc.accumulate(ones)
    optimizer = keras.optimizers.SGD(1.0)
    with torch.no_grad():
        optimizer.apply(combined, model.trainable_variables)
    np.testing.assert_array_equal(model.get_weights()[0], np.full((3, 1), -2.0))


def test_gradients_of_a_loss_scaled_by_loss_scale_factor_are_unscaled_by_apply():
    # keras.io's loop with an optimizer's static `loss_scale_factor`: the gradients
    # of `optimizer.scale_loss(loss)` go into the sums, and `apply` divides the
    # factor back out, as Keras's own step does: the update is the unscaled one.
    x, y = data(28)
    optimizer = keras.optimizers.Adam(0.01, loss_scale_factor=64.0)
    loop = Loop(optimizer, steps=3)
    start = 0
    for size in [4] * 7:
        part = slice(start, start + size)
        grads = grads_of(loop.model, x[part], y[part], loss_scale_optimizer=optimizer)
        loop.acc.step(optimizer, grads, weight=size)
        start += size
    assert loop.finish()
    scaled = reference(keras.optimizers.Adam(0.01, loss_scale_factor=64.0), x, y, [12, 12, 4])
    plain = reference(keras.optimizers.Adam(0.01), x, y, [12, 12, 4])
    assert_weights_close(loop.model, scaled)
    assert_weights_close(loop.model, plain)
    assert int(optimizer.iterations) == 3
