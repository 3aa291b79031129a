"""The gradient noise scale (`noise_scale=True`, `gradaccum.NoiseScaleSchedule`), on
every backend: the estimate against a linear model's known noise scale, the same
windows read alike in each mode, training unchanged by it, a schedule that follows
it, and its bad inputs."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import gradaccum
from gradaccum.adapter import accumulation_of
from gradaccum.core import noise_scale

D = 10


def linear_data(r_norm, samples, seed=0, noise=1.0):
    """Gaussian inputs, targets from weights `w*`, and weights `w = w* + r` with
    |r| = `r_norm`: the loss (w.x - y)^2 at `w` has the noise scale `truth`."""
    rng = np.random.default_rng(seed)
    w_star = rng.normal(size=(D, 1)).astype("float32")
    r = rng.normal(size=(D, 1))
    r = (r * r_norm / np.linalg.norm(r)).astype("float32")
    x = rng.normal(size=(samples, D)).astype("float32")
    y = (x @ w_star + noise * rng.normal(size=(samples, 1))).astype("float32")
    r2 = float(np.sum(r.astype("float64") ** 2))
    truth = (D * (r2 + noise**2) + r2) / r2
    return x, y, w_star + r, truth


def linear(weights, **options):
    """A linear model at `weights`, trained by SGD at learning rate 0 (the weights
    stay where the noise scale is known)."""
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign(weights)
    model = gradaccum.accumulate(model, **options)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    return model


def unequal_batches(x, y):
    """Micro-batches of 4, 8 and 12 samples in turn."""
    start = 0
    while start < len(x):
        for size in (4, 8, 12):
            yield x[start:start + size], y[start:start + size]
            start += size


@pytest.mark.parametrize("r_norm", [1.0, 2.0])
def test_an_epoch_of_8_x_8_windows_lands_within_15_percent_of_the_truth(r_norm):
    # 128 windows of 8 micro-batches of 8 samples. (Over 40 seeds of the same
    # draw in NumPy, the estimate's spread is 3.8 % at |r| = 1 and 2.9 % at 2.)
    x, y, weights, truth = linear_data(r_norm, 8 * 8 * 128)
    model = linear(weights, steps=8, noise_scale=True)
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    estimate = history.history["noise_scale"][0]
    assert abs(estimate / truth - 1) < 0.15, (estimate, truth)


def test_unequal_micro_batches_weigh_by_their_size():
    # Micro-batches of 4, 8 and 12 samples in turn (windows of 3 of them): each
    # is a piece of its own size.
    x, y, weights, truth = linear_data(1.0, 24 * 400, seed=1)

    model = linear(weights, steps=3, noise_scale=True)
    history = model.fit(unequal_batches(x, y), epochs=1, verbose=0)
    estimate = history.history["noise_scale"][0]
    assert abs(estimate / truth - 1) < 0.15, (estimate, truth)


def test_the_same_windows_read_alike_in_steps_and_split_mode_and_an_own_step():
    x, y, weights, _ = linear_data(1.0, 8 * 8 * 12, seed=2)
    steps = linear(weights, steps=8, noise_scale=True).fit(
        x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    split = linear(weights, micro_batch_size=8, noise_scale=True).fit(
        x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)

    class OwnStep(keras.Sequential):
        """Keras's step written out: the guide's model with its own train_step."""

        def train_step(self, *arguments):
            if keras.backend.backend() == "tensorflow":
                x, y = arguments[0]
                import tensorflow as tf

                with tf.GradientTape() as tape:
                    loss = keras.ops.mean((self(x, training=True) - y) ** 2)
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply(grads, self.trainable_variables)
                return {"loss": loss}
            return super().train_step(*arguments)

    own = OwnStep([keras.Input((D,)), keras.layers.Dense(1, use_bias=False)])
    own.layers[0].kernel.assign(weights)
    gradaccum.accumulate(own, steps=8, noise_scale=True)
    own.compile(keras.optimizers.SGD(0.0), "mse")
    readings = [own.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                        verbose=0).history["noise_scale"][0]]
    expected = steps.history["noise_scale"][0]
    assert np.isfinite(expected)
    for reading in [split.history["noise_scale"][0], *readings]:
        np.testing.assert_allclose(reading, expected, rtol=1e-4)


def test_training_is_unchanged_bit_for_bit_and_each_epoch_reads_its_own_windows():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(200, D)).astype("float32")
    y = rng.normal(size=(200, 1)).astype("float32")
    runs = {}
    for flag in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(4, "relu"),
                                  keras.layers.Dense(1)])
        gradaccum.accumulate(model, steps=3, noise_scale=flag)
        model.compile(keras.optimizers.Adam(0.01), "mse")
        # 200 samples in batches of 16: 13 micro-batches, a partial window of 1.
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        runs[flag] = (model.get_weights(), model.optimizer.variables, history.history)
    for plain, measured in zip(runs[False][0], runs[True][0]):
        np.testing.assert_array_equal(plain, measured)
    for plain, measured in zip(runs[False][1], runs[True][1]):
        np.testing.assert_array_equal(np.asarray(plain), np.asarray(measured))
    logs = runs[True][2]
    assert "noise_scale" not in runs[False][2]
    assert len(logs["noise_scale"]) == 2 and all(np.isfinite(logs["noise_scale"]))
    # Each epoch's reading is of its own windows (the weights moved).
    assert logs["noise_scale"][0] != logs["noise_scale"][1]


def test_a_window_of_one_micro_batch_measures_nothing():
    x, y, weights, _ = linear_data(1.0, 64)
    history = linear(weights, steps=1, noise_scale=True).fit(
        x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isnan(history.history["noise_scale"][0])


def test_a_schedule_follows_the_last_epochs_estimate():
    # At fixed weights the noise scale is about 21 samples: k = round(21 / 4) = 5.
    x, y, weights, _ = linear_data(1.0, 4 * 8 * 60, seed=4)
    schedule = gradaccum.NoiseScaleSchedule(micro_batch_size=4, max_steps=8)
    model = linear(weights, steps=schedule)
    history = model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0).history
    batches = len(x) // 4
    expected = [schedule.initial_steps]
    for estimate in history["noise_scale"][:-1]:
        expected.append(schedule.steps_for(estimate) or expected[-1])
    assert history["steps"] == [float(k) for k in expected]
    # Each epoch's windows are of its k (the last one partial): ceil(batches / k).
    updates = np.diff([0.0, *history["updates"]])
    assert updates.tolist() == [float(-(-batches // k)) for k in expected]
    assert expected[0] == 2 and 4 <= expected[1] <= 6


def test_a_schedule_every_n_updates_changes_k_at_those_updates():
    # About 21 samples of noise scale: after 4 windows of 2, k = round(21 / 4) = 5.
    x, y, weights, _ = linear_data(1.0, 4 * 80, seed=5)
    schedule = gradaccum.NoiseScaleSchedule(micro_batch_size=4, every=4, max_steps=8)
    model = linear(weights, steps=schedule)
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history
    k = int(history["steps"][0])
    assert 4 <= k <= 6
    # 8 micro-batches in windows of 2, then windows of k (set again every 4
    # updates, from the same weights: k or its neighbours).
    assert history["updates"][0] <= 4 + -(-(80 - 8) // (k - 1))
    assert history["updates"][0] >= 4 + (80 - 8) // (k + 1)


def test_the_schedule_travels_in_a_saved_model(tmp_path):
    x, y, weights, _ = linear_data(2.0, 64, seed=6)
    schedule = gradaccum.NoiseScaleSchedule(micro_batch_size=8, max_steps=6, every=3)
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign(weights)
    trainer = gradaccum.wrap(model, steps=schedule)
    trainer.compile(keras.optimizers.SGD(0.0), "mse")
    trainer.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    trainer.save(path)
    loaded = gradaccum.load_model(path)
    assert accumulation_of(loaded).options.window.steps == schedule
    again = loaded.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    assert "noise_scale" in again and "steps" in again


def test_the_accumulators_reading_and_its_reset():
    x, y, weights, truth = linear_data(1.0, 8 * 8 * 128, seed=7)
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign(weights)
    optimizer = keras.optimizers.SGD(0.0)
    optimizer.build(model.trainable_variables)
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=8,
                                        noise_scale=True)
    assert np.isnan(acc.noise_scale)
    _custom_loop(model, optimizer, acc, x, y, 8)
    assert abs(acc.noise_scale / truth - 1) < 0.15
    acc.reset_noise_scale()
    assert np.isnan(acc.noise_scale)
    plain = gradaccum.GradientAccumulator(model.trainable_variables, steps=8)
    with pytest.raises(ValueError, match=r"keeps no noise scale: make it with "
                                         r"`noise_scale=True`"):
        plain.noise_scale  # noqa: B018


def _custom_loop(model, optimizer, acc, x, y, size):
    """The backend's custom loop: a micro-batch of `size` samples at a time."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        def loss_fn(trainable, non_trainable, xb, yb):
            pred, _ = model.stateless_call(trainable, non_trainable, xb)
            return keras.ops.mean((pred - yb) ** 2)

        @jax.jit
        def step(state, xb, yb):
            trainable, non_trainable, optimizer_vars, acc_vars = state
            grads = jax.grad(loss_fn)(trainable, non_trainable, xb, yb)
            trainable, optimizer_vars, acc_vars = acc.stateless_step(
                optimizer, grads, trainable, optimizer_vars, acc_vars, weight=size)
            return trainable, non_trainable, optimizer_vars, acc_vars

        state = ([v.value for v in model.trainable_variables],
                 [v.value for v in model.non_trainable_variables],
                 [v.value for v in optimizer.variables], [v.value for v in acc.variables])
        for start in range(0, len(x), size):
            state = step(state, x[start:start + size], y[start:start + size])
        for variable, value in zip(acc.variables, state[3]):
            variable.assign(value)
    elif backend == "tensorflow":
        import tensorflow as tf

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb) - yb) ** 2)
            return acc.step(optimizer, tape.gradient(loss, model.trainable_variables),
                            weight=size)

        for start in range(0, len(x), size):
            step(x[start:start + size], y[start:start + size])
    else:
        import torch

        for start in range(0, len(x), size):
            xb, yb = torch.as_tensor(x[start:start + size]), torch.as_tensor(
                y[start:start + size])
            loss = keras.ops.mean((model(xb) - yb) ** 2)
            model.zero_grad()
            loss.backward()
            acc.step(optimizer, [v.value.grad for v in model.trainable_weights],
                     weight=size)


