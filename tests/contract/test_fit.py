"""`gradaccum.accumulate` through the model's own `fit`, on every backend (this module
runs in the TensorFlow and in the JAX process): each test against plain Keras on the
same backend trained on the concatenated windows."""

from __future__ import annotations

import gc
import warnings
import weakref

import keras
import numpy as np
import pytest
from largebatch import (
    SCE,
    assert_optimizer_close,
    assert_weights_close,
    data,
    max_gap,
    mlp,
    own_loss,
    reference_fit,
    windows_of,
)

import gradaccum

OPTIMIZERS = {
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adamw_clip": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1, global_clipnorm=0.5),
    "rmsprop_ema": lambda: keras.optimizers.RMSprop(0.01, use_ema=True, ema_overwrite_frequency=2),
}


def _trainer(steps=3, optimizer=None, seed=0, loss=SCE, **options):
    model = gradaccum.accumulate(mlp(seed), steps=steps, **options)
    model.compile(optimizer or keras.optimizers.Adam(0.05), loss)
    return model


def _reference(windows, x, y, optimizer=None, seed=0, loss=SCE, **kwargs):
    model = mlp(seed)
    model.compile(optimizer or keras.optimizers.Adam(0.05), loss)
    return reference_fit(model, windows, x, y, **kwargs)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_unequal_micro_batches_equal_one_step_on_each_window(name):
    # 40 samples in micro-batches of 16, 16, 8 with steps=3: one window, then a
    # second epoch. Exact weighting makes the 8 count half as much as a 16.
    x, y = data(40)
    model = _trainer(steps=3, optimizer=OPTIMIZERS[name]())
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    reference = _reference([np.arange(40)], x, y, OPTIMIZERS[name](), epochs=2)
    assert max_gap(model, mlp(0)) > 1e-3
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    assert int(model.optimizer.iterations) == 2
    assert history.history["updates"] == [1.0, 2.0]
    assert history.history["window_micro_batches"] == [3.0, 3.0]
    assert history.history["window_weight"] == [40.0, 40.0]
    np.testing.assert_allclose(history.history["loss"][0], float(
        SCE(y, mlp(0)(x))), rtol=1e-5)


def test_keras_gradient_accumulation_steps_is_not_exact_here():
    # What users have without gradaccum: a plain 1/k mean over the micro-batches.
    x, y = data(40)
    reference = _reference([np.arange(40)], x, y, keras.optimizers.SGD(0.5))
    builtin = mlp(0)
    builtin.compile(keras.optimizers.SGD(0.5, gradient_accumulation_steps=3), SCE)
    builtin.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    ours = _trainer(steps=3, optimizer=keras.optimizers.SGD(0.5))
    ours.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(ours, reference)
    assert max_gap(builtin, reference) > 1e-3


@pytest.mark.parametrize(
    "partial, windows_per_epoch, updates",
    [("flush", [3, 3, 3, 1], [4.0, 8.0]), ("drop", [3, 3, 3], [3.0, 6.0])],
)
def test_partial_window_at_the_end_of_each_epoch(partial, windows_per_epoch, updates):
    x, y = data(40)  # 10 micro-batches of 4
    model = _trainer(steps=3, optimizer=keras.optimizers.SGD(0.5), partial=partial)
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    windows = windows_of([4] * 10, windows_per_epoch)
    reference = _reference(windows, x, y, keras.optimizers.SGD(0.5), epochs=2)
    assert_weights_close(model, reference)
    assert history.history["updates"] == updates


def test_carry_keeps_the_window_open_across_epochs():
    x, y = data(40)  # 10 micro-batches of 4: windows of 3 run across the epochs
    model = _trainer(steps=3, optimizer=keras.optimizers.SGD(0.5), partial="carry")
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    xx, yy = np.concatenate([x, x]), np.concatenate([y, y])
    windows = windows_of([4] * 20, [3] * 6)
    reference = _reference(windows, xx, yy, keras.optimizers.SGD(0.5))
    assert_weights_close(model, reference)
    assert history.history["updates"] == [3.0, 6.0]
    assert gradaccum.attach.accumulation_of(model).open_micro_batches() == 2


def test_sample_weights_and_class_weights_are_exact():
    x, y = data(30)
    sw = np.random.default_rng(3).uniform(0.1, 2.0, size=30).astype("float32")
    model = _trainer(steps=2, optimizer=keras.optimizers.SGD(0.5))
    model.fit(x, y, sample_weight=sw, batch_size=5, epochs=1, shuffle=False, verbose=0)
    windows = windows_of([5] * 6, [2, 2, 2])
    reference = _reference(windows, x, y, keras.optimizers.SGD(0.5), sample_weight=sw)
    assert_weights_close(model, reference)


