"""gradaccum.accumulate / disable: the user's own model, class and fit, checked
against the same model trained on the concatenated windows (issue 14)."""

from __future__ import annotations

import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum.attach import accumulation_of

STEPS_RULE = (
    "`steps` must be an integer >= 1, a list of `(from_update, k)` pairs or a callable "
    "`update_index -> int`. Received: steps="
)

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(n=40, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, size=n)


def seeded(model, seed=0):
    """Builds `model` and draws its weights from a NumPy generator."""
    model(np.zeros((1, 6), "float32"))
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def max_gap(a, b):
    return max(float(np.abs(va - vb).max()) for va, vb in zip(a.get_weights(), b.get_weights()))


def assert_weights_close(a, b, rtol=1e-5, atol=1e-6):
    wa, wb = a.get_weights(), b.get_weights()
    assert len(wa) == len(wb)
    for va, vb in zip(wa, wb):
        np.testing.assert_allclose(va, vb, rtol=rtol, atol=atol)


class Plain(keras.Model):
    """Keras's default train_step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


class Penalized(Plain):
    """Overrides `compute_loss`: the compiled loss plus a penalty on the logits."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + 0.1 * keras.ops.mean(keras.ops.square(y_pred))


class OwnStep(Plain):
    """Defines its own train_step, handing gradients to `self.optimizer`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            loss = loss + 0.05 * keras.ops.mean(keras.ops.abs(y_pred))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


class NoApply(Plain):
    """A train_step that never hands gradients to an optimizer."""

    def train_step(self, data):
        x, y = data
        return {"loss": self.compute_loss(x=x, y=y, y_pred=self(x, training=True))}


class TwoOptimizers(keras.Model):
    """GAN-style: two sub-networks, each with its own optimizer and loss. Both
    gradients are computed before either is applied."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net_a = keras.Sequential(
            [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)], name="net_a"
        )
        self.net_b = keras.Sequential(
            [keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)], name="net_b"
        )

    def call(self, x):
        return self.net_b(keras.ops.softmax(self.net_a(x)))

    def compile(self, opt_a, opt_b, **kwargs):
        super().compile(**kwargs)
        self.opt_a = opt_a
        self.opt_b = opt_b

    def train_step(self, data):
        x, y = data
        target = keras.ops.cast(keras.ops.expand_dims(y, -1), "float32")
        with tf.GradientTape(persistent=True) as tape:
            logits = self.net_a(x, training=True)
            judged = self.net_b(keras.ops.softmax(logits), training=True)
            loss_a = keras.ops.mean(
                keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            ) + 0.1 * keras.ops.mean(keras.ops.square(judged))
            loss_b = keras.ops.mean(keras.ops.square(judged - target))
        grads_a = tape.gradient(loss_a, self.net_a.trainable_variables)
        grads_b = tape.gradient(loss_b, self.net_b.trainable_variables)
        del tape
        self.opt_a.apply_gradients(zip(grads_a, self.net_a.trainable_variables))
        self.opt_b.apply_gradients(zip(grads_b, self.net_b.trainable_variables))
        return {"loss_a": loss_a, "loss_b": loss_b}


def compiled(model, **kwargs):
    model.compile(keras.optimizers.Adam(0.05), SCE, **kwargs)
    return model


# A model's own compute_loss / train_step ---------------------------------------------


@pytest.mark.parametrize("cls", [Penalized, OwnStep], ids=["compute_loss", "train_step"])
def test_own_class_equals_its_training_on_the_windows(cls):
    x, y = data(40)  # 10 micro-batches of 4 per epoch, steps 3: windows 12, 12, 12, 4
    model = seeded(cls())
    assert gradaccum.accumulate(model, steps=3) is model
    compiled(model)
    history = model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)

    reference = compiled(seeded(cls()))
    reference.fit(x, y, batch_size=12, epochs=3, shuffle=False, verbose=0)
    assert max_gap(model, reference) > 0  # both trained; not the same object
    assert_weights_close(model, reference, rtol=1e-5)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 12
    assert history.history["updates"] == [4.0, 8.0, 12.0]
    assert type(model) is cls

    # gradaccum.wrap runs Keras's default step on the inner model: it ignores the
    # class's compute_loss / train_step, and is far off.
    inner = seeded(cls())
    with pytest.warns(UserWarning, match="will not run"):
        trainer = gradaccum.wrap(inner, steps=3)
    compiled(trainer)
    trainer.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    assert max_gap(inner, reference) > 1e-2


