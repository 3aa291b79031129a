"""float8 training and every `overwrite_with_gradient` variable through accumulation
(issue 55), on every backend: a small transformer block in float8 (`EinsumDense` and
`Dense`, `model.quantize("float8")`) trained by `accumulate` equals plain Keras
trained on the windows as one batch (weights, scales and amax histories); the window
keeps the maximum of a variable's values (Keras's own rule) in a custom loop, for a
variable a user marks, through a save in the middle of a window; what cannot be exact
is refused or warned, naming the variables."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
from largebatch import KerasIoStep

import gradaccum

BACKEND = keras.backend.backend()
SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def block(bias: bool = False, seed: int = 0) -> keras.Model:
    """A transformer block's projections in float8: an `EinsumDense` projection, a
    residual MLP of two `Dense`, a pooled `Dense` head. (`bias`: Keras's float8
    `Dense` rounds its bias's gradient to bfloat16 each step.)"""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 8))
    q = keras.layers.EinsumDense("btd,dh->bth", output_shape=(None, 8),
                                 bias_axes="h" if bias else None, name="q")(inputs)
    h = keras.layers.Dense(16, activation="relu", use_bias=bias, name="up")(q)
    h = keras.layers.Dense(8, use_bias=bias, name="down")(h)
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.Add()([inputs, h]))
    model = keras.Model(inputs, keras.layers.Dense(3, use_bias=bias, name="head")(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Add and the pooling have no float8 mode
        model.quantize("float8")
    return model


def block_data(n: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = (3 * rng.normal(size=(n, 6, 8))).astype("float32")
    return x, rng.integers(0, 3, size=(n,)).astype("int32")


def values(model) -> dict:
    return {v.path: keras.ops.convert_to_numpy(v) for v in model.weights}


def gaps(model, reference) -> dict:
    """Per variable: the largest difference over the reference's largest value."""
    mine, theirs = values(model), values(reference)
    return {path: float(np.max(np.abs(mine[path] - value)) / (np.max(np.abs(value)) or 1.0))
            for path, value in theirs.items()}


def assert_exact(model, reference) -> None:
    """Every variable within 1e-5 of the reference's largest value (`gaps`)."""
    gap = gaps(model, reference)
    assert max(gap.values()) < 1e-5, {p: g for p, g in gap.items() if g >= 1e-5}


def float8_paths(model) -> list:
    return [v.path for v in model.trainable_variables if v.overwrite_with_gradient]


def plain_fit(batch_size, epochs=2, bias=False, optimizer=None, n=64):
    x, y = block_data(n)
    model = block(bias)
    model.compile(optimizer or keras.optimizers.Adam(1e-2), SCE)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("mode", ["steps", "split"])
def test_a_float8_block_trains_as_the_large_batch(mode):
    # Windows of 2 micro-batches of 8 against plain Keras at 16, 2 epochs of 64.
    # At 44e53bb the inputs' amax history ended at 1.594 against 23.25 and the
    # kernels were 0.7 off: the values were weighted and summed as gradients.
    x, y = block_data()
    model = block()
    if mode == "steps":
        gradaccum.accumulate(model, steps=2)
        batch_size = 8
    else:
        gradaccum.accumulate(model, micro_batch_size=8)
        batch_size = 16
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    assert not fit_warned(model, x, y, batch_size=batch_size, epochs=2)
    reference = plain_fit(16)
    assert_exact(model, reference)
    histories = values(model)
    for path in float8_paths(model):
        if path.endswith("amax_history"):
            assert np.max(histories[path]) > 0, path  # measured, not left at zero
    assert int(model.optimizer.iterations) == 8


def test_a_flushed_partial_window_measures_its_own_gradient():
    # 40 samples in micro-batches of 8 at steps=2: windows of 16, 16 and 8 per
    # epoch. The last window's loss is its own (the epoch's length says how much
    # is left), so its output-gradient amax is the one a batch of 8 measures.
    x, y = block_data(40)
    model = gradaccum.accumulate(block(), steps=2, partial="flush")
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    reference = block()
    reference.compile(keras.optimizers.Adam(1e-2), SCE)
    for _ in range(2):
        for start, end in ((0, 16), (16, 32), (32, 40)):
            reference.train_on_batch(x[start:end], y[start:end])
    assert_exact(model, reference)
    assert int(model.optimizer.iterations) == 6


def batches(x, y, size):
    """A generator of `(x, y)` batches: data whose length `fit` cannot know."""

    def generate():
        for start in range(0, len(x), size):
            yield x[start:start + size], y[start:start + size]

    return generate()


def float8_warnings(caught) -> list:
    return [str(w.message) for w in caught if "this float8 model" in str(w.message)]


def fit_warned(model, *args, **kwargs) -> list:
    """`model.fit(*args, **kwargs)` in order; the float8 warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(*args, shuffle=False, verbose=0, **kwargs)
    return float8_warnings(caught)


def test_a_partial_window_flushed_at_an_unknown_end_is_warned():
    # 40 samples from a generator in micro-batches of 8 at steps=2: the last window
    # holds one micro-batch, whose loss the step divided by the full window's
    # weight (nothing says the data ends), so float8 quantized half its gradient.
    # Before the fix nothing said so (the first layer's output-gradient history
    # ended 3.6x the large batch's in the review's MLP).
    x, y = block_data(40)
    model = gradaccum.accumulate(block(), steps=2, partial="flush")
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    found = fit_warned(model, batches(x, y, 8))
    assert len(found) == 1, found
    assert "at an end `fit` did not know" in found[0]
    assert 'partial="drop"' in found[0]
    assert int(model.optimizer.iterations) == 3  # flushed all the same


@pytest.mark.parametrize("partial", ["drop", "carry"])
def test_an_unknown_end_that_flushes_nothing_is_not_warned(partial):
    x, y = block_data(40)
    model = gradaccum.accumulate(block(), steps=2, partial=partial)
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    assert not fit_warned(model, batches(x, y, 8))
    assert int(model.optimizer.iterations) == 2


def test_a_generator_of_whole_windows_is_exact_and_not_warned():
    # The same generator, 32 samples: every window is whole, so the unknown length
    # costs nothing and nothing is said.
    x, y = block_data(32)
    model = gradaccum.accumulate(block(), steps=2, partial="flush")
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    assert not fit_warned(model, batches(x, y, 8))
    assert_exact(model, plain_fit(16, epochs=1, n=32))


def test_a_scheduled_window_flushed_at_a_known_end_is_exact():
    # A schedule (windows of 2, then 3 from the second update) over 5 micro-batches
    # of 8 per epoch: windows of 2 and 3, then the next epoch's 3 and 2 (the last
    # one flushed, shortened by the epoch's known end). The step divides by what
    # is left of the epoch as it does for a constant `steps`.
    x, y = block_data(40)
    model = gradaccum.accumulate(block(), steps=[(0, 2), (1, 3)], partial="flush")
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    assert not fit_warned(model, x, y, batch_size=8, epochs=2)
    reference = block()
    reference.compile(keras.optimizers.Adam(1e-2), SCE)
    for start, end in ((0, 16), (16, 40), (0, 24), (24, 40)):
        reference.train_on_batch(x[start:end], y[start:end])
    assert_exact(model, reference)
    assert int(model.optimizer.iterations) == 4


def test_a_weight_budget_passed_is_warned():
    # A budget of 20 samples over micro-batches of 8: each window closes at 24,
    # while its micro-batches' losses were divided by 20.
    x, y = block_data(48)
    model = gradaccum.accumulate(block(), weight_per_update=20)
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    found = fit_warned(model, x, y, batch_size=8)
    assert len(found) == 1 and "`weight_per_update`" in found[0], found
    assert "different weights" not in found[0]  # a budget divides each by itself


def test_a_weight_budget_met_exactly_is_exact_and_not_warned():
    x, y = block_data(48)
    model = gradaccum.accumulate(block(), weight_per_update=24)
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    assert not fit_warned(model, x, y, batch_size=8)
    assert_exact(model, plain_fit(24, epochs=1, n=48))


def test_a_skipped_micro_batch_in_a_float8_window_is_warned():
    # The second micro-batch of the first window is not finite: the first one's
    # loss was divided by the weight of two.
    x, y = block_data(32)
    x[8:16] = np.nan
    model = gradaccum.accumulate(block(), steps=2)
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    found = fit_warned(model, x, y, batch_size=8)
    assert len(found) == 1 and "skipped a micro-batch" in found[0], found
    assert int(model.optimizer.iterations) == 2


def test_a_micro_batch_skipped_first_in_its_window_is_exact_and_not_warned():
    # Window 2 of steps=3 starts with a micro-batch that is not finite: the two
    # after it are divided by the weight of two, the window's.
    x, y = block_data(48)
    x[24:32] = np.nan
    model = gradaccum.accumulate(block(), steps=3)
    model.compile(keras.optimizers.SGD(0.1), SCE)
    assert not fit_warned(model, x, y, batch_size=8)
    reference = block()
    reference.compile(keras.optimizers.SGD(0.1), SCE)
    reference.train_on_batch(x[:24], y[:24])
    reference.train_on_batch(x[32:], y[32:])
    assert_exact(model, reference)


def test_data_that_ends_before_steps_per_epoch_is_warned():
    # A generator of 5 micro-batches under steps_per_epoch=6 (Keras says the data
    # ran out): the last window, 2 of steps=3, expected a third.
    x, y = block_data(40)
    model = gradaccum.accumulate(block(), steps=3, partial="flush")
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    found = fit_warned(model, batches(x, y, 8), steps_per_epoch=6)
    assert len(found) == 1 and "before the epoch's length" in found[0], found


def test_split_mode_with_a_smaller_last_micro_batch_is_exact_and_not_warned():
    # Batches of 16 in micro-batches of 5: 5, 5, 5 and 1. At 5f45ba7 the last one's
    # loss was divided by 28 (its size taken for the split's), 4e-3 off on
    # TensorFlow, and warned as micro-batches of different weights.
    x, y = block_data(48)
    model = gradaccum.accumulate(block(), micro_batch_size=5)
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    assert not fit_warned(model, x, y, batch_size=16)
    assert_exact(model, plain_fit(16, epochs=1, n=48))


def test_a_later_fit_of_whole_windows_is_not_warned_for_an_earlier_one():
    # The first fit's budget is passed (warned); the flag is the fit's, so a later
    # fit whose windows meet the budget exactly is silent.
    x, y = block_data(48)
    model = gradaccum.accumulate(block(), weight_per_update=20)
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    assert fit_warned(model, x, y, batch_size=8)
    gradaccum.disable(model)
    model = gradaccum.accumulate(model, weight_per_update=16)
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    assert not fit_warned(model, x[:32], y[:32], batch_size=8)


def test_what_is_not_float8_or_not_divided_is_not_warned_as_float8():
    # A variable a user marks (no float8 quantization: dividing the loss is
    # exact), and a model's own train_step (warned of its own float8 rule, never
    # divided), each over a generator that ends in a partial window.
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(40, 6)).astype("float32"), rng.integers(0, 3, (40,))
    model = gradaccum.accumulate(peaked(), steps=2)
    model.compile(keras.optimizers.SGD(0.1), SCE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the marked variable is named
        assert not fit_warned(model, batches(x, y, 8))
    x, y = block_data(40)
    own = gradaccum.accumulate(OwnStep(), steps=2)
    own.compile(keras.optimizers.Adam(1e-2), SCE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not fit_warned(own, batches(x, y, 8))


def tokens(seed: int = 0) -> keras.Model:
    """A masked token model in float8: `Embedding(mask_zero=True)` and two float8
    `Dense` applied per token (the loss is averaged over the unmasked tokens)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8, mask_zero=True, name="emb")(inputs)
    h = keras.layers.Dense(16, activation="relu", use_bias=False, name="up")(h)
    model = keras.Model(inputs, keras.layers.Dense(3, use_bias=False, name="head")(h))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.quantize("float8")
    return model


def test_micro_batches_of_other_weights_measure_the_windows_gradient_and_warn():
    # A window of 2 micro-batches of 8 rows: 2 tokens per row, then 6 (weights 16
    # and 48). Each micro-batch's output-gradient amax is taken in the window's
    # units, so the histories are the large batch's (without, the first window's
    # were twice it); the first micro-batch's loss was divided by the weight
    # expected then (32, not 64), which fit warns of.
    rng = np.random.default_rng(0)
    x = rng.integers(1, 20, size=(16, 6)).astype("int32")
    x[:8, 2:] = 0
    y = rng.integers(0, 3, size=(16, 6)).astype("int32")
    model = gradaccum.accumulate(tokens(), steps=2)
    model.compile(keras.optimizers.SGD(0.1), SCE)
    with pytest.warns(UserWarning, match="held micro-batches of different weights"):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    reference = tokens()
    reference.compile(keras.optimizers.SGD(0.1), SCE)
    reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert_exact(model, reference)
    assert np.max(values(model)["head/outputs_grad_amax_history"]) > 0


def test_float8_biases_follow_the_large_batch_to_bfloat16():
    # Keras's float8 Dense adds its bias through bfloat16, so each step's bias
    # gradient is rounded to 8 significant bits: a window's is the sum of its
    # micro-batches' rounded parts, the large batch's one rounding of the sum (at
    # most 2^-8 apart). One window of SGD from zero biases shows it bare: the
    # biases are within bfloat16's rounding, everything else is exact.
    x, y = block_data(16)
    model = gradaccum.accumulate(block(bias=True), steps=2)
    model.compile(keras.optimizers.SGD(0.1), SCE)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    reference = plain_fit(16, epochs=1, bias=True, optimizer=keras.optimizers.SGD(0.1), n=16)
    gap = gaps(model, reference)
    biases = {p: g for p, g in gap.items() if p.endswith("bias")}
    others = {p: g for p, g in gap.items() if not p.endswith("bias")}
    assert max(biases.values()) < 2.0**-7, biases
    assert max(others.values()) < 1e-5, others


@pytest.mark.skipif(BACKEND != "jax", reason="Keras's own rule, the same on every "
                    "backend: measured once (the suite's time budget)")
def test_keras_own_accumulation_is_not_the_large_batch_on_float8():
    # What the test above rules out, measured on the same block: Keras's
    # `gradient_accumulation_steps` keeps the micro-batches' output-gradient amax
    # (each micro-batch's loss, twice the large batch's gradient here).
    builtin = plain_fit(8, optimizer=keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2))
    gap = gaps(builtin, plain_fit(16))
    assert max(g for p, g in gap.items() if "outputs_grad" in p) > 0.5


# A model's own train_step ---------------------------------------------------------------------


class OwnStep(KerasIoStep):
    """The float8 block with its own train_step in keras.io's pattern for its
    backend."""

    def __init__(self):
        super().__init__()
        self.inner = block()

    def call(self, x, training=False):
        return self.inner(x, training=training)


def test_an_own_train_step_is_warned_naming_the_output_gradient_variables():
    x, y = block_data(32)
    model = gradaccum.accumulate(OwnStep(), steps=2)
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    with pytest.warns(UserWarning, match=r"own `train_step`.*'q/outputs_grad_scale'"):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    reference = plain_fit(16, epochs=1, n=32)
    # What the forward pass measures is the window's: the first layer's inputs.
    mine, theirs = values(model), values(reference)
    np.testing.assert_array_equal(mine["q/inputs_amax_history"],
                                  theirs["q/inputs_amax_history"])
    assert int(model.optimizer.iterations) == 2


# A variable a user marks overwrite_with_gradient -------------------------------------------


class Peak(keras.layers.Layer):
    """Passes its inputs through and keeps the largest |input| of the last batch in
    `peak`, a variable whose "gradient" is its new value (the rule float8 follows)."""

    def build(self, input_shape):
        self.peak = self.add_weight(shape=(), initializer="zeros", name="peak",
                                    overwrite_with_gradient=True)

    def call(self, inputs, training=False):
        @keras.ops.custom_gradient
        def through(x, peak):
            new = keras.ops.max(keras.ops.abs(x)) if training else None

            def grad(*args, upstream=None, variables=None):
                if upstream is None:
                    (upstream,) = args
                return upstream, new

            return x, grad

        return through(inputs, keras.ops.convert_to_tensor(self.peak))


def peaked(seed: int = 0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    h = Peak(name="peak")(keras.layers.Dense(8, name="hidden")(inputs))
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(h))


def test_a_variable_the_user_marks_keeps_the_windows_maximum_and_is_named():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(24, 6)).astype("float32")
    x[13] *= 40  # the largest input sits in the second micro-batch of window 2
    y = rng.integers(0, 3, size=(24,)).astype("int32")
    model = gradaccum.accumulate(peaked(), steps=3)
    model.compile(keras.optimizers.SGD(0.1), SCE)
    with pytest.warns(UserWarning, match=r"maximum of the values of variable\(s\) 'peak/peak'"):
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    reference = peaked()
    reference.compile(keras.optimizers.SGD(0.1), SCE)
    reference.fit(x, y, batch_size=12, shuffle=False, verbose=0)
    gap = gaps(model, reference)
    assert max(gap.values()) < 1e-5, gap
    assert float(model.get_layer("peak").peak) > 5.0