def _sequence_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((7,), dtype="int32")
    h = keras.layers.Embedding(20, 6, mask_zero=True)(inputs)
    h = keras.layers.Dense(8, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(5)(h))
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def test_masked_sequences_of_unequal_length_with_sample_weights_are_exact():
    # Per-token loss over masked positions: a micro-batch's normalizer is its count
    # of unmasked tokens, which differs between micro-batches.
    rng = np.random.default_rng(0)
    lengths = np.array([1, 2, 7, 7, 6, 3, 2, 1, 5, 7, 4, 2])
    x = np.zeros((12, 7), "int32")
    for i, n in enumerate(lengths):
        x[i, :n] = rng.integers(1, 20, size=n)
    y = rng.integers(0, 5, size=(12, 7)).astype("int32")
    sw = rng.uniform(0.5, 1.5, size=(12, 7)).astype("float32")  # per token: Keras on JAX
    # fails on masked outputs with per-sample weights (shapes (2, 7) and (2,))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = gradaccum.accumulate(_sequence_model(), steps=3)
    model.compile(keras.optimizers.SGD(0.5), loss)
    model.fit(x, y, sample_weight=sw, batch_size=2, epochs=1, shuffle=False, verbose=0)
    reference = _sequence_model()
    reference.compile(keras.optimizers.SGD(0.5), loss)
    reference_fit(reference, windows_of([2] * 6, [3, 3]), x, y, sample_weight=sw)
    assert max_gap(model, _sequence_model()) > 1e-3
    assert_weights_close(model, reference)
    uniform = gradaccum.accumulate(_sequence_model(), steps=3, weighting="uniform")
    uniform.compile(keras.optimizers.SGD(0.5), loss)
    uniform.fit(x, y, sample_weight=sw, batch_size=2, epochs=1, shuffle=False, verbose=0)
    assert max_gap(uniform, reference) > 1e-4


def test_uniform_callable_weighting_and_sum_reduction():
    x, y = data(24)
    sizes = [8, 8, 8]
    # uniform with equal micro-batches is exact
    model = _trainer(steps=3, optimizer=keras.optimizers.SGD(0.5), weighting="uniform")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model, _reference([np.arange(24)], x, y, keras.optimizers.SGD(0.5)))
    # a callable: the batch size, i.e. exact here too
    model = _trainer(steps=3, optimizer=keras.optimizers.SGD(0.5),
                     weighting=lambda x, y, sw: keras.ops.shape(x)[0])
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model, _reference([np.arange(24)], x, y, keras.optimizers.SGD(0.5)))
    assert history.history["window_weight"] == [24.0]
    # sum: G = sum of the micro-batch gradients = 3 x the mean gradient here
    model = _trainer(steps=3, optimizer=keras.optimizers.SGD(0.5), reduction="sum")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model, _reference([np.arange(24)], x, y, keras.optimizers.SGD(1.5)))
    assert sizes


@pytest.mark.parametrize(
    "steps",
    [[(0, 1), (2, 2), (4, 4)], lambda i: keras.ops.where(i < 2, 1, keras.ops.where(i < 4, 2, 4))],
    ids=["pairs", "callable"],
)
def test_a_schedule_of_steps_by_update_index(steps):
    x, y = data(56)  # 14 micro-batches of 4: windows 1, 1, 2, 2, 4, 4
    model = _trainer(steps=steps, optimizer=keras.optimizers.Adam(0.05))
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _reference(windows_of([4] * 14, [1, 1, 2, 2, 4, 4]), x, y)
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    assert history.history["updates"] == [6.0]
    assert history.history["window_micro_batches"] == [4.0]


def test_weight_per_update_closes_windows_by_weight():
    x, y = data(40)  # micro-batches of 6 (the last 4): a window closes at >= 14
    model = gradaccum.accumulate(mlp(0), weight_per_update=14)
    model.compile(keras.optimizers.SGD(0.5), SCE)
    history = model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    windows = windows_of([6] * 6 + [4], [3, 3, 1])  # 18, 18, 4 (flushed)
    assert_weights_close(model, _reference(windows, x, y, keras.optimizers.SGD(0.5)))
    assert history.history["updates"] == [3.0]


