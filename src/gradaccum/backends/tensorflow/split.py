"""Split mode: each batch is cut into micro-batches inside the training step.

With `micro_batch_size=b` the batch a training step receives is cut into consecutive
micro-batches of at most `b` samples (the last may be smaller). Every tensor of the
batch is cut alike (nested inputs, targets, sample weights: anything whose first
dimension is the batch), and the micro-batches run one at a time in a `tf.while_loop`
with `parallel_iterations=1`, so that memory holds one micro-batch's activations plus
the input batch itself. Because the combined gradient is exact for micro-batches of
any size, the split does not change the update. (The search behind
`micro_batch_size="auto"` is `gradaccum.core.auto_size.AutoSize`.)
"""

from __future__ import annotations

import tensorflow as tf

from gradaccum.core.validation import check_batch_dimensions


def _first_dimension(tensor):
    """(static or None, dynamic) size of `tensor`'s first dimension."""
    if isinstance(tensor, tf.SparseTensor):
        static = tensor.shape[0] if tensor.shape.rank else None
        return static, tf.cast(tensor.dense_shape[0], tf.int32)
    if isinstance(tensor, tf.RaggedTensor):
        return tensor.shape[0], tf.cast(tensor.nrows(), tf.int32)
    return tensor.shape[0], tf.shape(tensor, out_type=tf.int32)[0]


def _leaves(data) -> list:
    leaves = [t for t in tf.nest.flatten(data) if t is not None]
    for t in leaves:
        rank = t.shape.rank
        if rank == 0:
            raise ValueError(
                "Every tensor of a batch must have a first (batch) dimension to be "
                "split into micro-batches. Received: a scalar tensor "
                f"{getattr(t, 'name', t)!r} in the batch."
            )
    return leaves


def batch_size(data):
    """The number of samples in `data` (an int32 scalar tensor).

    Raises:
        ValueError: if the tensors of the batch have static first dimensions that
            differ (checked at run time, as an `InvalidArgumentError`, where the
            shapes are not known when the step is traced).
    """
    leaves = _leaves(data)
    if not leaves:
        raise ValueError(
            "A batch to split into micro-batches must hold at least one tensor. "
            f"Received: {data!r}"
        )
    sizes = [_first_dimension(t) for t in leaves]
    static = [s for s, _ in sizes]
    check_batch_dimensions(static, [t.shape for t in leaves])
    first = sizes[0][1]
    checks = [
        tf.debugging.assert_equal(
            dynamic,
            first,
            message=(
                "The tensors of a batch must agree on their first (batch) "
                "dimension to be split into micro-batches. Received: a batch whose "
                "tensors' first dimensions differ"
            ),
        )
        for (known_size, dynamic) in sizes[1:]
        if known_size is None or static[0] is None
    ]
    with tf.control_dependencies(checks):
        return tf.identity(first)


def take(data, start, size):
    """The micro-batch `data[start:start + size]`, cut alike in every tensor."""

    def cut(tensor):
        if tensor is None:
            return None
        if isinstance(tensor, tf.SparseTensor):
            rank = tensor.shape.rank
            begin = tf.concat([[tf.cast(start, tf.int64)], tf.zeros([rank - 1], tf.int64)], 0)
            extent = tf.concat([[tf.cast(size, tf.int64)], tensor.dense_shape[1:]], 0)
            return tf.sparse.slice(tensor, begin, extent)
        return tensor[start:start + size]

    return tf.nest.map_structure(cut, data)


def micro_batch_count(batch, size):
    """ceil(batch / size) for int32 tensors."""
    return (batch + size - 1) // size


def _loop(data, size, body, carry, start):
    """`carry = body(micro_batch, carry)` for micro-batches `start`, `start + 1`, ...
    of `data`, one at a time; returns the last carry."""
    size = tf.cast(size, tf.int32)
    batch = batch_size(data)

    def step(i, carry):
        begin = i * size
        return i + 1, body(take(data, begin, tf.minimum(size, batch - begin)), carry)

    _, carry = tf.while_loop(
        lambda i, _: i < micro_batch_count(batch, size),
        step,
        (tf.constant(start), carry),
        parallel_iterations=1,
    )
    return carry


def for_each(data, size, body, initial):
    """Runs `carry = body(micro_batch, *carry)` on each micro-batch of `data`, in
    order, one at a time (the next starts when the previous one's updates are
    done), from `initial` (a tuple of tensors). Returns the last carry, available
    once every micro-batch ran."""
    return tuple(_loop(data, size, lambda micro, carry: body(micro, *carry), initial, 0))


def fold(data, size, body):
    """As `for_each`, where `body` returns a structure of tensors (a step's logs):
    returns what the last micro-batch's `body` returned. The first micro-batch runs
    before the loop, which learns the structure from it."""

    def run(micro, _=None):
        return tf.nest.map_structure(tf.convert_to_tensor, body(micro))

    first = run(take(data, 0, tf.minimum(tf.cast(size, tf.int32), batch_size(data))))
    return _loop(data, size, run, first, 1)


def eager_batch_size(data, strategy=None) -> int:
    """The largest number of samples a replica holds in `data` (concrete values:
    a batch as the iterator gave it, before the step)."""
    leaves = [t for t in tf.nest.flatten(data, expand_composites=False) if t is not None]
    if not leaves:
        return 0
    first = leaves[0]
    parts = strategy.experimental_local_results(first) if strategy is not None else (first,)
    return max(int(_first_dimension(part)[1]) for part in parts)
