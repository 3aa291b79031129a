"""Several replicas with everything on: loss scaling and batch normalization.

MirroredStrategy over the two logical CPU devices of the root conftest. Each test
states what one device computes on the global windows and asserts that the replicas
compute it, with one cross-replica reduction per update.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from test_distribute import OwnStepMLP, mirrored, state_of, trainer_of
from test_keras_model import SCE, data, mlp, plan_windows, reference_fit


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def per_replica(strategy, variable):
    """Each replica's copy of a (mirrored) variable, as numbers."""
    inner = variable.value if isinstance(variable, keras.Variable) else variable
    return [float(v.numpy()) for v in strategy.experimental_local_results(inner)]


# Reduction "sum" ---------------------------------------------------------------------


@pytest.mark.parametrize("own_step", [False, True])
def test_reduction_sum_on_two_replicas_equals_one_device(door, own_step):
    """G = the sum of the micro-batches' gradients: the replicas' gradients of
    Keras's loss (divided by the replica count) summed, as Keras's optimizer does."""

    x, y = data(48)

    def model_of(inner):
        return OwnStepMLP(inner) if own_step else inner

    one_inner = mlp()
    one = trainer_of(door, model_of(one_inner), steps=3, reduction="sum")
    one.compile(keras.optimizers.SGD(0.1), SCE)
    one.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    strategy = mirrored()
    with strategy.scope():
        inner = mlp()
        trainer = trainer_of(door, model_of(inner), steps=3, reduction="sum")
        trainer.compile(keras.optimizers.SGD(0.1), SCE)
    trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(inner.get_weights(), one_inner.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# Loss scaling ----------------------------------------------------------------------

# float16 compute rounds each replica's gradient of its 4-row share, where one device
# rounds the gradient of the whole window: the sums differ by float16 rounding (2**-11
# relative to a gradient's largest entries, so absolute for its small ones), hence
# rtol 1e-3 and atol 5e-4 rather than the float32 tests' 1e-5. The same runs without
# an overflow sit at that distance too (max gap 6e-5 to 1e-4 after 4 updates); the
# float32 loss-scaling test below checks the same logic exactly.
FLOAT16_RTOL, FLOAT16_ATOL = 1e-3, 5e-4


def adam_reference(windows, x, y):
    """Plain Keras, one train_on_batch per global window, Adam (the policy's
    LossScaleOptimizer under mixed_float16)."""
    ref = mlp()
    ref.compile(keras.optimizers.Adam(0.02), SCE)
    return reference_fit(ref, windows, x, y)


def fit_on_two_replicas(door, x, y, ops=None, optimizer=lambda: keras.optimizers.Adam(0.02)):
    """The test MLP, steps 3, batches of 8 (4 per replica), 2 epochs."""
    strategy = mirrored(ops)
    with strategy.scope():
        model = mlp()
        trainer = trainer_of(door, model, steps=3)
        trainer.compile(optimizer(), SCE)
    history = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return strategy, model, trainer, history


def test_mixed_float16_on_two_replicas_equals_one_device(door, mixed_float16):
    x, y = data(50)
    windows, _ = plan_windows(50, 8, 3, epochs=2)  # 7 micro-batches: 3 + 3 + 1 (of 2)
    ref = adam_reference(windows, x, y)
    ops = gradaccum.CountingCrossDeviceOps()
    strategy, model, trainer, history = fit_on_two_replicas(door, x, y, ops)
    assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
    assert history.history["updates"] == [3.0, 6.0]
    assert history.history["skipped"] == [0.0, 0.0]
    assert int(ops.reductions) == 6  # one per update
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=FLOAT16_RTOL, atol=FLOAT16_ATOL)
    inner = trainer.optimizer.inner_optimizer
    for a, b in zip(inner.variables, ref.optimizer.inner_optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2, atol=1e-4)
    # No overflow: the 14 micro-batches count as 14 finite steps on both replicas.
    assert per_replica(strategy, trainer.optimizer.dynamic_scale) == [32768.0] * 2
    assert per_replica(strategy, trainer.optimizer.step_counter) == [14.0] * 2