def test_privacy_refuses_float8_naming_its_variables():
    x, y = block_data(16)
    model = gradaccum.accumulate(block(), steps=2, privacy=gradaccum.Privacy(1.0, 0.0, seed=1))
    model.compile(keras.optimizers.SGD(0.1), SCE)
    with pytest.raises(ValueError, match=r"`privacy` cannot train.*'q/inputs_scale'"):
        model.fit(x, y, batch_size=8, verbose=0)


# A custom loop ----------------------------------------------------------------------------


def _loop_updates(values, steps, optimizer):
    """A custom loop in the backend's keras.io pattern: one marked variable and one
    ordinary one, given `values` as the marked one's gradient micro-batch by micro-
    batch (the ordinary one's is 1.0). Returns both variables after."""
    marked = keras.Variable(0.0, name="marked")
    marked.overwrite_with_gradient = True
    ordinary = keras.Variable(0.0, name="ordinary")
    variables = [marked, ordinary]
    acc = gradaccum.GradientAccumulator(variables, steps=steps)
    optimizer.build(variables)
    if BACKEND == "jax":
        trainable = [v.value for v in variables]
        opt_vars = [v.value for v in optimizer.variables]
        acc_vars = [v.value for v in acc.variables]
        for value in values:
            grads = [keras.ops.convert_to_tensor(value), keras.ops.convert_to_tensor(1.0)]
            trainable, opt_vars, acc_vars = acc.stateless_step(
                optimizer, grads, trainable, opt_vars, acc_vars, weight=1.0)
        return [float(t) for t in trainable]
    for value in values:
        grads = [keras.ops.convert_to_tensor(value), keras.ops.convert_to_tensor(1.0)]
        acc.step(optimizer, grads, weight=1.0)
    return [float(keras.ops.convert_to_numpy(v)) for v in variables]


