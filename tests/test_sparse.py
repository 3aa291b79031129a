"""Sparse gradients (tf.IndexedSlices from Embedding) are scatter-added."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import gradaccum
from conftest import assert_same_state

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