def test_an_overflowing_replica_share_is_dropped_and_both_replicas_back_off(
    door, mixed_float16
):
    """Row 9 overflows float16 (1e6 > 65504): replica 0's share of the second
    micro-batch (rows 8-11) is dropped with its weight, replica 1's share (rows
    12-15) is kept, and the loss scale halves on both replicas at the update."""
    x, y = data(48)
    bad = x.copy()
    bad[9, 0] = 1e6
    windows, _ = plan_windows(48, 8, 3, epochs=2)  # [0-23], [24-47], twice
    kept = [np.setdiff1d(w, np.arange(8, 12)) for w in windows]
    ref = adam_reference(kept, x, y)
    ops = gradaccum.CountingCrossDeviceOps()
    strategy, model, trainer, history = fit_on_two_replicas(door, bad, y, ops)
    assert history.history["updates"] == [2.0, 4.0]
    assert history.history["skipped"] == [1.0, 2.0]
    assert int(ops.reductions) == 4
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=FLOAT16_RTOL, atol=FLOAT16_ATOL)
    # Each epoch: the first window overflowed (back off: halve, count from 0), the
    # second counted its 3 micro-batches. 32768 / 2 / 2 = 8192, on both replicas.
    assert per_replica(strategy, trainer.optimizer.dynamic_scale) == [8192.0] * 2
    assert per_replica(strategy, trainer.optimizer.step_counter) == [3.0] * 2
    acc = state_of(door, trainer).accumulators()[0]
    assert int(acc.skipped.numpy()) == 2 and int(acc.micro_step.numpy()) == 0


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_own_train_step_on_two_replicas_equals_one_device(policy):
    """Keras scales each replica's loss by 1/replicas (its optimizer then sums): the
    accumulated window is the global window's gradient all the same; under
    mixed_float16 the step scales its loss and the accumulator unscales it."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        _own_train_step_on_two_replicas(policy)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _own_train_step_on_two_replicas(policy):
    rtol, atol = (FLOAT16_RTOL, FLOAT16_ATOL) if policy == "mixed_float16" else (1e-5, 1e-6)
    x, y = data(50)
    windows, _ = plan_windows(50, 8, 3, epochs=2)
    ref = adam_reference(windows, x, y)
    strategy = mirrored()
    with strategy.scope():
        inner = mlp()
        model = gradaccum.accumulate(OwnStepMLP(inner), steps=3)
        model.compile(keras.optimizers.Adam(0.02), SCE)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert history.history["updates"] == [3.0, 6.0]
    for a, b in zip(inner.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
    if policy == "mixed_float16":
        assert per_replica(strategy, model.optimizer.step_counter) == [14.0] * 2


def test_loss_scaling_in_float32_drops_a_replica_share_exactly():
    """A LossScaleOptimizer under the float32 policy: the same screening and scale
    reactions, without float16 rounding, so the replicas equal one device at 1e-5."""
    x, y = data(48)
    bad = x.copy()
    bad[13, 2] = np.inf  # replica 1's share (rows 12-15) of the second micro-batch
    windows, _ = plan_windows(48, 8, 3, epochs=2)
    kept = [np.setdiff1d(w, np.arange(12, 16)) for w in windows]
    ref = adam_reference(kept, x, y)
    strategy, model, trainer, history = fit_on_two_replicas(
        "accumulate", bad, y,
        optimizer=lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.02)),
    )
    assert history.history["skipped"] == [1.0, 2.0]
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(trainer.optimizer.inner_optimizer.variables, ref.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert per_replica(strategy, trainer.optimizer.dynamic_scale) == [8192.0] * 2


def test_a_window_whose_every_share_overflowed_closes_without_an_update(mixed_float16):
    x, y = data(16)
    bad = x.copy()
    bad[[1, 5, 9, 13], 0] = 1e6  # every share of both micro-batches
    strategy = mirrored()
    with strategy.scope():
        model = mlp()
        before = model.get_weights()
        trainer = gradaccum.accumulate(model, steps=2)
        trainer.compile(keras.optimizers.Adam(0.02), SCE)
    history = trainer.fit(bad, y, batch_size=8, shuffle=False, verbose=0)
    assert history.history["updates"] == [0.0]
    assert history.history["skipped"] == [4.0]
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    assert per_replica(strategy, trainer.optimizer.dynamic_scale) == [16384.0] * 2
    acc = accumulation_state(trainer)
    assert int(acc.micro_step.numpy()) == 0 and int(acc.state.window_skipped.numpy()) == 0


def test_the_loss_scale_grows_once_its_growth_steps_are_counted(mixed_float16):
    """dynamic_growth_steps=4, windows of 3: the scale doubles at the update where
    the count of finite micro-batches reaches 4 (3 -> 6: doubled, 2 left)."""
    x, y = data(48)
    strategy = mirrored()
    with strategy.scope():
        model = mlp()
        trainer = gradaccum.accumulate(model, steps=3)
        trainer.compile(
            keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.1), initial_scale=256.0, dynamic_growth_steps=4
            ),
            SCE,
        )
    trainer.fit(x[:24], y[:24], batch_size=8, shuffle=False, verbose=0)
    assert per_replica(strategy, trainer.optimizer.dynamic_scale) == [256.0] * 2
    assert per_replica(strategy, trainer.optimizer.step_counter) == [3.0] * 2
    trainer.fit(x[24:], y[24:], batch_size=8, shuffle=False, verbose=0)
    assert per_replica(strategy, trainer.optimizer.dynamic_scale) == [512.0] * 2
    assert per_replica(strategy, trainer.optimizer.step_counter) == [2.0] * 2


def accumulation_state(model):
    from gradaccum.attach import accumulation_of

    return accumulation_of(model).state.accumulator


# Batch normalization ---------------------------------------------------------------


def shifted_data(n, seed=3):
    """Rows whose mean moves with their index: every share of every micro-batch has
    a mean of its own."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    x += np.linspace(-3.0, 5.0, n, dtype="float32")[:, None] * np.array(
        [1.0, -0.5, 2.0, 0.3], "float32"
    )
    return x, rng.integers(0, 3, size=n)


