"""The non-finite screen inside JAX's compiled step (`record.all_finite`): one
boolean `all(isfinite)` reduction per gradient joined by `and`, which XLA's CPU client
runs at a third of the cost of a float sum per gradient (issue 54,
BENCHMARKS.md). Its verdict on every kind of gradient a step meets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradaccum.backends.jax.record import all_finite

SHAPES = [(3, 5), (5,), (), (2, 0)]


def gradients(dtype, bad=None, at=0):
    """Four gradients of `dtype` (a matrix, a vector, a scalar, an empty one) and a
    None; `bad` (inf, -inf, nan) written at element `at` of the first three."""
    values = [np.full(shape, 1.5, "float32") for shape in SHAPES]
    if bad is not None:
        target = values[at]
        target.reshape(-1)[target.size - 1] = bad
    return [jnp.asarray(v, dtype) for v in values] + [None]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("at", [0, 1, 2])
def test_one_non_finite_element_anywhere_fails_the_micro_batch(dtype, bad, at):
    screened = jax.jit(all_finite)
    assert bool(screened(gradients(dtype))) is True
    assert bool(screened(gradients(dtype, bad, at))) is False


def test_the_largest_finite_values_pass_and_nothing_to_screen_passes():
    big = np.finfo("float32").max
    # A sum of these would overflow; the screen reads each element alone.
    values = [jnp.full((1000,), big), jnp.full((7,), -big)]
    assert bool(jax.jit(all_finite)(values)) is True
    assert bool(all_finite([None, None])) is True
    assert bool(all_finite([])) is True


def test_the_screen_is_one_boolean_reduction_per_gradient_and_no_float_sum():
    jaxpr = jax.make_jaxpr(all_finite)(gradients("float32"))
    names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert names.count("is_finite") == len(SHAPES)
    assert names.count("reduce_and") == len(SHAPES)
    assert "reduce_sum" not in names and "mul" not in names