def test_two_optimizers_each_update_once_per_window():
    x, y = data(40)

    def make():
        model = seeded(TwoOptimizers())
        model.compile(keras.optimizers.Adam(0.05), keras.optimizers.SGD(0.2, momentum=0.5))
        return model

    model = make()
    gradaccum.accumulate(model, steps=3)
    # compile after accumulate: the custom compile signature runs as the class wrote it
    model.compile(keras.optimizers.Adam(0.05), keras.optimizers.SGD(0.2, momentum=0.5))
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)

    reference = make()
    reference.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert int(model.opt_a.iterations) == int(reference.opt_a.iterations) == 8
    assert int(model.opt_b.iterations) == int(reference.opt_b.iterations) == 8
    # `updates` counts opt_a's updates, not those of the unused default `optimizer`
    # that `keras.Model.compile` gave the model.
    assert history.history["updates"] == [4.0, 8.0]
    assert int(model.optimizer.iterations) == 0
    assert max_gap(model, seeded(TwoOptimizers())) > 1e-2
    assert_weights_close(model, reference, rtol=1e-5)
    state = accumulation_of(model).state
    owners = [optimizer for _, optimizer in state.own]
    assert any(o is model.opt_a for o in owners) and any(o is model.opt_b for o in owners)


def test_a_micro_batch_both_optimizers_skip_counts_once():
    x, y = data(24)
    x[5, 0] = np.nan  # micro-batch 2 of 6: not finite for both networks
    model = seeded(TwoOptimizers())
    gradaccum.accumulate(model, steps=3)
    model.compile(keras.optimizers.Adam(0.05), keras.optimizers.SGD(0.2, momentum=0.5))
    with pytest.warns(UserWarning, match="skipped 1 micro-batch"):
        history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0]
    assert int(model.opt_a.iterations) == int(model.opt_b.iterations) == 2


class DCGANOrder(TwoOptimizers):
    """keras.io's DCGAN order: the step applies `opt_a`, then differentiates
    `net_b`'s loss through `net_a`'s new weights."""

    def losses(self, x, y):
        target = keras.ops.cast(keras.ops.expand_dims(y, -1), "float32")
        logits = self.net_a(x, training=True)
        judged = self.net_b(keras.ops.softmax(logits), training=True)
        loss_a = keras.ops.mean(
            keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        ) + 0.1 * keras.ops.mean(keras.ops.square(judged))
        return loss_a, keras.ops.mean(keras.ops.square(judged - target))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss_a = self.losses(x, y)[0]
        grads_a = tape.gradient(loss_a, self.net_a.trainable_variables)
        self.opt_a.apply_gradients(zip(grads_a, self.net_a.trainable_variables))
        with tf.GradientTape() as tape:
            loss_b = self.losses(x, y)[1]
        grads_b = tape.gradient(loss_b, self.net_b.trainable_variables)
        self.opt_b.apply_gradients(zip(grads_b, self.net_b.trainable_variables))
        return {"loss_a": loss_a, "loss_b": loss_b}


def _dcgan(steps=None):
    model = seeded(DCGANOrder())
    if steps is not None:
        gradaccum.accumulate(model, steps=steps)
    model.compile(keras.optimizers.Adam(0.05), keras.optimizers.SGD(0.2, momentum=0.5))
    return model


def test_at_steps_1_a_step_in_the_dcgan_order_is_plain_keras():
    x, y = data(24)
    model = _dcgan(steps=1)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    reference = _dcgan()
    reference.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_gap(model, seeded(DCGANOrder())) > 1e-2
    assert_weights_close(model, reference, rtol=1e-5)


def test_a_due_window_lands_where_the_step_applies_it():
    # Windows of 3 micro-batches of 4: net_a's update is the window's mean gradient
    # at the window's first weights; net_b's takes its last micro-batch's gradient
    # after net_a's update (the window is due there), the others' before it.
    x, y = data(24)
    model = _dcgan(steps=3)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _dcgan()

    def gradient(index, variables, part):
        with tf.GradientTape() as tape:
            loss = reference.losses(*part)[index]
        return tape.gradient(loss, variables)

    net_a, net_b = reference.net_a.trainable_variables, reference.net_b.trainable_variables
    for window in (range(0, 12, 4), range(12, 24, 4)):
        parts = [(x[s:s + 4], y[s:s + 4]) for s in window]
        mean_a = [sum(g) / 3 for g in zip(*[gradient(0, net_a, p) for p in parts])]
        before = [gradient(1, net_b, p) for p in parts[:2]]
        reference.opt_a.apply_gradients(zip(mean_a, net_a))
        after = gradient(1, net_b, parts[2])
        mean_b = [sum(g) / 3 for g in zip(*before, after)]
        reference.opt_b.apply_gradients(zip(mean_b, net_b))
    assert_weights_close(model, reference, rtol=1e-5)