def test_nonfinite_micro_batch_is_skipped_with_its_weight():
    x, y = data(24)
    x_bad = x.copy()
    x_bad[9, 0] = np.nan  # micro-batch 3 of 4 (batch 4), in the second window
    model = _trainer(steps=2, optimizer=keras.optimizers.SGD(0.5))
    with pytest.warns(UserWarning, match="skipped 1 micro-batch"):
        history = model.fit(x_bad, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    windows = [np.arange(0, 8), np.arange(12, 16), np.arange(16, 24)]
    assert_weights_close(model, _reference(windows, x, y, keras.optimizers.SGD(0.5)))
    assert history.history["skipped"] == [1.0]
    assert history.history["updates"] == [3.0]


def test_finite_gradients_whose_sum_overflows_are_not_skipped():
    # The loss times 1e37: each gradient element is finite, but their float32 sums
    # overflow, and the screen must not call them non-finite. With the learning rate
    # divided by 1e37 the updates are those of the plain loss.
    def huge(y_true, y_pred):
        return 1e37 * keras.losses.sparse_categorical_crossentropy(y_true, y_pred,
                                                                  from_logits=True)

    x, y = data(16)
    model = _trainer(steps=2, optimizer=keras.optimizers.SGD(2e-37), loss=huge)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="gradaccum skipped")
        history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert history.history["skipped"] == [0.0]
    assert history.history["updates"] == [2.0]
    reference = _reference(windows_of([4] * 4, [2, 2]), x, y, keras.optimizers.SGD(2.0))
    assert_weights_close(model, reference)


def test_train_on_batch_after_fit_keeps_the_window_rule():
    x, y = data(88)
    model = _trainer(steps=4, optimizer=keras.optimizers.SGD(0.5))
    model.fit(x[:40], y[:40], batch_size=4, epochs=1, shuffle=False, verbose=0)  # 4, 4, 2
    updates = []
    for i in range(12):
        logs = model.train_on_batch(x[40 + 4 * i: 44 + 4 * i], y[40 + 4 * i: 44 + 4 * i],
                                    return_dict=True)
        updates.append(int(logs["updates"]))
        assert "_gradaccum_error" not in logs
    assert updates == [3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6]
    windows = windows_of([4] * 22, [4, 4, 2, 4, 4, 4])
    assert_weights_close(model, _reference(windows, x, y, keras.optimizers.SGD(0.5)))


