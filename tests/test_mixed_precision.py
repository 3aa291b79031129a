"""Mixed precision: float32 accumulators, loss scaling and skipped micro-batches."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from helpers import OPTIMIZERS, assert_same_state, grads_of, make_data, make_mlp, mean_loss


@pytest.fixture
def policy():
    """Sets a global dtype policy for one test and restores float32 after it."""

    def use(name):
        keras.config.set_dtype_policy(name)

    yield use
    keras.config.set_dtype_policy("float32")


def tiny_mse(y_true, y_pred):
    # Gradients of this loss are ~1e-9: below float16's smallest subnormal (6e-8)
    # once unscaled, but well within range while scaled by Keras's 2**15.
    return 1e-9 * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def single_dense(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(2, kernel_initializer="zeros")]
    )


def regression_data(n=32, seed=3):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def test_float16_sums_lose_tiny_gradients_float32_accumulators_keep_them(policy):
    """mixed_float16, loss scaling: unscaled micro-gradients of ~1e-9 vanish in a
    float16 accumulator; gradaccum's float32 one gives the large-batch update."""
    x, y = regression_data()
    # The large-batch update in float32: one step on the whole window of 32.
    reference = single_dense()
    reference.compile(optimizer=keras.optimizers.SGD(1.0), loss=tiny_mse)
    reference.train_on_batch(x, y)
    expected = reference.get_weights()[0]
    assert np.abs(expected).max() > 1e-10

    policy("mixed_float16")

    moved = {}
    for dtype in ("float16", "float32"):
        model = single_dense()
        trainer = gradaccum.wrap(model, steps=8, accumulator_dtype=dtype)
        trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss=tiny_mse)
        assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
        history = trainer.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        assert history.history["updates"] == [1.0]
        assert history.history["skipped"] == [0.0]
        moved[dtype] = model.get_weights()[0]
    np.testing.assert_array_equal(moved["float16"], 0.0)
    # float16 compute rounds the scaled micro-batch gradients (~1e-5, subnormal).
    np.testing.assert_allclose(
        moved["float32"], expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max()
    )


def test_accumulators_are_float32_under_mixed_policies(policy):
    for name in ("mixed_float16", "mixed_bfloat16"):
        policy(name)
        model = make_mlp()
        trainer = gradaccum.wrap(model, steps=2)
        trainer.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        x, y = make_data(8)
        trainer.fit(x, y, batch_size=2, verbose=0)
        acc = trainer._fit_state.accumulator
        assert all(a.dtype == tf.float32 for a in acc.accumulators)
        assert all(v.dtype == "float32" for v in model.trainable_variables)


def test_mixed_bfloat16_fit_matches_the_large_batch_within_bfloat16_precision(policy):
    policy("mixed_bfloat16")
    x, y = make_data(24)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = make_mlp()
    reference.compile(optimizer=keras.optimizers.SGD(0.5), loss=sce)
    for start in (0, 12):
        reference.train_on_batch(x[start:start + 12], y[start:start + 12])
    model = make_mlp()
    trainer = gradaccum.wrap(model, steps=3)
    trainer.compile(optimizer=keras.optimizers.SGD(0.5), loss=sce)
    trainer.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    start = make_mlp().get_weights()
    for w, ref, w0 in zip(model.get_weights(), reference.get_weights(), start):
        # Compare the moves: bfloat16 compute rounds each micro-batch's gradient.
        np.testing.assert_allclose(w - w0, ref - w0, rtol=0.05, atol=2e-3)


def test_bfloat16_variables_accumulate_in_float32():
    """A model whose variables are bfloat16: 1 + 15 * 2**-9 is 1 in bfloat16 sums."""
    v = tf.Variable(tf.zeros([2], tf.bfloat16))
    acc = gradaccum.GradientAccumulator([v], steps=16)
    low = tf.constant([1.0, 1.0], tf.bfloat16)
    opt = keras.optimizers.SGD(1.0)
    acc.step(opt, [low], weight=1.0)
    tiny = tf.constant([2.0**-9, 2.0**-9], tf.bfloat16)
    for _ in range(15):
        acc.step(opt, [tiny], weight=1.0)
    assert float(tf.cast(low + tiny, tf.float32)[0]) == 1.0  # what a bfloat16 sum keeps
    expected = tf.cast(tf.constant((1 + 15 * 2.0**-9) / 16, tf.float32), tf.bfloat16)
    np.testing.assert_array_equal(v.numpy(), -np.full(2, expected.numpy()))
    assert v.numpy()[0] != -np.array(1 / 16, dtype=v.numpy().dtype)


