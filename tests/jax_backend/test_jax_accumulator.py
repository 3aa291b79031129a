"""`gradaccum.GradientAccumulator` on JAX: a custom training loop in keras.io's JAX
pattern (`jax.value_and_grad` over `model.stateless_call`, the state as arrays through
a jitted step), against one large batch per window."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from largebatch import SCE, assert_optimizer_close, assert_weights_close, data, mlp

import gradaccum


def loss_of(model):
    def loss_fn(trainable, non_trainable, x, y):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, x,
                                                     training=True)
        return SCE(y, logits), non_trainable

    return loss_fn


class Loop:
    """A model, its optimizer and an accumulator, trained micro-batch by micro-batch
    through one jitted step; `finish` flushes and writes everything back."""

    def __init__(self, optimizer, seed=0, grad_dtype=None, **options):
        self.model = mlp(seed)
        self.optimizer = optimizer
        optimizer.build(self.model.trainable_variables)
        self.acc = gradaccum.GradientAccumulator(self.model.trainable_variables, **options)
        loss_fn = loss_of(self.model)
        acc = self.acc

        @jax.jit
        def step(state, x, y, weight):
            trainable, non_trainable, optimizer_vars, acc_vars = state
            (_, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                trainable, non_trainable, x, y
            )
            if grad_dtype is not None:
                grads = [g.astype(grad_dtype) for g in grads]
            trainable, optimizer_vars, acc_vars = acc.stateless_step(
                optimizer, grads, trainable, optimizer_vars, acc_vars, weight=weight
            )
            return trainable, non_trainable, optimizer_vars, acc_vars

        self.step = step
        self.state = (
            [v.value for v in self.model.trainable_variables],
            [v.value for v in self.model.non_trainable_variables],
            [v.value for v in optimizer.variables],
            [v.value for v in self.acc.variables],
        )

    def run(self, x, y, sizes):
        start = 0
        for size in sizes:
            part = slice(start, start + size)
            self.state = self.step(self.state, x[part], y[part], float(size))
            start += size

    def finish(self, flush=True):
        trainable, non_trainable, optimizer_vars, acc_vars = self.state
        if flush:
            trainable, optimizer_vars, acc_vars = self.acc.stateless_apply(
                self.optimizer, trainable, optimizer_vars, acc_vars
            )
        for variables, values in ((self.model.trainable_variables, trainable),
                                  (self.optimizer.variables, optimizer_vars),
                                  (self.acc.variables, acc_vars)):
            for variable, value in zip(variables, values):
                variable.assign(value)


def reference(optimizer, x, y, windows, seed=0):
    """Plain Keras on JAX: one step per window on the concatenated window."""
    model = mlp(seed)
    model.compile(optimizer=optimizer, loss=SCE)
    start = 0
    for size in windows:
        model.train_on_batch(x[start:start + size], y[start:start + size])
        start += size
    return model


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_unequal_micro_batches_equal_one_step_on_each_window(name):
    make = {"sgd": lambda: keras.optimizers.SGD(0.1),
            "adam": lambda: keras.optimizers.Adam(0.01),
            "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1)}[name]
    x, y = data(80)
    loop = Loop(make(), steps=3)
    loop.run(x, y, [16, 16, 8, 16, 16, 8])  # two windows of 40
    loop.finish()
    expected = reference(make(), x, y, [40, 40])
    assert_weights_close(loop.model, expected)
    assert_optimizer_close(loop.optimizer, expected.optimizer)
    assert int(loop.optimizer.iterations.numpy()) == 2
    assert int(loop.acc.updates.numpy()) == 2
    assert int(loop.acc.last_window_micro_batches.numpy()) == 3
    assert float(loop.acc.last_window_weight.numpy()) == 40.0


def test_a_partial_window_is_flushed_as_a_smaller_batch():
    x, y = data(36)
    loop = Loop(keras.optimizers.Adam(0.01), steps=2)
    loop.run(x, y, [8, 8, 8, 8, 4])  # windows 16, 16, then 4 open
    loop.finish()
    expected = reference(keras.optimizers.Adam(0.01), x, y, [16, 16, 4])
    assert_weights_close(loop.model, expected)
    assert_optimizer_close(loop.optimizer, expected.optimizer)
    assert int(loop.acc.micro_step.numpy()) == 0
    assert all(not np.any(v.numpy()) for v in loop.acc.accumulators)


def test_without_a_flush_the_open_window_stays_in_the_state():
    x, y = data(24)
    loop = Loop(keras.optimizers.SGD(0.1), steps=2)
    loop.run(x, y, [8, 8, 8])
    loop.finish(flush=False)
    assert int(loop.acc.micro_step.numpy()) == 1
    assert float(loop.acc.total_weight.numpy()) == 8.0
    assert int(loop.optimizer.iterations.numpy()) == 1


def test_a_schedule_of_steps_by_update_index():
    x, y = data(56)
    loop = Loop(keras.optimizers.Adam(0.01), steps=[(0, 1), (1, 2), (3, 3)])
    loop.run(x, y, [8] * 7)  # windows of 1, 2, 2, 2 micro-batches
    loop.finish()
    expected = reference(keras.optimizers.Adam(0.01), x, y, [8, 16, 16, 16])
    assert_weights_close(loop.model, expected)
    assert int(loop.acc.updates.numpy()) == 4


def test_a_weight_budget():
    x, y = data(40)
    loop = Loop(keras.optimizers.Adam(0.01), weight_per_update=12)
    loop.run(x, y, [8, 8, 4, 12, 8])  # windows 16, 16, then 8 open
    loop.finish()
    expected = reference(keras.optimizers.Adam(0.01), x, y, [16, 16, 8])
    assert_weights_close(loop.model, expected)


def test_a_skipped_micro_batch_is_dropped_with_its_weight():
    x, y = data(24)
    bad = x.copy()
    bad[8:16] = np.nan
    loop = Loop(keras.optimizers.Adam(0.01), steps=3)
    loop.run(bad, y, [8, 8, 8])  # the middle micro-batch is not finite
    loop.finish()
    expected = reference(keras.optimizers.Adam(0.01), np.concatenate([x[:8], x[16:]]),
                         np.concatenate([y[:8], y[16:]]), [16])
    assert_weights_close(loop.model, expected)
    assert int(loop.acc.skipped.numpy()) == 1
    assert int(loop.acc.last_window_micro_batches.numpy()) == 3


def test_bfloat16_gradients_go_into_float32_sums():
    x, y = data(16)
    loop = Loop(keras.optimizers.SGD(0.1), steps=4, grad_dtype="bfloat16")
    loop.run(x, y, [4, 4])
    loop.finish(flush=False)
    assert {str(v.dtype) for v in loop.acc.accumulators} == {"float32"}
    # Each micro-batch's gradient rounded to bfloat16, summed in float32.
    model = mlp(0)
    loss_fn = loss_of(model)
    expected = None
    for start in (0, 4):
        xb, yb = x[start:start + 4], y[start:start + 4]
        grads = jax.grad(lambda t, xb=xb, yb=yb: loss_fn(t, [], xb, yb)[0])(
            [v.value for v in model.trainable_variables]
        )
        part = [np.asarray(g.astype("bfloat16").astype("float32")) * 4 for g in grads]
        expected = part if expected is None else [a + b for a, b in zip(expected, part)]
    for variable, value in zip(loop.acc.accumulators, expected):
        np.testing.assert_allclose(variable.numpy(), value, rtol=1e-6, atol=1e-7)


def test_reduction_sum_adds_the_micro_batch_gradients():
    x, y = data(16)
    loop = Loop(keras.optimizers.SGD(0.1), steps=2, reduction="sum")
    loop.run(x, y, [8, 8])
    loop.finish()
    # One SGD step with the sum of the two means = 2 x the mean over 16.
    expected = reference(keras.optimizers.SGD(0.2), x, y, [16])
    assert_weights_close(loop.model, expected)


def test_a_loss_scale_optimizer_unscales_skips_an_overflow_and_backs_off():
    x, y = data(24)
    bad = x.copy()
    bad[8:16] = np.inf
    model = mlp(0)
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                                    initial_scale=2.0 ** 10)
    optimizer.build(model.trainable_variables)
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=3)
    loss_fn = loss_of(model)

    @jax.jit
    def step(state, x, y):
        trainable, non_trainable, optimizer_vars, acc_vars = state

        def scaled(trainable):
            loss, new = loss_fn(trainable, non_trainable, x, y)
            mapping = list(zip(optimizer.variables, optimizer_vars))
            with keras.StatelessScope(state_mapping=mapping):
                return optimizer.scale_loss(loss), new

        (_, non_trainable), grads = jax.value_and_grad(scaled, has_aux=True)(trainable)
        trainable, optimizer_vars, acc_vars = acc.stateless_step(
            optimizer, grads, trainable, optimizer_vars, acc_vars, weight=x.shape[0])
        return trainable, non_trainable, optimizer_vars, acc_vars

    state = ([v.value for v in model.trainable_variables], [],
             [v.value for v in optimizer.variables], [v.value for v in acc.variables])
    for start in (0, 8, 16):
        state = step(state, bad[start:start + 8], y[start:start + 8])
    for variables, values in ((model.trainable_variables, state[0]),
                              (optimizer.variables, state[2]), (acc.variables, state[3])):
        for variable, value in zip(variables, values):
            variable.assign(value)
    expected = reference(keras.optimizers.Adam(0.01), np.concatenate([x[:8], x[16:]]),
                         np.concatenate([y[:8], y[16:]]), [16])
    assert_weights_close(model, expected, rtol=1e-4, atol=1e-5)
    assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 9
    assert int(acc.skipped.numpy()) == 1
    assert int(optimizer.inner_optimizer.iterations.numpy()) == 1


def test_nonfinite_raise_raises_eagerly_and_is_recorded_under_jit():
    model = mlp(0)
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=2,
                                        nonfinite="raise")
    grads = [jnp.full(v.shape, jnp.nan) for v in model.trainable_variables]
    values = [v.value for v in acc.variables]
    message = ("gradaccum: a gradient is not finite (inf or nan) in micro-batch 1 "
               "(counted from 1; the micro-batch 1 of its window)")
    with pytest.raises(FloatingPointError, match=re.escape(message)):
        acc.stateless_accumulate(grads, values, weight=4)
    jitted = jax.jit(lambda g, v: acc.stateless_accumulate(g, v, weight=4))
    recorded = jitted(grads, values)
    with pytest.raises(FloatingPointError, match=re.escape(message)):
        acc.check(recorded)


def test_a_variable_a_window_gave_no_gradient_is_left_out_of_its_update():
    # Window 2 hands None for the first layer: as Keras leaves out a None gradient,
    # that layer takes no step, no slot change and no weight decay.
    model = mlp(0)
    optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.5)
    optimizer.build(model.trainable_variables)
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=2)
    rng = np.random.default_rng(0)
    grads = [[jnp.asarray(rng.normal(size=v.shape), "float32")
              for v in model.trainable_variables] for _ in range(4)]
    for i in (2, 3):
        grads[i][0] = grads[i][1] = None
    step = jax.jit(lambda s, g: acc.stateless_step(optimizer, g, *s, weight=2.0))
    state = ([v.value for v in model.trainable_variables],
             [v.value for v in optimizer.variables], [v.value for v in acc.variables])
    for g in grads:
        state = step(state, g)
    reference = mlp(0)
    expected = keras.optimizers.AdamW(0.05, weight_decay=0.5)
    expected.build(reference.trainable_variables)
    for window in (grads[:2], grads[2:]):
        mean = [None if a is None else (a + b) / 2 for a, b in zip(*window)]
        pairs = [(g, v) for g, v in zip(mean, reference.trainable_variables) if g is not None]
        expected.apply([g for g, _ in pairs], [v for _, v in pairs])
    for value, variable in zip(state[0], reference.trainable_variables):
        np.testing.assert_allclose(np.asarray(value), variable.numpy(), rtol=1e-5, atol=1e-6)
    for value, variable in zip(state[1], expected.variables):
        np.testing.assert_allclose(np.asarray(value), variable.numpy(), rtol=1e-5, atol=1e-6)


def test_a_recorded_error_skips_its_micro_batch_only_and_clear_resets_it():
    model = mlp(0)
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=2,
                                        nonfinite="raise")
    good = [jnp.ones(v.shape) for v in model.trainable_variables]
    bad = [jnp.full(v.shape, jnp.nan) for v in model.trainable_variables]
    step = jax.jit(lambda s, g: acc.stateless_step(optimizer, g, *s, weight=1.0))
    state = ([v.value for v in model.trainable_variables],
             [v.value for v in optimizer.variables], [v.value for v in acc.variables])
    for g in (bad, good, good, good):
        state = step(state, g)
    with pytest.raises(FloatingPointError, match="micro-batch 1"):
        acc.check(state[2])
    # The bad micro-batch counted towards its window (skipped); the loop went on.
    cleared = acc.clear(state[2])
    acc.check(cleared)
    for variable, value in zip(acc.variables, cleared):
        variable.assign(value)
    assert int(acc.skipped.numpy()) == 1 and int(acc.updates.numpy()) == 2
    iterations = next(i for i, v in enumerate(optimizer.variables)
                      if v is optimizer.iterations)
    assert int(np.asarray(state[1][iterations])) == 2


def test_float64_sums_need_jaxs_64_bit_mode():
    with pytest.raises(ValueError, match=re.escape(
            "`accumulator_dtype` must be a dtype JAX computes in: float64 needs "
            "jax.config.update('jax_enable_x64', True)")):
        gradaccum.GradientAccumulator(mlp(0).trainable_variables, steps=2,
                                      accumulator_dtype="float64")


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=0), "`steps` must be an integer >= 1, a list of `(from_update, k)` pairs "
                    "or a callable `update_index -> int`. Received: steps=0"),
    (dict(steps=2, weight_per_update=3), "`steps` and `weight_per_update` cannot be used "
                                         "together"),
    (dict(steps=2, reduction="max"), "`reduction` must be one of 'mean', 'sum'. "
                                     "Received: reduction='max'"),
    (dict(steps=2, nonfinite="ignore"), "`nonfinite` must be one of 'skip', 'raise', "
                                        "'apply' or a callable"),
    (dict(steps=2, accumulator_dtype="int32"), "`accumulator_dtype` must be a floating "
                                               "dtype"),
])
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        gradaccum.GradientAccumulator(mlp(0).trainable_variables, **kwargs)


def test_bad_calls_are_refused():
    model = mlp(0)
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=2)
    trainable = [v.value for v in model.trainable_variables]
    grads = [jnp.zeros(v.shape) for v in model.trainable_variables]
    values = [v.value for v in acc.variables]
    opt = [v.value for v in optimizer.variables]
    with pytest.raises(ValueError, match=re.escape(
            "`grads` must have one entry per variable (4). Received: 3 gradients.")):
        acc.stateless_step(optimizer, grads[:3], trainable, opt, values)
    with pytest.raises(ValueError, match=re.escape(
            "`accumulator_variables` must be the values of the accumulator's "
            "`variables` (6). Received: 2 values.")):
        acc.stateless_step(optimizer, grads, trainable, opt, values[:2])
    with pytest.raises(ValueError, match=re.escape(
            "`weight` must be a finite number >= 0. Received: weight=-1.0")):
        acc.stateless_step(optimizer, grads, trainable, opt, values, weight=-1.0)
    manual = gradaccum.GradientAccumulator(model.trainable_variables)
    with pytest.raises(ValueError, match=re.escape(
            "`steps` or `weight_per_update` must be given to use `stateless_step`.")):
        manual.stateless_step(optimizer, grads, trainable, opt,
                              [v.value for v in manual.variables])

