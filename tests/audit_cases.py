"""`gradaccum.audit` on any backend: imported by tests/test_audit.py (TensorFlow) and
tests/jax_backend/test_jax_audit.py (JAX), which Keras runs in processes of their own."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest

import gradaccum

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), np.arange(n) % 2


def mlp(*middle, seed=0, compiled=True):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              *middle, keras.layers.Dense(2)])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32")
                       for w in model.get_weights()])
    if compiled:
        model.compile(keras.optimizers.Adam(0.01), SCE, metrics=["accuracy"])
    return model


def everything(model):
    """Every value the audit must leave as it was: the weights (batch statistics and
    random seeds among them) and the optimizer's state. (Compiled metrics start
    again, as at each `fit`.)"""
    variables = list(model.variables) + list(model.optimizer.variables)
    return [np.array(v.numpy()) for v in variables]


class SumPenalty(keras.layers.Layer):
    """An activity penalty summed over the batch."""

    def call(self, h):
        self.add_loss(0.01 * keras.ops.sum(keras.ops.square(h)))
        return h


class MeanPenalty(keras.layers.Layer):
    """The same penalty averaged per sample."""

    def call(self, h):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.sum(keras.ops.square(h), axis=-1)))
        return h


class OwnComputeLoss(keras.Sequential):
    """A model that adds a weight penalty in its own `compute_loss`."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
        loss = super().compute_loss(x, y, y_pred, sample_weight, **kwargs)
        penalty = sum(keras.ops.sum(keras.ops.square(w)) for w in self.trainable_weights)
        return loss + 1e-3 * penalty


def test_a_model_without_causes_is_exact_and_left_as_it_was():
    x, y = data()
    model = mlp()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # moments != 0
    before = everything(model)
    report = gradaccum.audit(model, x, y, steps=4, batch_size=8)
    assert report.exact
    assert report.max_difference < 1e-5
    assert report.causes == []
    assert report.micro_batch_sizes == [8, 8, 8, 8]
    assert [row[0] for row in report.rows] == [v.path for v in model.trainable_variables]
    assert all(row[2] > 0 for row in report.rows)
    for a, b in zip(everything(model), before):
        np.testing.assert_array_equal(a, b)
    text = str(report)
    assert "exact (rounding noise)" in text and "Causes: none." in text
    assert model.trainable_variables[0].path in text
    # The model trains as before afterwards (no accumulation left attached).
    assert gradaccum.attach.accumulation_of(model) is None
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 8


def test_a_batch_normalization_that_cannot_follow_the_window_is_named_so():
    x, y = data()
    model = mlp(keras.layers.BatchNormalization(renorm=True, name="renormed"))
    report = gradaccum.audit(model, x, y, steps=4, batch_size=8)
    assert report.causes[0].startswith("BatchNormalization layer 'renormed'")
    assert report.causes[0].endswith(
        "Its moving statistics move per micro-batch too: it cannot follow the window "
        "(`renorm=True` moves its renorm statistics too and corrects every micro-batch "
        "with them).")


def test_dropout_and_batch_normalization_are_named():
    x, y = data()
    model = mlp(keras.layers.BatchNormalization(name="norm"),
                keras.layers.Dropout(0.3, name="drop"))
    before = everything(model)
    report = gradaccum.audit(model, x, y, steps=4, batch_size=8)
    assert not report.exact
    assert report.max_difference > 1e-2
    assert len(report.causes) == 2
    assert report.causes[0].startswith("BatchNormalization layer 'norm': each micro-batch")
    assert report.causes[0].endswith(
        "Its moving statistics follow the window (moved once per update from the pooled "
        "statistics, as the large batch moves them); the forward pass is the one "
        "difference left.")
    assert report.causes[1].startswith("Dropout layer 'drop': draws its random numbers")
    assert "NOT exact" in str(report) and "- Dropout layer 'drop'" in str(report)
    # The batch statistics and the dropout seed are put back too.
    for a, b in zip(everything(model), before):
        np.testing.assert_array_equal(a, b)


def test_a_loss_term_summed_over_the_batch_is_named():
    x, y = data()
    summed = gradaccum.audit(mlp(SumPenalty(name="penalty")), x, y, steps=4, batch_size=8)
    assert not summed.exact
    assert summed.causes == [
        "A loss term of layer 'penalty' (`add_loss`) is summed over the batch, not "
        "averaged per sample: the large batch's term is the sum of the micro-batches', "
        "and accumulation averages them. Divide it by the batch size."
    ]
    averaged = gradaccum.audit(mlp(MeanPenalty(name="penalty")), x, y, steps=4, batch_size=8)
    assert averaged.exact and averaged.causes == []


def test_uniform_weighting_with_unequal_micro_batches_is_named():
    x, y = data(30)  # micro-batches of 8, 8, 8 and 6
    uniform = gradaccum.audit(mlp(), x, y, steps=4, batch_size=8, weighting="uniform")
    assert not uniform.exact
    assert uniform.micro_batch_sizes == [8, 8, 8, 6]
    assert uniform.causes == [UNIFORM.format("8, 8, 8, 6")]
    exact = gradaccum.audit(mlp(), x, y, steps=4, batch_size=8)
    assert exact.exact and exact.causes == []


UNIFORM = (
    "weighting='uniform' (micro-batches of {} samples): each micro-batch counts the "
    "same, which is exact only where every micro-batch's loss normalizer (its samples, "
    "unmasked tokens or sample weights) is equal; weighting='exact' weighs them by their "
    "normalizers."
)


