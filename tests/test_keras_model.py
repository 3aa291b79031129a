"""gradaccum.wrap and gradaccum.accumulate + fit() against plain Keras training on the
windows (each test that trains runs for both doors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from helpers import fit_state, make_trainer, trained

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def take(data, idx):
    return tf.nest.map_structure(lambda a: a[idx], data)


def plan_windows(n, batch_size, steps, epochs, partial="flush"):
    """Index arrays of the windows fit() makes with shuffle=False."""
    micro = [np.arange(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    windows, open_window = [], []
    for _ in range(epochs):
        for mb in micro:
            open_window.append(mb)
            if len(open_window) == steps:
                windows.append(np.concatenate(open_window))
                open_window = []
        if partial == "flush" and open_window:
            windows.append(np.concatenate(open_window))
            open_window = []
        elif partial == "drop":
            open_window = []
    return windows, open_window


def reference_fit(model, windows, x, y, sample_weight=None):
    """Plain Keras: one train_on_batch per window (the large batch)."""
    for w in windows:
        sw = None if sample_weight is None else sample_weight[w]
        model.train_on_batch(take(x, w), take(y, w), sample_weight=sw)
    return model


def mlp(seed=0, regularize=False):
    keras.utils.set_random_seed(seed)
    reg = keras.regularizers.L2(1e-2) if regularize else None
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", kernel_regularizer=reg),
            keras.layers.Dense(3),
        ]
    )


def data(n=40, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, size=n)


def assert_weights_close(a, b, rtol=1e-5, atol=1e-6):
    wa, wb = a.get_weights(), b.get_weights()
    assert len(wa) == len(wb)
    for va, vb in zip(wa, wb):
        np.testing.assert_allclose(va, vb, rtol=rtol, atol=atol)


def max_gap(a, b):
    return max(float(np.abs(va - vb).max()) for va, vb in zip(a.get_weights(), b.get_weights()))


# The headline -----------------------------------------------------------------------


def test_batch_40_as_16_16_8_equals_one_large_step_and_keras_builtin_does_not(door):
    x, y = data(40)
    ref = mlp()
    ref.compile(keras.optimizers.SGD(0.5), SCE)
    ref.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)

    model = mlp()
    trainer = make_trainer(door, model, steps=3)
    trainer.compile(keras.optimizers.SGD(0.5), SCE)
    history = trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert history.history["updates"] == [1.0]
    assert int(trainer.optimizer.iterations) == 1
    assert_weights_close(model, ref)

    builtin = mlp()
    builtin.compile(keras.optimizers.SGD(0.5, gradient_accumulation_steps=3), SCE)
    builtin.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    # Keras's plain 1/k mean weighs the 8-sample batch like the 16-sample ones.
    assert max_gap(builtin, ref) > 1e-3
    assert max_gap(model, ref) < 1e-6


@pytest.mark.parametrize(
    "make_opt",
    [lambda: keras.optimizers.Adam(0.02), lambda: keras.optimizers.AdamW(0.02, weight_decay=0.2)],
    ids=["adam", "adamw"],
)
def test_several_epochs_with_partial_windows_equal_fit_on_the_windows(door, make_opt):
    x, y = data(50)
    windows, _ = plan_windows(50, 8, 3, epochs=3)  # 7 micro-batches: 3 + 3 + 1
    assert [len(w) for w in windows[:3]] == [24, 24, 2]
    ref = mlp()
    ref.compile(make_opt(), SCE)
    reference_fit(ref, windows, x, y)

    model = mlp()
    trainer = make_trainer(door, model, steps=3)
    trainer.compile(make_opt(), SCE)
    history = trainer.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    assert history.history["updates"] == [3.0, 6.0, 9.0]
    assert int(fit_state(trainer).accumulator.micro_step) == 0
    assert_weights_close(model, ref)
    for va, vb in zip(trainer.optimizer.variables, ref.optimizer.variables):
        np.testing.assert_allclose(np.asarray(va), np.asarray(vb), rtol=1e-5, atol=1e-6)


def test_masked_sequences_of_unequal_length_with_sample_weights_are_exact(door):
    vocab, classes = 12, 4
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 9, size=30)
    seqs = [rng.integers(1, vocab, size=n) for n in lengths]
    labels = [rng.integers(0, classes, size=n) for n in lengths]
    weights = rng.uniform(0.2, 2.0, size=(30, 1)).astype("float32")

    def padded(idx):
        t = max(lengths[i] for i in idx)
        xs = np.zeros((len(idx), t), "int32")
        ys = np.zeros((len(idx), t), "int32")
        for row, i in enumerate(idx):
            xs[row, : lengths[i]] = seqs[i]
            ys[row, : lengths[i]] = labels[i]
        return xs, ys, weights[idx]

    def seq_model():
        keras.utils.set_random_seed(5)
        inputs = keras.Input((None,), dtype="int32")
        h = keras.layers.Embedding(vocab, 6, mask_zero=True)(inputs)
        h = keras.layers.Dense(8, activation="tanh")(h)
        return keras.Model(inputs, keras.layers.Dense(classes)(h))

    # Micro-batches of 4 samples, each padded to its own longest sequence.
    micro = [list(range(i, min(i + 4, 30))) for i in range(0, 30, 4)]  # 8 micro-batches
    steps = 3
    ref, ref_opt = seq_model(), keras.optimizers.Adam(0.05)
    for w in range(0, len(micro), steps):
        idx = [i for mb in micro[w : w + steps] for i in mb]
        xs, ys, sw = padded(idx)
        with tf.GradientTape() as tape:
            loss = SCE(ys, ref(xs, training=True), sw)
        # The large-batch gradient, densified: Keras's Adam squares the slices of an
        # IndexedSlices gradient before summing duplicate rows, which is not the
        # Adam of the summed gradient (gradaccum applies the summed one).
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, ref.trainable_variables)]
        ref_opt.apply_gradients(zip(grads, ref.trainable_variables))

    def gen():
        for mb in micro:
            yield padded(mb)

    spec = (
        tf.TensorSpec((None, None), tf.int32),
        tf.TensorSpec((None, None), tf.int32),
        tf.TensorSpec((None, 1), tf.float32),
    )
    ds = tf.data.Dataset.from_generator(gen, output_signature=spec)
    model = seq_model()
    trainer = make_trainer(door, model, steps=steps)
    trainer.compile(keras.optimizers.Adam(0.05), SCE)
    trainer.fit(ds, epochs=1, verbose=0)
    assert int(trainer.optimizer.iterations) == 3  # 3 + 3 + a partial of 2
    assert_weights_close(model, ref)

    uniform = seq_model()
    plain_mean = make_trainer(door, uniform, steps=steps, weighting="uniform")
    plain_mean.compile(keras.optimizers.Adam(0.05), SCE)
    plain_mean.fit(ds, epochs=1, verbose=0)
    assert max_gap(uniform, ref) > 1e-4


# Once per update --------------------------------------------------------------------


def test_iterations_and_lr_schedule_advance_once_per_update(door):
    x, y = data(48)

    def opt():
        return keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
        )

    windows, _ = plan_windows(48, 8, 2, epochs=2)
    ref = reference_fit(_compiled(mlp(), opt()), windows, x, y)
    model = mlp()
    trainer = make_trainer(door, model, steps=2)
    trainer.compile(opt(), SCE)
    trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert int(trainer.optimizer.iterations) == 6
    np.testing.assert_allclose(float(trainer.optimizer.learning_rate), 0.5 * 0.5**6)
    assert_weights_close(model, ref)


@pytest.mark.parametrize(
    "opt_kwargs",
    [
        dict(clipnorm=0.05),
        dict(clipvalue=0.01),
        dict(global_clipnorm=0.05),
        dict(use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2),
    ],
    ids=["clipnorm", "clipvalue", "global_clipnorm", "ema"],
)
def test_clipping_and_ema_act_on_the_combined_gradient(door, opt_kwargs):
    x, y = data(40)
    windows, _ = plan_windows(40, 10, 2, epochs=2)
    ref = reference_fit(_compiled(mlp(), keras.optimizers.Adam(0.05, **opt_kwargs)), windows, x, y)
    model = mlp()
    trainer = make_trainer(door, model, steps=2)
    trainer.compile(keras.optimizers.Adam(0.05, **opt_kwargs), SCE)
    trainer.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    if opt_kwargs.get("use_ema"):
        # fit() ends by writing the EMA into the weights, as Keras does.
        ref.optimizer.finalize_variable_values(ref.trainable_variables)
    assert_weights_close(model, ref)


def _compiled(model, optimizer, loss=SCE, **kwargs):
    model.compile(optimizer, loss, **kwargs)
    return model


# Partial windows --------------------------------------------------------------------


def test_partial_carry_keeps_the_window_open_across_epochs(door):
    x, y = data(10)
    windows, open_window = plan_windows(10, 2, 3, epochs=2, partial="carry")
    assert len(windows) == 3 and len(open_window) == 1
    ref = reference_fit(_compiled(mlp(), keras.optimizers.Adam(0.05)), windows, x, y)
    model = mlp()
    trainer = make_trainer(door, model, steps=3, partial="carry")
    trainer.compile(keras.optimizers.Adam(0.05), SCE)
    history = trainer.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
    assert history.history["updates"] == [1.0, 3.0]
    acc = fit_state(trainer).accumulator
    assert int(acc.micro_step) == 1 and float(acc.total_weight) == 2.0
    assert_weights_close(model, ref)


def test_partial_drop_discards_the_open_window(door):
    x, y = data(10)
    windows, _ = plan_windows(10, 2, 3, epochs=2, partial="drop")
    assert [len(w) for w in windows] == [6, 6]
    ref = reference_fit(_compiled(mlp(), keras.optimizers.Adam(0.05)), windows, x, y)
    model = mlp()
    trainer = make_trainer(door, model, steps=3, partial="drop")
    trainer.compile(keras.optimizers.Adam(0.05), SCE)
    history = trainer.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
    assert history.history["updates"] == [1.0, 2.0]
    assert int(fit_state(trainer).accumulator.micro_step) == 0
    assert_weights_close(model, ref)


def test_unknown_cardinality_and_short_last_batch_flush_before_validation(door):
    x, y = data(44)
    xv, yv = data(20, seed=9)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(8)
    assert int(ds.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    windows, _ = plan_windows(44, 8, 4, epochs=2)  # 6 micro-batches: 4 + 2 (last of 4)
    ref = reference_fit(_compiled(mlp(), keras.optimizers.Adam(0.05)), windows, x, y)
    model = mlp()
    trainer = make_trainer(door, model, steps=4)
    trainer.compile(keras.optimizers.Adam(0.05), SCE)
    history = trainer.fit(ds, epochs=2, verbose=0, validation_data=(xv, yv))
    assert history.history["updates"] == [2.0, 4.0]
    assert_weights_close(model, ref)
    # Validation saw the weights after the epoch's partial window.
    np.testing.assert_allclose(
        history.history["val_loss"][-1], ref.evaluate(xv, yv, verbose=0), rtol=1e-5
    )
    assert "val_updates" not in history.history


# Models, inputs, options ------------------------------------------------------------


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def subclassed(seed=0):
    keras.utils.set_random_seed(seed)
    model = Subclassed()
    model(np.zeros((1, 6), "float32"))
    return model


@pytest.mark.parametrize(
    "factory, compile_kwargs",
    [
        (lambda: mlp(regularize=True), {}),
        (subclassed, {}),
        (mlp, {"steps_per_execution": 1}),
        (mlp, {"steps_per_execution": 4}),
        (mlp, {"jit_compile": True}),
    ],
    ids=["sequential-l2", "subclassed", "one-micro-batch-per-call", "four-per-call", "jit"],
)
def test_model_kinds_and_compile_options_are_exact(door, factory, compile_kwargs):
    x, y = data(46)
    windows, _ = plan_windows(46, 6, 3, epochs=2)
    ref = reference_fit(_compiled(factory(), keras.optimizers.Adam(0.03)), windows, x, y)
    model = factory()
    trainer = make_trainer(door, model, steps=3)
    trainer.compile(keras.optimizers.Adam(0.03), SCE, **compile_kwargs)
    history = trainer.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert history.history["updates"] == [3.0, 6.0]
    assert_weights_close(model, ref)


def two_in_two_out(seed=0):
    keras.utils.set_random_seed(seed)
    a = keras.Input((4,), name="a")
    b = keras.Input((2,), name="b")
    h = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([a, b]))
    return keras.Model(
        {"a": a, "b": b},
        {"reg": keras.layers.Dense(1, name="reg")(h), "cls": keras.layers.Dense(3, name="cls")(h)},
    )


def test_multi_input_multi_output_with_class_and_loss_weights_is_exact(door):
    rng = np.random.default_rng(4)
    x = {"a": rng.normal(size=(30, 4)).astype("float32"),
         "b": rng.normal(size=(30, 2)).astype("float32")}
    y = {"reg": rng.normal(size=(30, 1)).astype("float32"), "cls": rng.integers(0, 3, 30)}
    sw = rng.uniform(0.1, 3.0, size=30).astype("float32")
    losses = {"reg": "mse", "cls": SCE}
    loss_weights = {"reg": 0.5, "cls": 2.0}
    windows, _ = plan_windows(30, 7, 2, epochs=2)
    ref = _compiled(two_in_two_out(), keras.optimizers.Adam(0.03), losses,
                    loss_weights=loss_weights)
    reference_fit(ref, windows, x, y, sample_weight=sw)
    model = two_in_two_out()
    trainer = make_trainer(door, model, steps=2)
    trainer.compile(keras.optimizers.Adam(0.03), losses, loss_weights=loss_weights)
    with _no_inexact_warning():
        trainer.fit(x, y, sample_weight=sw, batch_size=7, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, ref)


def test_class_weight_is_exact(door):
    x, y = data(36)
    class_weight = {0: 0.2, 1: 1.0, 2: 3.0}
    windows, _ = plan_windows(36, 5, 3, epochs=1)
    sw = np.array([class_weight[int(c)] for c in y], "float32")
    ref = reference_fit(_compiled(mlp(), keras.optimizers.SGD(0.3)), windows, x, y, sw)
    model = mlp()
    trainer = make_trainer(door, model, steps=3)
    trainer.compile(keras.optimizers.SGD(0.3), SCE)
    trainer.fit(x, y, class_weight=class_weight, batch_size=5, shuffle=False, verbose=0)
    assert_weights_close(model, ref)


class _no_inexact_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self._log = self._catch.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        assert not [w for w in self._log if "approximate" in str(w.message)]


def test_one_window_per_compiled_call_by_default(door):
    trainer = make_trainer(door, mlp(), steps=5)
    trainer.compile("sgd", SCE)
    assert trainer.steps_per_execution == 5
    trainer.compile("sgd", SCE, steps_per_execution=2)
    assert trainer.steps_per_execution == 2


def test_metrics_see_every_micro_batch_and_loss_is_the_window_loss(door):
    x, y = data(45)
    model = mlp()
    trainer = make_trainer(door, model, steps=4)
    trainer.compile(keras.optimizers.SGD(0.0), SCE, metrics=["accuracy"])
    history = trainer.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    # With a zero learning rate the weights stay put, so the epoch's figures must be
    # those of the whole data: every micro-batch counted with its weight (45 samples).
    logits = model.predict(x, verbose=0)
    expected_loss = float(SCE(y, logits))
    expected_acc = float((logits.argmax(1) == y).mean())
    np.testing.assert_allclose(history.history["loss"][0], expected_loss, rtol=1e-5)
    np.testing.assert_allclose(history.history["accuracy"][0], expected_acc, rtol=1e-6)


def test_dropout_model_trains_with_one_update_per_window(door):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
         keras.layers.Dropout(0.3), keras.layers.Dense(3)]
    )
    x, y = data(64)
    trainer = make_trainer(door, model, steps=4)
    trainer.compile(keras.optimizers.Adam(0.02), SCE)
    history = trainer.fit(x, y, batch_size=4, epochs=4, shuffle=False, verbose=0)
    assert history.history["updates"] == [4.0, 8.0, 12.0, 16.0]
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_callable_weighting_is_used(door):
    x, y = data(40)
    windows, _ = plan_windows(40, 16, 3, epochs=1)
    ref = reference_fit(_compiled(mlp(), keras.optimizers.SGD(0.5)), windows, x, y)
    model = mlp()
    trainer = make_trainer(door, model, steps=3, weighting=lambda x, y, sw: tf.shape(x)[0])
    trainer.compile(keras.optimizers.SGD(0.5), SCE)
    trainer.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert_weights_close(model, ref)


# Callbacks, saving, resuming --------------------------------------------------------


def test_keras_callbacks_work_and_keep_exactness(door, tmp_path):
    x, y = data(40)
    xv, yv = data(16, seed=2)

    def schedule(epoch, lr):
        return 0.05 / (epoch + 1)

    windows, _ = plan_windows(40, 8, 2, epochs=3)  # 5 micro-batches: 2 + 2 + 1
    ref = _compiled(mlp(), keras.optimizers.Adam(0.05))
    per_epoch = 3
    for epoch in range(3):
        ref.optimizer.learning_rate.assign(schedule(epoch, None))
        reference_fit(ref, windows[epoch * per_epoch : (epoch + 1) * per_epoch], x, y)

    model = mlp()
    trainer = make_trainer(door, model, steps=2)
    trainer.compile(keras.optimizers.Adam(0.05), SCE)
    callbacks = [
        keras.callbacks.LearningRateScheduler(schedule),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt.weights.h5"), save_weights_only=True),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "full.keras")),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=50),
        keras.callbacks.TensorBoard(str(tmp_path / "tb")),
    ]
    history = trainer.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                          validation_data=(xv, yv), callbacks=callbacks)
    assert history.history["updates"] == [3.0, 6.0, 9.0]
    assert_weights_close(model, ref)
    assert any(p.name.startswith("events") for p in (tmp_path / "tb" / "train").iterdir())

    restored = make_trainer(door, mlp(seed=3), steps=2)
    restored.compile(keras.optimizers.Adam(0.05), SCE)
    restored.build((None, 6))
    restored.optimizer.build(restored.trainable_variables)
    restored.load_weights(str(tmp_path / "ckpt.weights.h5"))
    assert_weights_close(trained(door, restored), model)
    assert int(restored.optimizer.iterations) == 9
    assert int(fit_state(restored).accumulator.micro_step) == 0

    loaded = keras.models.load_model(str(tmp_path / "full.keras"))
    if door == "wrap":
        assert isinstance(loaded, gradaccum.AccumulatingModel) and loaded.steps == 2
    else:
        # accumulate saves the user's model as Keras would: it loads without gradaccum.
        assert type(loaded) is keras.Sequential
        assert gradaccum.attach.accumulation_of(loaded) is None
    assert_weights_close(trained(door, loaded), model)


def test_early_stopping_mid_epoch_flushes_at_the_end_of_fit(door):
    class StopAfter(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                self.model.stop_training = True

    x, y = data(80)
    windows = [np.arange(0, 24), np.arange(24, 40)]  # 3 micro-batches of 8, then 2
    ref = reference_fit(_compiled(mlp(), keras.optimizers.Adam(0.05)), windows, x, y)
    model = mlp()
    trainer = make_trainer(door, model, steps=3)
    trainer.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=1)
    trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[StopAfter()])
    assert int(trainer.optimizer.iterations) == 2
    assert_weights_close(model, ref)


def test_inner_model_saves_as_plain_keras(door, tmp_path):
    x, y = data(24)
    model = mlp()
    trainer = make_trainer(door, model, steps=2)
    trainer.compile(keras.optimizers.Adam(0.05), SCE)
    trainer.fit(x, y, batch_size=4, epochs=1, verbose=0)
    path = tmp_path / "inner.keras"
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        assert "gradaccum" not in archive.read("config.json").decode()
    expected = model.predict(x, verbose=0)
    np.save(tmp_path / "x.npy", x)
    code = (
        "import sys; sys.modules['gradaccum'] = None\n"
        "import keras, numpy as np\n"
        f"m = keras.models.load_model({str(path)!r})\n"
        f"print(np.abs(m.predict(np.load({str(tmp_path / 'x.npy')!r}), verbose=0)).sum())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-2000:]
    np.testing.assert_allclose(float(out.stdout.split()[-1]), np.abs(expected).sum(), rtol=1e-5)


@pytest.mark.parametrize(
    "partial, save_freq, stop_at",
    [("flush", 1, (1, 1)), ("carry", "epoch", (1, 0))],
    ids=["flush-batch-save", "carry-epoch-save"],
)
def test_backup_and_restore_resumes_mid_window_exactly(door, tmp_path, partial, save_freq,
                                                       stop_at):
    x, y = data(10)  # 5 micro-batches of 2 per epoch, steps 3
    epochs = 3

    def trainer_for(model):
        trainer = make_trainer(door, model, steps=3, partial=partial)
        # One micro-batch per call, so that the crash can land inside a window.
        trainer.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=1)
        return trainer

    full = mlp()
    trainer_for(full).fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0)

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == stop_at:
                raise RuntimeError("simulated crash")

    backup = str(tmp_path / "backup")
    model = mlp()
    trainer = trainer_for(model)
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=save_freq),
                               Crash()])
    meta = json.loads((tmp_path / "backup" / "training_metadata.json").read_text())
    assert meta["epoch"] == 1
    assert max_gap(model, full) > 1e-4

    keras.utils.clear_session()
    resumed = mlp(seed=11)  # fresh weights: everything must come from the backup
    trainer2 = trainer_for(resumed)
    trainer2.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0,
                 callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=save_freq)])
    assert_weights_close(resumed, full, rtol=1e-6, atol=1e-7)


# Bad input --------------------------------------------------------------------------


@pytest.mark.parametrize("obj", [keras.layers.Dense(3), "model", None])
def test_wrap_refuses_what_is_not_a_keras_model(door, obj):
    with pytest.raises(ValueError) as info:
        make_trainer(door, obj, steps=2)
    assert str(info.value) == (
        f"`model` must be a keras.Model. Received: model={obj!r} of type {type(obj).__name__}"
    )


def test_wrap_refuses_a_wrapped_model():
    trainer = gradaccum.wrap(mlp(), steps=2)
    with pytest.raises(ValueError, match="already wrapped"):
        gradaccum.wrap(trainer, steps=2)


@pytest.mark.parametrize(
    "steps, shown",
    [(0, "0"), (-3, "-3"), (2.5, "2.5"), ("4", "'4'"), (True, "True")],
)
def test_wrap_invalid_steps(door, steps, shown):
    with pytest.raises(ValueError) as info:
        make_trainer(door, mlp(), steps=steps)
    assert str(info.value) == (
        "`steps` must be an integer >= 1, a list of `(from_update, k)` pairs or a "
        f"callable `update_index -> int`. Received: steps={shown}"
    )


def test_wrap_needs_steps_or_micro_batch_size(door):
    with pytest.raises(ValueError) as info:
        make_trainer(door, mlp(), steps=None)
    assert str(info.value) == (
        "`steps`, `weight_per_update` or `micro_batch_size` must be given. "
        "Received: steps=None, weight_per_update=None, micro_batch_size=None"
    )


def test_wrap_unknown_partial(door):
    with pytest.raises(ValueError) as info:
        make_trainer(door, mlp(), steps=2, partial="keep")
    assert str(info.value) == (
        "`partial` must be one of 'flush', 'carry', 'drop'. Received: partial='keep'"
    )


@pytest.mark.parametrize("weighting", ["tokens", 3, None])
def test_wrap_unknown_weighting(door, weighting):
    with pytest.raises(ValueError) as info:
        make_trainer(door, mlp(), steps=2, weighting=weighting)
    assert str(info.value) == (
        "`weighting` must be one of 'exact', 'uniform' or a callable "
        f"(x, y, sample_weight) -> weight. Received: weighting={weighting!r}"
    )


def test_weighting_callable_returning_a_non_scalar(door):
    x, y = data(8)
    trainer = make_trainer(door, mlp(), steps=2,
                           weighting=lambda x, y, sw: tf.ones(tf.shape(x)[:1]))
    trainer.compile("sgd", SCE)
    with pytest.raises(ValueError) as info:
        trainer.fit(x, y, batch_size=4, verbose=0)
    assert "The `weighting` callable must return a scalar weight. Received: a value of shape (" \
        in str(info.value)


@pytest.mark.parametrize("value", [-1.0, float("nan")], ids=["negative", "nan"])
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_weighting_callable_returning_a_negative_weight(door, run_eagerly, value):
    x, y = data(8)
    trainer = make_trainer(door, mlp(), steps=2, weighting=lambda x, y, sw: value)
    trainer.compile("sgd", SCE, run_eagerly=run_eagerly)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="The `weighting` callable must return a weight >= 0"):
        trainer.fit(x, y, batch_size=4, verbose=0)


def test_optimizer_with_builtin_accumulation_is_refused(door):
    trainer = make_trainer(door, mlp(), steps=2)
    with pytest.raises(ValueError, match="Received: gradient_accumulation_steps=4"):
        trainer.compile(keras.optimizers.Adam(gradient_accumulation_steps=4), SCE)


def test_exact_weighting_refuses_a_summed_loss(door):
    trainer = make_trainer(door, mlp(), steps=2)
    with pytest.raises(ValueError, match="Received: loss 'sum_ce' with reduction='sum'"):
        trainer.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum", name="sum_ce"))