# Loss scaling --------------------------------------------------------------------


def scaled_grads_of(model, optimizer, x, y):
    with tf.GradientTape() as tape:
        loss = optimizer.scale_loss(mean_loss(model, x, y))
    return tape.gradient(loss, model.trainable_variables)


def test_loss_scale_optimizer_custom_loop_equals_the_large_batch():
    """Loss scaling by powers of two is exact: the float32 result equals plain
    Keras on the concatenated windows, slots and iterations included."""
    x, y = make_data(30)
    sizes = [8, 8, 4, 6, 4]  # windows of 3 and 2 micro-batches
    bounds = np.cumsum([0, *sizes])
    micro = [(x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    ref_model, ref_opt = make_mlp(), OPTIMIZERS["adam"]()
    for window in (micro[:3], micro[3:]):
        wx = np.concatenate([m[0] for m in window])
        wy = np.concatenate([m[1] for m in window])
        ref_opt.apply_gradients(zip(grads_of(ref_model, wx, wy), ref_model.trainable_variables))

    model = make_mlp()
    opt = keras.optimizers.LossScaleOptimizer(OPTIMIZERS["adam"](), initial_scale=2.0**10)
    acc = gradaccum.GradientAccumulator(model.trainable_variables)
    for window in (micro[:3], micro[3:]):
        for mx, my in window:
            grads = scaled_grads_of(model, opt, mx, my)
            assert bool(acc.accumulate(grads, len(mx), loss_scale_optimizer=opt))
        assert bool(acc.apply(opt))
    assert_same_state(model, opt.inner_optimizer, ref_model, ref_opt, rtol=1e-6, atol=1e-7)
    assert int(acc.skipped) == 0 and float(opt.dynamic_scale) == 2.0**10


def test_non_finite_micro_batch_is_skipped_and_the_scale_backs_off():
    model = make_mlp()
    opt = keras.optimizers.LossScaleOptimizer(OPTIMIZERS["adam"](), initial_scale=2.0**10)
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=3)
    x, y = make_data(12)
    assert not bool(acc.step(opt, scaled_grads_of(model, opt, x[:4], y[:4]), weight=4))
    before = [a.numpy().copy() for a in acc.accumulators]
    weights = model.get_weights()

    bad = x[4:8].copy()
    bad[1, 0] = np.inf
    grads = scaled_grads_of(model, opt, bad, y[4:8])
    assert not all(np.isfinite(g).all() for g in grads)
    assert not bool(acc.step(opt, grads, weight=4))
    for a, b in zip(acc.accumulators, before):
        np.testing.assert_array_equal(a.numpy(), b)
    assert int(acc.micro_step) == 1 and float(acc.total_weight) == 4.0
    assert int(acc.skipped) == 1 and float(opt.dynamic_scale) == 2.0**9
    for w, w0 in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(w, w0)

    # The skipped micro-batch still counts towards the window: the third closes it,
    # with the weight of the two good ones only.
    good = scaled_grads_of(model, opt, x[8:12], y[8:12])
    assert bool(acc.step(opt, good, weight=4))
    assert int(opt.iterations) == 1 and int(acc.micro_step) == 0

    ref_model, ref_opt = make_mlp(), OPTIMIZERS["adam"]()
    wx, wy = np.concatenate([x[:4], x[8:12]]), np.concatenate([y[:4], y[8:12]])
    ref_opt.apply_gradients(zip(grads_of(ref_model, wx, wy), ref_model.trainable_variables))
    assert_same_state(model, opt.inner_optimizer, ref_model, ref_opt, rtol=1e-6, atol=1e-7)


def test_a_window_of_only_skipped_micro_batches_makes_no_update():
    v = tf.Variable([1.0])
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.1))
    acc = gradaccum.GradientAccumulator([v], steps=2)
    for _ in range(2):
        assert not bool(acc.step(opt, [tf.constant([np.nan])]))
    assert int(opt.iterations) == 0 and float(v[0]) == 1.0
    assert int(acc.window_length()) == 0 and int(acc.skipped) == 2
    assert float(opt.dynamic_scale) == 2.0**13
    # The next window trains normally.
    acc.step(opt, [opt.scale_loss(tf.constant([1.0]))])
    assert bool(acc.step(opt, [opt.scale_loss(tf.constant([3.0]))]))
    assert int(opt.iterations) == 1 and float(v[0]) < 1.0