def bn_model(synchronized=False, momentum=0.9, hidden=False):
    """BatchNormalization on the inputs (its statistics are the data's), or after a
    hidden layer (gradients then flow through the statistics into that layer)."""
    keras.utils.set_random_seed(0)
    first = [keras.layers.Dense(5, activation="tanh")] if hidden else []
    return keras.Sequential(
        [
            keras.Input((4,)),
            *first,
            gradaccum.BatchNormalization(momentum=momentum, synchronized=synchronized),
            keras.layers.Dense(3),
        ]
    )


def keras_moving_statistics(windows, x, momentum=0.9):
    """A Keras BatchNormalization fed each global window as one batch."""
    layer = keras.layers.BatchNormalization(momentum=momentum)
    layer.build((None, 4))
    for w in windows:
        layer(x[w], training=True)
    return layer.moving_mean.numpy(), layer.moving_variance.numpy()


def test_moving_statistics_of_two_replicas_equal_keras_on_the_global_window(door):
    x, y = shifted_data(48)  # micro-batches of 16: 8 rows per replica, 3 per window
    strategy = mirrored()
    with strategy.scope():
        model = bn_model()
        trainer = trainer_of(door, model, steps=3)
        trainer.compile(keras.optimizers.SGD(0.1), SCE)
    trainer.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    mean, variance = keras_moving_statistics([np.arange(48)], x)
    bn = model.layers[0]
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), variance, rtol=1e-5)
    assert float(bn.window_count.numpy().max()) == 0.0  # nothing pending


def test_keras_layers_are_named_under_replicas_and_moved_as_keras_moves_them():
    # Keras's own layer is followed on one device and under keras.distribution; under
    # tf.distribute replicas a warning names it and points to the window-aware layer
    # (the test above: the global window's statistics). Keras's per-micro-batch moves
    # stay as they are: training runs, the statistics finite and moved.
    x, y = shifted_data(48)
    strategy = mirrored()
    with strategy.scope():
        inner = keras.Sequential([keras.Input((4,)),
                                  keras.layers.BatchNormalization(name="keras_bn"),
                                  keras.layers.Dense(3)])
        model = gradaccum.accumulate(inner, steps=3)
        model.compile(keras.optimizers.SGD(0.1), SCE)
    with pytest.warns(UserWarning, match="layers 'keras_bn' move their moving statistics "
                      "at every micro-batch under a tf.distribute strategy of 2 replicas"):
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    bn = inner.get_layer("keras_bn")
    assert np.all(np.isfinite(bn.moving_mean.numpy()))
    assert np.max(np.abs(bn.moving_mean.numpy())) > 1e-3


def test_moving_statistics_with_partial_windows_over_epochs(door):
    x, y = shifted_data(56)  # 16, 16, 16, 8: windows of 3, then a partial 1 (flush)
    windows, _ = plan_windows(56, 16, 3, epochs=2)
    ops = gradaccum.CountingCrossDeviceOps()
    strategy = mirrored(ops)
    with strategy.scope():
        model = bn_model()
        trainer = trainer_of(door, model, steps=3)
        trainer.compile(keras.optimizers.SGD(0.1), SCE)
    trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert int(ops.reductions) == len(windows) == 4
    mean, variance = keras_moving_statistics(windows, x)
    bn = model.layers[0]
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), variance, rtol=1e-5)


