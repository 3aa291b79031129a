"""DP-SGD on TensorFlow: each example's gradient, clipped, summed over a micro-batch
(`clipped_micro_batch`), and the window's noise, added once when it is applied
(`noised`). The options and the accounting are `gradaccum.core.privacy`'s.

Per-example gradients come from one `tf.vectorized_map` over the micro-batch's
examples: the model's forward pass, its compiled loss and the backward pass of one
example each, vectorized (no Python loop over examples). A model with a recurrent
layer, or one pfor cannot convert as a whole, runs its examples one after another in
a `tf.map_fn` instead: slower, as exact. A sparse gradient (an
embedding's) stays sparse: its norm sums each row once, however often the example
looks it up.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from gradaccum.backends.tensorflow import keras_compat as kc
from gradaccum.backends.tensorflow.vectorized import per_example
from gradaccum.core.privacy import clip_factors, per_example_inputs, regularized_variables


def clipped_micro_batch(accumulation, x, y, sample_weight):
    """One micro-batch's examples through the model, each example's gradient clipped.

    Returns:
        `(y_pred, gradients, examples)`: the micro-batch's predictions, the sum of its
        clipped per-example gradients (plus `examples` times the gradient of the
        weight regularizers) per trainable variable (a tensor, a `tf.IndexedSlices`,
        or None for a variable no example reaches), and its number of examples.
    """
    host = accumulation.host
    privacy = accumulation.options.privacy
    variables = list(accumulation.state.accumulator.target_variables)
    compile_loss, elements = per_example_inputs(host, kc.compiled_loss(host), x, y,
                                                 sample_weight)
    # Known when the function is traced: which variables get a gradient, and which
    # gradients are sparse.
    kinds = []

    def one_example(element):
        single = tf.nest.map_structure(lambda t: t[None], element)
        with tf.GradientTape() as tape, kc.loss_metrics_set_aside(compile_loss):
            if kc.call_has_training_arg(host):
                y_pred = host(single["x"], training=True)
            else:
                y_pred = host(single["x"])
            loss = compile_loss(single.get("y"), y_pred, single.get("sample_weight"))
            # Keras divides a loss by the replicas (it sums their gradients).
            loss = kc.unscale_loss_for_distribution(loss)
        gradients = tape.gradient(loss, variables)
        kinds.clear()
        parts = []
        for gradient in gradients:
            if gradient is None:
                kinds.append(None)
            elif isinstance(gradient, tf.IndexedSlices):
                kinds.append("sparse")
                parts.append((gradient.values, gradient.indices))
            else:
                kinds.append("dense")
                parts.append(gradient)
        return tf.nest.map_structure(lambda t: t[0], y_pred), parts

    if _recurrent(host):
        # pfor converts a recurrent layer's loop, but not always right (an Embedding
        # feeding an LSTM fails as it runs, in TensorFlow 2.21): the examples run
        # one after another.
        y_pred, parts = _one_by_one(one_example, elements)
    else:
        try:
            y_pred, parts = per_example(one_example, elements)
        except (ValueError, TypeError, NotImplementedError) as error:
            if "`privacy`" in str(error):
                raise
            # pfor cannot convert the model's graph as a whole.
            y_pred, parts = _one_by_one(one_example, elements)
    _check_no_added_losses(host)
    examples = tf.shape(tf.nest.flatten(x)[0])[0]
    squares = tf.zeros([examples], tf.float32)
    for kind, part in zip([k for k in kinds if k is not None], parts):
        squares += _squared_norms(kind, part, examples)
    factors = clip_factors(squares, privacy.l2_norm_clip)
    clipped, position = [], 0
    for kind, variable in zip(kinds, variables):
        if kind is None:
            clipped.append(None)
            continue
        clipped.append(_clipped_sum(kind, parts[position], factors, variable))
        position += 1
    clipped = _with_regularization(host, variables, clipped, examples)
    return y_pred, clipped, examples


def _recurrent(model) -> bool:
    """Whether `model` holds a recurrent layer (LSTM, GRU, SimpleRNN, a wrapper)."""
    return any(isinstance(layer, (keras.layers.RNN, keras.layers.Bidirectional))
               for layer in kc.flatten_layers(model))


def _one_by_one(function, elements):
    """`function` on each example in turn (`tf.map_fn`), its outputs stacked as
    `per_example`'s: slower, the same values."""
    spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), elements)
    outputs = tf.function(function, autograph=False).get_concrete_function(spec)
    signature = tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape, t.dtype), outputs.structured_outputs
    )
    return tf.map_fn(function, elements, fn_output_signature=signature)