@pytest.mark.parametrize(("options", "message"), [
    ({"steps": 2, "noise_scale": "yes"},
     r"`noise_scale` must be True or False\. Received: noise_scale='yes'"),
    ({"steps": 2, "noise_scale": True, "reduction": "sum"},
     r'`noise_scale=True` needs reduction="mean".*Received: reduction=\'sum\''),
    ({"steps": 2, "noise_scale": True, "privacy": "privacy"},
     r"`noise_scale=True` cannot be used with `privacy`"),
    ({"steps": "schedule", "reduction": "sum"},
     r'`noise_scale=True` needs reduction="mean"'),
    ({"steps": "schedule", "weight_per_update": 10},
     r"`steps` and `weight_per_update` cannot be used together"),
    ({"steps": "schedule", "micro_batch_size": 4},
     r"`steps` and `micro_batch_size` cannot be used together"),
])
def test_bad_options_are_refused_with_the_fix(options, message):
    options = dict(options)
    if options.get("steps") == "schedule":
        options["steps"] = gradaccum.NoiseScaleSchedule(micro_batch_size=8)
    if options.get("privacy") == "privacy":
        options["privacy"] = gradaccum.Privacy(l2_norm_clip=1.0, noise_multiplier=1.0)
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=message):
        gradaccum.accumulate(model, **options)