def test_custom_loop_pools_the_replicas_windows_and_flushes_from_cross_replica_context():
    """GradientAccumulator(layers=model) in a custom loop; the last, partial window
    is applied with `acc.apply` outside `strategy.run`."""
    x, y = shifted_data(40)  # global micro-batches of 16, 16, 8
    strategy = mirrored()
    with strategy.scope():
        model = bn_model()
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
        acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=2, layers=model)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = tf.reduce_mean(SCE(yb, logits))
        return acc.step(optimizer, tape.gradient(loss, model.trainable_variables),
                        tf.shape(xb)[0])

    @tf.function
    def step(xb, yb):
        strategy.run(replica_step, args=(xb, yb))

    for xb, yb in strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    ):
        step(xb, yb)
    with strategy.scope():
        assert bool(acc.apply(optimizer))
    mean, variance = keras_moving_statistics([np.arange(32), np.arange(32, 40)], x)
    bn = model.layers[0]
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), variance, rtol=1e-5)


@pytest.mark.parametrize("hidden", [False, True])
def test_synchronized_replicas_equal_one_device_on_the_global_micro_batches(hidden):
    """synchronized=True: each replica normalizes its share with the statistics of
    the whole global micro-batch, so two replicas train as one device whose
    micro-batches are the global ones (there each micro-batch is normalized with its
    own statistics). After a hidden layer the gradient flows through the shared
    statistics into the other replica's share (the all-reduce's gradient)."""
    x, y = shifted_data(48)
    one = bn_model(hidden=hidden)
    one_trainer = gradaccum.accumulate(one, steps=3)
    one_trainer.compile(keras.optimizers.Adam(0.05), SCE)
    one_trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    strategy = mirrored()
    with strategy.scope():
        model = bn_model(synchronized=True, hidden=hidden)
        trainer = gradaccum.accumulate(model, steps=3)
        trainer.compile(keras.optimizers.Adam(0.05), SCE)
    trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    # Weights, gamma, beta and the moving statistics.
    for a, b in zip(model.get_weights(), one.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if not hidden:
        windows, _ = plan_windows(48, 16, 3, epochs=2)
        mean, variance = keras_moving_statistics(windows, x)
        bn = model.layers[0]
        np.testing.assert_allclose(bn.moving_mean.numpy(), mean, rtol=1e-5)
        np.testing.assert_allclose(bn.moving_variance.numpy(), variance, rtol=1e-5)


@pytest.mark.parametrize("synchronized", [False, True])
def test_an_empty_replica_share_leaves_the_statistics_finite(synchronized):
    """49 rows in batches of 16: the last batch (1 row) splits 1 / 0. The empty
    share has no moments; it must not poison the gradient, the skip count, or
    (synchronized) the other replica's statistics."""
    x, y = shifted_data(49)
    windows, _ = plan_windows(49, 16, 3, epochs=2)  # [0-47], [48], twice
    one = bn_model()
    one_trainer = gradaccum.accumulate(one, steps=3)
    one_trainer.compile(keras.optimizers.SGD(0.1), SCE)
    one_trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    strategy = mirrored()
    with strategy.scope():
        model = bn_model(synchronized=synchronized)
        trainer = gradaccum.accumulate(model, steps=3)
        trainer.compile(keras.optimizers.SGD(0.1), SCE)
    history = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert history.history["skipped"] == [0.0, 0.0]
    assert history.history["updates"] == [2.0, 4.0]
    assert np.all(np.isfinite(history.history["loss"]))
    mean, variance = keras_moving_statistics(windows, x)
    bn = model.layers[0]
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), variance, rtol=1e-5)
    if synchronized:  # two replicas = one device on the global micro-batches
        for a, b in zip(model.get_weights(), one.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("offset", [500.0])
def test_window_statistics_pool_exactly_far_from_zero(offset):
    """Inputs of mean 500 and std 0.5: pooling raw float32 moments (or deviations
    from the moving mean, 0 here) would be 12% off the variance; the replicas'
    windows pool as Keras's layer sees the global window (momentum 0: the moving
    statistics are the window's). rtol 1e-4: each micro-batch's float32 mean carries
    the rounding of its sum (ulp(8 x 500) / 8), which the spread between means
    inherits."""
    rng = np.random.default_rng(7)
    x = (offset + 0.5 * rng.normal(size=(48, 4))).astype("float32")
    y = rng.integers(0, 3, size=48)
    strategy = mirrored()
    with strategy.scope():
        model = bn_model(momentum=0.0)
        trainer = gradaccum.accumulate(model, steps=3)
        trainer.compile(keras.optimizers.SGD(0.0), SCE)
    trainer.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    mean, variance = keras_moving_statistics([np.arange(48)], x, momentum=0.0)
    bn = model.layers[0]
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, rtol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), variance, rtol=1e-4)


