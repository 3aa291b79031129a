"""Sparse gradients (tf.IndexedSlices from Embedding) are scatter-added."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from helpers import assert_same_state

VOCAB, DIM = 200_000, 8


def embedding_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(VOCAB, DIM),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )


def token_data(n, seed=4):
    rng = np.random.default_rng(seed)
    # Repeated ids inside and across micro-batches, spread over the whole table.
    ids = rng.integers(0, VOCAB, size=(n, 6)).astype("int32")
    ids[:, 0] = ids[0, 0]
    return ids, rng.integers(0, 3, size=n)


SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def micro_gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = SCE(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


def test_sparse_and_dense_accumulation_give_equal_weights():
    x, y = token_data(20)
    sizes = [6, 6, 3, 5]  # two windows: 6 + 6 + 3, then 5
    bounds = np.cumsum([0, *sizes])
    runs = {}
    for mode in ("sparse", "dense"):
        model = embedding_model()
        opt = keras.optimizers.Adam(0.05)
        acc = gradaccum.GradientAccumulator(model.trainable_variables)
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            grads = micro_gradients(model, x[a:b], y[a:b])
            assert isinstance(grads[0], tf.IndexedSlices)
            if mode == "dense":
                grads = [tf.convert_to_tensor(g) for g in grads]
            acc.accumulate(grads, weight=b - a)
            if i in (2, 3):
                acc.apply(opt)
        runs[mode] = model, opt
    assert_same_state(*runs["sparse"], *runs["dense"], rtol=1e-6, atol=1e-7)
    table = runs["sparse"][0].get_weights()[0]
    assert (table != embedding_model().get_weights()[0]).any(axis=1).sum() > 0


def test_fit_with_an_embedding_equals_the_large_batch():
    """SGD applies sparse gradients exactly (duplicates summed), so plain Keras on
    the concatenated windows is the reference."""
    x, y = token_data(16)
    reference = embedding_model()
    reference.compile(optimizer=keras.optimizers.SGD(0.5), loss=SCE)
    for window in (np.r_[0:12], np.r_[12:16]):
        reference.train_on_batch(x[window], y[window])
    model = embedding_model()
    trainer = gradaccum.wrap(model, steps=3)
    trainer.compile(optimizer=keras.optimizers.SGD(0.5), loss=SCE)
    trainer.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def all_operations(graph):
    """The graph's operations and those of its tf.cond branches (the finiteness
    screen puts the accumulation in one)."""
    for op in graph.get_operations():
        yield op
        for branch in ("then_branch", "else_branch"):
            try:
                name = op.get_attr(branch).name
            except (ValueError, AttributeError):
                continue
            yield from all_operations(graph._get_function(name).graph)


def test_accumulating_a_micro_batch_never_builds_the_dense_table():
    """The traced accumulate step holds no tensor of the table's shape: the rows
    are scatter-added into the accumulator."""
    table = tf.Variable(tf.zeros([VOCAB, DIM]))
    acc = gradaccum.GradientAccumulator([table])

    @tf.function
    def accumulate(values, indices):
        acc.accumulate([tf.IndexedSlices(values, indices, tf.constant([VOCAB, DIM]))], 3.0)

    graph = accumulate.get_concrete_function(
        tf.TensorSpec([None, DIM]), tf.TensorSpec([None], tf.int32)
    ).graph
    ops = list(all_operations(graph))
    shapes = [out.shape for op in ops for out in op.outputs]
    assert not any(s.rank == 2 and s[0] == VOCAB for s in shapes)
    assert "ResourceScatterAdd" in {op.type for op in ops}
    accumulate(tf.ones([2, DIM]), tf.constant([7, 7]))
    np.testing.assert_array_equal(acc.accumulators[0][7].numpy(), np.full(DIM, 6.0))
    assert float(tf.reduce_sum(acc.accumulators[0])) == 6.0 * DIM


# Every optimizer receives the gradient's own math (issue 28) ---------------------------

SMALL_VOCAB = 12

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adamw": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.05),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adafactor": lambda: keras.optimizers.Adafactor(0.1),
    "lion": lambda: keras.optimizers.Lion(0.01),
}


def small_embedding_model(seed=0):
    """An embedding of 12 rows: every batch hits some row several times."""
    model = keras.Sequential([
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(SMALL_VOCAB, 4),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(3),
    ])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32")
                       for w in model.get_weights()])
    return model


class OwnSparseStep(keras.Sequential):
    """A train_step of its own, handing the tape's (sparse) gradients over."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = SCE(y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def repeated_ids(n=16, seed=3):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 4, size=(n, 5)).astype("int32"),
            rng.integers(0, 3, size=(n,)))


