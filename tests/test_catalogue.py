"""Every entry of the catalogue of bad inputs (docs/bad-input.md and the pages of
docs/bad-input/): the input is refused with exactly that message."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from catalogue_pages import entries
from helpers import make_data, make_mlp

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def two_replicas():
    if len(tf.config.list_logical_devices("CPU")) < 2:
        pytest.skip("needs two logical CPU devices (set up by the root conftest)")
    # No collective ops: several such strategies may live in one process.
    return tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


def under_another_backend(backend="numpy"):
    """The first use of a public name while Keras reports `backend`. (A child process
    with KERAS_BACKEND set would need that backend's package installed.)"""
    cached = gradaccum.__dict__.pop("accumulate", None)
    real = keras.backend.backend
    keras.backend.backend = lambda: backend
    try:
        gradaccum.accumulate  # noqa: B018 (the attribute's first use is the test)
    finally:
        keras.backend.backend = real
        if cached is not None:
            gradaccum.accumulate = cached


def accumulator(**kwargs):
    return gradaccum.GradientAccumulator([tf.Variable([1.0, 2.0], name="w")], **kwargs)


def trainer(**kwargs):
    model = make_mlp()
    return gradaccum.wrap(model, steps=kwargs.pop("steps", 2), **kwargs)


def fit(trainer_, data=None, loss=SCE, optimizer="sgd"):
    trainer_.compile(optimizer=optimizer, loss=loss)
    x, y = make_data(8)
    if data is None:
        return trainer_.fit(x, y, batch_size=4, verbose=0)
    return trainer_.fit(data, verbose=0)


def fit_after_setting_accumulation_steps():
    """`gradient_accumulation_steps` set on the optimizer after `compile`."""
    model = gradaccum.accumulate(make_mlp(), steps=2)
    model.compile(optimizer="sgd", loss=SCE)
    model.optimizer.gradient_accumulation_steps = 2
    x, y = make_data(8)
    return model.fit(x, y, batch_size=4, verbose=0)


def predict_steps(steps):
    wrapped = trainer()
    wrapped.compile(optimizer="sgd", loss=SCE)
    x, _ = make_data(16)
    wrapped.predict(x, batch_size=2, steps=steps, verbose=0)


def fit_poisoned_under_xla():
    x, y = make_data(8)
    x[5, 0] = np.nan
    wrapped = trainer(nonfinite="raise")
    wrapped.compile(optimizer="sgd", loss=SCE, jit_compile=True)
    wrapped.fit(x, y, batch_size=4, verbose=0)


def named_mlp(name):
    model = make_mlp()
    model.name = name
    return model


class Idle(keras.Model):
    """Its own train_step never hands gradients to an optimizer."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        return {}


def empty_data():
    x, y = np.zeros((0, 5), "float32"), np.zeros((0,), "int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(4)


def under(strategy, build):
    with strategy.scope():
        return build()


def built_outside_then_in(strategy, make):
    model = make_mlp()
    with strategy.scope():
        make(model)


def accumulate_in_cross_replica_context():
    strategy = two_replicas()
    with strategy.scope():
        model = make_mlp()
        acc = gradaccum.GradientAccumulator(model.trainable_variables)
        acc.accumulate([tf.zeros_like(v) for v in model.trainable_variables])


def schedule_zero_at_second_window():
    # Windows of 2 micro-batches for update 0, then 0 (refused when update 1's
    # window opens).
    acc = accumulator(steps=lambda update: 2 - 2 * tf.minimum(update, 1))
    optimizer = keras.optimizers.SGD()
    for _ in range(3):
        acc.step(optimizer, [tf.constant([1.0, 1.0])])


def nonfinite_raise():
    acc = accumulator(steps=2, nonfinite="raise")
    acc.accumulate([tf.constant([1.0, 1.0])])
    acc.accumulate([tf.constant([np.inf, 1.0])])


class SummingLoss(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return keras.ops.sum(keras.ops.square(y_true - y_pred), axis=-1)

    def __call__(self, y_true, y_pred, sample_weight=None):
        return keras.ops.mean(self.call(y_true, y_pred))


class Frozen(keras.Model):
    def __init__(self):
        super().__init__(name="frozen")
        self.dense = keras.layers.Dense(3, trainable=False)

    def call(self, x):
        return self.dense(x)


def built(model):
    model(np.zeros((1, 5), "float32"))
    return model


class Subclassed(keras.Model):
    def call(self, x):
        return x


def bn_model(**options):
    return keras.Sequential(
        [keras.Input((4, 3)), keras.layers.BatchNormalization(name="bn", **options)]
    )


def split_with_synchronized_batch_norm_on_two_replicas():
    strategy = two_replicas()
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((4,)),
            gradaccum.BatchNormalization(synchronized=True, name="bn"),
            keras.layers.Dense(3),
        ])
        model = gradaccum.accumulate(model, micro_batch_size=8)
        model.compile(keras.optimizers.SGD(0.1), SCE)
    model.fit(np.ones((16, 4), "float32"), np.zeros(16), batch_size=16, verbose=0)


def load_four_into_six(tmp_path):
    plain = keras.Sequential([keras.Input((3,)), gradaccum.BatchNormalization(name="bn")])
    layer = plain.layers[0]
    layer.load_own_variables({str(i): np.zeros(3) for i in range(6)})


def saved_state(problem):
    """`load_weights` of an accumulated model, its weights saved as `model.weights.h5`
    (a relative path, in a folder of its own) with a window open, then: another save's
    weights copied over them (`other-weights`), the state file cut in half
    (`damaged`), a model with another window rule or other variables, a state file
    of gradaccum's first format."""
    folder = tempfile.mkdtemp()
    with contextlib.chdir(folder):
        try:
            x, y = make_data(24)

            def trainer(steps=4, hidden=16):
                keras.utils.set_random_seed(0)
                net = keras.Sequential([keras.Input((5,)),
                                        keras.layers.Dense(hidden, activation="tanh"),
                                        keras.layers.Dense(3)])
                model = gradaccum.accumulate(net, steps=steps, partial="carry")
                model.compile(keras.optimizers.Adam(0.01), SCE)
                return model

            model = trainer()
            model.fit(x, y, batch_size=4, verbose=0)
            model.save_weights("model.weights.h5")
            loader = trainer(**{"window": {"steps": 8}, "model": {"hidden": 8}}.get(problem, {}))
            loader.build((None, 5))
            loader.optimizer.build(loader.trainable_variables)
            if problem == "other-weights":
                other = trainer()
                other.fit(x[:12], y[:12], batch_size=4, verbose=0)
                other.save_weights("other.weights.h5")
                shutil.copy("other.weights.h5", "model.weights.h5")
            elif problem == "damaged":
                size = os.path.getsize("model.weights.h5.gradaccum.npz")
                with open("model.weights.h5.gradaccum.npz", "r+b") as f:
                    f.truncate(size // 2)
            elif problem == "format":
                with np.load("model.weights.h5.gradaccum.npz") as store:
                    kept = {k: store[k] for k in store.files if k.startswith("gradaccum_")}
                np.savez("model.weights.h5.gradaccum.npz", **kept)
            loader.load_weights("model.weights.h5")
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def audited(steps=2, batch_size=4, compiled=True, built=True, accumulated=False,
            generator=False, **kwargs):
    """`gradaccum.audit` on a model named 'net' and 8 samples."""
    model = keras.Sequential(([keras.Input((4,))] if built else []) + [keras.layers.Dense(2)],
                             name="net")
    if compiled:
        model.compile("sgd", "mse")
    if accumulated:
        gradaccum.accumulate(model, steps=2)
    x, y = np.zeros((8, 4), "float32"), np.zeros((8, 2), "float32")
    if generator:
        x = (row for row in x)
    gradaccum.audit(model, x, y, steps=steps, batch_size=batch_size, **kwargs)


def private(model=None, steps=2, fit_it=False, dataset_size=None, policy=None, **kwargs):
    """`accumulate(..., privacy=Privacy(1.0, 1.0, ...))` on `model` (an MLP named 'net'),
    compiled, and fit on 8 samples in batches of 4 when `fit_it`."""
    model = model if model is not None else keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(3)], name="net")
    privacy = gradaccum.Privacy(1.0, 1.0, dataset_size=dataset_size, delta=1e-3)
    gradaccum.accumulate(model, steps=steps, privacy=privacy, **kwargs)
    optimizer = keras.optimizers.SGD(0.1)
    if policy == "loss_scale":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    elif policy == "loss_scale_factor":
        optimizer = keras.optimizers.SGD(0.1, loss_scale_factor=64.0)
    model.compile(optimizer=optimizer, loss=SCE)
    if fit_it:
        x, y = make_data(8)
        model.fit(x, y, batch_size=4, verbose=0)
    return model