@pytest.mark.parametrize("saved_on, restored_on", [(2, 1), (1, 2)])
def test_a_pending_window_restores_exactly_on_another_replica_count(
    door, saved_on, restored_on, tmp_path
):
    """Two micro-batches of a window of 3 are pending (partial="carry") when the
    weights are saved; a model on another number of replicas loads them and trains
    the third: the moving statistics are those of the 48-row window."""
    import contextlib

    x, y = shifted_data(48)
    path = str(tmp_path / "pending.weights.h5")

    def trained(replicas, rows, load=None, save=None):
        scope = mirrored().scope() if replicas == 2 else contextlib.nullcontext()
        with scope:
            model = bn_model()
            trainer = trainer_of(door, model, steps=3, partial="carry")
            trainer.compile(keras.optimizers.SGD(0.1), SCE)
        if load:
            trainer.load_weights(load)
        trainer.fit(x[rows], y[rows], batch_size=16, shuffle=False, verbose=0)
        if save:
            trainer.save_weights(save)
        return model, trainer

    trained(saved_on, slice(0, 32), save=path)
    model, trainer = trained(restored_on, slice(32, 48), load=path)
    assert int(trainer.optimizer.iterations.numpy()) == 1
    mean, variance = keras_moving_statistics([np.arange(48)], x)
    bn = model.layers[0]
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), variance, rtol=1e-5)


def test_a_custom_loop_applying_with_the_inner_optimizer_still_moves_the_scale():
    """accumulate(..., loss_scale_optimizer=lso) then apply(lso.inner_optimizer):
    the window's overflow still halves the scale, on both replicas."""
    x, y = data(16)
    bad = x.copy()
    bad[2, 0] = np.inf  # replica 0's share of the first micro-batch
    strategy = mirrored()
    with strategy.scope():
        model = mlp()
        lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                  initial_scale=1024.0)
        lso.build(model.trainable_variables)
        acc = gradaccum.GradientAccumulator(model.trainable_variables)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(SCE(yb, model(xb, training=True)))
            scaled = lso.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        acc.accumulate(grads, tf.shape(xb)[0], loss_scale_optimizer=lso)

    step = tf.function(lambda xb, yb: strategy.run(replica_step, args=(xb, yb)))
    for xb, yb in strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((bad, y)).batch(8)
    ):
        step(xb, yb)
    with strategy.scope():
        assert bool(acc.apply(lso.inner_optimizer))
    assert int(lso.inner_optimizer.iterations.numpy()) == 1
    assert per_replica(strategy, lso.dynamic_scale) == [512.0] * 2
    assert int(acc.skipped.numpy()) == 1


# float8 ------------------------------------------------------------------------------


def test_float8_on_two_replicas_equals_one_device():
    """A float8 block's scales and amax histories take the maximum across the
    replicas, once per update (their sum would double them), and the loss each
    replica differentiates is the global window's: the replicas train as one
    device does on the global windows, in one reduction per update."""
    from test_float8 import SCE as F8_SCE
    from test_float8 import block, block_data, gaps

    x, y = block_data(64)
    one = gradaccum.accumulate(block(), steps=2)
    one.compile(keras.optimizers.Adam(1e-2), F8_SCE)
    one.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    ops = gradaccum.CountingCrossDeviceOps()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
    with strategy.scope():
        model = gradaccum.accumulate(block(), steps=2)
        model.compile(keras.optimizers.Adam(1e-2), F8_SCE)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    gap = gaps(model, one)
    assert max(gap.values()) < 1e-5, {p: g for p, g in gap.items() if g >= 1e-5}
    assert int(model.optimizer.iterations.numpy()) == 4
    assert int(ops.reductions) == 4
