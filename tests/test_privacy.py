"""Differentially private training (gradaccum.Privacy): each example's gradient clipped,
noise once per window, the accounting of dp-accounting.

References clip example by example in a Python loop (the per-example gradient of the
model's compiled loss on a batch of that one example), sum the window, divide by its
number of examples and apply one optimizer step: what DP-SGD defines.
"""

from __future__ import annotations

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum.core import privacy as core_privacy

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def tagger(seed=1, regularizer=None):
    """An embedding over 20 ids (ids repeat within an example: sparse gradients with
    repeated rows), a dense layer, two outputs with losses of their own."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((6,), dtype="int32")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(ids))
    hidden = keras.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer)(hidden)
    outputs = {
        "tag": keras.layers.Dense(3, name="tag")(hidden),
        "score": keras.layers.Dense(1, name="score")(hidden),
    }
    return keras.Model(ids, outputs, name="tagger")


TAGGER_LOSS = {"tag": SCE, "score": "mse"}


def tagger_data(n=30, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 5, (n, 6)).astype("int32")
    y = {"tag": rng.integers(0, 3, n), "score": rng.normal(size=(n, 1)).astype("float32")}
    return x, y, rng.uniform(0.2, 2.0, n).astype("float32")


def mlp(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(200, activation="tanh"),
        keras.layers.Dense(3),
    ], name="mlp")


def mlp_data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 3, n)


def take(tree, rows):
    return keras.tree.map_structure(lambda a: a[rows], tree)


def clipped_reference(model, optimizer, loss, windows, clip):
    """One optimizer step per window on the mean of its per-example-clipped gradients
    (plus the weight regularizers' gradient, as it is)."""
    model.compile(optimizer=optimizer, loss=loss)
    variables = model.trainable_variables
    for x, y, sample_weight in windows:
        count = len(keras.tree.flatten(x)[0])
        total = [tf.zeros_like(v) for v in variables]
        for i in range(count):
            with tf.GradientTape() as tape:
                y_pred = model(take(x, slice(i, i + 1)), training=True)
                value = model._compile_loss(
                    take(y, slice(i, i + 1)), y_pred,
                    None if sample_weight is None else sample_weight[i:i + 1],
                )
            grads = [tf.convert_to_tensor(g) for g in tape.gradient(value, variables)]
            norm = float(tf.linalg.global_norm(grads))
            total = [t + g * (clip / max(norm, clip)) for t, g in zip(total, grads)]
        mean = [t / count for t in total]
        if model.losses:
            with tf.GradientTape() as tape:
                penalty = tf.add_n(model.losses)
            extra = tape.gradient(penalty, variables)
            mean = [m if e is None else m + tf.convert_to_tensor(e)
                    for m, e in zip(mean, extra)]
        optimizer.apply_gradients(zip(mean, variables))
    return model


def assert_weights_close(a, b, atol=1e-6):
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=1e-5, atol=atol)


# Without noise: the mean of the per-example-clipped gradients --------------------------


def test_without_noise_the_update_is_the_mean_of_per_example_clipped_gradients():
    """Windows of 3 micro-batches of 4 (the last window partial: 6 examples), an
    embedding whose rows repeat inside an example, two outputs, sample weights, a
    weight regularizer, Adam: equal to the clip-by-example reference."""
    x, y, sample_weight = tagger_data(30)
    clip = 0.3
    model = gradaccum.accumulate(
        tagger(regularizer=keras.regularizers.L2(0.01)), steps=3,
        privacy=gradaccum.Privacy(l2_norm_clip=clip, noise_multiplier=0.0),
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=TAGGER_LOSS)
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=4, epochs=1,
                        shuffle=False, verbose=0)
    assert history.history["updates"] == [3.0]
    assert history.history["window_weight"] == [6.0]  # examples in the last window
    windows = [(x[s], take(y, s), sample_weight[s])
               for s in (slice(0, 12), slice(12, 24), slice(24, 30))]
    reference = clipped_reference(
        tagger(regularizer=keras.regularizers.L2(0.01)), keras.optimizers.Adam(0.01),
        TAGGER_LOSS, windows, clip,
    )
    assert_weights_close(model, reference)
    # Clipping acted: the clip is below most examples' gradient norms.
    unclipped = clipped_reference(
        tagger(regularizer=keras.regularizers.L2(0.01)), keras.optimizers.Adam(0.01),
        TAGGER_LOSS, windows, 1e6,
    )
    moved = max(float(np.abs(a - b).max())
                for a, b in zip(model.get_weights(), unclipped.get_weights()))
    assert moved > 1e-3