@pytest.mark.parametrize(("arguments", "message"), [
    ({"micro_batch_size": 0},
     r"`micro_batch_size` must be an integer >= 1\. Received: micro_batch_size=0"),
    ({"micro_batch_size": 8.0},
     r"`micro_batch_size` must be an integer >= 1\. Received: micro_batch_size=8\.0"),
    ({"micro_batch_size": 8, "min_steps": 1},
     r"`min_steps` must be an integer >= 2\. Received: min_steps=1"),
    ({"micro_batch_size": 8, "min_steps": 4, "max_steps": 3},
     r"`max_steps` must be an integer >= 4\. Received: max_steps=3"),
    ({"micro_batch_size": 8, "initial_steps": 1},
     r"`initial_steps` must be an integer >= 2\. Received: initial_steps=1"),
    ({"micro_batch_size": 8, "max_steps": 4, "initial_steps": 5},
     r"`initial_steps` must be at most `max_steps`\. Received: initial_steps=5, "
     r"max_steps=4"),
    ({"micro_batch_size": 8, "every": 0},
     r'`every` must be "epoch" or an integer >= 1 of updates\. Received: every=0'),
    ({"micro_batch_size": 8, "every": "week"},
     r"Received: every='week'"),
])
def test_a_schedules_bad_arguments_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        gradaccum.NoiseScaleSchedule(**arguments)