def _keras_updates(values, steps):
    marked = keras.Variable(0.0, name="marked")
    marked.overwrite_with_gradient = True
    ordinary = keras.Variable(0.0, name="ordinary")
    optimizer = keras.optimizers.SGD(0.5, gradient_accumulation_steps=steps)
    for value in values:
        optimizer.apply([keras.ops.convert_to_tensor(value), keras.ops.convert_to_tensor(1.0)],
                        [marked, ordinary])
    return [float(keras.ops.convert_to_numpy(marked)), float(keras.ops.convert_to_numpy(ordinary))]


@pytest.mark.parametrize("values", [[1.0, 2.0], [2.0, 1.0], [1.0, 2.0, 3.0, 0.5]])
def test_a_custom_loop_keeps_the_maximum_as_keras_does(values):
    # At 44e53bb the accumulator averaged the values (1.5 for 1 and 2); Keras's
    # own accumulation keeps the maximum (2.0), and the ordinary variable's mean.
    mine = _loop_updates(values, 2, keras.optimizers.SGD(0.5))
    assert mine == pytest.approx(_keras_updates(values, 2))
    assert mine[0] == max(values[-2:])  # the last window's


def test_a_custom_loop_keeps_negative_values_as_they_are():
    # The window's maximum of its own values (Keras starts from zero: max(-3, -2, 0)).
    assert _loop_updates([-3.0, -2.0], 2, keras.optimizers.SGD(0.5))[0] == -2.0


