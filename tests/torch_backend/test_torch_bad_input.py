"""What gradaccum refuses on PyTorch, each with its fixed-form message: the entries of
the catalogue of bad inputs (docs/bad-input.md and docs/bad-input/) for `accumulate`,
`wrap`, `compile` and `fit`, character for character as on TensorFlow and JAX, and
what the torch step raises while it runs (a schedule's zero, a negative weight, a
non-finite gradient under `"raise"`)."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import torch
from largebatch import SCE, data, mlp

import gradaccum
from catalogue_pages import entries


def _mlp5():
    """The catalogue's model: 5 -> 8 -> 3."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


def _data5(n):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def _trainer(**kwargs):
    return gradaccum.wrap(_mlp5(), steps=kwargs.pop("steps", 2), **kwargs)


def _named(name):
    model = _mlp5()
    model.name = name
    return model


def _fit(trainer, loss=SCE, x=None, y=None):
    trainer.compile(optimizer="sgd", loss=loss)
    if x is None:
        x, y = _data5(8)
    return trainer.fit(x, y, batch_size=4, verbose=0)


def _under_another_backend(backend="numpy"):
    cached = gradaccum.__dict__.pop("accumulate", None)
    real = keras.backend.backend
    keras.backend.backend = lambda: backend
    try:
        gradaccum.accumulate  # noqa: B018 (the attribute's first use is the test)
    finally:
        keras.backend.backend = real
        if cached is not None:
            gradaccum.accumulate = cached