def test_fit_skips_an_injected_non_finite_micro_batch_and_goes_on(policy, door):
    policy("mixed_float16")
    x, y = make_data(24)
    bad = x.copy()
    bad[5, 2] = 1e30  # the second micro-batch of 4 overflows float16
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # wrap's trainer computes in float16 under the policy; with accumulate the model
    # itself must (make_mlp pins float32 layers unless told otherwise).
    model = make_mlp() if door == "wrap" else make_mlp(dtype="mixed_float16")
    trainer = (gradaccum.wrap if door == "wrap" else gradaccum.accumulate)(model, steps=3)
    trainer.compile(optimizer=keras.optimizers.SGD(0.5), loss=sce)
    history = trainer.fit(bad, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0, 2.0]
    assert history.history["updates"] == [2.0, 4.0]
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert float(trainer.optimizer.dynamic_scale) == 2.0**13  # backed off twice

    # Equal to training on the data without the bad micro-batch, windows kept.
    reference = make_mlp()
    reference.compile(optimizer=keras.optimizers.SGD(0.5), loss=sce)
    keep = np.r_[0:4, 8:12], np.r_[12:24]
    for _ in range(2):
        for window in keep:
            reference.train_on_batch(x[window], y[window])
    start = make_mlp().get_weights()
    for w, ref, w0 in zip(model.get_weights(), reference.get_weights(), start):
        np.testing.assert_allclose(w - w0, ref - w0, rtol=0.02, atol=1e-3)


@pytest.mark.parametrize("steps", [1, 3])
def test_loss_scale_optimizer_in_float32_fit_equals_the_large_batch(steps, door):
    x, y = make_data(22)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = make_mlp()
    reference.compile(optimizer=OPTIMIZERS["adam"](), loss=sce)
    windows = [np.r_[a:min(a + 4 * steps, 22)] for a in range(0, 22, 4 * steps)]
    for window in windows:
        reference.train_on_batch(x[window], y[window])
    model = make_mlp()
    trainer = (gradaccum.wrap if door == "wrap" else gradaccum.accumulate)(model, steps=steps)
    trainer.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(OPTIMIZERS["adam"]()), loss=sce
    )
    history = trainer.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert history.history["updates"] == [len(windows)]
    assert history.history["skipped"] == [0.0]
    assert_same_state(
        model, trainer.optimizer.inner_optimizer, reference, reference.optimizer, rtol=1e-5
    )


def test_static_loss_scale_factor_is_undone_once():
    """An optimizer's `loss_scale_factor`: the loss is scaled in the step and the
    optimizer unscales the combined gradient, as in Keras's own train step."""
    x, y = make_data(16)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = make_mlp()
    reference.compile(optimizer=keras.optimizers.Adam(0.01, loss_scale_factor=64.0), loss=sce)
    for window in (np.r_[0:8], np.r_[8:16]):
        reference.train_on_batch(x[window], y[window])
    for steps in (1, 2):
        model = make_mlp()
        trainer = gradaccum.wrap(model, steps=steps)
        trainer.compile(optimizer=keras.optimizers.Adam(0.01, loss_scale_factor=64.0), loss=sce)
        history = trainer.fit(x, y, batch_size=8 // steps, shuffle=False, verbose=0)
        assert history.history["skipped"] == [0.0]
        assert_same_state(model, trainer.optimizer, reference, reference.optimizer, rtol=1e-5)


def test_loss_scale_is_not_pushed_down_by_the_micro_batch_weight(policy):
    """The weight is applied with the unscaling, not to the scaled loss: large
    micro-batches overflow no more than in Keras's own step."""
    policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 5)).astype("float32")
    y = rng.integers(0, 3, size=2048)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainer = gradaccum.wrap(make_mlp(), steps=2)
    trainer.compile(optimizer="adam", loss=sce)
    history = trainer.fit(x, y, batch_size=512, verbose=0)
    assert history.history["skipped"] == [0.0]
    assert float(trainer.optimizer.dynamic_scale) == 2.0**15
    assert "skipped" not in trainer.evaluate(x, y, verbose=0, return_dict=True)