# Saving in the middle of a window --------------------------------------------------------------


def test_a_float8_window_saved_in_its_middle_resumes_exactly(tmp_path):
    x, y = block_data(48)
    path = str(tmp_path / "float8.keras")

    def trainer():
        model = gradaccum.accumulate(block(), steps=3, partial="carry")
        model.compile(keras.optimizers.Adam(1e-2), SCE)
        return model

    full = trainer()
    full.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    part = trainer()
    part.fit(x[:32], y[:32], batch_size=8, shuffle=False, verbose=0)  # 1 window + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        part.save(path)
    resumed = gradaccum.accumulate(gradaccum.load_model(path), steps=3, partial="carry")
    resumed.fit(x[32:], y[32:], batch_size=8, shuffle=False, verbose=0)
    gap = gaps(resumed, full)
    assert max(gap.values()) < 1e-6, {p: g for p, g in gap.items() if g >= 1e-6}
    assert int(resumed.optimizer.iterations) == 2


# Mixed precision and other quantized training -------------------------------------------------


def test_float8_under_mixed_bfloat16_follows_the_large_batch_to_bfloat16():
    # Under mixed_bfloat16 every gradient is computed in bfloat16, rounded per
    # micro-batch (a window's is the sum of rounded parts, as the biases above):
    # one window of SGD from the same start is within bfloat16's rounding, and
    # the float8 scales and amax histories are the large batch's.
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        x, y = block_data(16)
        model = gradaccum.accumulate(block(), steps=2)
        model.compile(keras.optimizers.SGD(0.1), SCE)
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        reference = plain_fit(16, epochs=1, optimizer=keras.optimizers.SGD(0.1), n=16)
    finally:
        keras.config.set_dtype_policy("float32")
    assert "bfloat16" in model.get_layer("up").dtype_policy.name
    gap = gaps(model, reference)
    measured = {p: g for p, g in gap.items() if "amax" in p or "scale" in p}
    assert max(gap.values()) < 2.0**-6, gap
    assert max(measured.values()) < 1e-5, measured