class TwoOptimizersBatchNorm(TwoOptimizers):
    """TwoOptimizers whose first network starts with gradaccum's window-aware
    BatchNormalization (its scale and offset trained by `opt_a`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net_a = keras.Sequential(
            [gradaccum.BatchNormalization(momentum=0.8), keras.layers.Dense(8, activation="tanh"),
             keras.layers.Dense(3)], name="net_a",
        )


def test_window_aware_batch_norm_with_two_optimizers_moves_once_per_window():
    # 40 samples in micro-batches of 4, steps=3: windows of 12, 12, 12 and 4 samples.
    x, y = data(40)
    model = seeded(TwoOptimizersBatchNorm())
    moving = [w.numpy() for w in model.net_a.layers[0].non_trainable_weights]
    gradaccum.accumulate(model, steps=3)
    model.compile(keras.optimizers.Adam(0.05), keras.optimizers.SGD(0.2, momentum=0.5))
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert int(model.opt_a.iterations) == int(model.opt_b.iterations) == 8

    reference = keras.layers.BatchNormalization(momentum=0.8)
    reference.build((None, 6))
    for variable, value in zip(reference.non_trainable_weights, moving):
        variable.assign(value)
    for _ in range(2):
        for window in (np.r_[0:12], np.r_[12:24], np.r_[24:36], np.r_[36:40]):
            reference(x[window], training=True)
    layer = model.net_a.layers[0]
    np.testing.assert_allclose(layer.moving_mean.numpy(), reference.moving_mean.numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.moving_variance.numpy(),
                               reference.moving_variance.numpy(), rtol=1e-5, atol=1e-6)
    # Keras's layer moves on every micro-batch: 20 moves, not 8.
    keras_model = seeded(TwoOptimizersBatchNorm())
    keras_model.compile(keras.optimizers.Adam(0.05), keras.optimizers.SGD(0.2, momentum=0.5))
    keras_model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert np.abs(keras_model.net_a.layers[0].moving_mean.numpy()
                  - reference.moving_mean.numpy()).max() > 1e-3


# Bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("obj", [keras.layers.Dense(3), "model", None])
def test_accumulate_refuses_what_is_not_a_keras_model(obj):
    with pytest.raises(ValueError) as info:
        gradaccum.accumulate(obj, steps=2)
    assert str(info.value) == (
        f"`model` must be a keras.Model. Received: model={obj!r} of type {type(obj).__name__}"
    )


def already(name):
    return (
        "`model` must be a keras.Model that gradaccum does not accumulate for "
        f"already. Received: model={name!r}, which accumulates already. Call "
        "`gradaccum.disable(model)` first to change its options."
    )


def test_accumulate_refuses_a_model_accumulating_already():
    model = gradaccum.accumulate(Plain(name="twice"), steps=2)
    with pytest.raises(ValueError) as info:
        gradaccum.accumulate(model, steps=4)
    assert str(info.value) == already("twice")
    assert accumulation_of(model).options.steps == 2


def test_accumulate_refuses_a_wrap_trainer():
    trainer = gradaccum.wrap(Plain(), steps=2)
    with pytest.raises(ValueError) as info:
        gradaccum.accumulate(trainer, steps=2)
    assert str(info.value) == already(trainer.name)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(steps=0), f"{STEPS_RULE}0"),
        (dict(steps=2.5), f"{STEPS_RULE}2.5"),
        (
            dict(steps=None),
            "`steps`, `weight_per_update` or `micro_batch_size` must be given. "
            "Received: steps=None, weight_per_update=None, micro_batch_size=None",
        ),
        (dict(steps=2, partial="x"),
         "`partial` must be one of 'flush', 'carry', 'drop'. Received: partial='x'"),
        (dict(steps=2, reduction="max"),
         "`reduction` must be one of 'mean', 'sum'. Received: reduction='max'"),
        (dict(steps=2, weighting="tokens"),
         "`weighting` must be one of 'exact', 'uniform' or a callable "
         "(x, y, sample_weight) -> weight. Received: weighting='tokens'"),
    ],
    ids=["steps0", "steps2.5", "stepsNone", "partial", "reduction", "weighting"],
)
def test_accumulate_invalid_options(options, message):
    model = Plain()
    with pytest.raises(ValueError) as info:
        gradaccum.accumulate(model, **options)
    assert str(info.value) == message
    assert accumulation_of(model) is None  # nothing attached on a refusal


@pytest.mark.parametrize("obj", [Plain(name="plain"), "model", None])
def test_disable_refuses_a_model_not_accumulating(obj):
    with pytest.raises(ValueError) as info:
        gradaccum.disable(obj)
    shown = f"{obj.name!r}" if isinstance(obj, keras.Model) else f"{obj!r}"
    assert str(info.value) == (
        "`model` must be a model that gradaccum accumulates for (returned by "
        f"`gradaccum.accumulate`). Received: model={shown} of type {type(obj).__name__}"
    )


def test_disable_twice_is_refused():
    model = gradaccum.disable(gradaccum.accumulate(Plain(), steps=2))
    with pytest.raises(ValueError, match="must be a model that gradaccum accumulates for"):
        gradaccum.disable(model)


def test_train_step_that_never_applies_gradients_is_refused_at_fit():
    x, y = data(8)
    model = compiled(gradaccum.accumulate(seeded(NoApply()), steps=2))
    before = model.get_weights()
    with pytest.raises(ValueError) as info:
        model.fit(x, y, batch_size=4, verbose=0)
    assert str(info.value) == (
        "The train_step of NoApply must hand its gradients to an optimizer of the model "
        "(`self.optimizer.apply_gradients(...)` or `.apply(...)`) for gradaccum to "
        "accumulate them. Received: a step that called neither on any optimizer "
        "attribute of the model, so nothing would be trained."
    )
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


# disable, and the order of accumulate and compile ------------------------------------


def test_disable_restores_plain_keras_training_and_the_users_compile():
    x, y = data(40)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = seeded(Plain())
    gradaccum.accumulate(model, steps=3)
    model.compile(keras.optimizers.Adam(0.05), loss)
    assert model.loss is not loss  # gradaccum's normalizer-recording wrapper
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 4

    assert gradaccum.disable(model) is model
    assert accumulation_of(model) is None
    assert model.loss is loss
    assert "fit" not in vars(model) and "train_step" not in vars(model)
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert "updates" not in history.history
    assert int(model.optimizer.iterations) == 4 + 10  # one update per batch again

    reference = seeded(Plain())
    reference.compile(keras.optimizers.Adam(0.05), loss)
    reference.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model, reference, rtol=1e-5)


def test_disable_flushes_an_open_window():
    x, y = data(8)
    model = seeded(Plain())
    gradaccum.accumulate(model, steps=3, partial="carry")
    compiled(model)
    model.fit(x[:8], y[:8], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 0  # 2 micro-batches carried
    with pytest.warns(UserWarning, match="discards an open window of 2 micro-batch"):
        gradaccum.disable(model)


def test_accumulate_before_or_after_compile_gives_the_same_weights():
    x, y = data(40)
    before = gradaccum.accumulate(seeded(Plain()), steps=3)
    compiled(before)
    after = gradaccum.accumulate(compiled(seeded(Plain())), steps=3)
    for model in (before, after):
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    reference = compiled(seeded(Plain()))
    reference.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(before, after, rtol=1e-6, atol=1e-7)
    assert_weights_close(before, reference, rtol=1e-5)
    assert int(before.optimizer.iterations) == int(after.optimizer.iterations) == 8


# BackupAndRestore ---------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Plain, OwnStep], ids=["default_step", "own_train_step"])
def test_backup_and_restore_resumes_mid_window_exactly(tmp_path, cls):
    x, y = data(10)  # 5 micro-batches of 2 per epoch, steps 3
    epochs = 3

    def make(seed=0):
        model = gradaccum.accumulate(seeded(cls(), seed), steps=3)
        # One micro-batch per call, so that the crash can land inside a window.
        model.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=1)
        return model

    full = make()
    full.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0)

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == (1, 1):
                raise RuntimeError("simulated crash")

    backup = str(tmp_path / "backup")
    model = make()
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1), Crash()])
    meta = json.loads((tmp_path / "backup" / "training_metadata.json").read_text())
    assert meta["epoch"] == 1
    assert max_gap(model, full) > 1e-4
    # The crash left a window of 2 micro-batches open: the sidecar holds it.
    assert any(p.name.endswith(".gradaccum.npz") for p in (tmp_path / "backup").iterdir())

    keras.utils.clear_session()
    resumed = make(seed=11)  # fresh weights: everything must come from the backup
    resumed.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    assert_weights_close(resumed, full, rtol=1e-6, atol=1e-7)
    assert int(resumed.optimizer.iterations) == int(full.optimizer.iterations) == 6


def _three_layers(seed=0):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(6, activation="tanh"),
                              keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def test_a_compile_that_freezes_a_layer_keeps_each_variables_window():
    # 5 micro-batches with steps=3 and carry: a window of 2 stays open; layer 0 is
    # frozen and the model compiled again. Layers 1 and 2 have kernels of one shape
    # (6x6 and 6x6 before; 6x6 and 6x3 after): each window sum stays with its
    # variable, and the frozen layer's share is dropped with a warning.
    x, y = data(24)
    model = gradaccum.accumulate(_three_layers(), steps=3, partial="carry")
    model.compile(keras.optimizers.SGD(0.5), SCE)
    model.fit(x[:20], y[:20], batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.layers[0].trainable = False
    with pytest.warns(UserWarning, match="no longer a trainable variable"):
        model.compile(keras.optimizers.SGD(0.5), SCE)
        model.fit(x[20:], y[20:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _three_layers()
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    reference.train_on_batch(x[:12], y[:12])
    reference.layers[0].trainable = False
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    reference.train_on_batch(x[12:24], y[12:24])
    assert_weights_close(model, reference)


def test_train_on_batch_after_fit_closes_windows_by_their_rule_only():
    # fit ends an epoch of 8 micro-batches (2 windows of 4); train_on_batch after
    # it has no epoch, so 12 micro-batches make 3 windows, not one at every
    # micro-batch past the fit's epoch length.
    x, y = data(80)
    model = gradaccum.accumulate(_three_layers(), steps=4)
    model.compile(keras.optimizers.Adam(0.05), SCE)
    model.fit(x[:32], y[:32], batch_size=4, epochs=1, shuffle=False, verbose=0)
    for i in range(12):
        model.train_on_batch(x[32 + 4 * i:36 + 4 * i], y[32 + 4 * i:36 + 4 * i])
    reference = _three_layers()
    reference.compile(keras.optimizers.Adam(0.05), SCE)
    for start in range(0, 80, 16):
        reference.train_on_batch(x[start:start + 16], y[start:start + 16])
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
    model = gradaccum.accumulate(_three_layers(), steps=4)
    model.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=1)
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x[:32], y[:32], batch_size=4, epochs=1, shuffle=False, verbose=0,
                  callbacks=[_StopAfter(6)])
    for i in range(12):
        model.train_on_batch(x[24 + 4 * i:28 + 4 * i], y[24 + 4 * i:28 + 4 * i])
    reference = _three_layers()
    reference.compile(keras.optimizers.Adam(0.05), SCE)
    for start in range(0, 64, 16):
        reference.train_on_batch(x[start:start + 16], y[start:start + 16])
    assert int(model.optimizer.iterations) == 4
    assert_weights_close(model, reference)


class _BatchLogs(keras.callbacks.Callback):
    """Each batch's logs, and the model's metrics read after it."""

    def __init__(self):
        super().__init__()
        self.logs, self.metrics = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs))
        self.metrics.append({k: float(v) for k, v in self.model.get_metrics_result().items()})


def test_each_batchs_logs_are_the_steps_values_under_their_names():
    # On one device the step's scalar logs leave the compiled call in one vector with
    # gradaccum's entries: callbacks see each batch's loss and metrics as Keras
    # computed them, and at steps=1 the same losses as plain Keras.
    x, y = data(24)
    logged = _BatchLogs()
    model = gradaccum.accumulate(seeded(Plain()), steps=2)
    model.compile(keras.optimizers.Adam(0.05), SCE, metrics=["accuracy"],
                  steps_per_execution=1)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[logged])
    for logs, metrics in zip(logged.logs, logged.metrics):
        assert {k: logs[k] for k in metrics} == metrics
    assert [logs["updates"] for logs in logged.logs] == [0.0, 1.0, 1.0, 2.0, 2.0, 3.0]
    assert all(logs["window_micro_batches"] in (0.0, 2.0) for logs in logged.logs)

    plain_logged, single_logged = _BatchLogs(), _BatchLogs()
    plain = seeded(Plain())
    single = gradaccum.accumulate(seeded(Plain()), steps=1)
    for model, callback in ((plain, plain_logged), (single, single_logged)):
        model.compile(keras.optimizers.Adam(0.05), SCE, metrics=["accuracy"],
                      steps_per_execution=1)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                  callbacks=[callback])
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose([logs[key] for logs in single_logged.logs],
                                   [logs[key] for logs in plain_logged.logs], rtol=1e-6)


class OddLogs(Plain):
    """A step whose logs hold entries that do not travel packed."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss, "per_class": tf.constant([1.0, 2.0]),
                "count": tf.constant(3, tf.int64), "a,b": tf.constant(0.5),
                "wide": tf.constant(0.25, tf.float64),
                "learning_rate": self.optimizer.learning_rate}


