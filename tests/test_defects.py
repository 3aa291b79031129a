"""Defects found by trying gradaccum as a new user would (issue: core correctness).

Each test failed before its fix: gradients lost by trace order, a finite gradient
screened as non-finite, fit's hook inserted into the caller's CallbackList.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from helpers import make_data, make_mlp

# 1. Which variables an update touches follows the window, not the trace order -------


def _two_variable_run(order, make_optimizer, compiled):
    """Variables v1, v2; A accumulates [g, None], B [g, g], C applies; runs `order`."""
    v1 = tf.Variable([0.5, -0.5], name="v1")
    v2 = tf.Variable([0.25, 1.0], name="v2")
    optimizer = make_optimizer()
    acc = gradaccum.GradientAccumulator([v1, v2])
    g = tf.constant([1.0, 2.0])

    def wrap(fn):
        return tf.function(fn) if compiled else fn

    calls = {
        "A": wrap(lambda: acc.accumulate([g, None], weight=2.0)),
        "B": wrap(lambda: acc.accumulate([g, 3.0 * g], weight=1.0)),
        "C": wrap(lambda: acc.apply(optimizer)),
    }
    for name in order:
        calls[name]()
    return [v1.numpy(), v2.numpy()], [np.asarray(v) for v in optimizer.variables]


@pytest.mark.parametrize("order", ["ACBC", "BCAC", "ABCAC", "CACBC"])
@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: keras.optimizers.SGD(1.0),
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.AdamW(0.1, weight_decay=0.5),
    ],
    ids=["sgd", "momentum", "adamw"],
)
def test_graph_updates_the_variables_the_window_received_whatever_the_trace_order(
    order, make_optimizer
):
    eager_weights, eager_slots = _two_variable_run(order, make_optimizer, compiled=False)
    weights, slots = _two_variable_run(order, make_optimizer, compiled=True)
    for a, b in zip(weights, eager_weights):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert len(slots) == len(eager_slots)
    for a, b in zip(slots, eager_slots):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_the_issue_reproduction_v2_gets_its_update():
    # A, C, then B, C with SGD(1.0): eager gives v2 = -1.
    v1, v2 = tf.Variable(0.0), tf.Variable(0.0)
    acc = gradaccum.GradientAccumulator([v1, v2])
    optimizer = keras.optimizers.SGD(1.0)
    g = tf.constant(1.0)
    a = tf.function(lambda: acc.accumulate([g, None]))
    b = tf.function(lambda: acc.accumulate([g, g]))
    c = tf.function(lambda: acc.apply(optimizer))
    a(), c(), b(), c()
    assert (float(v1), float(v2)) == (-2.0, -1.0)
    assert int(optimizer.iterations) == 2


def test_a_variable_without_gradient_in_the_window_keeps_weight_and_slots():
    # Keras leaves out a None gradient: no step, no slot change, no weight decay.
    v1, v2 = tf.Variable([1.0]), tf.Variable([1.0])
    optimizer = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    acc = gradaccum.GradientAccumulator([v1, v2])
    step = tf.function(lambda g1, g2: acc.accumulate([g1, g2]))
    step_one = tf.function(lambda g1: acc.accumulate([g1, None]))
    apply = tf.function(lambda: acc.apply(optimizer))
    step(tf.constant([1.0]), tf.constant([1.0]))
    apply()
    before = [np.asarray(v).copy() for v in optimizer.variables]
    v2_before = v2.numpy().copy()
    step_one(tf.constant([1.0]))
    apply()
    assert v2.numpy() == v2_before
    reference = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    r1, r2 = tf.Variable([1.0]), tf.Variable([1.0])
    reference.apply_gradients([(tf.constant([1.0]), r1), (tf.constant([1.0]), r2)])
    reference.apply_gradients([(tf.constant([1.0]), r1)])
    np.testing.assert_allclose(v1.numpy(), r1.numpy(), rtol=1e-6)
    np.testing.assert_allclose(v2.numpy(), r2.numpy(), rtol=1e-6)
    for ours, theirs in zip(optimizer.variables, reference.variables):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6)
    # v2's slots did not move in the second update.
    changed = [not np.array_equal(b, np.asarray(a)) for b, a in zip(before, optimizer.variables)]
    assert changed.count(True) == 3  # iterations, v1's two moments


def test_skip_flag_is_read_at_run_time():
    # A window of only skipped micro-batches closes, whichever function was traced first.
    v = tf.Variable([0.0])
    optimizer = keras.optimizers.SGD(1.0)
    acc = gradaccum.GradientAccumulator([v], steps=2)
    apply = tf.function(lambda: acc.apply(optimizer))
    step = tf.function(lambda g: acc.step(optimizer, [g]))
    apply()  # traced before any accumulate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(tf.constant([np.inf])), step(tf.constant([np.nan]))
    assert int(acc.window_length()) == 0 and int(acc.skipped) == 2
    step(tf.constant([1.0])), step(tf.constant([3.0]))
    np.testing.assert_allclose(v.numpy(), [-2.0])


# 2. A finite gradient is never screened as non-finite ------------------------------


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph"])
def test_finite_gradient_whose_sum_overflows_is_accumulated(compiled):
    v = tf.Variable(tf.zeros([4]))
    acc = gradaccum.GradientAccumulator([v])
    big = tf.fill([4], 2e38)
    accumulate = tf.function(acc.accumulate) if compiled else acc.accumulate
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bool(accumulate([big], 1.0))
    assert int(acc.skipped) == 0 and int(acc.micro_step) == 1
    np.testing.assert_array_equal(acc.accumulators[0].numpy(), np.full([4], 2e38, "float32"))
    # A real inf or nan is still skipped.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not bool(accumulate([tf.constant([1.0, np.inf, 0.0, 0.0])], 1.0))
        assert not bool(accumulate([tf.constant([np.nan, 1.0, 0.0, 0.0])], 1.0))
    assert int(acc.skipped) == 2


def test_raise_policy_lets_an_overflowing_sum_through():
    v = tf.Variable(tf.zeros([3]))
    acc = gradaccum.GradientAccumulator([v], nonfinite="raise")
    assert bool(tf.function(acc.accumulate)([tf.fill([3], -3e38)], 1.0))
    assert int(acc.micro_step) == 1


# nonfinite as a callable (optax's should_skip_update_fn) -----------------------------


def test_callable_policy_skips_what_it_says_and_matches_the_reference():
    model, reference = make_mlp(), make_mlp()
    optimizer, ref_optimizer = keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.01)

    def too_large(gradients):
        return tf.linalg.global_norm([g for g in gradients if g is not None]) > 1e3

    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=3,
                                        nonfinite=too_large)
    ref_acc = gradaccum.GradientAccumulator(reference.trainable_variables, steps=3)
    x, y = make_data(24)
    step = tf.function(lambda grads, w: acc.step(optimizer, grads, w))
    from helpers import grads_of

    for i in range(6):
        xs, ys = x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]
        grads = grads_of(model, xs, ys)
        if i == 1:
            grads = [g * 1e6 for g in grads]  # finite, but the policy refuses it
        step(grads, tf.constant(4.0))
        if i != 1:
            ref_acc.accumulate(grads_of(reference, xs, ys), 4.0)
        if i in (2, 5):
            ref_acc.apply(ref_optimizer)
    assert int(acc.skipped) == 1 and int(optimizer.iterations) == 2
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_callable_policy_in_fit():
    model = make_mlp()
    trainer = gradaccum.wrap(model, steps=2, nonfinite=lambda grads: tf.constant(True))
    trainer.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    before = model.get_weights()
    x, y = make_data(8)
    history = trainer.fit(x, y, batch_size=2, verbose=0)
    assert history.history["skipped"] == [4.0] and history.history["updates"] == [0.0]
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "verdict, message",
    [
        (lambda g: tf.constant(1.0),
         "The `nonfinite` callable must return a boolean (True: skip the micro-batch). "
         "Received: a value of dtype float32"),
        (lambda g: tf.constant([True, False]),
         "The `nonfinite` callable must return a scalar boolean. Received: a value of "
         "shape (2,)"),
    ],
    ids=["not-bool", "not-scalar"],
)
def test_callable_policy_bad_output(verdict, message):
    acc = gradaccum.GradientAccumulator([tf.Variable(1.0)], nonfinite=verdict)
    with pytest.raises(ValueError) as info:
        acc.accumulate([tf.constant(1.0)])
    assert str(info.value) == message


# 3. fit(callbacks=CallbackList(...)) leaves the caller's list as it was --------------


class _Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0
        self.epochs = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1

    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1


def _fit_model(callbacks, epochs=2):
    """Fits with `callbacks`: a list, or a function of the trainer making a list or
    a CallbackList (as Keras users build one: with History and the model)."""
    model = make_mlp()
    trainer = gradaccum.wrap(model, steps=3)
    if callable(callbacks):
        callbacks = callbacks(trainer)
    trainer.compile(optimizer=keras.optimizers.Adam(0.01),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    steps_per_execution=1)
    x, y = make_data(28)
    epoch_lengths = []

    class Length(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epoch_lengths.append(int(trainer._fit_state.epoch_length.numpy()))

    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.callbacks.append(Length())
    else:
        callbacks = [*callbacks, Length()]
    trainer.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0,
                callbacks=callbacks)
    return trainer, model, epoch_lengths


def test_callback_list_is_left_as_it_was_and_the_epoch_length_is_known():
    recorder = _Recorder()
    made = []

    def callback_list(trainer):
        made.append(keras.callbacks.CallbackList([recorder], add_history=True, model=trainer))
        return made[0]

    trainer, model, lengths = _fit_model(callback_list)
    callbacks = made[0]
    # The recorder, Keras's History, and the test's epoch-length probe: nothing more.
    assert len(callbacks.callbacks) == 3 and callbacks.callbacks[0] is recorder
    # 28 samples at batch 4: 7 micro-batches per epoch, known from the start.
    assert lengths == [7, 7]
    assert (recorder.batches, recorder.epochs) == (14, 2)
    # 7 micro-batches = 3 + 3 + 1 (flushed): 3 updates per epoch.
    assert int(trainer.optimizer.iterations) == 6
    # A second fit with the same list adds nothing to it.
    trainer.fit(*make_data(28), batch_size=4, epochs=1, verbose=0, callbacks=callbacks)
    assert len(callbacks.callbacks) == 3 and recorder.epochs == 3
    # The same weights as with a plain list.
    _, reference, _ = _fit_model([_Recorder()])
    _, listed, _ = _fit_model(
        lambda trainer: keras.callbacks.CallbackList([], add_history=True, model=trainer)
    )
    for a, b in zip(listed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


# Found by review of accumulate (each failed before its fix) --------------------------

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_a_recompile_keeps_the_open_window():
    x, y = make_data(40)
    full = gradaccum.accumulate(make_mlp(), steps=4, partial="carry")
    full.compile(keras.optimizers.SGD(0.5, momentum=0.9), SCE)
    full.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    split = gradaccum.accumulate(make_mlp(), steps=4, partial="carry")
    split.compile(keras.optimizers.SGD(0.5, momentum=0.9), SCE)
    split.fit(x[:24], y[:24], batch_size=4, shuffle=False, verbose=0)  # 2 left open
    split.compile(split.optimizer, SCE, metrics=["accuracy"])  # e.g. to add a metric
    split.fit(x[24:], y[24:], batch_size=4, shuffle=False, verbose=0)
    assert int(split.optimizer.iterations) == int(full.optimizer.iterations) == 2
    for a, b in zip(split.get_weights(), full.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class TwoHeadsModel(keras.Model):
    """Its own step: the first layer through `self.optimizer`, the second through an
    optimizer kept in a list attribute (`"list"`; `"chained"`: its gradient taken
    after the first layer's update), or twice through `self.optimizer` (`"twice"`;
    `"overlap"`: all variables, then the first layer's)."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.first = keras.layers.Dense(4, activation="tanh")
        self.second = keras.layers.Dense(3)
        self.extra = [keras.optimizers.SGD(0.1)]

    def call(self, x):
        return self.second(self.first(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True))
        first, second = self.first.trainable_variables, self.second.trainable_variables
        grads = tape.gradient(loss, first + second)
        if self.mode == "list":
            self.optimizer.apply_gradients(zip(grads[:2], first))
            self.extra[0].apply_gradients(zip(grads[2:], second))
        elif self.mode == "chained":
            # The second head's gradient after the first head's update.
            self.optimizer.apply_gradients(zip(grads[:2], first))
            with tf.GradientTape() as tape:
                again = self.compute_loss(x, y, self(x, training=True))
            self.extra[0].apply_gradients(zip(tape.gradient(again, second), second))
        elif self.mode == "overlap":
            self.optimizer.apply_gradients(zip(grads, first + second))
            self.optimizer.apply_gradients(zip(grads[:2], first))
        else:
            self.optimizer.apply_gradients(zip(grads, first + second))
            self.optimizer.apply_gradients(zip(grads, first + second))
        return {"loss": loss}


def _two_heads(mode, accumulate_steps=None):
    model = TwoHeadsModel(mode)
    model(np.zeros((1, 5), "float32"))
    rng = np.random.default_rng(3)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32")
                       for w in model.get_weights()])
    if accumulate_steps:
        gradaccum.accumulate(model, steps=accumulate_steps)
    model.compile(keras.optimizers.SGD(0.1), SCE, steps_per_execution=1)
    return model


