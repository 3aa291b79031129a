"""`per_example`: a function of one example, vectorized over a batch with
`tf.vectorized_map` (TensorFlow's pfor), safe under oneDNN.

pfor runs each op of the per-example graph on the stacked examples, one axis more.
The function gets a batch of one example, so a dense layer on a sequence multiplies
`[examples, 1, time, features]` by its kernel; TensorFlow's CPU build with oneDNN (the
default on x86) computes that batched matmul wrong, and corrupts its heap, when a
batch axis has size 1 (TensorFlow 2.21: `tf.linalg.matmul` of shapes (4, 1, 16, 32)
and (32, 32) in a `tf.function` is off by about 20; a KerasHub GPT-2 crashed). While
`per_example` converts the function, matmuls run at rank 2 or 3 (the example's axes
merged), einsums without their axes of size 1 (at the rank they have in plain
training), and softmax and log-softmax (last axis only) at rank 2: the ranks and
shapes of ordinary training.
"""

from __future__ import annotations

import contextlib
import string

import tensorflow as tf
from tensorflow.python.ops import gen_nn_ops
from tensorflow.python.ops.parallel_for import pfor as _pfor

_LAST_AXIS_OPS = {"Softmax": gen_nn_ops.softmax, "LogSoftmax": gen_nn_ops.log_softmax}
_MATMULS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def per_example(function, elements):
    """`tf.vectorized_map(function, elements)` with the converters above; an op pfor
    cannot vectorize (a depthwise convolution's filter gradient, a bilinear resize)
    runs in a loop over the examples, the rest stays vectorized."""
    with _converters_swapped():
        return tf.vectorized_map(function, elements, fallback_to_while_loop=True)


def _flattened(op):
    def convert(pfor_input):
        stacked = pfor_input.stacked_input(0)
        shape = tf.shape(stacked)
        result = op(tf.reshape(stacked, [-1, shape[-1]]))
        return _pfor.wrap(tf.reshape(result, shape), True)

    return convert


def _einsum_without_unit_axes(original):
    """pfor's Einsum converter, after the letters whose every axis has size 1 are
    squeezed out of the equation (and put back in the result)."""

    def convert(pfor_input):
        equation = pfor_input.get_attr("equation").decode("utf-8")
        if "." in equation:
            return original(pfor_input)
        inputs_expr, output_expr = equation.split("->")
        exprs = inputs_expr.split(",")
        shapes = [pfor_input.op.inputs[i].shape for i in range(pfor_input.num_inputs)]
        if any(shape.rank is None for shape in shapes):
            return original(pfor_input)
        sizes = {}
        for expr, shape in zip(exprs, shapes):
            for letter, size in zip(expr, shape.as_list()):
                sizes.setdefault(letter, set()).add(size)
        units = {letter for letter, found in sizes.items() if found == {1}}
        if not units:
            return original(pfor_input)
        loop = next(s for s in string.ascii_letters if s not in equation)
        operands, new_exprs = [], []
        for i, expr in enumerate(exprs):
            value, stacked, _ = pfor_input.input(i)
            offset = 1 if stacked else 0
            axes = [offset + j for j, letter in enumerate(expr) if letter in units]
            operands.append(tf.squeeze(value, axes) if axes else value)
            kept = "".join(letter for letter in expr if letter not in units)
            new_exprs.append(loop + kept if stacked else kept)
        kept_output = "".join(letter for letter in output_expr if letter not in units)
        result = tf.einsum(f"{','.join(new_exprs)}->{loop}{kept_output}", *operands)
        for j, letter in enumerate(output_expr):
            if letter in units:
                result = tf.expand_dims(result, 1 + j)
        return _pfor.wrap(result, True)

    return convert


def _matmul_at_rank_3(original):
    """pfor's BatchMatMul converters, with the example's axes merged: a stacked
    operand times a matrix runs as one rank-2 matmul, two stacked operands with the
    same batch axes as one rank-3 batched matmul."""

    def convert(pfor_input):
        x, x_stacked, _ = pfor_input.input(0)
        y, y_stacked, _ = pfor_input.input(1)
        adj_x, adj_y = pfor_input.get_attr("adj_x"), pfor_input.get_attr("adj_y")
        if (x_stacked and not y_stacked and y.shape.rank is not None and y.shape.rank > 2
                and all(size == 1 for size in y.shape[:-2])):
            # A matrix with batch axes of size 1 (a weight of shape (1, d, e)).
            y = tf.reshape(y, tf.shape(y)[-2:])
        if x_stacked and not y_stacked and y.shape.rank == 2 and not adj_x:
            shape = tf.shape(x)
            result = tf.linalg.matmul(tf.reshape(x, [-1, shape[-1]]), y, adjoint_b=adj_y)
            result = tf.reshape(result, tf.concat([shape[:-1], tf.shape(result)[-1:]], 0))
            return _pfor.wrap(result, True)
        if (x_stacked and y_stacked and x.shape.rank == y.shape.rank
                and x.shape.rank is not None and x.shape.rank > 3
                and x.shape[:-2].is_fully_defined()
                and x.shape[:-2] == y.shape[:-2]):
            batch = x.shape[:-2].as_list()
            x3 = tf.reshape(x, [-1, *x.shape[-2:]]) if x.shape[-2:].is_fully_defined() \
                else tf.reshape(x, tf.concat([[-1], tf.shape(x)[-2:]], 0))
            y3 = tf.reshape(y, [-1, *y.shape[-2:]]) if y.shape[-2:].is_fully_defined() \
                else tf.reshape(y, tf.concat([[-1], tf.shape(y)[-2:]], 0))
            result = tf.linalg.matmul(x3, y3, adjoint_a=adj_x, adjoint_b=adj_y)
            result = tf.reshape(result, tf.concat([batch, tf.shape(result)[-2:]], 0))
            return _pfor.wrap(result, True)
        return original(pfor_input)

    return convert


@contextlib.contextmanager
def _converters_swapped():
    """pfor's converters for these ops, swapped while a function converts (pfor
    reads them when it traces, in this thread)."""
    registry = _pfor._pfor_converter_registry
    names = (*_LAST_AXIS_OPS, "Einsum", *_MATMULS)
    saved = {name: registry.get(name) for name in names}
    registry.update({name: _flattened(op) for name, op in _LAST_AXIS_OPS.items()})
    if saved["Einsum"] is not None:
        registry["Einsum"] = _einsum_without_unit_axes(saved["Einsum"])
    for name in _MATMULS:
        if saved[name] is not None:
            registry[name] = _matmul_at_rank_3(saved[name])
    try:
        yield
    finally:
        for name, converter in saved.items():
            if converter is None:
                registry.pop(name, None)
            else:
                registry[name] = converter