def test_a_steps_other_log_entries_reach_the_callbacks_as_they_are():
    x, y = data(8)
    logged = _BatchLogs()
    model = gradaccum.accumulate(seeded(OddLogs()), steps=2)
    model.compile(keras.optimizers.SGD(0.1), SCE, steps_per_execution=1)
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                        callbacks=[logged])
    for logs in logged.logs:
        np.testing.assert_array_equal(logs["per_class"], [1.0, 2.0])
        assert (logs["count"], logs["a,b"], logs["wide"]) == (3.0, 0.5, 0.25)
        assert logs["learning_rate"] == float(np.float32(0.1))
        assert np.isfinite(logs["loss"])
    assert [logs["updates"] for logs in logged.logs] == [0.0, 1.0]
    assert history.history["a,b"] == [0.5]


class SortedMetrics(Plain):
    """Returns its metrics in another order than the model's metrics list."""

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return dict(sorted(super().compute_metrics(x, y, y_pred, sample_weight).items()))


def test_backup_and_restore_takes_a_step_whose_logs_come_in_another_order(tmp_path):
    # Under BackupAndRestore the step's logs and the model's metrics (what a skipped
    # micro-batch returns) are two branches of one cond: they travel packed alike
    # whatever the order of the step's entries.
    x, y = data(16)
    models = []
    for cls, callbacks in ((SortedMetrics, [keras.callbacks.BackupAndRestore(
            str(tmp_path / "backup"))]), (Plain, [])):
        model = gradaccum.accumulate(seeded(cls()), steps=2)
        model.compile(keras.optimizers.Adam(0.05), SCE, metrics=["accuracy"],
                      steps_per_execution=1)
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                            callbacks=callbacks)
        models.append((model, history.history))
    (ordered, ordered_history), (plain, plain_history) = models
    assert_weights_close(ordered, plain, rtol=1e-6, atol=1e-7)
    for key in ("loss", "accuracy", "updates"):
        np.testing.assert_allclose(ordered_history[key], plain_history[key], rtol=1e-6)