@pytest.mark.parametrize("mode, updates", [("list", (2, 2)), ("twice", (4, None))])
def test_own_step_optimizers_in_a_list_and_twice_per_step(mode, updates):
    x, y = make_data(32)
    model = _two_heads(mode, accumulate_steps=4)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    reference = _two_heads(mode)
    reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == updates[0]
    if mode == "list":
        assert int(model.extra[0].iterations) == int(reference.extra[0].iterations) == 2
        for a, b in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_masked_update_leaves_constraints_and_overwrites_of_an_ungraded_variable():
    free = tf.Variable([1.0, 2.0])
    constrained = keras.Variable([-1.0, 3.0], constraint=keras.constraints.NonNeg())
    overwritten = keras.Variable([7.0, 8.0])
    overwritten.overwrite_with_gradient = True
    optimizer = keras.optimizers.SGD(1.0)
    acc = gradaccum.GradientAccumulator([free, constrained, overwritten])
    tf.function(lambda: acc.accumulate([tf.constant([1.0, 1.0]), None, None]))()
    tf.function(lambda: acc.apply(optimizer))()
    np.testing.assert_array_equal(free.numpy(), [0.0, 1.0])
    np.testing.assert_array_equal(np.asarray(constrained), [-1.0, 3.0])
    np.testing.assert_array_equal(np.asarray(overwritten), [7.0, 8.0])