def test_split_mode_and_wrap_make_the_same_private_updates():
    """micro_batch_size=4 on batches of 12 and `wrap(steps=3)` on batches of 4 make the
    windows of `accumulate(steps=3)`; the same seed draws the same noise."""
    x, y = mlp_data(36)
    privacy = gradaccum.Privacy(l2_norm_clip=0.5, noise_multiplier=0.7, seed=11)

    def trained(make, batch_size):
        model = make()
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=SCE)
        model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
        return model

    steps = trained(lambda: gradaccum.accumulate(mlp(), steps=3, privacy=privacy), 4)
    split = trained(
        lambda: gradaccum.accumulate(mlp(), micro_batch_size=4, privacy=privacy), 12
    )
    wrapped = trained(lambda: gradaccum.wrap(mlp(), steps=3, privacy=privacy), 4)
    assert_weights_close(split, steps)
    assert_weights_close(wrapped.model, steps)
    assert int(steps.optimizer.iterations) == int(split.optimizer.iterations) == 6


# With noise: once per window ------------------------------------------------------------


@pytest.mark.parametrize("steps, jit_compile", [(1, False), (4, False), (4, True)])
def test_the_noise_of_an_update_has_standard_deviation_sigma_c_over_b(steps, jit_compile):
    """One window of B = 32 examples as k micro-batches, SGD with rate 1: the update
    minus the noiseless one is the noise / B. Its standard deviation over the 1,803
    weights is sigma C / B for k = 1 and k = 4 alike (noise per micro-batch would give
    sqrt(k) sigma C / B), compiled by XLA too."""
    x, y = mlp_data(32)
    sigma, clip, examples = 2.0, 0.5, 32

    def one_update(noise_multiplier):
        model = gradaccum.accumulate(mlp(), steps=steps, privacy=gradaccum.Privacy(
            l2_norm_clip=clip, noise_multiplier=noise_multiplier, seed=5))
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss=SCE, jit_compile=jit_compile)
        model.fit(x, y, batch_size=examples // steps, epochs=1, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations) == 1
        return np.concatenate([w.ravel() for w in model.get_weights()])

    noise = one_update(sigma) - one_update(0.0)
    expected = sigma * clip / examples
    assert noise.size == 1803
    assert abs(noise.std() / expected - 1) < 0.06
    assert abs(noise.mean()) < 4 * expected / np.sqrt(noise.size)


def test_the_noise_follows_the_seed():
    x, y = mlp_data(16)

    def weights(seed):
        model = gradaccum.accumulate(mlp(), steps=2, privacy=gradaccum.Privacy(
            l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=SCE)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        return model.get_weights()[0]

    np.testing.assert_array_equal(weights(3), weights(3))
    assert np.abs(weights(3) - weights(4)).max() > 1e-4
    # seed=None: each model draws its own.
    assert np.abs(weights(None) - weights(None)).max() > 1e-4


def test_two_replicas_add_the_noise_once_to_the_global_window():
    """MirroredStrategy over two CPUs: each replica clips its share's examples; the
    window's noise, drawn once, makes the update of one device with the same seed."""
    from test_distribute import mirrored

    x, y = mlp_data(48)
    privacy = gradaccum.Privacy(l2_norm_clip=0.5, noise_multiplier=1.0, seed=2)
    one = gradaccum.accumulate(mlp(), steps=3, privacy=privacy)
    one.compile(optimizer=keras.optimizers.Adam(0.01), loss=SCE)
    one.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    with mirrored().scope():
        two = gradaccum.accumulate(mlp(), steps=3, privacy=privacy)
        two.compile(optimizer=keras.optimizers.Adam(0.01), loss=SCE)
    history = two.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert history.history["updates"] == [2.0, 4.0]
    assert_weights_close(two, one, atol=1e-5)


# Accounting -----------------------------------------------------------------------------


def test_epsilon_is_dp_accountings_for_the_updates_made():
    """fit logs epsilon after each epoch; privacy_spent gives the same, and both are
    dp-accounting's RDP accountant for Poisson-sampled Gaussian updates at
    q = window / dataset size (the partial last window counted as a full one)."""
    x, y = mlp_data(40)
    sigma, delta = 1.1, 1e-5
    model = gradaccum.accumulate(mlp(), steps=4, privacy=gradaccum.Privacy(
        l2_norm_clip=1.0, noise_multiplier=sigma, seed=0, dataset_size=40, delta=delta))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=SCE)
    assert gradaccum.privacy_spent(model) == 0.0
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    # 10 micro-batches per epoch: windows of 16, 16 and 8 examples.
    assert history.history["updates"] == [3.0, 6.0]

    def expected(updates, accountant):
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(16 / 40, dp_accounting.GaussianDpEvent(sigma)),
            updates,
        )
        ledger = accountant()
        ledger.compose(event)
        return ledger.get_epsilon(delta)

    rdp = dp_accounting.rdp.RdpAccountant
    np.testing.assert_allclose(history.history["epsilon"], [expected(3, rdp), expected(6, rdp)])
    np.testing.assert_allclose(gradaccum.privacy_spent(model), expected(6, rdp))
    np.testing.assert_allclose(
        gradaccum.privacy_spent(model, dataset_size=400, delta=1e-6),
        core_privacy.epsilon(sigma, 16 / 400, 6, 1e-6),
    )
    pld = gradaccum.Privacy(1.0, sigma, dataset_size=40, delta=delta, accountant="pld")
    assert core_privacy.epsilon(sigma, 0.4, 6, delta, pld.accountant) == \
        pytest.approx(expected(6, dp_accounting.pld.PLDAccountant))