def test_uniform_weighting_with_unequal_normalizers_is_named():
    # Micro-batches of 8 samples each, whose sample weights sum differently: the
    # normalizers of reduction "mean_with_sample_weight" differ.
    x, y = data()
    weights = np.repeat([0.5, 1.0, 2.0, 4.0], 8).astype("float32")
    model = mlp(compiled=False)
    model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"))
    uniform = gradaccum.audit(model, x, y, sample_weight=weights, steps=4, batch_size=8,
                              weighting="uniform")
    assert not uniform.exact and uniform.causes == [UNIFORM.format("8, 8, 8, 8")]
    exact = gradaccum.audit(model, x, y, sample_weight=weights, steps=4, batch_size=8)
    assert exact.exact and exact.causes == []


def test_layers_without_random_draws_are_not_named_and_listed_generators_are():
    x = np.random.default_rng(0).normal(size=(32, 3, 4)).astype("float32")
    y = np.arange(32) % 2
    model = keras.Sequential([keras.Input((3, 4)), keras.layers.LSTM(4, dropout=0.0),
                              keras.layers.Dropout(0.0), keras.layers.Dense(2)])
    model.compile(keras.optimizers.Adam(0.01), SCE)
    report = gradaccum.audit(model, x, y, steps=4, batch_size=8)
    assert report.exact and report.causes == [], str(report)
    noisy = mlp(ListedNoise(name="noise"))
    listed = gradaccum.audit(noisy, *data(), steps=4, batch_size=8)
    assert not listed.exact
    assert listed.causes == [
        "ListedNoise layer 'noise': draws its random numbers for each micro-batch apart, "
        "not those the large batch draws; the accumulated gradient is the large batch's "
        "in expectation only."
    ]


class ListedNoise(keras.layers.Layer):
    """Noise from a seed generator kept in a list attribute."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generators = [keras.random.SeedGenerator(3)]

    def call(self, h, training=False):
        if training:
            h = h + keras.random.normal(keras.ops.shape(h), seed=self.generators[0])
        return h


def test_mixed_precision_is_measured_against_its_own_rounding():
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    try:
        x, y = data()
        report = gradaccum.audit(mlp(), x, y, steps=4, batch_size=8)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert report.tolerance == 5e-2
    assert report.exact and report.causes == [], str(report)


def test_a_skipped_micro_batch_is_named():
    x, y = data()
    x[9, 0] = np.nan  # in the second micro-batch
    report = gradaccum.audit(mlp(), x, y, steps=4, batch_size=8)
    assert not report.exact
    # The window as one batch is skipped once, and the second micro-batch.
    # In the words fit warns with.
    assert report.causes == [
        "gradaccum skipped 2 micro-batch(es) whose gradient is not finite (inf or "
        "nan): each is dropped with its weight and counted in `skipped` (in fit's logs "
        "too; nonfinite='skip'). Pass nonfinite='raise' to stop at the first, or "
        "nonfinite='apply' for Keras's behaviour."
    ]


def test_sample_weights_and_an_own_compute_loss_are_exact():
    x, y = data()
    weights = np.linspace(0.2, 2.0, len(x)).astype("float32")
    model = OwnComputeLoss([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                            keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), SCE)
    report = gradaccum.audit(model, x, y, sample_weight=weights, steps=4, batch_size=8)
    assert report.exact, str(report)


@pytest.mark.parametrize("case, message", [
    ("batch_size", "`batch_size` must be at most the number of samples audited. Received: "
                   "batch_size=64 for 32 samples"),
    ("steps", "`steps` must be an integer >= 1. Received: steps=0"),
    ("not_compiled", "`model` must be compiled (its loss and optimizer are what the audit "
                     "runs). Received: model"),
    ("accumulated", "`model` must be audited before `gradaccum.accumulate` (the audit runs "
                    "its own accumulation). Received: model"),
    ("weighting", "`weighting` must be one of"),
    ("too_few", "`steps` micro-batches of `batch_size` samples must fit in the data "
                "audited. Received: steps=8, batch_size=8 for 32 samples (4 micro-batches)"),
    ("dataset", "`x` must be arrays the audit can slice into micro-batches (numpy arrays "
                "or tensors, dicts or lists of them, a list of strings). Received: x of "
                "type generator"),
])
def test_bad_input_is_refused(case, message):
    x, y = data()
    model = mlp(compiled=case != "not_compiled")
    kwargs = dict(steps=4, batch_size=8)
    if case == "batch_size":
        kwargs["batch_size"] = 64
    if case == "steps":
        kwargs["steps"] = 0
    if case == "accumulated":
        gradaccum.accumulate(model, steps=2)
    if case == "weighting":
        kwargs["weighting"] = "by_size"
    if case == "too_few":
        kwargs["steps"] = 8
    if case == "dataset":
        x = (row for row in x)
    with pytest.raises(ValueError, match=re.escape(message)):
        gradaccum.audit(model, x, y, **kwargs)


def test_a_keras_hub_task_on_strings_is_exact():
    import hub_models

    task = hub_models.make_task(seed=0)
    before = [w.copy() for w in task.get_weights()]
    report = gradaccum.audit(task, hub_models.make_texts(), steps=3, batch_size=4)
    assert report.exact, str(report)
    assert report.causes == []
    assert len(report.rows) == len(task.trainable_variables)
    for a, b in zip(task.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    assert int(task.optimizer.iterations) == 0