def test_load_weights_before_compile_then_resume(tmp_path):
    x, y = make_data(24)
    model = gradaccum.accumulate(make_mlp(), steps=4, partial="carry")
    model.compile(keras.optimizers.Adam(0.05), SCE)
    model.fit(x[:8], y[:8], batch_size=4, shuffle=False, verbose=0)  # 2 open
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    restored = gradaccum.accumulate(make_mlp(seed=5), steps=4, partial="carry")
    restored.load_weights(path)  # before compile: the window waits
    restored.compile(keras.optimizers.Adam(0.05), SCE)
    restored.optimizer.build(restored.trainable_variables)
    # The waiting window lives on as soon as the model is compiled (as on JAX):
    # `save_weights`, `disable` and `open_micro_batches` see it before the next fit.
    window = gradaccum.attach.accumulation_of(restored)
    assert window.open_micro_batches() == 2
    restored.fit(x[8:16], y[8:16], batch_size=4, shuffle=False, verbose=0)
    model.fit(x[8:16], y[8:16], batch_size=4, shuffle=False, verbose=0)
    assert int(restored.optimizer.iterations) == int(model.optimizer.iterations) == 1


def test_fit_with_no_epoch_left_to_run_is_not_an_error():
    model = gradaccum.accumulate(make_mlp(), steps=2)
    model.compile("sgd", SCE)
    history = model.fit(*make_data(8), batch_size=2, epochs=2, initial_epoch=2, verbose=0)
    assert history.history == {} and int(model.optimizer.iterations) == 0


def test_an_optimizer_applied_twice_per_batch_is_warned_about_once_per_fit():
    x, y = make_data(32)
    model = _two_heads("twice", accumulate_steps=4)
    message = (
        "TwoHeadsModel.train_step applies `self.optimizer` 2 times per batch to the same "
        "variables. gradaccum gives each call its own accumulator: a window makes 2 "
        "updates with it, each from the gradients its call took at the weights the "
        "window started from. Training on the window as one batch would compute each "
        "call's gradients after the previous update, so the results differ (a WGAN "
        "critic trained several times per step: train it once per batch and let more "
        "batches reach it instead)."
    )
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        assert [str(w.message) for w in caught if "times per batch" in str(w.message)] == [
            message
        ]
    # Two windows of 4 micro-batches an epoch, 2 updates each: 16 after two fits.
    assert int(model.optimizer.iterations) == 16
    once = _two_heads("list", accumulate_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        once.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert not [w for w in caught if "times per batch" in str(w.message)]