def test_without_noise_epsilon_is_infinite():
    x, y = mlp_data(8)
    model = gradaccum.accumulate(mlp(), steps=2, privacy=gradaccum.Privacy(
        l2_norm_clip=1.0, noise_multiplier=0.0, dataset_size=8, delta=1e-3))
    model.compile(optimizer="sgd", loss=SCE)
    history = model.fit(x, y, batch_size=2, verbose=0)
    assert history.history["epsilon"] == [float("inf")]


# A KerasHub task ------------------------------------------------------------------------


def test_a_gpt2_task_with_lora_trains_privately_on_strings():
    """A KerasHub GPT-2 on raw strings with LoRA: each text's gradient (its masked
    token loss) clipped, windows of 12 texts; equal to the reference clipping text by
    text on the preprocessed batch."""
    import hub_models

    texts = hub_models.make_texts()
    clip = 0.03
    task = hub_models.make_task(seed=0, optimizer=keras.optimizers.SGD(0.5))
    task.backbone.enable_lora(rank=4)
    reference = hub_models.make_task(seed=0, optimizer=keras.optimizers.SGD(0.5))
    reference.backbone.enable_lora(rank=4)
    reference.set_weights(task.get_weights())
    gradaccum.accumulate(task, steps=3, privacy=gradaccum.Privacy(clip, 0.0))
    history = task.fit(texts, batch_size=4, shuffle=False, verbose=0)
    assert history.history["updates"] == [2.0]

    x, y, sample_weight = reference.preprocessor(texts)
    variables = reference.trainable_variables

    @tf.function  # one trace: every example has the preprocessor's length
    def gradient(example, label, weight):
        with tf.GradientTape() as tape:
            value = reference.compute_loss(example, label, reference(example, training=True),
                                           weight)
        return tape.gradient(value, variables)

    norms = []
    for start in (0, 12):
        total = [tf.zeros_like(v) for v in variables]
        for i in range(start, start + 12):
            grads = gradient(take(x, slice(i, i + 1)), y[i:i + 1], sample_weight[i:i + 1])
            norm = float(tf.linalg.global_norm(grads))
            norms.append(norm)
            total = [t + g * (clip / max(norm, clip)) for t, g in zip(total, grads)]
        reference.optimizer.apply_gradients(zip([t / 12 for t in total], variables))
    assert sum(norm > clip for norm in norms) >= 12  # clipping acted
    assert_weights_close(task, reference, atol=1e-6)


# What privacy refuses -------------------------------------------------------------------


class OwnLoss(keras.Model):
    def __init__(self):
        super().__init__(name="own_loss")
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(keras.ops.square(y_pred))


class AddsLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(keras.ops.mean(x))
        return x


def test_a_layer_that_adds_a_loss_in_its_call_is_refused():
    model = keras.Sequential([keras.Input((5,)), AddsLoss(name="adds"), keras.layers.Dense(3)])
    gradaccum.accumulate(model, steps=2, privacy=gradaccum.Privacy(1.0, 1.0))
    model.compile(optimizer="sgd", loss=SCE)
    x, y = mlp_data(8)
    with pytest.raises(ValueError, match="layer 'adds' of model .* adds a loss in its call"):
        model.fit(x, y, batch_size=4, verbose=0)


