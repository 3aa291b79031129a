"""Property-based tests: random windows against the large-batch reference.

Hypothesis draws micro-batch sizes (1 to 33), steps (1 to 8), partial-window
policies, reductions, weightings and optimizers; every case is compared with an
independent reference computed on the concatenated windows. Examples are derandomized
(the same on every run) and few, on a small model, to keep the suite fast.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import gradaccum
from helpers import OPTIMIZERS, fit_state, grads_of, make_mlp, make_trainer

SETTINGS = dict(
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def data(n, seed=7):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 3, size=n)


def split(sizes):
    bounds = np.cumsum([0, *sizes])
    return [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def windows_of(micro, steps, partial):
    """Closed windows (lists of index arrays) and the open rest, one pass."""
    full = [micro[i:i + steps] for i in range(0, len(micro), steps)]
    closed, rest = full, []
    if full and len(full[-1]) < steps:
        closed, last = full[:-1], full[-1]
        if partial == "flush":
            closed = [*closed, last]
        elif partial == "carry":
            rest = last
    return closed, rest


def reference_gradient(model, x, y, window, reduction, weighting):
    """G for one window, computed from per-micro-batch gradients in float64, or on
    the concatenated window where that is the definition."""
    if reduction == "mean" and weighting == "exact":
        idx = np.concatenate(window)
        return [g.numpy().astype("float64") for g in grads_of(model, x[idx], y[idx])]
    per = [[g.numpy().astype("float64") for g in grads_of(model, x[m], y[m])] for m in window]
    total = [sum(parts) for parts in zip(*per)]
    if reduction == "sum":
        return total
    return [t / len(window) for t in total]


@settings(max_examples=min(4, settings().max_examples), **SETTINGS)
# Besides the drawn examples (few, for the suite's time): a dropped partial window
# under Adam and a carried one under RMSprop, every time.
@example(sizes=[5, 3, 8, 2, 7], steps=3, partial="drop", reduction="mean",
         weighting="exact", optimizer="adam")
@example(sizes=[4, 9, 1, 6], steps=3, partial="carry", reduction="sum",
         weighting="uniform", optimizer="rmsprop")
@given(
    sizes=st.lists(st.integers(1, 33), min_size=1, max_size=9),
    steps=st.integers(1, 8),
    partial=st.sampled_from(["flush", "drop", "carry"]),
    reduction=st.sampled_from(["mean", "sum"]),
    weighting=st.sampled_from(["exact", "uniform"]),
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
)
def test_accumulator_equals_the_large_batch(sizes, steps, partial, reduction, weighting,
                                            optimizer):
    keras.utils.clear_session()
    x, y = data(sum(sizes))
    micro = split(sizes)
    closed, rest = windows_of(micro, steps, partial)

    model, opt = make_mlp(), OPTIMIZERS[optimizer]()
    acc = gradaccum.GradientAccumulator(
        model.trainable_variables, steps=steps, reduction=reduction
    )
    for m in micro:
        weight = len(m) if weighting == "exact" else 1.0
        acc.step(opt, grads_of(model, x[m], y[m]), weight=weight)
    if partial == "flush":
        acc.apply(opt)
    elif partial == "drop":
        acc.reset()

    ref_model, ref_opt = make_mlp(), OPTIMIZERS[optimizer]()
    for window in closed:
        g = reference_gradient(ref_model, x, y, window, reduction, weighting)
        ref_opt.apply_gradients(
            zip([tf.constant(v, tf.float32) for v in g], ref_model.trainable_variables)
        )
    assert int(opt.iterations) == int(ref_opt.iterations) == len(closed)
    for a, b in zip(model.get_weights(), ref_model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    for a, b in zip(opt.variables, ref_opt.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    assert int(acc.micro_step) == len(rest)
    if rest:  # carried: the open window holds the rest's combination
        expected = reference_gradient(ref_model, x, y, rest, reduction, weighting)
        for a, b in zip(acc.gradients(), expected):
            np.testing.assert_allclose(a.numpy(), b, rtol=2e-5, atol=2e-6)


@settings(max_examples=min(3, settings().max_examples), **SETTINGS)
@example(n=23, batch_size=4, steps=4, partial="drop", epochs=2, optimizer="rmsprop")
@given(
    n=st.integers(1, 40),
    batch_size=st.integers(1, 33),
    steps=st.integers(1, 8),
    partial=st.sampled_from(["flush", "drop", "carry"]),
    epochs=st.integers(1, 2),
    optimizer=st.sampled_from(["adam", "sgd_nesterov", "rmsprop"]),
)
def test_fit_equals_the_large_batch(door, n, batch_size, steps, partial, epochs, optimizer):
    keras.utils.clear_session()
    x, y = data(n)
    micro = [np.arange(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    # Windows over the whole run: "carry" joins the epochs' micro-batches.
    windows, rest = [], []
    if partial == "carry":
        windows, rest = windows_of(micro * epochs, steps, "carry")
    else:
        for _ in range(epochs):
            windows += windows_of(micro, steps, partial)[0]

    model = make_mlp()
    trainer = make_trainer(door, model, steps=steps, partial=partial)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainer.compile(optimizer=OPTIMIZERS[optimizer](), loss=sce)
    history = trainer.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
                          verbose=0)

    reference = make_mlp()
    reference.compile(optimizer=OPTIMIZERS[optimizer](), loss=sce)
    for window in windows:
        idx = np.concatenate(window)
        reference.train_on_batch(x[idx], y[idx])
    assert history.history["updates"][-1] == len(windows)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    assert int(fit_state(trainer).accumulator.micro_step) == len(rest)