# Bad input -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["int32", "int64", "bool", "string", "float8"])
def test_non_floating_accumulator_dtype_is_refused(dtype):
    with pytest.raises(ValueError) as info:
        gradaccum.GradientAccumulator([tf.Variable([1.0])], accumulator_dtype=dtype)
    assert str(info.value) == (
        "`accumulator_dtype` must be a floating dtype, one of 'float16', 'bfloat16', "
        f"'float32', 'float64'. Received: accumulator_dtype={dtype!r}"
    )
    with pytest.raises(ValueError, match="accumulator_dtype"):
        gradaccum.wrap(make_mlp(), steps=2, accumulator_dtype=dtype)


def test_loss_scale_optimizer_argument_must_be_one():
    acc = gradaccum.GradientAccumulator([tf.Variable([1.0])])
    with pytest.raises(ValueError) as info:
        acc.accumulate([tf.constant([1.0])], loss_scale_optimizer=keras.optimizers.Adam())
    assert str(info.value) == (
        "`loss_scale_optimizer` must be a keras.optimizers.LossScaleOptimizer. "
        "Received: loss_scale_optimizer of type Adam"
    )


def test_bfloat16_variables_fit_with_float32_accumulators():
    """A model whose variables are bfloat16: the accumulators are float32 and the
    update matches the large batch within bfloat16's precision."""
    x, y = make_data(24)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = make_mlp(dtype="bfloat16")
    reference.compile(optimizer=keras.optimizers.SGD(0.5), loss=sce)
    for start in (0, 12):
        reference.train_on_batch(x[start:start + 12], y[start:start + 12])
    model = make_mlp(dtype="bfloat16")
    assert all(v.dtype == "bfloat16" for v in model.trainable_variables)
    trainer = gradaccum.wrap(model, steps=3)
    trainer.compile(optimizer=keras.optimizers.SGD(0.5), loss=sce)
    trainer.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    acc = trainer._fit_state.accumulator
    assert all(a.dtype == tf.float32 for a in acc.accumulators)
    start = make_mlp(dtype="bfloat16").get_weights()
    for w, ref, w0 in zip(model.get_weights(), reference.get_weights(), start):
        w, ref, w0 = (np.asarray(a, "float32") for a in (w, ref, w0))
        np.testing.assert_allclose(w - w0, ref - w0, rtol=0.1, atol=2e-2)


def test_the_loss_scale_grows_and_backs_off_per_micro_batch_on_one_device():
    """On one device each micro-batch is a LossScaleOptimizer step: with
    dynamic_growth_steps=4 the scale doubles after the 4th finite micro-batch, and
    an overflowing one halves it and restarts the count."""
    model = make_mlp()
    opt = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=256.0, dynamic_growth_steps=4
    )
    opt.build(model.trainable_variables)
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=3)
    finite = [tf.ones_like(v) for v in model.trainable_variables]
    overflow = [tf.fill(v.shape, np.inf) for v in model.trainable_variables]
    seen = []
    for grads in [finite] * 6 + [overflow, finite]:
        acc.step(opt, grads, weight=1.0)
        seen.append((float(opt.dynamic_scale.numpy()), int(opt.step_counter.numpy())))
    assert seen == [
        (256.0, 1), (256.0, 2), (256.0, 3), (512.0, 0), (512.0, 1), (512.0, 2),
        (256.0, 0), (256.0, 1),
    ]
    assert int(acc.skipped.numpy()) == 1
