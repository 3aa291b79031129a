"""Non-finite gradients in float32 training: nonfinite="skip" | "raise" | "apply"."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from helpers import OPTIMIZERS, assert_same_state, grads_of, make_data, make_mlp

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def poisoned(x, row):
    bad = x.copy()
    bad[row, 0] = np.nan
    return bad


def reference_without(x, y, windows, optimizer="adam"):
    """Plain Keras, one step per window (index arrays) of good samples."""
    model, opt = make_mlp(), OPTIMIZERS[optimizer]()
    for w in windows:
        opt.apply_gradients(zip(grads_of(model, x[w], y[w]), model.trainable_variables))
    return model, opt


def test_skip_drops_the_micro_batch_with_its_weight_and_warns_once():
    x, y = make_data(24)
    bad = poisoned(x, 9)  # in the third micro-batch of 4
    model, opt = make_mlp(), OPTIMIZERS["adam"]()
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=3)
    assert acc.nonfinite == "skip"
    skipped_one = r"skipped 1 micro-batch\(es\) whose gradient is not finite"
    with pytest.warns(UserWarning, match=skipped_one):
        for start in range(0, 24, 4):
            acc.step(opt, grads_of(model, bad[start:start + 4], y[start:start + 4]), weight=4)
    assert int(acc.skipped) == 1 and int(acc.micro_batches) == 6
    assert int(opt.iterations) == 2
    # The window closed after 3 micro-batches all the same, from the 2 good ones.
    ref_model, ref_opt = reference_without(x, y, [np.r_[0:8], np.r_[12:24]])
    assert_same_state(model, opt, ref_model, ref_opt, rtol=1e-6, atol=1e-7)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second skip does not warn again
        acc.accumulate(grads_of(model, bad[8:12], y[8:12]), weight=4)
    assert int(acc.skipped) == 2


def test_raise_names_the_micro_batch():
    x, y = make_data(12)
    model, opt = make_mlp(), OPTIMIZERS["sgd"]()
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=2, nonfinite="raise")

    @tf.function
    def step(x, y):
        return acc.step(opt, grads_of(model, x, y), weight=4)

    step(x[:4], y[:4])
    weights = model.get_weights()
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        step(poisoned(x, 5)[4:8], y[4:8])
    message = str(info.value)
    assert "gradaccum: a gradient is not finite (inf or nan) in micro-batch" in message
    assert "micro-batch] [2] [(counted from 1; the micro-batch] [2] [of its window)" in message
    assert "nonfinite=raise stops here" in message
    for w, w0 in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(w, w0)

    # Eagerly: the same error, as one sentence.
    v = tf.Variable([1.0])
    eager = gradaccum.GradientAccumulator([v], steps=2, nonfinite="raise")
    eager.step(opt, [tf.constant([1.0])])
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        eager.step(opt, [tf.constant([np.inf])])
    assert str(info.value) == (
        "gradaccum: a gradient is not finite (inf or nan) in micro-batch 2 (counted from "
        "1; the micro-batch 2 of its window): nonfinite=raise stops here. Check the data "
        "and the loss of that micro-batch, or use nonfinite=skip to drop it."
    )
    assert float(v[0]) == 1.0 and int(eager.micro_step) == 1


def test_apply_is_keras_behaviour():
    x, y = make_data(8)
    model, opt = make_mlp(), OPTIMIZERS["sgd"]()
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=2, nonfinite="apply")
    acc.step(opt, grads_of(model, x[:4], y[:4]), weight=4)
    acc.step(opt, grads_of(model, poisoned(x, 5)[4:8], y[4:8]), weight=4)
    assert int(acc.skipped) == 0
    assert np.isnan(model.get_weights()[0]).any()


DOORS = {"wrap": gradaccum.wrap, "accumulate": gradaccum.accumulate}


@pytest.mark.parametrize("steps", [1, 3])
def test_fit_skips_by_default_and_shows_the_counter(steps, door):
    x, y = make_data(24)
    bad = poisoned(x, 9)
    model = make_mlp()
    trainer = DOORS[door](model, steps=steps)
    trainer.compile(optimizer=OPTIMIZERS["adam"](), loss=SCE)
    with pytest.warns(UserWarning, match=r"skipped 1 micro-batch\(es\)"):
        history = trainer.fit(bad, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0, 2.0]
    if steps == 1:
        windows = [np.r_[a:a + 4] for a in (0, 4, 12, 16, 20)]
    else:
        windows = [np.r_[0:8], np.r_[12:24]]
    assert history.history["updates"] == [len(windows), 2 * len(windows)]
    ref_model, ref_opt = reference_without(x, y, windows * 2)
    assert_same_state(model, trainer.optimizer, ref_model, ref_opt, rtol=1e-5)


def test_fit_raise_stops_at_the_micro_batch(door):
    x, y = make_data(16)
    trainer = DOORS[door](make_mlp(), steps=2, nonfinite="raise")
    trainer.compile(optimizer="sgd", loss=SCE)
    with pytest.raises(tf.errors.InvalidArgumentError, match="in micro-batch"):
        trainer.fit(poisoned(x, 13), y, batch_size=4, shuffle=False, verbose=0)


def test_fit_apply_lets_nan_through_as_keras_does(door):
    x, y = make_data(16)
    model = make_mlp()
    trainer = DOORS[door](model, steps=2, nonfinite="apply")
    trainer.compile(optimizer="sgd", loss=SCE)
    history = trainer.fit(poisoned(x, 13), y, batch_size=4, shuffle=False, verbose=0)
    assert "skipped" not in history.history
    assert np.isnan(model.get_weights()[0]).all()


def test_raise_under_xla_raises_after_the_compiled_call(door):
    """XLA compiles the step's assertion away: the micro-batch is skipped, and fit
    raises after the compiled call that skipped it."""
    x, y = make_data(16)
    model = make_mlp()
    trainer = DOORS[door](model, steps=2, nonfinite="raise")
    trainer.compile(optimizer="sgd", loss=SCE, jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        trainer.fit(poisoned(x, 13), y, batch_size=4, shuffle=False, verbose=0)
    assert str(info.value).startswith(
        "gradaccum: a gradient is not finite (inf or nan) in 1 micro-batch(es) of this "
        "compiled call (jit_compile: the micro-batch was skipped"
    )
    assert all(np.isfinite(w).all() for w in model.get_weights())
    # A later fit on clean data is not blamed for the earlier skip.
    history = trainer.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0]


@pytest.mark.parametrize("make", ["accumulator", "wrap"])
def test_unknown_nonfinite_is_refused(make):
    with pytest.raises(ValueError) as info:
        if make == "accumulator":
            gradaccum.GradientAccumulator([tf.Variable(1.0)], nonfinite="ignore")
        else:
            gradaccum.wrap(make_mlp(), steps=2, nonfinite="ignore")
    assert str(info.value) == (
        "`nonfinite` must be one of 'skip', 'raise', 'apply' or a callable gradients -> "
        "bool (True skips the micro-batch). Received: nonfinite='ignore'"
    )


def test_dropped_window_of_only_skipped_micro_batches_does_not_leak():
    """Data of unknown length, partial="drop": the last window (one micro-batch, not
    finite) is dropped with its skip, and the next fit starts a fresh window."""
    x, y = make_data(20)
    bad = poisoned(x, 17)  # the fifth micro-batch of 4: alone in its window

    def dataset(features):
        def generate():
            for start in range(0, 20, 4):
                yield features[start:start + 4], y[start:start + 4]

        spec = (tf.TensorSpec([None, 5], tf.float32), tf.TensorSpec([None], tf.int64))
        return tf.data.Dataset.from_generator(generate, output_signature=spec)

    trainer = gradaccum.wrap(make_mlp(), steps=2, partial="drop")
    trainer.compile(optimizer="sgd", loss=SCE)
    with pytest.warns(UserWarning, match="skipped 1 micro-batch"):
        history = trainer.fit(dataset(bad), verbose=0)
    acc = trainer._fit_state.accumulator
    assert history.history["updates"] == [2.0] and history.history["skipped"] == [1.0]
    assert int(acc.window_length()) == 0
    history = trainer.fit(dataset(x), verbose=0)
    assert history.history["updates"] == [4.0]  # 2 windows of 2; the fifth dropped