def test_privacy_options_are_checked():
    with pytest.raises(ValueError, match="`weighting` must be \"exact\" and `reduction`"):
        gradaccum.accumulate(mlp(), steps=2, weighting="uniform",
                             privacy=gradaccum.Privacy(1.0, 1.0))
    with pytest.raises(ValueError, match="defines its own compute_loss"):
        gradaccum.accumulate(OwnLoss(), steps=2, privacy=gradaccum.Privacy(1.0, 1.0))
    # A Privacy is its own record: repr shows what it holds.
    assert repr(gradaccum.Privacy(1.0, 0.5, seed=3)) == (
        "Privacy(l2_norm_clip=1.0, noise_multiplier=0.5, seed=3, dataset_size=None, "
        "delta=None, accountant='rdp')"
    )


def test_xla_compiles_the_private_step_sparse_rows_included():
    """jit_compile=True (Keras's default on a GPU): the same clipped updates as without
    (XLA draws other numbers from the same noise seed: the noise is checked above)."""
    x, y, sample_weight = tagger_data(16)

    def trained(jit_compile):
        model = gradaccum.accumulate(tagger(), steps=2, privacy=gradaccum.Privacy(
            l2_norm_clip=0.3, noise_multiplier=0.0))
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=TAGGER_LOSS,
                      jit_compile=jit_compile)
        model.fit(x, y, sample_weight=sample_weight, batch_size=4, shuffle=False, verbose=0)
        return model

    assert_weights_close(trained(True), trained(False), atol=1e-5)


class UnitBatchWeight(keras.layers.Layer):
    """`x @ w` with a weight of shape (1, d, e): a batch axis of size 1, which oneDNN
    multiplies wrong in a vectorized pass unless it is squeezed."""

    def build(self, shape):
        self.w = self.add_weight(shape=(1, shape[-1], 6))

    def call(self, x):
        return keras.ops.matmul(x, self.w)


def conv_model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6, 6, 2))
    hidden = keras.layers.DepthwiseConv2D(3, padding="same")(inputs)
    hidden = keras.layers.UpSampling2D(interpolation="bilinear")(hidden)
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(hidden)))


def unit_batch_model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6, 8))
    hidden = keras.layers.Flatten()(UnitBatchWeight()(inputs))
    return keras.Model(inputs, keras.layers.Dense(3)(hidden))


@pytest.mark.parametrize("make, shape", [(conv_model, (6, 6, 2)), (unit_batch_model, (6, 8))],
                         ids=["depthwise_bilinear", "unit_batch_weight"])
def test_ops_pfor_loops_over_and_matmuls_oneDNN_gets_wrong_are_exact(make, shape):
    """A depthwise convolution and a bilinear resize (ops pfor runs in a loop over the
    examples), a weight with a batch axis of 1 (a matmul oneDNN computes wrong when
    vectorized as it is): with a clip no example reaches and no noise, the window's
    update is plain fit's on the window."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, *shape)).astype("float32")
    y = rng.integers(0, 3, 8)
    private = gradaccum.accumulate(make(), steps=2, privacy=gradaccum.Privacy(1e9, 0.0))
    private.compile(optimizer=keras.optimizers.SGD(0.5), loss=SCE)
    private.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    plain = make()
    plain.compile(optimizer=keras.optimizers.SGD(0.5), loss=SCE)
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert_weights_close(private, plain)


def test_an_embedding_feeding_an_lstm_runs_example_by_example_and_is_exact():
    """pfor cannot run an Embedding feeding an LSTM (TensorFlow 2.21): a model with a
    recurrent layer runs its examples one after another (tf.map_fn); masked ids,
    sparse embedding rows, a clip that acts."""

    def reader():
        keras.utils.set_random_seed(1)
        return keras.Sequential([
            keras.Input((5,), dtype="int32"), keras.layers.Embedding(10, 4, mask_zero=True),
            keras.layers.LSTM(3), keras.layers.Dense(3),
        ], name="reader")

    rng = np.random.default_rng(0)
    x = rng.integers(0, 10, (12, 5)).astype("int32")
    y = rng.integers(0, 3, 12)
    model = gradaccum.accumulate(reader(), steps=3, privacy=gradaccum.Privacy(0.1, 0.0))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=SCE)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    windows = [(x[s], y[s], None) for s in (slice(0, 6), slice(6, 12))]
    reference = clipped_reference(reader(), keras.optimizers.SGD(0.5), SCE, windows, 0.1)
    assert_weights_close(model, reference)