class StepOfItsOwn(keras.Model):
    def train_step(self, data):
        return {}


class LossOfItsOwn(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(y_pred)


def functional(cls, name):
    inputs = keras.Input((5,))
    return cls(inputs, keras.layers.Dense(3)(inputs), name=name)


def spent_without_delta():
    model = gradaccum.accumulate(make_mlp(), steps=2, privacy=gradaccum.Privacy(1.0, 1.0))
    gradaccum.privacy_spent(model, dataset_size=100)


CASES = {
    # Privacy(...), privacy_spent(...), accumulate(..., privacy=...)
    "privacy-clip": lambda: gradaccum.Privacy(l2_norm_clip=0, noise_multiplier=1.0),
    "privacy-noise": lambda: gradaccum.Privacy(l2_norm_clip=1.0, noise_multiplier=-0.5),
    "privacy-seed": lambda: gradaccum.Privacy(1.0, 1.0, seed=1.5),
    "privacy-delta": lambda: gradaccum.Privacy(1.0, 1.0, delta=1.5),
    "privacy-dataset-size": lambda: gradaccum.Privacy(1.0, 1.0, dataset_size=0),
    "privacy-accountant": lambda: gradaccum.Privacy(1.0, 1.0, accountant="moments"),
    "privacy-type": lambda: gradaccum.accumulate(
        make_mlp(), steps=2, privacy={"l2_norm_clip": 1.0}),
    "privacy-window-larger-than-dataset": lambda: private(fit_it=True, dataset_size=6),
    "privacy-weighting": lambda: private(weighting="uniform"),
    "privacy-own-train-step": lambda: private(functional(StepOfItsOwn, "stepper")),
    "privacy-own-compute-loss": lambda: private(functional(LossOfItsOwn, "contrastive")),
    "privacy-batch-norm": lambda: private(keras.Sequential(
        [keras.Input((5,)), keras.layers.BatchNormalization(name="bn"),
         keras.layers.Dense(3)], name="net")),
    "privacy-activity-regularizer": lambda: private(keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(3, activity_regularizer="l2", name="dense")],
        name="net")),
    "privacy-loss-scale": lambda: private(policy="loss_scale", fit_it=True),
    "privacy-loss-scale-factor": lambda: private(policy="loss_scale_factor", fit_it=True),
    "privacy-spent-not-private": lambda: gradaccum.privacy_spent(
        keras.Sequential([keras.layers.Dense(1)], name="net")),
    "privacy-spent-delta": spent_without_delta,
    # audit
    "audit-batch-size": lambda: audited(batch_size=16),
    "audit-steps": lambda: audited(steps=0),
    "audit-not-compiled": lambda: audited(compiled=False),
    "audit-not-built": lambda: audited(built=False),
    "audit-accumulated": lambda: audited(accumulated=True),
    "audit-too-few": lambda: audited(steps=3),
    "audit-not-arrays": lambda: audited(generator=True),
    "audit-reduction": lambda: audited(reduction="max"),
    # Every public name
    "backend-unsupported": under_another_backend,
    "accumulator-dtype-replicas": lambda: under(
        two_replicas(),
        lambda: gradaccum.GradientAccumulator(
            make_mlp().trainable_variables, accumulator_dtype="bfloat16"
        ),
    ),
    "fit-split-synchronized-replicas": split_with_synchronized_batch_norm_on_two_replicas,
    # GradientAccumulator(...)
    "accumulator-variables-empty": lambda: gradaccum.GradientAccumulator([]),
    "accumulator-variables-element": lambda: gradaccum.GradientAccumulator([1.0]),
    "accumulator-steps": lambda: accumulator(steps=0),
    "accumulator-steps-callable-zero": lambda: accumulator(steps=lambda update: 0),
    "accumulator-steps-callable-later": schedule_zero_at_second_window,
    "accumulator-steps-callable-dtype": lambda: accumulator(steps=lambda update: 1.5),
    "accumulator-steps-callable-shape": lambda: accumulator(steps=lambda update: [1, 2]),
    "accumulator-steps-pairs-empty": lambda: accumulator(steps=[]),
    "accumulator-steps-pairs-form": lambda: accumulator(steps=[(0, 2.5)]),
    "accumulator-steps-pairs-sorted": lambda: accumulator(steps=[(0, 1), (4, 4), (2, 2)]),
    "accumulator-steps-pairs-start": lambda: accumulator(steps=[(2, 2)]),
    "accumulator-weight-per-update": lambda: accumulator(weight_per_update=0),
    "accumulator-steps-and-weight-per-update": lambda: accumulator(
        steps=4, weight_per_update=64
    ),
    "accumulator-reduction": lambda: accumulator(reduction="avg"),
    "accumulator-dtype": lambda: accumulator(accumulator_dtype="int32"),
    "accumulator-layers": lambda: accumulator(layers=["bn"]),
    "accumulator-nonfinite": lambda: accumulator(nonfinite="ignore"),
    "accumulator-name": lambda: accumulator(name="bad name!"),
    "accumulator-outside-scope": lambda: built_outside_then_in(
        two_replicas(), lambda m: gradaccum.GradientAccumulator(m.trainable_variables)
    ),
    # accumulate / step / apply
    "accumulate-gradients-length": lambda: accumulator().accumulate([]),
    "accumulate-gradient-shape": lambda: accumulator().accumulate([tf.zeros([3])]),
    "accumulate-weight-negative": lambda: accumulator().accumulate([tf.zeros([2])], -1),
    "accumulate-weight-nan": lambda: accumulator().accumulate([tf.zeros([2])], float("nan")),
    "accumulate-weight-shape": lambda: accumulator().accumulate([tf.zeros([2])], [1, 2]),
    "accumulate-loss-scale-optimizer": lambda: accumulator().accumulate(
        [tf.zeros([2])], loss_scale_optimizer=keras.optimizers.Adam()
    ),
    "accumulate-cross-replica": accumulate_in_cross_replica_context,
    "accumulate-nonfinite-raise": nonfinite_raise,
    "step-without-steps": lambda: accumulator().step(keras.optimizers.SGD(), [tf.zeros([2])]),
    "step-optimizer": lambda: accumulator(steps=1).step("sgd", [tf.zeros([2])]),
    "step-optimizer-accumulates": lambda: accumulator(steps=1).step(
        keras.optimizers.SGD(gradient_accumulation_steps=2), [tf.zeros([2])]
    ),
    # wrap(...) / AccumulatingModel(...)
    "accumulate-model": lambda: gradaccum.accumulate("model", steps=2),
    "accumulate-twice": lambda: gradaccum.accumulate(
        gradaccum.accumulate(named_mlp("net"), steps=2), steps=2
    ),
    "accumulate-steps": lambda: gradaccum.accumulate(make_mlp(), steps=0),
    "accumulate-partial": lambda: gradaccum.accumulate(make_mlp(), steps=2, partial="keep"),
    "accumulate-micro-batch-size": lambda: gradaccum.accumulate(make_mlp(), micro_batch_size=0),
    "accumulate-steps-and-weight-per-update": lambda: gradaccum.accumulate(
        make_mlp(), steps=[(0, 1), (2, 2)], weight_per_update=64
    ),
    "accumulate-weight-per-update-and-micro-batch-size": lambda: gradaccum.accumulate(
        make_mlp(), weight_per_update=64, micro_batch_size=16
    ),
    "accumulate-steps-and-micro-batch-size": lambda: gradaccum.accumulate(
        make_mlp(), steps=4, micro_batch_size=16
    ),
    "accumulate-no-window": lambda: gradaccum.accumulate(make_mlp()),
    "accumulate-max-micro-batch-size": lambda: gradaccum.accumulate(
        make_mlp(), micro_batch_size=16, max_micro_batch_size=64
    ),
    "accumulate-split-partial": lambda: gradaccum.accumulate(
        make_mlp(), micro_batch_size=16, partial="drop"
    ),
    "fit-split-batch-dimensions": lambda: fit(
        gradaccum.accumulate(make_mlp(), micro_batch_size=4),
        data=tf.data.Dataset.from_tensors((make_data(8)[0], make_data(8)[1][:7])),
    ),
    "accumulate-step-without-optimizer": lambda: fit(gradaccum.accumulate(Idle(), steps=2)),
    "wrap-model": lambda: gradaccum.wrap("model", steps=2),
    "wrap-wrapped": lambda: gradaccum.wrap(trainer(), steps=2),
    "wrap-steps": lambda: trainer(steps=2.5),
    "wrap-steps-pairs": lambda: trainer(steps=[(2, 2), (0, 1)]),
    "wrap-weight-per-update": lambda: gradaccum.wrap(make_mlp(), weight_per_update=-1),
    "wrap-weighting": lambda: trainer(weighting="tokens"),
    "wrap-partial": lambda: trainer(partial="keep"),
    "wrap-reduction": lambda: trainer(reduction="avg"),
    "wrap-accumulator-dtype": lambda: trainer(accumulator_dtype="int32"),
    "wrap-convert-batch-norm": lambda: trainer(convert_batch_norm="yes"),
    "wrap-nonfinite": lambda: trainer(nonfinite="ignore"),
    "wrap-moving-statistics": lambda: trainer(moving_statistics="pooled"),
    "load-state-other-weights": lambda: saved_state("other-weights"),
    "load-state-damaged": lambda: saved_state("damaged"),
    "load-state-window": lambda: saved_state("window"),
    "load-state-model": lambda: saved_state("model"),
    "load-state-format": lambda: saved_state("format"),
    "wrap-outside-scope": lambda: built_outside_then_in(
        two_replicas(), lambda m: gradaccum.wrap(m, steps=2)
    ),
    # compile / fit
    "compile-optimizer-accumulates": lambda: trainer().compile(
        optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2), loss=SCE
    ),
    "fit-optimizer-accumulates": fit_after_setting_accumulation_steps,
    "predict-steps-not-a-multiple": lambda: predict_steps(3),
    "fit-empty-data": lambda: fit(trainer(), data=empty_data()),
    "fit-unbuilt-empty-data": lambda: fit(
        gradaccum.wrap(keras.Sequential([keras.layers.Dense(3)], name="net"), steps=2),
        data=empty_data(),
    ),
    "fit-no-trainable-variables": lambda: fit(gradaccum.wrap(built(Frozen()), steps=2),
                                              loss="mse"),
    "fit-exact-sum-loss": lambda: fit(
        trainer(), loss=keras.losses.MeanSquaredError(reduction="sum")
    ),
    "fit-exact-unreduced-loss": lambda: fit(
        trainer(), loss=keras.losses.MeanSquaredError(reduction=None)
    ),
    "fit-exact-custom-call-loss": lambda: fit(trainer(), loss=SummingLoss(name="summing")),
    "fit-nonfinite-raise-xla": lambda: fit_poisoned_under_xla(),
    "fit-weighting-not-a-number": lambda: fit(
        trainer(weighting=lambda x, y, sw: tf.constant("many"))
    ),
    "fit-weighting-not-a-scalar": lambda: fit(
        trainer(weighting=lambda x, y, sw: tf.ones([2]))
    ),
    # BatchNormalization / convert_batch_normalization
    "batch-norm-renorm": lambda: gradaccum.BatchNormalization(renorm=True, name="bn"),
    "batch-norm-weights": lambda: load_four_into_six(None),
    "convert-subclassed": lambda: gradaccum.convert_batch_normalization(Subclassed()),
    "convert-renorm": lambda: gradaccum.convert_batch_normalization(bn_model(renorm=True)),
    "convert-unreachable": lambda: gradaccum.convert_batch_normalization(
        keras.Sequential(
            [keras.Input((4, 3)),
             keras.layers.TimeDistributed(keras.layers.BatchNormalization(name="inner"))]
        )
    ),
    # CountingCrossDeviceOps(...)
    "counting-inner": lambda: gradaccum.CountingCrossDeviceOps("nccl"),
}


ROWS = entries()


def test_every_case_has_a_row_and_every_row_a_case():
    assert len(ROWS) == len({r[0] for r in ROWS}) >= 40
    assert {r[0] for r in ROWS} == set(CASES)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_catalogue_row(row):
    case, error, message = row
    expected = {"ValueError": ValueError, "ImportError": ImportError,
                "InvalidArgumentError": tf.errors.InvalidArgumentError}
    with pytest.raises(expected[error]) as info:
        CASES[case]()
    text = info.value.message if error == "InvalidArgumentError" else str(info.value)
    assert text == message


def test_an_entry_the_catalogue_cannot_read_is_an_error(tmp_path, monkeypatch):
    import catalogue_pages

    page = tmp_path / "bad-input.md"
    page.write_text("- **`steps`**: not an integer. ValueError:\n\n    `` `steps` ``\n")
    monkeypatch.setattr(catalogue_pages, "PAGES", [page])
    with pytest.raises(ValueError, match="an entry the catalogue cannot read"):
        catalogue_pages.entries()
    page.write_text("Some text.\n\n    `` `steps` must be ``\n")
    with pytest.raises(ValueError, match="a message without its entry"):
        catalogue_pages.entries()
