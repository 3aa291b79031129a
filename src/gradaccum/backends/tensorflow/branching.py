"""`cond_kept_whole`: a `tf.cond` kept as one functional `If` op, so that the branch
not taken costs nothing (an update on the micro-batches that make none)."""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2


def cond_kept_whole(pred, true_fn, false_fn):
    """`tf.cond(pred, true_fn, false_fn)` kept as one functional `If` op.

    Inside a `tf.function` TensorFlow lowers a `tf.cond` to switch and merge nodes,
    and its executor then walks every node of the branch not taken (as dead) each
    time the step runs: an optimizer update of a few hundred nodes costs its walk on
    every micro-batch that makes no update. Kept whole, the `If` runs one branch as a
    function call, and the other is never visited. Eagerly and under XLA (which
    keeps `If` whole) this is `tf.cond`.
    """
    out = tf.cond(pred, true_fn, false_fn)
    if tf.executing_eagerly():
        return out
    op = out.op
    while op.type in ("Identity", "IdentityN"):
        op = op.inputs[0].op
    if op.type in ("If", "StatelessIf"):
        op._set_attr("_lower_using_switch_merge", attr_value_pb2.AttrValue(b=False))
    return out