def test_fit_says_once_that_the_dcgan_order_is_approximate():
    # As audit names it (issue 46, item 3); a window of one micro-batch is exact.
    x, y = data(24)
    model = _dcgan(steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    said = [str(w.message) for w in caught if "computes the gradients" in str(w.message)]
    assert said == [
        "Accumulation is approximate for this model. The model's train_step computes "
        "the gradients it hands to `self.opt_b` after applying `self.opt_a`, from "
        "variables `self.opt_a` updates (a GAN in keras.io's DCGAN order): on the "
        "large batch they see that update; accumulated, they are taken at the weights "
        "the window started from."
    ]
    model = _dcgan(steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert not [w for w in caught if "approximate" in str(w.message)]


def test_a_process_that_trains_many_models_is_not_warned_of_retracing(caplog):
    # Each model's end-of-data close is traced once for its state; TensorFlow keys
    # its retracing count by the Python function's code, which every model's close
    # shared: from the sixth model on, each fit logged a retracing warning.
    x = np.random.default_rng(0).normal(size=(40, 6)).astype("float32")
    y = (np.arange(40) % 3).astype("int32")
    with caplog.at_level("WARNING", logger="tensorflow"):
        for _ in range(7):
            model = gradaccum.accumulate(
                keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)]), steps=3)
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(x, y, batch_size=4, verbose=0)
            assert int(model.optimizer.iterations) == 4  # windows 3, 3, 3, 1
    assert not [r for r in caplog.records if "retracing" in r.getMessage()]