def lora_int8(seed: int = 0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(16, activation="tanh", name="hidden"),
                              keras.layers.Dense(3, name="out")], name="lora")
    model.quantize("int8")
    for layer in model.layers:
        layer.enable_lora(2)
    # LoRA's B starts at zero: a start away from it, the same for both runs.
    rng = np.random.default_rng(seed)
    for variable in model.trainable_variables:
        variable.assign(rng.normal(0, 0.3, variable.shape).astype("float32"))
    return model


def test_int8_with_lora_trains_as_the_large_batch():
    # int8 (and int4) layers keep no overwrite_with_gradient variable: their kernels
    # and scales are frozen, LoRA's factors train with ordinary gradients.
    rng = np.random.default_rng(5)
    x = rng.normal(size=(48, 6)).astype("float32")
    y = rng.integers(0, 3, size=(48,)).astype("int32")
    model = gradaccum.accumulate(lora_int8(), steps=3)
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    reference = lora_int8()
    reference.compile(keras.optimizers.Adam(1e-2), SCE)
    reference.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert not float8_paths(model)
    assert not any(v.path.endswith("kernel") for v in model.trainable_variables)
    gap = gaps(model, reference)
    assert max(gap.values()) < 1e-5, gap



# The audit ---------------------------------------------------------------------------------