def _squared_norms(kind, part, examples):
    """Each example's squared L2 norm of one variable's gradient (float32 [B])."""
    if kind == "dense":
        flat = tf.reshape(tf.cast(part, tf.float32), [examples, -1])
        return tf.reduce_sum(tf.square(flat), axis=1)
    values, indices = part
    # An example's sparse gradient has one piece per lookup; a row looked up twice
    # has the sum of its pieces as its gradient. The norm of the summed rows is the
    # sum of v_i . v_j over the pairs of pieces with the same row (static shapes, so
    # XLA compiles it).
    rows = tf.shape(indices)[1]
    values = tf.reshape(tf.cast(values, tf.float32), [examples, rows, -1])
    products = tf.linalg.matmul(values, values, transpose_b=True)
    same_row = tf.cast(indices[:, :, None] == indices[:, None, :], tf.float32)
    return tf.reduce_sum(products * same_row, axis=[1, 2])


def _clipped_sum(kind, part, factors, variable):
    """The sum over examples of one variable's gradient times each example's factor."""
    if kind == "dense":
        return tf.tensordot(tf.cast(factors, part.dtype), part, axes=1)
    values, indices = part
    scaled = values * tf.reshape(
        tf.cast(factors, values.dtype), [-1] + [1] * (len(values.shape) - 1)
    )
    row_shape = tf.shape(values)[2:]
    return tf.IndexedSlices(
        tf.reshape(scaled, tf.concat([[-1], row_shape], axis=0)),
        tf.reshape(indices, [-1]),
        tf.shape(variable, out_type=indices.dtype),
    )


def _with_regularization(host, variables, clipped, examples):
    """Adds `examples` times the gradient of the weight regularizers: they depend on
    the weights only, so they are neither clipped nor noised, and the window's mean
    carries their gradient once."""
    if not regularized_variables(host):
        return clipped
    with tf.GradientTape() as tape:
        total = tf.add_n([tf.cast(loss, tf.float32) for loss in host.losses])
        total = total * tf.cast(examples, tf.float32)
    gradients = tape.gradient(total, variables)
    combined = []
    for part, extra in zip(clipped, gradients):
        if extra is None:
            combined.append(part)
        elif part is None:
            combined.append(tf.convert_to_tensor(extra))
        else:
            combined.append(tf.convert_to_tensor(part) + tf.cast(extra, part.dtype))
    return combined


def _check_no_added_losses(host) -> None:
    """A layer that called `add_loss` in its call computed the loss over examples
    (inside the vectorized pass it is not one of the model's losses): refused."""
    for layer in kc.flatten_layers(host):
        if getattr(layer, "_losses", None):
            raise ValueError(
                "`privacy` needs losses that can be split per example: layer "
                f"{layer.name!r} of model {host.name!r} adds a loss in its call "
                "(`add_loss`), computed over the micro-batch. Received: a model whose "
                "layers add losses."
            )


def noised(accumulator, sums):
    """The window's sums with the privacy noise added once: `N(0, (sigma C)^2)` per
    element, drawn from the accumulator's noise seed and its update count (the same
    on every replica, so a window closed across replicas is noised once)."""
    privacy = accumulator._privacy.value
    if privacy is None or privacy.noise_stddev == 0:
        return sums
    seed = tf.stack([
        tf.convert_to_tensor(accumulator._noise_seed),
        tf.cast(accumulator.state.updates, tf.int64),
    ])
    noisy = []
    for index, total in enumerate(sums):
        noise = tf.random.stateless_normal(
            tf.shape(total),
            seed=tf.random.experimental.stateless_fold_in(seed, index, alg="philox"),
            stddev=privacy.noise_stddev,
            dtype=tf.float32,
            # Named: "auto_select" may pick another generator under XLA or on
            # another device, and the noise must follow the seed everywhere.
            alg="philox",
        )
        noisy.append(total + tf.cast(noise, total.dtype))
    return noisy