def _three_layers(seed=0):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(6, activation="tanh"),
                              keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def test_a_compile_that_freezes_a_layer_keeps_each_variables_window():
    # 5 micro-batches with steps=3 and carry: a window of 2 stays open; layer 0 is
    # frozen and the model compiled again; the window's sums stay with their variables.
    x, y = data(24)
    model = gradaccum.accumulate(_three_layers(), steps=3, partial="carry")
    model.compile(keras.optimizers.SGD(0.5), SCE)
    model.fit(x[:20], y[:20], batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.layers[0].trainable = False
    with pytest.warns(UserWarning, match="no longer a trainable variable"):
        model.compile(keras.optimizers.SGD(0.5), SCE)
    assert gradaccum.attach.accumulation_of(model).open_micro_batches() == 2
    model.fit(x[20:], y[20:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _three_layers()
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    reference.train_on_batch(x[:12], y[:12])
    reference.layers[0].trainable = False
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    reference.train_on_batch(x[12:24], y[12:24])
    assert_weights_close(model, reference)


def test_a_recompile_with_another_loss_and_optimizer_trains_with_them():
    # Fit, then compile again with another loss and other optimizer settings over the
    # same shapes: the second fit trains with them, as plain Keras does (on JAX the
    # step's function was jitted again from the same object, and JAX replayed the
    # first compile's trace: its loss, its optimizer's settings).
    x, y = data(24)

    def second():
        return (keras.optimizers.Adam(0.05, beta_1=0.1, clipnorm=1e-2),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=2))

    model = _trainer(steps=3)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    before = weakref.ref(gradaccum.attach.accumulation_of(model).state)
    model.compile(*second())
    if keras.backend.backend() == "jax":
        # The first compile's state (a float32 sum per variable) is let go.
        gc.collect()
        assert before() is None
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    reference = mlp(0)
    reference.compile(keras.optimizers.Adam(0.05), SCE)
    reference.train_on_batch(x, y)
    reference.compile(*second())
    reference.train_on_batch(x, y)
    assert_weights_close(model, reference)


def test_save_weights_after_a_recompile_keeps_the_open_window(tmp_path):
    x, y = data(40)
    full = _trainer(steps=4, partial="carry", optimizer=keras.optimizers.SGD(0.5))
    full.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    part = _trainer(steps=4, partial="carry", optimizer=keras.optimizers.SGD(0.5))
    part.fit(x[:24], y[:24], batch_size=4, epochs=1, shuffle=False, verbose=0)
    part.compile(part.optimizer, SCE)
    path = str(tmp_path / "w.weights.h5")
    part.save_weights(path)
    resumed = _trainer(steps=4, partial="carry", seed=3, optimizer=keras.optimizers.SGD(0.5))
    resumed.build((None, 6))
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(path)
    resumed.fit(x[24:], y[24:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(resumed, full)


def test_nonfinite_callable_skips_what_it_says():
    x, y = data(24)
    model = _trainer(steps=2, optimizer=keras.optimizers.SGD(0.5),
                     nonfinite=lambda grads: keras.ops.sum(grads[-1]) > 1e9)
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert history.history["skipped"] == [0.0]
    windows = windows_of([4] * 6, [2, 2, 2])
    assert_weights_close(model, _reference(windows, x, y, keras.optimizers.SGD(0.5)))


@pytest.mark.parametrize("mode", ["steps_per_execution", "eager"])
def test_steps_per_execution_and_no_jit(mode):
    x, y = data(40)
    if mode == "steps_per_execution" and keras.backend.backend() == "torch":
        pytest.skip("Keras's torch trainer refuses steps_per_execution > 1")
    model = gradaccum.accumulate(mlp(0), steps=3)
    if mode == "eager":
        model.compile(keras.optimizers.Adam(0.05), SCE, run_eagerly=True)
    else:
        model.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=4)
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    reference = _reference(windows_of([4] * 10, [3, 3, 3, 1]), x, y, epochs=2)
    assert_weights_close(model, reference)
    assert history.history["updates"] == [4.0, 8.0]


def test_compile_defaults_steps_per_execution_to_the_window():
    model = _trainer(steps=3)
    # Keras's torch trainer runs one batch per call.
    assert model.steps_per_execution == (1 if keras.backend.backend() == "torch" else 3)
    model = gradaccum.accumulate(mlp(0), steps=[(0, 1), (1, 2)])
    model.compile("adam", SCE)
    assert model.steps_per_execution == 1


def test_lr_schedule_counts_updates():
    x, y = data(48)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    model = _trainer(steps=2, optimizer=keras.optimizers.SGD(schedule))
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _reference(windows_of([4] * 12, [2] * 6), x, y,
                           keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(
                               0.5, decay_steps=1, decay_rate=0.5)))
    assert int(model.optimizer.iterations) == 6
    assert_weights_close(model, reference)


def test_a_model_with_its_own_compute_loss():
    x, y = data(24)
    model = gradaccum.accumulate(own_loss(), steps=3)
    model.compile(keras.optimizers.SGD(0.5), SCE)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    reference = own_loss()
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    reference.train_on_batch(x, y)
    assert_weights_close(model, reference)


def test_save_weights_in_the_middle_of_a_window_resumes_exactly(tmp_path):
    x, y = data(40)
    full = _trainer(steps=4)
    full.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    # Train 6 micro-batches (a window and a half) with carry, save, resume.
    part = _trainer(steps=4, partial="carry")
    part.fit(x[:24], y[:24], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert gradaccum.attach.accumulation_of(part).open_micro_batches() == 2
    path = str(tmp_path / "mid.weights.h5")
    part.save_weights(path)
    resumed = _trainer(steps=4, seed=5)
    resumed.build((None, 6))
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(path)
    resumed.fit(x[24:], y[24:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(resumed, full)
    assert_optimizer_close(resumed.optimizer, full.optimizer)


def test_backup_and_restore_resumes_inside_an_epoch(tmp_path):
    x, y = data(40)

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            # `batch` is the last of a compiled call of 3 (steps_per_execution).
            if batch >= 6 and not getattr(self, "done", False):
                self.done = True
                raise RuntimeError("interrupted")

    backup = str(tmp_path / "backup")
    model = _trainer(steps=3)
    callbacks = [keras.callbacks.BackupAndRestore(backup, save_freq=1)]
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                  callbacks=[*callbacks, Interrupt()])
    resumed = _trainer(steps=3, seed=9)
    history = resumed.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    reference = _reference(windows_of([4] * 10, [3, 3, 3, 1]), x, y, epochs=2)
    assert_weights_close(resumed, reference)
    assert history.history["updates"][-1] == 8.0


def test_disable_restores_plain_keras_training():
    x, y = data(24)
    model = _trainer(steps=2, partial="flush")
    model.fit(x[:12], y[:12], batch_size=4, epochs=1, shuffle=False, verbose=0)
    gradaccum.disable(model)
    assert not any(m.name == "gradaccum_state" for m in model.metrics)
    model.fit(x[12:], y[12:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _reference([np.arange(0, 8), np.arange(8, 12), np.arange(12, 16),
                            np.arange(16, 20), np.arange(20, 24)], x, y)
    assert_weights_close(model, reference)
    assert int(model.optimizer.iterations) == 5


def test_model_save_writes_plain_keras(tmp_path):
    x, y = data(24)
    model = _trainer(steps=2)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is keras.Sequential
    assert gradaccum.attach.accumulation_of(loaded) is None
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6)
    assert int(loaded.optimizer.iterations) == 3


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_steps_1_is_plain_keras_training(name):
    # steps=1 applies each micro-batch's gradient directly (no accumulator): the
    # same as Keras's own fit, an unequal last batch and the optimizer state included.
    x, y = data(40)
    model = _trainer(steps=1, optimizer=OPTIMIZERS[name]())
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    plain = mlp(0)
    plain.compile(OPTIMIZERS[name](), SCE)
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, plain)
    assert_optimizer_close(model.optimizer, plain.optimizer)
    assert int(model.optimizer.iterations) == 6
    assert history.history["updates"] == [3.0, 6.0]
    assert history.history["window_micro_batches"] == [1.0, 1.0]
    assert history.history["window_weight"] == [8.0, 8.0]


def test_steps_1_skips_a_nonfinite_micro_batch():
    x, y = data(24)
    bad = x.copy()
    bad[9, 0] = np.nan  # batch 3 of 6
    model = _trainer(steps=1, optimizer=keras.optimizers.Adam(0.05))
    with pytest.warns(UserWarning, match="skipped 1 micro-batch"):
        history = model.fit(bad, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    keep = np.r_[0:8, 12:24]
    plain = mlp(0)
    plain.compile(keras.optimizers.Adam(0.05), SCE)
    plain.fit(x[keep], y[keep], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model, plain)
    assert_optimizer_close(model.optimizer, plain.optimizer)
    assert history.history["skipped"] == [1.0] and history.history["updates"] == [5.0]


def test_train_on_batch_after_fit_closes_windows_by_their_rule_only():
    # As on TensorFlow: after fit's epoch of 8 micro-batches, 12 train_on_batch
    # micro-batches make 3 windows of 4.
    x, y = data(80)
    model = _trainer(steps=4)
    model.fit(x[:32], y[:32], batch_size=4, epochs=1, shuffle=False, verbose=0)
    for i in range(12):
        model.train_on_batch(x[32 + 4 * i:36 + 4 * i], y[32 + 4 * i:36 + 4 * i])
    reference = _reference([np.arange(s, s + 16) for s in range(0, 80, 16)], x, y)
    assert int(model.optimizer.iterations) == 5
    assert_weights_close(model, reference)


class _StopAfter(keras.callbacks.Callback):
    """Raises after `batches` batches of a fit (an interrupt)."""

    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.batches:
            raise RuntimeError("interrupted")


def test_train_on_batch_after_an_interrupted_fit_closes_windows_by_their_rule_only():
    # The fit stops after 6 of its 8 micro-batches (one window applied, 2 open);
    # 12 train_on_batch micro-batches then close 3 windows of 4.
    x, y = data(80)
    model = gradaccum.accumulate(mlp(0), steps=4)
    model.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=1)
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x[:32], y[:32], batch_size=4, epochs=1, shuffle=False, verbose=0,
                  callbacks=[_StopAfter(6)])
    for i in range(12):
        model.train_on_batch(x[24 + 4 * i:28 + 4 * i], y[24 + 4 * i:28 + 4 * i])
    reference = _reference([np.arange(s, s + 16) for s in range(0, 64, 16)], x, y)
    assert int(model.optimizer.iterations) == 4
    assert_weights_close(model, reference)


def test_a_checkpoint_saved_in_a_fit_does_not_bring_back_its_epoch_length(tmp_path):
    # Weights saved at an epoch's end (as ModelCheckpoint does), loaded into a model
    # trained with train_on_batch: its windows close by their rule only.
    class Save(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.save_weights(str(tmp_path / "epoch.weights.h5"))

    x, y = data(80)
    model = _trainer(steps=4)
    model.fit(x[:32], y[:32], batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[Save()])
    with np.load(gradaccum.saving.sidecar(tmp_path / "epoch.weights.h5")) as saved:
        assert "gradaccum_epoch_length" not in saved.files
    resumed = _trainer(steps=4, seed=5)
    resumed.build((None, 6))
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(str(tmp_path / "epoch.weights.h5"))
    for i in range(12):
        resumed.train_on_batch(x[32 + 4 * i:36 + 4 * i], y[32 + 4 * i:36 + 4 * i])
    reference = _reference([np.arange(s, s + 16) for s in range(0, 80, 16)], x, y)
    assert int(resumed.optimizer.iterations) == 5
    assert_weights_close(resumed, reference)