def test_the_audit_of_a_float8_block_is_exact_and_names_the_rule():
    x, y = block_data(32)
    model = block()
    model.compile(keras.optimizers.Adam(1e-2), SCE)
    report = gradaccum.audit(model, x, y, steps=4, batch_size=8)
    assert report.exact, str(report)
    assert len(report.rules) == 4 and report.rules[0].startswith("float8 layer 'q': its 6")
    assert "Rules:\n- float8 layer 'q'" in str(report)
    measured = [row for row in report.rows if row[0] == "q/outputs_grad_amax_history"]
    assert measured and measured[0][2] > 0  # measured, and equal both ways


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_a_window_opened_by_a_micro_batch_that_weighs_nothing_is_exact(nonfinite):
    # The masked token model; micro-batch 3 (of 4 rows) is all padding: it opens
    # window 2 with weight 0. At 079feab its loss was divided by 0 (nan): skipped
    # and warned as not finite, or raised under "raise", on valid data.
    rng = np.random.default_rng(0)
    x = rng.integers(1, 20, size=(16, 6)).astype("int32")
    x[8:12] = 0
    y = rng.integers(0, 3, size=(16, 6)).astype("int32")
    model = gradaccum.accumulate(tokens(), steps=2, nonfinite=nonfinite)
    model.compile(keras.optimizers.SGD(0.1), SCE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "not finite" in m or "this float8 model" in m], messages
    reference = tokens()
    reference.compile(keras.optimizers.SGD(0.1), SCE)
    for start in range(0, 16, 8):
        reference.train_on_batch(x[start:start + 8], y[start:start + 8])
    assert_exact(model, reference)