def test_the_estimators_on_a_window_of_known_pieces():
    # Two pieces of 2 and 6 samples, weighing their samples, with gradients (1, 0)
    # and (0, 1): x = (2 * 1 + 6 * 1) / 8 = 1, |G_W|^2 = (2/8)^2 + (6/8)^2 = 0.625,
    # a = 2 / 8, c = 8 / 64: tr(Sigma) = (1 - 0.625) / (a - c), and
    # |G|^2 = (a 0.625 - c) / (a - c).
    trace, gradient, counted = noise_scale.window_estimates(
        pieces_norm=2 * 1 + 6 * 1, spread=2.0, spread_squared=8.0, pieces=2,
        pieces_weight=8, sums_norm=2**2 + 6**2, weight=8)
    np.testing.assert_allclose([float(trace), float(gradient)],
                               [0.375 / 0.125, (0.25 * 0.625 - 0.125) / 0.125],
                               rtol=1e-6)
    assert bool(counted)
    # One piece, or pieces that hold less than the window's weight, do not count.
    assert not bool(noise_scale.window_estimates(4.0, 1.0, 4.0, 1, 4, 4.0, 4)[2])
    assert not bool(noise_scale.window_estimates(8.0, 2.0, 8.0, 2, 8, 40.0, 12)[2])


def test_uniform_weights_over_unequal_micro_batches_count_their_samples():
    # weighting="uniform": each micro-batch weighs 1 whatever its size (4, 8, 12);
    # its gradient's noise is its samples'.
    x, y, weights, truth = linear_data(1.0, 24 * 400, seed=10)

    model = linear(weights, steps=3, noise_scale=True, weighting="uniform")
    estimate = model.fit(unequal_batches(x, y), epochs=1,
                         verbose=0).history["noise_scale"][0]
    assert abs(estimate / truth - 1) < 0.15, (estimate, truth)


def test_an_accumulators_schedule_sets_k_every_n_updates():
    x, y, weights, _ = linear_data(1.0, 4 * 80, seed=8)
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign(weights)
    optimizer = keras.optimizers.SGD(0.0)
    optimizer.build(model.trainable_variables)
    schedule = gradaccum.NoiseScaleSchedule(micro_batch_size=4, every=4, max_steps=8)
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=schedule)
    _custom_loop(model, optimizer, acc, x, y, 4)
    # Four windows of 2, then windows of about round(21 / 4) = 5.
    assert 4 + 72 // 7 <= int(acc.updates.numpy()) <= 4 + 72 // 3
    assert np.isfinite(acc.noise_scale)
    with pytest.raises(ValueError, match=r"must set k every N updates: a custom loop "
                                         r"has no epochs.*Received: every='epoch'"):
        gradaccum.GradientAccumulator(model.trainable_variables,
                                      steps=gradaccum.NoiseScaleSchedule(4))


def reference_estimate(x, y, weights, steps, size, skipped=()):
    """The noise scale of windows of `steps` micro-batches of `size` samples of
    the linear model at `weights` (micro-batches in `skipped` are no piece of
    their window), in NumPy: each micro-batch's mean gradient against the
    window's, the estimators of `gradaccum.core.noise_scale`."""
    x, y, w = (np.asarray(a, "float64") for a in (x, y, weights))
    trace = gradient = 0.0
    count = len(x) // size
    for start in range(0, count, steps):
        pieces = [i for i in range(start, min(start + steps, count)) if i not in skipped]
        grads = [2 * x[i * size:(i + 1) * size].T
                 @ (x[i * size:(i + 1) * size] @ w - y[i * size:(i + 1) * size]) / size
                 for i in pieces]
        m, total = len(grads), size * len(grads)
        if m < 2:
            continue
        small = np.mean([float(np.sum(g**2)) for g in grads])
        large = float(np.sum(np.mean(grads, axis=0) ** 2))
        trace += total * (small - large) / (m - 1)
        gradient += (m * large - small) / (m - 1)
    return trace / gradient


def test_a_skipped_micro_batch_is_no_piece_of_its_window():
    # Micro-batch 5 holds a nan: skipped, its window (micro-batches 4 to 7) holds
    # three pieces. The estimate is NumPy's on the same pieces.
    x, y, weights, _ = linear_data(1.0, 8 * 4 * 6, seed=9)
    poisoned = x.copy()
    poisoned[40:48] = np.nan
    history = linear(weights, steps=4, noise_scale=True).fit(
        poisoned, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    assert history["skipped"] == [1.0]
    expected = reference_estimate(x, y, weights, 4, 8, skipped={5})
    np.testing.assert_allclose(history["noise_scale"][0], expected, rtol=1e-4)


def test_a_loop_of_train_on_batch_calls_warns_that_epochs_set_k():
    x, y, weights, _ = linear_data(1.0, 32, seed=11)
    model = linear(weights, steps=gradaccum.NoiseScaleSchedule(micro_batch_size=8))
    with pytest.warns(UserWarning, match=r"NoiseScaleSchedule\(every='epoch'\) sets k at "
                                         r"fit's epochs.*k stays 2\. Pass every=N"):
        model.train_on_batch(x[:8], y[:8])