def densified_reference(name, x, y, window=4):
    """The same optimizer, each window's gradient handed over dense (the math)."""
    model = small_embedding_model()
    optimizer = OPTIMIZERS[name]()
    for start in range(0, len(x), window):
        with tf.GradientTape() as tape:
            loss = SCE(y[start:start + window], model(x[start:start + window], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        optimizer.apply([tf.convert_to_tensor(g) for g in grads], model.trainable_variables)
    return model, optimizer


def trained(name, mode, x, y):
    """Windows of 4 samples: steps=1 at batch 4, steps=2 at batch 2, split mode
    (batch 4, micro-batches of 2), a model's own step at steps=1; or plain Keras."""
    if mode == "own_step":
        model = OwnSparseStep(small_embedding_model().layers)
        model.build((None, 5))
        model.set_weights(small_embedding_model().get_weights())
    else:
        model = small_embedding_model()
    options = {"steps_1": dict(steps=1), "steps_2": dict(steps=2),
               "split": dict(micro_batch_size=2), "own_step": dict(steps=1)}
    if mode != "keras":
        gradaccum.accumulate(model, **options[mode])
    model.compile(OPTIMIZERS[name](), SCE)
    batch = 2 if mode == "steps_2" else 4
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return model, model.optimizer


@pytest.mark.parametrize("mode", ["steps_1", "steps_2", "split", "own_step"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_receives_the_dense_math_of_repeated_rows(name, mode):
    x, y = repeated_ids()
    reference = densified_reference(name, x, y)
    assert_same_state(*trained(name, mode, x, y), *reference, rtol=1e-5, atol=1e-6)


def test_keras_alone_is_off_on_repeated_rows():
    # What gradaccum fixes: Keras's Adam squares each piece of the sparse gradient
    # before summing them (the row hit 3 times moves by the sum of squares).
    x, y = repeated_ids()
    model, _ = trained("adam", "keras", x, y)
    reference, _ = densified_reference("adam", x, y)
    gap = np.abs(model.get_weights()[0] - reference.get_weights()[0]).max()
    assert gap > 0.1


def test_deduplicated_sums_repeated_rows_and_keeps_them_sparse():
    from gradaccum.backends.tensorflow.sums import deduplicated

    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
                              tf.constant([7, 2, 7]), tf.constant([10, 2]))
    out = deduplicated(slices)
    assert isinstance(out, tf.IndexedSlices)
    assert sorted(out.indices.numpy().tolist()) == [2, 7]
    np.testing.assert_array_equal(tf.convert_to_tensor(out), tf.convert_to_tensor(slices))
    dense = tf.ones([2])
    assert deduplicated(dense) is dense


@pytest.mark.parametrize("steps", [1, 2])
def test_two_replicas_hand_adam_the_dense_math(steps):
    from test_distribute import mirrored

    x, y = repeated_ids()
    with mirrored().scope():
        model = small_embedding_model()
        gradaccum.accumulate(model, steps=steps)
        model.compile(OPTIMIZERS["adam"](), SCE)
    model.fit(x, y, batch_size=4 // steps, epochs=1, shuffle=False, verbose=0)
    assert_same_state(model, model.optimizer, *densified_reference("adam", x, y),
                      rtol=1e-5, atol=1e-6)