class Idle(keras.Model):
    """Its own train_step never hands gradients to an optimizer."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        return {}


class _Frozen(keras.Model):
    def __init__(self):
        super().__init__(name="frozen")
        self.dense = keras.layers.Dense(3, trainable=False)

    def call(self, x):
        return self.dense(x)


def _built(model):
    model(np.zeros((1, 5), "float32"))
    return model


class _SummingLoss(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return keras.ops.sum(keras.ops.square(y_true - y_pred), axis=-1)

    def __call__(self, y_true, y_pred, sample_weight=None):
        return keras.ops.mean(self.call(y_true, y_pred))


def _split_batch_dimensions():
    # After a first batch (Keras's symbolic build on the first one checks its shapes
    # itself); the catalogue's 8 samples, 7 targets.
    model = gradaccum.accumulate(_mlp5(), micro_batch_size=4)
    model.compile(optimizer="sgd", loss=SCE)
    x, y = _data5(8)
    model.train_on_batch(x, y)
    model.train_on_batch(x, y[:7])


# The catalogue's rows that run the same way on every backend, with the catalogue's
# inputs (tests/test_catalogue.py).
CASES = {
    "backend-unsupported": _under_another_backend,
    "accumulate-model": lambda: gradaccum.accumulate("model", steps=2),
    "accumulate-twice": lambda: gradaccum.accumulate(
        gradaccum.accumulate(_named("net"), steps=2), steps=2),
    "accumulate-steps": lambda: gradaccum.accumulate(_mlp5(), steps=0),
    "accumulate-partial": lambda: gradaccum.accumulate(_mlp5(), steps=2, partial="keep"),
    "accumulate-micro-batch-size": lambda: gradaccum.accumulate(_mlp5(), micro_batch_size=0),
    "accumulate-steps-and-weight-per-update": lambda: gradaccum.accumulate(
        _mlp5(), steps=[(0, 1), (2, 2)], weight_per_update=64),
    "accumulate-weight-per-update-and-micro-batch-size": lambda: gradaccum.accumulate(
        _mlp5(), weight_per_update=64, micro_batch_size=16),
    "accumulate-steps-and-micro-batch-size": lambda: gradaccum.accumulate(
        _mlp5(), steps=4, micro_batch_size=16),
    "accumulate-no-window": lambda: gradaccum.accumulate(_mlp5()),
    "accumulate-max-micro-batch-size": lambda: gradaccum.accumulate(
        _mlp5(), micro_batch_size=16, max_micro_batch_size=64),
    "accumulate-split-partial": lambda: gradaccum.accumulate(
        _mlp5(), micro_batch_size=16, partial="drop"),
    "fit-split-batch-dimensions": _split_batch_dimensions,
    "wrap-model": lambda: gradaccum.wrap("model", steps=2),
    "wrap-wrapped": lambda: gradaccum.wrap(_trainer(), steps=2),
    "wrap-steps": lambda: _trainer(steps=2.5),
    "wrap-steps-pairs": lambda: _trainer(steps=[(2, 2), (0, 1)]),
    "wrap-weight-per-update": lambda: gradaccum.wrap(_mlp5(), weight_per_update=-1),
    "wrap-weighting": lambda: _trainer(weighting="tokens"),
    "wrap-partial": lambda: _trainer(partial="keep"),
    "wrap-reduction": lambda: _trainer(reduction="avg"),
    "wrap-accumulator-dtype": lambda: _trainer(accumulator_dtype="int32"),
    "wrap-convert-batch-norm": lambda: _trainer(convert_batch_norm="yes"),
    "wrap-nonfinite": lambda: _trainer(nonfinite="ignore"),
    "wrap-moving-statistics": lambda: _trainer(moving_statistics="pooled"),
    "compile-optimizer-accumulates": lambda: _trainer().compile(
        optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2), loss=SCE),
    # (Keras's torch trainer builds the compiled loss on the first batch before the
    # state is made: targets of the predictions' shape.)
    "fit-no-trainable-variables": lambda: _fit(
        gradaccum.wrap(_built(_Frozen()), steps=2), loss="mse",
        x=np.zeros((8, 5), "float32"), y=np.zeros((8, 3), "float32")),
    "fit-exact-sum-loss": lambda: _fit(
        _trainer(), loss=keras.losses.MeanSquaredError(reduction="sum")),
    "fit-exact-custom-call-loss": lambda: _fit(_trainer(), loss=_SummingLoss(name="summing")),
    "fit-weighting-not-a-scalar": lambda: _fit(
        _trainer(weighting=lambda x, y, sw: torch.ones([2]))),
    "privacy-type": lambda: gradaccum.accumulate(
        _mlp5(), steps=2, privacy={"l2_norm_clip": 1.0}),
}


# {name: (error type, message)} of every entry of the catalogue.
ROWS = {name: (error, message) for name, error, message in entries()}


def test_every_case_is_a_row_of_the_catalogue():
    assert set(CASES) <= set(ROWS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_catalogue_row_on_torch(case):
    error, message = ROWS[case]
    expected = {"ValueError": ValueError, "ImportError": ImportError}[error]
    with pytest.raises(expected) as info:
        CASES[case]()
    assert str(info.value) == message


@pytest.mark.parametrize("value", [0, -1, 2.5, "8", True])
def test_invalid_micro_batch_size(value):
    for door in (gradaccum.accumulate, gradaccum.wrap):
        with pytest.raises(ValueError) as info:
            door(mlp(), micro_batch_size=value)
        assert str(info.value) == (
            '`micro_batch_size` must be an integer >= 1 or "auto". '
            f"Received: micro_batch_size={value!r}"
        )


@pytest.mark.parametrize("door", ["accumulate", "wrap"])
def test_every_option_is_checked_as_on_the_other_backends(door):
    make = getattr(gradaccum, door)
    cases = [
        (dict(steps=0), "`steps` must be an integer >= 1, a list of `(from_update, k)` pairs "
                        "or a callable `update_index -> int`. Received: steps=0"),
        (dict(steps=-3), "`steps` must be an integer >= 1, a list of `(from_update, k)` "
                         "pairs or a callable `update_index -> int`. Received: steps=-3"),
        (dict(steps=[]), "`steps` pairs must be a non-empty list of `(from_update, k)` "
                         "pairs. Received: steps=[]"),
        (dict(steps=[(2, 2)]), "`steps` pairs must start at update 0 (the first window's "
                               "length). Received: steps=[(2, 2)]"),
        (dict(steps=lambda i: True), "The `steps` callable must return an integer >= 1. "
                                     "Received: a value of dtype bool"),
        (dict(steps=2, partial="later"),
         "`partial` must be one of 'flush', 'carry', 'drop'. Received: partial='later'"),
        (dict(steps=2, reduction="max"),
         "`reduction` must be one of 'mean', 'sum'. Received: reduction='max'"),
        (dict(steps=2, weighting="tokens"),
         "`weighting` must be one of 'exact', 'uniform' or a callable (x, y, sample_weight) "
         "-> weight. Received: weighting='tokens'"),
        (dict(steps=2, nonfinite="ignore"),
         "`nonfinite` must be one of 'skip', 'raise', 'apply' or a callable gradients -> "
         "bool (True skips the micro-batch). Received: nonfinite='ignore'"),
        (dict(steps=2, accumulator_dtype="int32"),
         "`accumulator_dtype` must be a floating dtype, one of 'float16', 'bfloat16', "
         "'float32', 'float64'. Received: accumulator_dtype='int32'"),
        (dict(steps=2, moving_statistics="pooled"),
         "`moving_statistics` must be one of 'window', 'micro_batch'. "
         "Received: moving_statistics='pooled'"),
        (dict(weight_per_update=0),
         "`weight_per_update` must be a finite number > 0. Received: weight_per_update=0"),
        (dict(steps=2, weight_per_update=4),
         "`steps` and `weight_per_update` cannot be used together: a window closes after "
         "`steps` micro-batches or once its total weight reaches `weight_per_update`. "
         "Received: steps=2, weight_per_update=4"),
        (dict(micro_batch_size="auto", max_micro_batch_size=0),
         "`max_micro_batch_size` must be an integer >= 1. Received: max_micro_batch_size=0"),
        (dict(micro_batch_size=8, partial="carry"),
         "`partial` must be 'flush' with `micro_batch_size`: each batch is one window, so "
         "no window is ever left partial at the end of the data. Received: partial='carry'"),
        (dict(micro_batch_size="auto", weighting="uniform"),
         '`weighting` must be "exact" or a callable, and `reduction` "mean", with '
         'micro_batch_size="auto": "auto" changes the split, which must not change the '
         "update. Received: weighting='uniform', reduction='mean'"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError) as info:
            make(mlp(), **options)
        assert str(info.value) == message, options


def test_a_models_own_train_step_with_split_mode():
    class Stepper(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    model = Stepper([keras.Input((6,)), keras.layers.Dense(3)], name="stepper")
    with pytest.raises(ValueError) as info:
        gradaccum.accumulate(model, micro_batch_size=8)
    assert str(info.value) == (
        "On Keras's PyTorch backend a model's own `train_step` accumulates with `steps` "
        "(each batch is a micro-batch); split mode runs Keras's default step. Received: "
        "micro_batch_size=8 for model 'stepper' of class Stepper, which defines its own "
        "`train_step`."
    )


def test_a_train_step_that_hands_no_gradients_to_an_optimizer():
    # The rule of the catalogue's row `accumulate-step-without-optimizer`, in the
    # torch step's words (its optimizer call is `self.optimizer.apply`), as on JAX.
    model = gradaccum.accumulate(Idle(), steps=2)
    with pytest.raises(ValueError) as info:
        _fit(model)
    assert str(info.value) == (
        "The train_step of Idle must hand its gradients to the model's optimizer "
        "(`self.optimizer.apply(grads, variables)`) for gradaccum to accumulate them. "
        "Received: a step that did not call it, so nothing would be trained."
    )
    assert str(info.value).startswith(
        ROWS["accumulate-step-without-optimizer"][1].split(" to an optimizer")[0])


# Schedules ----------------------------------------------------------------------------


def test_a_schedule_callable_of_zero_or_a_float():
    with pytest.raises(ValueError) as info:
        gradaccum.accumulate(mlp(), steps=lambda i: i * 0)
    assert str(info.value) == (
        "The `steps` callable must return an integer >= 1. Received: 0 for update_index=0")
    with pytest.raises(ValueError) as info:
        gradaccum.accumulate(mlp(), steps=lambda i: keras.ops.cast(i, "float32") + 1.5)
    assert str(info.value) == (
        "The `steps` callable must return an integer >= 1. Received: a value of dtype float32")
    with pytest.raises(ValueError) as info:
        gradaccum.accumulate(mlp(), steps=lambda i: 1.5)
    assert str(info.value) == (
        "The `steps` callable must return an integer >= 1. Received: a value of dtype float32")


def test_a_schedule_callable_may_use_a_python_if_on_torch():
    # The step runs eagerly: the callable gets the update index as a Python int.
    seen = []

    def ramp(update_index):
        seen.append(update_index)
        return 1 if update_index < 2 else 4

    x, y = data(24)
    model = gradaccum.accumulate(mlp(), steps=ramp)
    model.compile(keras.optimizers.SGD(0.5), SCE)
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    # Windows of 1, 1, then 4: six micro-batches make three updates.
    assert history.history["updates"] == [3.0]
    assert all(type(i) is int for i in seen)


def test_a_schedule_that_later_returns_zero_raises_at_its_window():
    x, y = data(24)
    model = gradaccum.accumulate(mlp(), steps=lambda i: 2 if i < 2 else 0)
    model.compile("sgd", SCE)
    with pytest.raises(ValueError) as info:
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert str(info.value) == (
        "The `steps` callable must return an integer >= 1. Received: 0 for update_index=2")
    # The two windows before it were applied; the third never opened.
    assert int(model.optimizer.iterations) == 2


def test_a_schedule_written_with_keras_ops_that_later_returns_zero():
    x, y = data(24)
    model = gradaccum.accumulate(mlp(), steps=lambda i: keras.ops.where(i < 2, 2, 0))
    model.compile("sgd", SCE)
    with pytest.raises(ValueError, match=re.escape(
        "The `steps` callable must return an integer >= 1. Received: "
    )) as info:
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert str(info.value).endswith(" for update_index=2")


# Weights and non-finite gradients while fit runs -------------------------------------------


@pytest.mark.parametrize("weight", [-1.0, float("nan")], ids=["negative", "nan"])
def test_a_negative_weight_from_the_weighting_callable(weight):
    x, y = data(24)
    model = gradaccum.accumulate(mlp(), steps=2, weighting=lambda x, y, sw: weight)
    model.compile("sgd", SCE)
    with pytest.raises(ValueError) as info:
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert str(info.value) == (
        "The `weighting` callable must return a weight >= 0. Received: a negative or nan "
        "weight for micro-batch 1 of its window (it was accumulated with weight 0)."
    )
    assert int(model.optimizer.iterations) == 0


def test_a_weighting_callable_of_a_torch_tensor_is_a_weight():
    # A torch scalar computed from the batch (its tensors are torch's) is a weight.
    x, y = data(24)
    seen = []

    def weight(x, y, sw):
        seen.append(type(x))
        return torch.ones(()) * x.shape[0]

    model = gradaccum.accumulate(mlp(), steps=2, weighting=weight)
    model.compile("sgd", SCE)
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert history.history["updates"] == [3.0]
    assert history.history["window_weight"] == [8.0]
    assert set(seen) == {torch.Tensor}


def test_nonfinite_raise_in_fit_names_the_micro_batch():
    # Batches of 4, steps=2: sample 13 is in micro-batch 4, the second of window 2.
    x, y = data(24)
    bad = x.copy()
    bad[13, 0] = np.nan
    model = gradaccum.accumulate(mlp(), steps=2, nonfinite="raise")
    model.compile(keras.optimizers.SGD(0.5), SCE)
    with pytest.raises(FloatingPointError) as info:
        model.fit(bad, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert str(info.value) == (
        "gradaccum: a gradient is not finite (inf or nan) in micro-batch 4 (counted from "
        "1; the micro-batch 2 of its window): nonfinite=raise stops here. Check the data "
        "and the loss of that micro-batch, or use nonfinite=skip to drop it."
    )
    # The first window was applied; the second's bad micro-batch never reached the
    # weights.
    assert int(model.optimizer.iterations) == 1
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_nonfinite_raise_in_train_on_batch():
    x, y = data(4)
    x[0, 0] = np.inf
    model = gradaccum.accumulate(mlp(), steps=2, nonfinite="raise")
    model.compile(keras.optimizers.SGD(0.5), SCE)
    with pytest.raises(FloatingPointError, match=re.escape(
        "in micro-batch 1 (counted from 1; the micro-batch 1 of its window)"
    )):
        model.train_on_batch(x, y)


# Names that run on TensorFlow only --------------------------------------------------------


@pytest.mark.parametrize("name", ["CountingCrossDeviceOps", "BatchNormalization"])
def test_tensorflow_only_names_say_where_they_run(name):
    gradaccum.__dict__.pop(name, None)
    with pytest.raises(ImportError) as info:
        getattr(gradaccum, name)
    assert str(info.value).startswith(
        f"gradaccum.{name} runs on Keras's TensorFlow backend. Received: "
        "keras.backend.backend()='torch'."
    )
